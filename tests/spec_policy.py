"""An evaluator of exported policies written from ``protocols/EXTERNAL.md`` section 9 alone.

It imports nothing of runnel -- numpy and the standard library only -- and so shows that the
section is enough to write the local-inference half of a client in another language. It reads a
decoded description (codec arrays as numpy arrays), works in float64 on purpose (section 9.3
says float64 may stand in for float32 within rounding), and takes observations the way a client
holds them: a list with one observation per row, each nested like the space (dicts for Dict,
tuples for Tuple, and for a leaf a number, a nested list of numbers or an array).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable

import numpy as np

FORMAT = "runnel-numpy-policy"
VERSIONS = (1, 2)
LOG_STD_MIN, LOG_STD_MAX = -20.0, 2.0
ACTIVATIONS: dict[str, Callable[[np.ndarray], np.ndarray]] = {
    "tanh": np.tanh,
    "relu": lambda z: np.maximum(z, 0.0),
    "elu": lambda z: np.where(z > 0, z, np.expm1(np.minimum(z, 0.0))),
    "silu": lambda z: z / (1.0 + np.exp(-z)),
    "identity": lambda z: z,
}


class Unreadable(ValueError):
    """The description may not be acted with (section 9.1): fall back to remote inference."""


@dataclass
class Leaf:
    kind: str
    size: int = 0
    nvec: tuple[int, ...] = ()
    start: int = 0
    shape: tuple[int, int, int] = (0, 0, 0)
    scale: float = 1.0

    @property
    def width(self) -> int:
        return self.size if self.kind == "box" else sum(self.nvec) if self.kind == "onehot" else math.prod(self.shape)


def _weights(op: dict, key: str, ndim: int) -> np.ndarray:
    a = op.get(key)
    if not isinstance(a, np.ndarray) or a.dtype != np.dtype("<f4") or a.ndim != ndim:
        raise Unreadable(f"{key} must be a {ndim}-d float32 array, got {a!r:.80}")
    return a.astype(np.float64)


class SpecPolicy:
    def __init__(self, desc: dict) -> None:
        if desc.get("format") != FORMAT:
            raise Unreadable(f"format {desc.get('format')!r}")
        if desc.get("version") not in VERSIONS:
            raise Unreadable(f"version {desc.get('version')!r}; this reader reads {VERSIONS}")
        self.leaves = [self._leaf(x) for x in desc["encoder"]]
        if not self.leaves or (any(x.kind == "image" for x in self.leaves) and len(self.leaves) > 1):
            raise Unreadable("an encoder needs leaves, and an image leaf is the only one")
        shape: tuple[int, ...] = (self.leaves[0].shape if self.leaves[0].kind == "image"
                                  else (sum(x.width for x in self.leaves),))
        self.version = desc["version"]
        self.mask = desc.get("mask") if self.version >= 2 else None  # 9.9; a version 1 reader ignores the key
        self.layers, shape = self._layers(desc["layers"], shape, inside_dueling=False)
        cells = [op for op in self.layers if isinstance(op, Cell)]
        if len(cells) > 1:
            raise Unreadable("more than one lstm op")
        self.cell = cells[0] if cells else None
        dist = desc["dist"]
        self.kind, self.dim = dist["kind"], int(dist["dim"])
        if shape != (self.dim,):
            raise Unreadable(f"the layers output {shape}, dist.dim is {self.dim}")
        if self.kind == "categorical":
            self.nvec = [self.dim]
        elif self.kind == "multi_categorical":
            self.nvec = [int(n) for n in dist["nvec"]]
            if sum(self.nvec) != self.dim:
                raise Unreadable(f"nvec {self.nvec} does not add up to {self.dim}")
        elif self.kind == "gaussian" and self.dim % 2 == 0:
            self.nvec = []
        else:
            raise Unreadable(f"dist {dist!r:.80}")
        exploration = desc.get("exploration", {"type": "sample"})
        self.rule = exploration["type"]
        if self.rule not in ("sample", "random", "epsilon_greedy", "softmax"):
            raise Unreadable(f"exploration type {self.rule!r}")
        self.epsilon = float(exploration.get("epsilon", 0.0))
        self.temperature = float(exploration.get("temperature", 1.0))

    # --- reading (9.2, 9.3) ----------------------------------------------------------------
    @staticmethod
    def _leaf(x: dict) -> Leaf:
        if x["kind"] == "box":
            return Leaf("box", size=int(x["size"]))
        if x["kind"] == "onehot":
            return Leaf("onehot", nvec=tuple(int(n) for n in x["nvec"]), start=int(x.get("start", 0)))
        if x["kind"] == "image":
            h, w, c = (int(n) for n in x["shape"])
            return Leaf("image", shape=(h, w, c), scale=float(x.get("scale", 1.0)))
        raise Unreadable(f"encoder kind {x['kind']!r}")

    def _layers(self, ops: list, shape: tuple[int, ...], inside_dueling: bool) -> tuple[list[Callable], tuple]:
        out = []
        for op in ops:
            name = op["op"]
            if name in ACTIVATIONS:
                out.append(ACTIVATIONS[name])
            elif name == "linear" and len(shape) == 1:
                w, b = _weights(op, "weight", 2), _weights(op, "bias", 1)
                if w.shape[1] != shape[0] or b.shape != (w.shape[0],):
                    raise Unreadable(f"linear {w.shape} after {shape}")
                out.append(lambda v, w=w, b=b: v @ w.T + b)  # y = W v + b, W out x in
                shape = (w.shape[0],)
            elif name == "conv2d" and len(shape) == 3 and not inside_dueling:
                k, b = _weights(op, "weight", 4), _weights(op, "bias", 1)
                sh, sw = (int(s) for s in op["stride"])
                h, w, c = shape
                if k.shape[1] != c or k.shape[2] > h or k.shape[3] > w or b.shape != (k.shape[0],):
                    raise Unreadable(f"conv2d {k.shape} after {shape}")
                ho, wo = (h - k.shape[2]) // sh + 1, (w - k.shape[3]) // sw + 1
                out.append(lambda x, k=k, b=b, sh=sh, sw=sw, ho=ho, wo=wo: _conv(x, k, b, sh, sw, ho, wo))
                shape = (ho, wo, k.shape[0])
            elif name == "flatten" and not inside_dueling:
                if len(shape) == 3:
                    # channel-major: x[i, j, c] -> c*H*W + i*W + j
                    out.append(lambda x: np.moveaxis(x, 3, 1).reshape(len(x), -1))
                    shape = (math.prod(shape),)
            elif name == "lstm" and len(shape) == 1 and not inside_dueling and self.version >= 2:
                wi, wh = _weights(op, "weight_ih", 2), _weights(op, "weight_hh", 2)
                bi, bh = _weights(op, "bias_ih", 1), _weights(op, "bias_hh", 1)
                n = wh.shape[1]
                if wi.shape != (4 * n, shape[0]) or wh.shape != (4 * n, n) or bi.shape != (4 * n,) or bh.shape != (4 * n,):
                    raise Unreadable(f"lstm {wi.shape} {wh.shape} after {shape}")
                out.append(Cell(wi, wh, bi, bh))
                shape = (n,)
            elif name == "dueling" and len(shape) == 1 and not inside_dueling:
                branches = [int(n) for n in op["branches"]]
                adv, adv_shape = self._layers(op["advantage"], shape, inside_dueling=True)
                val, val_shape = self._layers(op["value"], shape, inside_dueling=True)
                if adv_shape != (sum(branches),) or val_shape != (1,):
                    raise Unreadable(f"dueling {branches}: advantage {adv_shape}, value {val_shape}")
                out.append(lambda v, adv=adv, val=val, branches=branches: _dueling(v, adv, val, branches))
                shape = (sum(branches),)
            else:
                raise Unreadable(f"op {name!r} on a {shape} input")
        return out, shape

    # --- evaluating ------------------------------------------------------------------------
    def features(self, observations: list[Any]) -> np.ndarray:
        rows = []
        for obs in observations:
            values = _leaves_in_order(obs)
            if len(values) != len(self.leaves):
                raise ValueError(f"{len(values)} observation leaves for {len(self.leaves)} encoder leaves")
            parts = [self._encode(leaf, np.asarray(v)) for leaf, v in zip(self.leaves, values)]
            rows.append(parts[0] if self.leaves[0].kind == "image" else np.concatenate(parts))
        return np.stack(rows)

    @staticmethod
    def _encode(leaf: Leaf, value: np.ndarray) -> np.ndarray:
        if leaf.kind == "box":
            return value.reshape(-1).astype(np.float32).astype(np.float64)
        if leaf.kind == "image":
            return (value.reshape(leaf.shape).astype(np.float32) * np.float32(leaf.scale)).astype(np.float64)
        ints = value.reshape(-1).astype(np.int64)
        hot = []
        for v, n in zip(ints, leaf.nvec, strict=True):
            one = np.zeros(n)
            one[min(max(int(v) - leaf.start, 0), n - 1)] = 1.0
            hot.append(one)
        return np.concatenate(hot)

    def dist_inputs(self, observations: list[Any]) -> np.ndarray:
        return self.step(observations, None)[0]

    def step(self, observations: list[Any], state: np.ndarray | None) -> tuple[np.ndarray, np.ndarray | None]:
        """The distribution inputs, and for a recurrent policy (9.8) the rows' new states ``[B, 2, n]`` from
        ``state`` (None: each row at its episode's start, h = c = 0)."""
        legal = None
        if self.mask is not None:  # 9.9: the mask entry out, the encoder reads the rest
            key, only = self.mask["key"], self.mask.get("features")
            legal = np.stack([np.asarray(o[key]).reshape(-1) != 0 for o in observations])
            observations = [o[only] if only is not None else {k: v for k, v in o.items() if k != key}
                            for o in observations]
            for i, group in enumerate(self.groups(legal)):
                if not group.any(axis=1).all():
                    raise ValueError(f"a mask allows no action in block {i}")
        x = self.features(observations)
        new_state = None
        for op in self.layers:
            if isinstance(op, Cell):
                if state is None:
                    state = np.zeros((len(x), 2, op.n))
                x, new_state = op.step(x, state)
            else:
                x = op(x)
        if legal is not None:
            x = np.where(legal, x, float(np.finfo(np.float32).min))
        return x, new_state

    # --- distributions (9.4) and acting (9.5) ----------------------------------------------
    def groups(self, inputs: np.ndarray) -> list[np.ndarray]:
        bounds = np.cumsum([0] + self.nvec)
        return [inputs[:, lo:hi] for lo, hi in zip(bounds[:-1], bounds[1:])]

    def gaussian(self, inputs: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        a = self.dim // 2
        return inputs[:, :a], np.clip(inputs[:, a:], LOG_STD_MIN, LOG_STD_MAX)

    def _shape(self, per_component: list[np.ndarray]) -> np.ndarray:
        return per_component[0] if self.kind == "categorical" else np.stack(per_component, axis=1)

    def greedy(self, inputs: np.ndarray) -> np.ndarray:
        if self.kind == "gaussian":
            return self.gaussian(inputs)[0]
        return self._shape([g.argmax(axis=1) for g in self.groups(inputs)])  # argmax: first on a tie

    def logp(self, inputs: np.ndarray, actions: np.ndarray) -> np.ndarray:
        if self.kind == "gaussian":
            mean, log_std = self.gaussian(inputs)
            z = (np.asarray(actions, np.float64) - mean) / np.exp(log_std)
            return (-z * z / 2 - log_std - math.log(2 * math.pi) / 2).sum(axis=1)
        acts = np.asarray(actions).reshape(len(inputs), -1)
        total = np.zeros(len(inputs))
        for i, l in enumerate(self.groups(inputs)):
            m = l.max(axis=1, keepdims=True)
            log_softmax = l - m - np.log(np.exp(l - m).sum(axis=1, keepdims=True))
            total += log_softmax[np.arange(len(l)), acts[:, i]]
        return total

    def random(self, n: int, rng: np.random.Generator, inputs: np.ndarray | None = None) -> np.ndarray:
        if self.kind == "gaussian":
            return rng.uniform(-1.0, 1.0, (n, self.dim // 2))
        if self.mask is not None:  # 9.9: uniformly among each block's legal actions
            floor = float(np.finfo(np.float32).min)
            return self._shape([np.array([rng.choice(np.flatnonzero(row > floor)) for row in group])
                                for group in self.groups(inputs)])
        return self._shape([rng.integers(0, k, n) for k in self.nvec])

    def sample(self, inputs: np.ndarray, rng: np.random.Generator, temperature: float = 1.0) -> np.ndarray:
        if self.kind == "gaussian":
            mean, log_std = self.gaussian(inputs)
            return mean + np.exp(log_std) * rng.standard_normal(mean.shape)
        drawn = []
        for l in self.groups(inputs):  # inverse CDF, one uniform per row and component
            p = np.exp(l / temperature - (l / temperature).max(axis=1, keepdims=True))
            cdf = np.cumsum(p / p.sum(axis=1, keepdims=True), axis=1)
            drawn.append(np.minimum((cdf < rng.random((len(l), 1))).sum(axis=1), l.shape[1] - 1))
        return self._shape(drawn)

    def act(self, observations: list[Any], explore: bool, rng: np.random.Generator
            ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Actions, their ``logp`` and the ``dist`` (distribution inputs) for a list of observations."""
        inputs = self.dist_inputs(observations)
        if not explore:
            actions = self.greedy(inputs)
        elif self.rule == "sample":
            actions = self.sample(inputs, rng)
        elif self.rule == "random":
            actions = self.random(len(inputs), rng, inputs)
        elif self.rule == "softmax":
            actions = self.sample(inputs, rng, self.temperature)
        else:  # epsilon_greedy: one draw per observation, the whole action random or greedy
            pick = rng.random(len(inputs)) < self.epsilon
            random, greedy = self.random(len(inputs), rng, inputs), self.greedy(inputs)
            actions = np.where(pick.reshape(-1, *[1] * (greedy.ndim - 1)), random, greedy)
        return actions, self.logp(inputs, actions), inputs


class Cell:
    """The lstm op (9.3): one LSTM step; state row 0 is h, row 1 is c."""

    def __init__(self, wi: np.ndarray, wh: np.ndarray, bi: np.ndarray, bh: np.ndarray) -> None:
        self.wi, self.wh, self.bi, self.bh, self.n = wi, wh, bi, bh, wh.shape[1]

    def step(self, v: np.ndarray, state: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        h, c, n = state[:, 0], state[:, 1], self.n
        z = v @ self.wi.T + self.bi + h @ self.wh.T + self.bh
        sigmoid = lambda a: 1.0 / (1.0 + np.exp(-a))  # noqa: E731
        i, f, g, o = sigmoid(z[:, :n]), sigmoid(z[:, n:2 * n]), np.tanh(z[:, 2 * n:3 * n]), sigmoid(z[:, 3 * n:])
        c2 = f * c + i * g
        h2 = o * np.tanh(c2)
        return h2, np.stack([h2, c2], axis=1)


def _leaves_in_order(obs: Any) -> list[Any]:
    """Depth-first: Dict entries by key in code-point (= UTF-8 byte) order, Tuple entries in order."""
    if isinstance(obs, dict):
        return [leaf for key in sorted(obs, key=lambda k: k.encode("utf-8")) for leaf in _leaves_in_order(obs[key])]
    if isinstance(obs, tuple):  # a Tuple space; a list is a leaf's numbers (plain form)
        return [leaf for item in obs for leaf in _leaves_in_order(item)]
    return [obs]


def _conv(x: np.ndarray, k: np.ndarray, b: np.ndarray, sh: int, sw: int, ho: int, wo: int) -> np.ndarray:
    """Unpadded cross-correlation, one kernel offset (u, t) at a time: x is [B, H, W, in]."""
    y = np.zeros((len(x), ho, wo, k.shape[0])) + b
    for u in range(k.shape[2]):
        for t in range(k.shape[3]):
            window = x[:, u:u + sh * (ho - 1) + 1:sh, t:t + sw * (wo - 1) + 1:sw, :]  # [B, ho, wo, in]
            y += window @ k[:, :, u, t].T
    return y


def _dueling(v: np.ndarray, adv_ops: list, value_ops: list, branches: list[int]) -> np.ndarray:
    adv, value = v, v
    for op in adv_ops:
        adv = op(adv)
    for op in value_ops:
        value = op(value)
    bounds = np.cumsum([0] + branches)
    return np.concatenate([value + adv[:, lo:hi] - adv[:, lo:hi].mean(axis=1, keepdims=True)
                           for lo, hi in zip(bounds[:-1], bounds[1:])], axis=1)
