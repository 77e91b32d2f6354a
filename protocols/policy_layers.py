"""Reading and running the layers of an exported policy (``protocols/EXTERNAL.md`` 9.2-9.3): the checks every
part of a description passes before use, the encoder's leaves, and the ops as numpy functions -- linear,
elementwise, conv2d, flatten, dueling and the LSTM cell. ``protocols.numpy_policy.NumpyPolicy`` puts them together.
Everything here reads data that came over a network: a value that is not what the format allows raises
``ProtocolError`` naming where it was."""
from __future__ import annotations

import math
from typing import Any, Callable, NamedTuple

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view

from protocols.errors import ProtocolError

MAX_WIDTH = 1 << 22
"""Most numbers per row a tensor may hold: bounds what a hostile description can make us allocate."""

Op = Callable[[np.ndarray], np.ndarray]
_ELEMENTWISE: dict[str, Op] = {
    "tanh": np.tanh,
    "relu": lambda x: np.maximum(x, np.float32(0.0)),
    "elu": lambda x: np.maximum(x, np.float32(0.0)) + np.expm1(np.minimum(x, np.float32(0.0))),  # cheaper than where
    # x * sigmoid(x) with sigmoid through tanh: no exp overflow for large negative x
    "silu": lambda x: x * (np.float32(0.5) + np.float32(0.5) * np.tanh(np.float32(0.5) * x)),
    "identity": lambda x: x,
}


class Leaf(NamedTuple):
    """One observation leaf as the encoder reads it (9.2)."""


    kind: str  # "box" | "onehot" | "image"
    width: int  # numbers the leaf adds to the feature vector (image: H*W*C)
    shape: tuple[int, ...]  # what one observation of the leaf holds, flattened: (size,), (len(nvec),), (H, W, C)
    nvec: list[int]
    start: int
    scale: np.float32


# --- reading the description ---------------------------------------------------------------------
def field(d: Any, key: str, kind: type, where: str, default: Any = None) -> Any:
    if not isinstance(d, dict):
        raise ProtocolError(f"{where} must be a map, got {type(d).__name__}")
    value = d.get(key, default)
    if not isinstance(value, kind):
        raise ProtocolError(f"{where}.{key} must be a {kind.__name__}, got {type(value).__name__}")
    return value


def integer(value: Any, where: str, lo: int, hi: int = MAX_WIDTH) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or not lo <= value <= hi:
        raise ProtocolError(f"{where} must be an integer in [{lo}, {hi}], got {value!r}")
    return int(value)


def number(value: Any, where: str, lo: float, hi: float) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float, np.floating)) or not lo <= value <= hi:
        raise ProtocolError(f"{where} must be a number in [{lo}, {hi}], got {value!r}")  # NaN fails too
    return float(value)


def _array(op: dict, key: str, shape: tuple[int | None, ...], where: str) -> np.ndarray:
    """A float32 array of the given shape (None: any size); copied, so it is aligned and owned."""
    a = op.get(key)
    if not isinstance(a, np.ndarray) or a.dtype != np.float32:
        what = f"{a.dtype} array" if isinstance(a, np.ndarray) else type(a).__name__
        raise ProtocolError(f"{where}.{key} must be a float32 array, got {what}")
    if a.ndim != len(shape) or any(want is not None and got != want for got, want in zip(a.shape, shape)):
        want = tuple("*" if s is None else s for s in shape)
        raise ProtocolError(f"{where}.{key} has shape {a.shape}; expected {want}")
    return a


def read_leaf(x: Any, where: str) -> Leaf:
    kind = field(x, "kind", str, where)
    if kind == "box":
        size = integer(x.get("size"), f"{where}.size", 1)
        return Leaf("box", size, (size,), [], 0, np.float32(1.0))
    if kind == "onehot":
        nvec = [integer(n, f"{where}.nvec[]", 1) for n in field(x, "nvec", list, where)]
        if not nvec:
            raise ProtocolError(f"{where}.nvec is empty")
        start = integer(x.get("start", 0), f"{where}.start", -(1 << 62), 1 << 62)
        return Leaf("onehot", integer(sum(nvec), f"{where} width", 1), (len(nvec),), nvec, start, np.float32(1.0))
    if kind == "image":
        shape = tuple(integer(n, f"{where}.shape[]", 1) for n in field(x, "shape", list, where))
        if len(shape) != 3:
            raise ProtocolError(f"{where}.shape must be [H, W, C], got {list(shape)}")
        scale = number(x.get("scale", 1.0), f"{where}.scale", -math.inf, math.inf)
        return Leaf("image", integer(math.prod(shape), f"{where} size", 1), shape, [], 0, np.float32(scale))
    raise ProtocolError(f"{where}.kind {kind!r} is not one of ['box', 'onehot', 'image']")


def read_ops(raw: list, shape: tuple[int, ...], where: str, head: bool) -> tuple[list[Op], tuple[int, ...]]:
    """Checked ops as functions, and the shape of one row they output given the shape they read:
    ``(width,)`` for a vector, ``(H, W, C)`` for an image tensor. Only a head list may hold
    conv2d/flatten/dueling/lstm ops (an lstm op is an ``LSTMCell``, which the caller splits the list at);
    a dueling head's own lists are linear and elementwise ops."""
    ops: list[Op] = []
    for i, op in enumerate(raw):
        at = f"{where}[{i}]"
        kind = field(op, "op", str, at)
        if kind in _ELEMENTWISE:
            ops.append(_ELEMENTWISE[kind])
        elif kind == "linear":
            if len(shape) != 1:
                raise ProtocolError(f"{at}: linear reads a vector; the input is a {shape} image tensor (flatten it)")
            w = _array(op, "weight", (None, shape[0]), at)
            b = _array(op, "bias", (w.shape[0],), at)
            ops.append(_linear(w, b))
            shape = (integer(w.shape[0], f"{at} outputs", 1),)
        elif kind == "lstm" and head:
            if len(shape) != 1:
                raise ProtocolError(f"{at}: lstm reads a vector, not a {shape} image tensor")
            w_ih = _array(op, "weight_ih", (None, shape[0]), at)
            if w_ih.shape[0] % 4 or not w_ih.shape[0]:
                raise ProtocolError(f"{at}.weight_ih has {w_ih.shape[0]} rows; an LSTM's are 4 x its cell size")
            size = integer(w_ih.shape[0] // 4, f"{at} cell size", 1)
            ops.append(LSTMCell(w_ih, _array(op, "weight_hh", (4 * size, size), at),
                             _array(op, "bias_ih", (4 * size,), at), _array(op, "bias_hh", (4 * size,), at)))
            shape = (size,)
        elif kind == "conv2d" and head:
            if len(shape) != 3:
                raise ProtocolError(f"{at}: conv2d reads an [H, W, C] image tensor, not a vector")
            w = _array(op, "weight", (None, shape[2], None, None), at)
            b = _array(op, "bias", (w.shape[0],), at)
            strides = field(op, "stride", list, at)
            if len(strides) != 2:
                raise ProtocolError(f"{at}.stride must be [sh, sw], got {strides}")
            sh, sw = (integer(s, f"{at}.stride[]", 1) for s in strides)
            kh, kw = w.shape[2:]
            if kh < 1 or kw < 1 or kh > shape[0] or kw > shape[1]:
                raise ProtocolError(f"{at}: a {kh}x{kw} kernel does not fit a {shape[0]}x{shape[1]} input")
            ops.append(_conv2d(w, b, sh, sw))
            shape = ((shape[0] - kh) // sh + 1, (shape[1] - kw) // sw + 1, w.shape[0])
            integer(math.prod(shape), f"{at} outputs", 1)
        elif kind == "flatten" and head:
            if len(shape) == 3:
                ops.append(_flatten)
                shape = (math.prod(shape),)
        elif kind == "dueling" and head:
            if len(shape) != 1:
                raise ProtocolError(f"{at}: dueling reads a vector, not a {shape} image tensor")
            branches = [integer(n, f"{at}.branches[]", 1) for n in field(op, "branches", list, at)]
            adv, adv_shape = read_ops(field(op, "advantage", list, at), shape, f"{at}.advantage", head=False)
            value, value_shape = read_ops(field(op, "value", list, at), shape, f"{at}.value", head=False)
            if not branches or adv_shape != (sum(branches),) or value_shape != (1,):
                raise ProtocolError(f"{at}: advantages {adv_shape} for branches {branches}, value {value_shape}; "
                                    f"expected ({sum(branches)},) and (1,)")
            ops.append(_dueling(adv, value, np.cumsum(branches)[:-1].tolist()))
            shape = adv_shape
        else:
            raise ProtocolError(f"{at}: unknown op {kind!r}" if head or kind not in ("conv2d", "flatten", "dueling", "lstm")
                                else f"{at}: op {kind!r} is not allowed inside a dueling head")
    return ops, shape


# --- the ops -------------------------------------------------------------------------------------
def _linear(w: np.ndarray, b: np.ndarray) -> Op:
    w_t, b = w.T.copy(), b.copy()  # copies: decoded arrays may be unaligned views, which BLAS would copy per call

    def linear(x: np.ndarray) -> np.ndarray:
        y = x @ w_t
        y += b
        return y
    return linear


def _conv2d(w: np.ndarray, b: np.ndarray, sh: int, sw: int) -> Op:
    kh, kw = w.shape[2:]
    w_k = np.ascontiguousarray(w.transpose(1, 2, 3, 0))  # [in, kh, kw, out]: contracts with the windows' last axes
    b = b.copy()

    def conv2d(x: np.ndarray) -> np.ndarray:
        windows = sliding_window_view(x, (kh, kw), axis=(1, 2))[:, ::sh, ::sw]  # [B, Ho, Wo, in, kh, kw]
        y = np.tensordot(windows, w_k, axes=3)
        y += b
        return y
    return conv2d


class LSTMCell:
    """One step of an LSTM cell (torch's ``nn.LSTM`` math and weight layout: gates input, forget, cell,
    output, stacked in that order), on a batch of vectors and their states ``[B, 2, size]``."""

    def __init__(self, w_ih: np.ndarray, w_hh: np.ndarray, b_ih: np.ndarray, b_hh: np.ndarray) -> None:
        self.size = w_hh.shape[1]
        self.w_ih_t, self.w_hh_t = w_ih.T.copy(), w_hh.T.copy()
        self.bias = b_ih + b_hh

    def __call__(self, x: np.ndarray, state: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        n = self.size
        h, c = state[:, 0], state[:, 1]
        gates = x @ self.w_ih_t
        gates += h @ self.w_hh_t
        gates += self.bias
        i, f, o = (_sigmoid(gates[:, k * n:(k + 1) * n]) for k in (0, 1, 3))
        c_out = f * c + i * np.tanh(gates[:, 2 * n:3 * n])
        h_out = o * np.tanh(c_out)
        return h_out, np.stack([h_out, c_out], axis=1).astype(np.float32, copy=False)


def _sigmoid(z: np.ndarray) -> np.ndarray:
    return np.float32(0.5) + np.float32(0.5) * np.tanh(np.float32(0.5) * z)  # no exp overflow for large |z|


def _flatten(x: np.ndarray) -> np.ndarray:
    return x.transpose(0, 3, 1, 2).reshape(x.shape[0], -1)  # channel-major, as torch flattens NCHW


def _dueling(adv_ops: list[Op], value_ops: list[Op], splits: list[int]) -> Op:
    def dueling(x: np.ndarray) -> np.ndarray:
        adv, value = x, x
        for op in adv_ops:
            adv = op(adv)
        for op in value_ops:
            value = op(value)
        parts = [value + a - a.mean(-1, keepdims=True) for a in np.split(adv, splits, axis=-1)]
        return parts[0] if len(parts) == 1 else np.concatenate(parts, axis=-1)
    return dueling
