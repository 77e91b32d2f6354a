"""NumpyPolicy: evaluate an exported runnel policy with numpy alone (no torch).

A policy server sends this description to clients in local inference mode, and uses it itself for
small remote-inference batches, where numpy beats torch's per-operation overhead. The exporter is
``actors.modules.export``. The description is plain data (msgpack-able through the codec)::

    {"format": "runnel-numpy-policy", "version": 1,
     "encoder": [leaf, ...],      # one per observation leaf, in sorted-dict-key / tuple order:
                                  #   {"kind": "box", "size": n}        flattened, as float32
                                  #   {"kind": "onehot", "nvec": [..], "start": s}
                                  #       (x - start) clipped to [0, n_i - 1], one-hot per component
     "layers": [op, ...],         # applied in order to the concatenated float32 features
     "dist": {"kind": "categorical" | "multi_categorical" | "gaussian", "nvec": [..], "dim": D},
     "exploration": {"type": "sample" | "random" | "epsilon_greedy" | "softmax", "epsilon": e,
                     "temperature": t}}

    op: {"op": "linear", "weight": float32 [out, in], "bias": float32 [out]}   y = x @ W.T + b
        {"op": "tanh" | "relu" | "elu" | "silu" | "identity"}
        {"op": "dueling", "branches": [n, ...], "advantage": [op, ...], "value": [op, ...]}
            per branch i: q_i = v + a_i - mean(a_i), concatenated (v: "value"'s single output)

The layers' output is the distribution inputs ``D``: logits (categorical; per component for
multi_categorical, split by ``nvec``), or ``[mean, log_std]`` (gaussian; log_std clipped to
[-20, 2]). Actions: sampled (Gumbel-max for logits), uniformly random, epsilon-greedy (greedy =
argmax / mean) or softmax(logits / temperature); ``explore=False`` is always greedy. The log-
probability of the chosen action under the distribution goes into chunks as ``action_logp``.
"""
from __future__ import annotations

import math
from typing import Any

import numpy as np

from protocols import nested
from protocols.errors import ProtocolError

FORMAT = "runnel-numpy-policy"
VERSION = 1
LOG_STD_MIN, LOG_STD_MAX = -20.0, 2.0
_ACTIVATIONS = {
    "tanh": np.tanh,
    "relu": lambda x: np.maximum(x, 0.0, dtype=np.float32),
    "elu": lambda x: np.where(x > 0, x, np.expm1(np.minimum(x, 0.0))).astype(np.float32),
    "silu": lambda x: (x / (1.0 + np.exp(-x))).astype(np.float32),
    "identity": lambda x: x,
}
_EXPLORATIONS = ("sample", "random", "epsilon_greedy", "softmax")
_HALF_LOG_2PI = 0.5 * math.log(2 * math.pi)


class NumpyPolicy:
    def __init__(self, desc: dict) -> None:
        if not isinstance(desc, dict) or desc.get("format") != FORMAT:
            raise ProtocolError(f"not a {FORMAT} description")
        if desc.get("version") != VERSION:
            raise ProtocolError(f"{FORMAT} version {desc.get('version')!r}; this client reads version {VERSION}")
        try:
            self.encoder = [_leaf(x) for x in desc["encoder"]]
            width = sum(x[1] for x in self.encoder)
            self.layers, width = _ops(desc["layers"], width)
            dist = desc["dist"]
            self.kind = dist["kind"]
            self.nvec = [int(n) for n in dist.get("nvec") or []]
            self.dim = int(dist["dim"])
            exploration = dict(desc.get("exploration") or {"type": "sample"})
        except (KeyError, TypeError, ValueError, AttributeError) as err:
            raise ProtocolError(f"malformed policy description: {type(err).__name__}: {err}") from None
        if self.kind not in ("categorical", "multi_categorical", "gaussian"):
            raise ProtocolError(f"distribution kind {self.kind!r} is not evaluated here")
        expected = {"categorical": self.dim, "multi_categorical": sum(self.nvec), "gaussian": self.dim}[self.kind]
        if width != self.dim or expected != self.dim or (self.kind == "categorical" and self.dim < 1):
            raise ProtocolError(f"the layers give {width} outputs; the distribution needs {self.dim}")
        if self.kind == "categorical":
            self.nvec = [self.dim]
        self.exploration = exploration.get("type")
        if self.exploration not in _EXPLORATIONS:
            raise ProtocolError(f"exploration {self.exploration!r} is not one of {list(_EXPLORATIONS)}")
        self.epsilon = float(exploration.get("epsilon", 0.0))
        self.temperature = float(exploration.get("temperature", 1.0))
        if self.exploration == "softmax" and (self.kind == "gaussian" or self.temperature <= 0):
            raise ProtocolError("softmax exploration needs discrete actions and a temperature > 0")

    # --- forward ---------------------------------------------------------------------------------
    def dist_inputs(self, obs: Any) -> np.ndarray:
        """A batch of observations (leading batch dim, nested like the space) -> float32 ``[B, D]``."""
        leaves = nested.flatten(obs)
        if len(leaves) != len(self.encoder):
            raise ProtocolError(f"the observation has {len(leaves)} leaves; the policy reads {len(self.encoder)}")
        if len(leaves) == 1 and self.encoder[0][0] == "box":  # the common case, without the general path's copies
            leaf = np.asarray(leaves[0])
            x = leaf.reshape(leaf.shape[0], -1)
            if x.shape[1] != self.encoder[0][1]:
                raise ProtocolError(f"an observation has {x.shape[1]} numbers; the policy reads {self.encoder[0][1]}")
            return _run(self.layers, x.astype(np.float32, copy=False))
        parts = []
        for (kind, size, nvec, start), leaf in zip(self.encoder, leaves):
            leaf = np.asarray(leaf)
            rows = leaf.reshape(leaf.shape[0], -1)
            if kind == "box":
                if rows.shape[1] != size:
                    raise ProtocolError(f"an observation leaf has {rows.shape[1]} numbers; the policy reads {size}")
                parts.append(rows.astype(np.float32, copy=False))
            else:
                idx = np.maximum(rows.astype(np.int64) - start, 0)
                for i, n in enumerate(nvec):
                    parts.append(np.eye(n, dtype=np.float32)[np.minimum(idx[:, i], n - 1)])
        x = parts[0] if len(parts) == 1 else np.concatenate(parts, axis=1)
        return _run(self.layers, x)

    # --- acting ----------------------------------------------------------------------------------
    def act(self, obs: Any, explore: bool = True, rng: np.random.Generator | None = None
            ) -> tuple[np.ndarray, dict[str, np.ndarray]]:
        """Actions for a batch of observations and their extras (``action_logp``, ``action_dist_inputs``)."""
        rng = rng if rng is not None else np.random.default_rng()
        inputs = self.dist_inputs(obs)
        actions = self.choose(inputs, explore, rng)
        return actions, {"action_logp": self.logp(inputs, actions), "action_dist_inputs": inputs}

    def extras(self, obs: Any, actions: np.ndarray) -> dict[str, np.ndarray]:
        """The extras of actions taken by someone else (``log_action``)."""
        inputs = self.dist_inputs(obs)
        return {"action_logp": self.logp(inputs, np.asarray(actions)), "action_dist_inputs": inputs}

    def choose(self, inputs: np.ndarray, explore: bool, rng: np.random.Generator) -> np.ndarray:
        """Actions from distribution inputs ``[B, D]`` by the exploration rule (greedy without ``explore``)."""
        n = inputs.shape[0]
        greedy = self.greedy(inputs)
        if not explore:
            return greedy
        how = self.exploration
        if how == "random":
            return self.random(n, rng)
        if how == "epsilon_greedy":
            pick = rng.random(n) < self.epsilon
            if not pick.any():
                return greedy
            return np.where(pick.reshape(n, *([1] * (greedy.ndim - 1))), self.random(n, rng), greedy)
        if self.kind == "gaussian":
            mean, log_std = _split_gaussian(inputs)
            return (mean + np.exp(log_std) * rng.standard_normal(mean.shape, dtype=np.float32)).astype(np.float32)
        scale = 1.0 / self.temperature if how == "softmax" else 1.0
        out = [_gumbel_argmax(logits * scale, rng) for logits in self._branches(inputs)]
        return out[0] if self.kind == "categorical" else np.stack(out, axis=-1)

    def greedy(self, inputs: np.ndarray) -> np.ndarray:
        if self.kind == "gaussian":
            return _split_gaussian(inputs)[0].copy()
        out = [logits.argmax(-1) for logits in self._branches(inputs)]
        return out[0] if self.kind == "categorical" else np.stack(out, axis=-1)

    def random(self, n: int, rng: np.random.Generator) -> np.ndarray:
        if self.kind == "gaussian":
            return rng.uniform(-1.0, 1.0, (n, self.dim // 2)).astype(np.float32)
        out = [rng.integers(0, k, n) for k in self.nvec]
        return out[0] if self.kind == "categorical" else np.stack(out, axis=-1)

    def logp(self, inputs: np.ndarray, actions: np.ndarray) -> np.ndarray:
        if self.kind == "gaussian":
            mean, log_std = _split_gaussian(inputs)
            z = (actions - mean) * np.exp(-log_std)
            return (-0.5 * z * z - log_std - _HALF_LOG_2PI).sum(-1).astype(np.float32)
        n = inputs.shape[0]
        actions = actions.astype(np.int64, copy=False).reshape(n, -1)
        rows = np.arange(n)
        total = np.zeros(n, np.float32)
        for i, logits in enumerate(self._branches(inputs)):
            total += logits[rows, actions[:, i]] - _logsumexp(logits)[:, 0]
        return total

    def _branches(self, inputs: np.ndarray) -> list[np.ndarray]:
        if self.kind == "categorical":
            return [inputs]
        return np.split(inputs, np.cumsum(self.nvec)[:-1], axis=-1)


def _leaf(x: dict) -> tuple[str, int, list[int], int]:
    if x["kind"] == "box":
        size = int(x["size"])
        if size < 1:
            raise ValueError(f"box leaf of size {size}")
        return "box", size, [], 0
    if x["kind"] == "onehot":
        nvec = [int(n) for n in x["nvec"]]
        if not nvec or min(nvec) < 1:
            raise ValueError(f"onehot leaf with nvec {nvec}")
        return "onehot", sum(nvec), nvec, int(x.get("start", 0))
    raise ValueError(f"unknown encoder leaf kind {x['kind']!r}")


def _ops(raw: list, width: int) -> tuple[list, int]:
    """Checked ops and the width they output, given the width they read."""
    ops = []
    if not isinstance(raw, list):
        raise ValueError("layers must be a list")
    for op in raw:
        kind = op["op"]
        if kind == "linear":
            w = np.ascontiguousarray(np.asarray(op["weight"], np.float32))
            b = np.asarray(op["bias"], np.float32)
            if w.ndim != 2 or w.shape[1] != width or b.shape != (w.shape[0],):
                raise ValueError(f"linear layer of shape {w.shape} (bias {b.shape}) cannot read {width} inputs")
            ops.append(("linear", w.T.copy(), b))
            width = w.shape[0]
        elif kind in _ACTIVATIONS:
            ops.append((kind, _ACTIVATIONS[kind]))
        elif kind == "dueling":
            branches = [int(n) for n in op["branches"]]
            adv, adv_width = _ops(op["advantage"], width)
            value, value_width = _ops(op["value"], width)
            if adv_width != sum(branches) or value_width != 1 or min(branches) < 1:
                raise ValueError(f"dueling head: advantages {adv_width} for branches {branches}, value {value_width}")
            ops.append(("dueling", adv, value, np.cumsum(branches)[:-1]))
            width = sum(branches)
        else:
            raise ValueError(f"unknown op {kind!r}")
    return ops, width


def _run(ops: list, x: np.ndarray) -> np.ndarray:
    for op in ops:
        if op[0] == "linear":
            x = x @ op[1]
            x += op[2]
        elif op[0] == "dueling":
            _, adv_ops, value_ops, splits = op
            adv = _run(adv_ops, x)
            value = _run(value_ops, x)
            x = np.concatenate([value + a - a.mean(-1, keepdims=True) for a in np.split(adv, splits, axis=-1)], -1)
        else:
            x = op[1](x)
    return x.astype(np.float32, copy=False)


def _logsumexp(x: np.ndarray) -> np.ndarray:
    m = x.max(-1, keepdims=True)
    return m + np.log(np.exp(x - m).sum(-1, keepdims=True))


def _gumbel_argmax(logits: np.ndarray, rng: np.random.Generator) -> np.ndarray:
    u = np.maximum(rng.random(logits.shape, dtype=np.float32), 1e-20)
    return (logits - np.log(-np.log(u))).argmax(-1)


def _split_gaussian(inputs: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    half = inputs.shape[-1] // 2
    return inputs[:, :half], np.clip(inputs[:, half:], LOG_STD_MIN, LOG_STD_MAX)
