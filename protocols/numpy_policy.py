"""NumpyPolicy: evaluate an exported runnel policy with numpy alone (no torch, no ML framework).

A policy server sends the description to clients in local inference mode, and evaluates it
itself for small remote-inference batches, where numpy beats torch's per-call overhead. The
format is specified in ``protocols/EXTERNAL.md`` section 9; ``actors/modules/export.py`` writes
it. The description arrives over a network, so it is checked completely before use: a wrong
format or version, an unknown op, an array that is not float32 of the right shape, or layers
whose sizes do not chain raise ``ProtocolError``, and nothing in it is ever executed or unpickled.
The layers' reading and the ops themselves are ``protocols.policy_layers``'; this module adds the masks, the
distributions and the acting.
"""
from __future__ import annotations

import math
from typing import Any

import numpy as np

from protocols import nested
from protocols.errors import ProtocolError
from protocols.policy_layers import LSTMCell, Op, field, integer, number, read_leaf, read_ops

FORMAT = "runnel-numpy-policy"
VERSION = 2
"""The newest format version written and read. Version 2 adds the ``lstm`` op (recurrent policies) and the
``mask`` key (observations that carry an action mask); a policy with neither is written as version 1, which every
older reader reads."""
VERSIONS = (1, 2)
LOG_STD_MIN, LOG_STD_MAX = -20.0, 2.0
SMALL_BATCH = 8
"""Categorical batches up to this many rows are sampled in plain floats (``choose_with_logp``)."""

_EXPLORATIONS = ("sample", "random", "epsilon_greedy", "softmax")
_DISTS = ("categorical", "multi_categorical", "gaussian")
_HALF_LOG_2PI = np.float32(0.5 * math.log(2 * math.pi))
MASKED = np.finfo(np.float32).min
"""What an illegal action's distribution input becomes (the lowest finite float32, as the torch modules do)."""
_LOG_STD_MIN, _LOG_STD_MAX = np.float32(LOG_STD_MIN), np.float32(LOG_STD_MAX)


class NumpyPolicy:
    """An exported policy: ``act`` for batches of observations, with the extras chunks record."""

    def __init__(self, desc: dict) -> None:
        if not isinstance(desc, dict) or desc.get("format") != FORMAT:
            raise ProtocolError(f"not a {FORMAT} description")
        if desc.get("version") not in VERSIONS:
            raise ProtocolError(f"{FORMAT} version {desc.get('version')!r}; this reader reads versions "
                                f"{' and '.join(map(str, VERSIONS))}")
        try:
            self._parse(desc)
        except ProtocolError:
            raise
        except (KeyError, TypeError, ValueError, AttributeError, IndexError) as err:  # a safety net
            raise ProtocolError(f"malformed {FORMAT} description: {type(err).__name__}: {err}") from None
        self._rng: np.random.Generator | None = None

    def _parse(self, desc: dict) -> None:
        self.mask_key, self.mask_features = None, None
        if "mask" in desc:
            if desc["version"] < 2:
                raise ProtocolError("mask: action masks are version 2's; this description says version 1")
            mask = field(desc, "mask", dict, "the description")
            self.mask_key = field(mask, "key", str, "mask")
            self.mask_features = mask.get("features")
            if self.mask_features is not None and (type(self.mask_features) is not str
                                                   or self.mask_features == self.mask_key):
                raise ProtocolError(f"mask.features must be the one other key (a str) or absent, got "
                                    f"{self.mask_features!r:.80}")
        leaves = field(desc, "encoder", list, "the description")
        if not leaves:
            raise ProtocolError("encoder: no observation leaves")
        self.encoder = [read_leaf(x, f"encoder[{i}]") for i, x in enumerate(leaves)]
        if any(leaf.kind == "image" for leaf in self.encoder):
            if len(self.encoder) != 1:
                raise ProtocolError("encoder: an image leaf must be the only leaf")
            shape: tuple[int, ...] = self.encoder[0].shape
        else:
            shape = (integer(sum(leaf.width for leaf in self.encoder), "encoder width", 1),)
        self.width_in = math.prod(shape)
        self._one_box = len(self.encoder) == 1 and self.encoder[0].kind == "box"
        layers, shape = read_ops(field(desc, "layers", list, "the description"), shape, "layers", head=True)
        if len(shape) != 1:
            raise ProtocolError(f"layers end with a {shape} image tensor; a 'flatten' op is missing")
        cells = [i for i, op in enumerate(layers) if isinstance(op, LSTMCell)]
        if cells and desc["version"] < 2:
            raise ProtocolError("layers: the 'lstm' op is version 2's; this description says version 1")
        if len(cells) > 1:
            raise ProtocolError(f"layers: {len(cells)} 'lstm' ops; a policy has at most one")
        self.cell: LSTMCell | None = layers[cells[0]] if cells else None
        """A recurrent policy's LSTM (``act_recurrent``): the ops before it are ``layers``, those after it ``head``."""
        self.layers, self.head = (layers[:cells[0]], layers[cells[0] + 1:]) if cells else (layers, [])

        dist = field(desc, "dist", dict, "the description")
        self.kind = field(dist, "kind", str, "dist")
        if self.kind not in _DISTS:
            raise ProtocolError(f"dist.kind {self.kind!r} is not one of {list(_DISTS)}")
        self.dim = integer(dist.get("dim"), "dist.dim", 1)
        if shape[0] != self.dim:
            raise ProtocolError(f"the layers output {shape[0]} numbers; dist.dim is {self.dim}")
        nvec = [integer(n, "dist.nvec[]", 1) for n in field(dist, "nvec", list, "dist", default=[])]
        if self.kind == "categorical":
            if nvec not in ([], [self.dim]):
                raise ProtocolError(f"categorical dist.nvec {nvec} does not match dist.dim {self.dim}")
            nvec = [self.dim]
        elif self.kind == "multi_categorical" and (not nvec or sum(nvec) != self.dim):
            raise ProtocolError(f"multi_categorical dist.nvec {nvec} does not add up to dist.dim {self.dim}")
        elif self.kind == "gaussian" and self.dim % 2:
            raise ProtocolError(f"gaussian dist.dim {self.dim} is not 2 * action size")
        self.nvec = nvec if self.kind != "gaussian" else []
        self._splits = np.cumsum(self.nvec)[:-1].tolist()
        if self.mask_key is not None:
            if self.kind == "gaussian":
                raise ProtocolError("mask: action masks need discrete actions, not a gaussian dist")
            if integer(desc["mask"].get("width"), "mask.width", 1) != self.dim:
                raise ProtocolError(f"mask.width {desc['mask'].get('width')} is not dist.dim {self.dim}")

        exploration = field(desc, "exploration", dict, "the description", default={"type": "sample"})
        self.exploration = exploration.get("type")
        if self.exploration not in _EXPLORATIONS:
            raise ProtocolError(f"exploration.type {self.exploration!r} is not one of {list(_EXPLORATIONS)}")
        self.epsilon = number(exploration.get("epsilon", 0.0), "exploration.epsilon", 0.0, 1.0)
        self.temperature = number(exploration.get("temperature", 1.0), "exploration.temperature", 0.0, math.inf)
        if self.exploration == "softmax" and (self.kind == "gaussian" or self.temperature <= 0):
            raise ProtocolError("softmax exploration needs discrete actions and a temperature > 0")

    # --- forward ---------------------------------------------------------------------------------
    @property
    def recurrent(self) -> bool:
        """The policy carries a state from step to step (an ``lstm`` op): act with ``act_recurrent``."""
        return self.cell is not None

    def initial_state(self, n: int) -> np.ndarray:
        """``n`` states an episode starts from (zeros, float32 ``[n, 2, cell]``: hidden and cell state)."""
        if self.cell is None:
            raise ValueError("this policy is not recurrent: it has no state")
        return np.zeros((n, 2, self.cell.size), np.float32)

    def dist_inputs(self, obs: Any) -> np.ndarray:
        """A batch of observations (leading batch dim, nested like the space) -> float32 ``[B, D]``."""
        if self.cell is not None:
            raise ValueError("this policy is recurrent: act with act_recurrent(obs, state, ...), which takes and "
                             "returns the episodes' states")
        if self.mask_key is None:
            return self._through(obs, self.layers)
        features, mask = self._split_mask(obs)
        return self._masked(self._through(features, self.layers), mask)

    def step(self, obs: Any, state: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """A recurrent policy's step: the distribution inputs ``[B, D]`` for a batch of observations acting from
        ``state`` ``[B, 2, cell]``, and the states after it."""
        if self.cell is None:
            raise ValueError("this policy is not recurrent: use dist_inputs(obs)")
        features, mask = (obs, None) if self.mask_key is None else self._split_mask(obs)
        x = self._through(features, self.layers)
        want = (x.shape[0], 2, self.cell.size)
        state = np.asarray(state)
        if state.shape != want or state.dtype != np.float32:
            raise ValueError(f"recurrent state of shape {state.shape} and dtype {state.dtype}; this policy takes "
                             f"float32 {want} (rows, hidden and cell state)")
        h, state_out = self.cell(x, state)
        for op in self.head:
            h = op(h)
        h = h.astype(np.float32, copy=False)
        return (h if mask is None else self._masked(h, mask)), state_out

    def _split_mask(self, obs: Any) -> tuple[Any, np.ndarray]:
        """A batch of masked observations -> (what the encoder reads, the mask as bools ``[B, dim]``)."""
        key = self.mask_key
        if not isinstance(obs, dict) or key not in obs:
            got = sorted(obs) if isinstance(obs, dict) else type(obs).__name__
            raise ProtocolError(f"this policy reads observations with an {key!r} key, got {got}")
        raw = np.asarray(obs[key])
        n = _batch(raw)
        if raw.size != n * self.dim or raw.dtype.kind not in "biuf":
            raise ProtocolError(f"observation[{key!r}] of shape {raw.shape}: expected {n} rows of {self.dim} numbers")
        features = obs[self.mask_features] if self.mask_features is not None else {
            k: v for k, v in obs.items() if k != key}
        return features, raw.reshape(n, self.dim) > 0

    def _masked(self, x: np.ndarray, mask: np.ndarray) -> np.ndarray:
        """Distribution inputs with illegal actions at ``MASKED``; a row (or branch) with no legal action is an
        error naming it -- an env must offer a legal action to an agent it asks to act."""
        for i, legal in enumerate(np.split(mask, self._splits, axis=-1) if self._splits else [mask]):
            empty = ~legal.any(-1)
            if empty.any():
                row = int(np.flatnonzero(empty)[0])
                where = f"row {row}" + (f", branch {i}" if self._splits else "")
                raise ValueError(f"observation[{self.mask_key!r}] allows no action ({where} of the batch)")
        return np.where(mask, x, MASKED).astype(np.float32, copy=False)

    def _through(self, obs: Any, ops: list[Op]) -> np.ndarray:
        if (type(obs) is np.ndarray and self._one_box and obs.ndim == 2 and obs.shape[1] == self.width_in
                and obs.dtype.kind in "biuf"):
            x = obs.astype(np.float32, copy=False)  # the common case, checked without flattening
        else:
            x = self._features(nested.flatten(obs))
        for op in ops:
            x = op(x)
        return x.astype(np.float32, copy=False)

    def _features(self, leaves: list[Any]) -> np.ndarray:
        if len(leaves) != len(self.encoder):
            raise ProtocolError(f"the observation has {len(leaves)} leaves; the policy reads {len(self.encoder)}")
        n = _batch(leaves[0])
        first = self.encoder[0]
        if len(leaves) == 1 and first.kind != "onehot":  # the common case, without copies where the dtype allows
            x = _rows(leaves[0], n, first.shape)
            if first.kind == "image":
                return np.multiply(x, first.scale, dtype=np.float32)
            return x.astype(np.float32, copy=False)
        x = np.zeros((n, self.width_in), np.float32)
        rows, offset = np.arange(n), 0
        for leaf, value in zip(self.encoder, leaves):
            data = _rows(value, n, leaf.shape)
            if leaf.kind == "box":
                x[:, offset:offset + leaf.width] = data
                offset += leaf.width
                continue
            idx = np.maximum(data.astype(np.int64) - leaf.start, 0)
            for i, size in enumerate(leaf.nvec):
                x[rows, offset + np.minimum(idx[:, i], size - 1)] = 1.0
                offset += size
        return x

    # --- acting ----------------------------------------------------------------------------------
    def act(self, obs: Any, explore: bool = True, rng: np.random.Generator | None = None
            ) -> tuple[np.ndarray, dict[str, np.ndarray]]:
        """Actions for a batch of observations (int64 ``[B]``/``[B, K]``, or float32 ``[B, A]``) and
        their extras: ``action_logp`` float32 ``[B]`` and ``action_dist_inputs`` float32 ``[B, D]``."""
        inputs = self.dist_inputs(obs)
        actions, logp = self.choose_with_logp(inputs, explore, rng if rng is not None else self._default_rng())
        return actions, {"action_logp": logp, "action_dist_inputs": inputs}

    def act_recurrent(self, obs: Any, state: np.ndarray, explore: bool = True, rng: np.random.Generator | None = None
                      ) -> tuple[np.ndarray, dict[str, np.ndarray], np.ndarray]:
        """``act`` for a recurrent policy: also the states ``[B, 2, cell]`` the batch acts from, and the next ones
        are returned after the extras."""
        inputs, state_out = self.step(obs, state)
        actions, logp = self.choose_with_logp(inputs, explore, rng if rng is not None else self._default_rng())
        return actions, {"action_logp": logp, "action_dist_inputs": inputs}, state_out

    def extras_recurrent(self, obs: Any, state: np.ndarray, actions: np.ndarray
                         ) -> tuple[dict[str, np.ndarray], np.ndarray]:
        """``extras`` for a recurrent policy: the extras of ``actions`` acting from ``state``, and the next states."""
        inputs, state_out = self.step(obs, state)
        return self._extras_of(inputs, actions), state_out

    def choose_with_logp(self, inputs: np.ndarray, explore: bool, rng: np.random.Generator
                         ) -> tuple[np.ndarray, np.ndarray]:
        """``choose`` and ``logp`` of what it chose, in one pass."""
        n = inputs.shape[0]
        if not (explore and self.kind == "categorical" and self.exploration == "sample" and n <= SMALL_BATCH):
            actions = self.choose(inputs, explore, rng)
            return actions, self.logp(inputs, actions)
        # A few rows of a categorical policy (a remote-inference request, one env stepping): in plain
        # floats, a sample and its log-probability cost a few microseconds; numpy's per-call overhead
        # makes the same work ~5x slower at this size. Inverse-CDF sampling: exact, one uniform a row.
        actions, logp = np.empty(n, np.int64), np.empty(n, np.float32)
        uniforms = rng.random(n).tolist()
        for i, row in enumerate(inputs.tolist()):
            top = max(row)
            weights = [math.exp(v - top) for v in row]
            total = sum(weights)
            target, k, acc = uniforms[i] * total, 0, weights[0]
            while acc <= target and k < len(weights) - 1:
                k += 1
                acc += weights[k]
            actions[i], logp[i] = k, row[k] - top - math.log(total)
        return actions, logp

    def extras(self, obs: Any, actions: np.ndarray) -> dict[str, np.ndarray]:
        """The extras of actions chosen by someone else (``log_action``)."""
        return self._extras_of(self.dist_inputs(obs), actions)

    def _extras_of(self, inputs: np.ndarray, actions: np.ndarray) -> dict[str, np.ndarray]:
        actions = np.asarray(actions)
        n = inputs.shape[0]
        if self.kind == "gaussian":
            if actions.shape != (n, self.dim // 2):
                raise ProtocolError(f"actions of shape {actions.shape}; expected {(n, self.dim // 2)}")
        else:
            ints = actions.astype(np.int64).reshape(n, -1) if actions.size == n * len(self.nvec) else None
            if ints is None or (ints < 0).any() or (ints >= np.asarray(self.nvec)).any():
                raise ProtocolError(f"actions {actions.tolist()} are not {n} valid actions for nvec {self.nvec}")
        return {"action_logp": self.logp(inputs, actions), "action_dist_inputs": inputs}

    def choose(self, inputs: np.ndarray, explore: bool, rng: np.random.Generator) -> np.ndarray:
        """Actions from distribution inputs ``[B, D]`` by the exploration rule (greedy without ``explore``)."""
        how = self.exploration
        if not explore:
            return self.greedy(inputs)
        n = inputs.shape[0]
        if how == "random":
            return self.random(n, rng, inputs)
        if how == "epsilon_greedy":
            greedy = self.greedy(inputs)
            pick = rng.random(n) < self.epsilon
            if not pick.any():
                return greedy
            return np.where(pick.reshape(n, *([1] * (greedy.ndim - 1))), self.random(n, rng, inputs), greedy)
        if self.kind == "gaussian":
            mean, log_std = self._gaussian(inputs)
            return mean + np.exp(log_std) * rng.standard_normal(mean.shape, dtype=np.float32)
        scale = np.float32(1.0 / self.temperature) if how == "softmax" else None
        out = [_gumbel_argmax(logits if scale is None else logits * scale, rng) for logits in self._branches(inputs)]
        return out[0] if self.kind == "categorical" else np.stack(out, axis=-1)

    def greedy(self, inputs: np.ndarray) -> np.ndarray:
        if self.kind == "gaussian":
            return inputs[:, : self.dim // 2].copy()  # a copy: callers may overwrite actions in place
        out = [logits.argmax(-1) for logits in self._branches(inputs)]
        return out[0] if self.kind == "categorical" else np.stack(out, axis=-1)

    def random(self, n: int, rng: np.random.Generator, inputs: np.ndarray | None = None) -> np.ndarray:
        """Uniformly random actions (Box: uniform in [-1, 1], the module's normalized range); with an action
        mask, among the legal ones ``inputs`` (the masked distribution inputs) leave."""
        if self.kind == "gaussian":
            return rng.uniform(-1.0, 1.0, (n, self.dim // 2)).astype(np.float32)
        if self.mask_key is not None and inputs is not None:
            out = [_gumbel_argmax(np.where(block > MASKED / 2, np.float32(0.0), MASKED), rng)
                   for block in self._branches(inputs)]
            return out[0] if self.kind == "categorical" else np.stack(out, axis=-1)
        out = [rng.integers(0, k, n) for k in self.nvec]
        return out[0] if self.kind == "categorical" else np.stack(out, axis=-1)

    def logp(self, inputs: np.ndarray, actions: np.ndarray) -> np.ndarray:
        """Log-probabilities ``[B]`` of ``actions`` under the distributions ``inputs`` describe."""
        if self.kind == "gaussian":
            mean, log_std = self._gaussian(inputs)
            z = (actions - mean) * np.exp(-log_std)
            return (np.float32(-0.5) * z * z - log_std - _HALF_LOG_2PI).sum(-1, dtype=np.float32)
        n = inputs.shape[0]
        actions = actions.astype(np.int64, copy=False).reshape(n, -1)
        rows = np.arange(n)
        total = np.zeros(n, np.float32)
        for i, logits in enumerate(self._branches(inputs)):
            m = logits.max(-1)
            total += logits[rows, actions[:, i]] - m - np.log(np.exp(logits - m[:, None]).sum(-1))
        return total

    def _branches(self, inputs: np.ndarray) -> list[np.ndarray]:
        return [inputs] if self.kind == "categorical" else np.split(inputs, self._splits, axis=-1)

    def _gaussian(self, inputs: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        half = self.dim // 2
        # minimum/maximum: np.clip costs several times more on the small arrays of one step
        return inputs[:, :half], np.minimum(np.maximum(inputs[:, half:], _LOG_STD_MIN), _LOG_STD_MAX)

    def _default_rng(self) -> np.random.Generator:
        if self._rng is None:  # made once: seeding a generator from OS entropy costs more than a small step
            self._rng = np.random.default_rng()
        return self._rng


# --- observations and sampling -------------------------------------------------------------------
def _batch(leaf: Any) -> int:
    shape = np.shape(leaf)
    if not shape:
        raise ProtocolError("observations need a leading batch dimension")
    return shape[0]


def _rows(value: Any, n: int, shape: tuple[int, ...]) -> np.ndarray:
    """One observation leaf as ``[n, *shape]`` (a view where possible)."""
    a = np.asarray(value)
    if a.ndim == 0 or a.shape[0] != n or a.size != n * math.prod(shape) or a.dtype.kind not in "biuf":
        raise ProtocolError(f"an observation leaf of shape {a.shape} and dtype {a.dtype} does not hold {n} rows "
                            f"of {list(shape)} numbers")
    return a.reshape(n, *shape)


def _gumbel_argmax(logits: np.ndarray, rng: np.random.Generator) -> np.ndarray:
    u = np.maximum(rng.random(logits.shape, dtype=np.float32), np.float32(1e-20))
    return (logits - np.log(-np.log(u))).argmax(-1)
