"""Gymnasium spaces as plain dicts (JSON- and msgpack-able) and back.

A remote environment describes its observation/action spaces with these dicts; runnel rebuilds
the spaces with :func:`space_from_dict`, which treats its input as untrusted (types, dtypes,
sizes and nesting are checked; every problem raises ProtocolError).

Formats (``dtype`` is a numpy name such as ``"float32"``)::

    {"type": "Box", "shape": [..], "dtype": .., "low": L, "high": H}
        L/H: one number for a uniform bound, else a flat list in C order; non-finite floats
        are the strings "inf", "-inf", "nan" so the dict stays strict JSON
    {"type": "Discrete", "n": int, "start": int, "dtype": ..}
    {"type": "MultiDiscrete", "nvec": [..], "start": [..], "shape": [..], "dtype": ..}
    {"type": "MultiBinary", "n": int or [..]}
    {"type": "Dict", "spaces": {key: space dict, ...}}
    {"type": "Tuple", "spaces": [space dict, ...]}
"""
from __future__ import annotations

import math
from typing import Any

import numpy as np

from protocols.errors import ProtocolError

SUPPORTED = ("Box", "Discrete", "MultiDiscrete", "MultiBinary", "Dict", "Tuple")
MAX_ELEMENTS = 1 << 24
"""Largest number of elements of a Box/MultiDiscrete/MultiBinary accepted by space_from_dict."""
MAX_DEPTH = 32
"""Deepest nesting of Dict/Tuple spaces accepted by space_from_dict."""
MAX_SPACES = 4096
"""Most spaces (leaves and Dict/Tuple nodes) in one description accepted by space_from_dict."""

_BOX_DTYPES = ("bool", "int8", "int16", "int32", "int64", "uint8", "uint16", "uint32", "uint64",
               "float16", "float32", "float64")
_INT_DTYPES = tuple(d for d in _BOX_DTYPES if "int" in d)
_NONFINITE = {"inf": math.inf, "-inf": -math.inf, "nan": math.nan}


def _unsupported(what: str) -> ProtocolError:
    return ProtocolError(f"unsupported space type {what}; supported: {', '.join(SUPPORTED)}")


def _number(x: Any) -> Any:
    if isinstance(x, float) and not math.isfinite(x):
        return "nan" if math.isnan(x) else ("inf" if x > 0 else "-inf")
    return x


def _bound(arr: np.ndarray) -> Any:
    flat = arr.ravel()
    if flat.size and (flat == flat[0]).all() and not (arr.dtype.kind == "f" and np.isnan(flat[0])):
        return _number(flat[0].item())
    return [_number(x) for x in flat.tolist()]


def space_to_dict(space: Any) -> dict:
    """Describe a gymnasium space as a plain dict (see the module docstring)."""
    from gymnasium import spaces as S

    if isinstance(space, S.Box):
        return {"type": "Box", "shape": list(space.shape), "dtype": space.dtype.name,
                "low": _bound(space.low), "high": _bound(space.high)}
    if isinstance(space, S.Discrete):
        return {"type": "Discrete", "n": int(space.n), "start": int(space.start),
                "dtype": getattr(space, "dtype", np.dtype(np.int64)).name}
    if isinstance(space, S.MultiDiscrete):
        start = getattr(space, "start", np.zeros_like(space.nvec))
        return {"type": "MultiDiscrete", "nvec": space.nvec.ravel().tolist(),
                "start": start.ravel().tolist(), "shape": list(space.shape),
                "dtype": space.dtype.name}
    if isinstance(space, S.MultiBinary):
        n = space.n
        return {"type": "MultiBinary", "n": int(n) if np.ndim(n) == 0 else [int(x) for x in n]}
    if isinstance(space, S.Dict):
        for key in space.spaces:
            if not isinstance(key, str):
                raise ProtocolError(f"Dict space keys must be str, got {key!r}")
        return {"type": "Dict", "spaces": {k: space_to_dict(s) for k, s in space.spaces.items()}}
    if isinstance(space, S.Tuple):
        return {"type": "Tuple", "spaces": [space_to_dict(s) for s in space.spaces]}
    raise _unsupported(type(space).__name__)


def space_from_dict(d: Any) -> Any:
    """Rebuild a gymnasium space from :func:`space_to_dict`'s output; ProtocolError if invalid."""
    try:
        return _from_dict(d, 0, [MAX_SPACES])
    except ProtocolError:
        raise
    except Exception as exc:  # gymnasium's own checks (ValueError, AssertionError, ...)
        raise ProtocolError(f"invalid space description: {type(exc).__name__}: {exc}") from exc


def _field(d: dict, key: str, types: tuple, kind: str) -> Any:
    if key not in d:
        raise ProtocolError(f"{kind} space description lacks {key!r}")
    value = d[key]
    if not isinstance(value, types) or isinstance(value, bool) and bool not in types:
        raise ProtocolError(f"{kind} space {key!r} has the wrong type {type(value).__name__}")
    return value


def _shape(value: Any, kind: str) -> tuple[int, ...]:
    if not isinstance(value, (list, tuple)) or len(value) > 32 or not all(
        isinstance(x, int) and not isinstance(x, bool) and 0 <= x for x in value
    ):
        raise ProtocolError(f"{kind} space has a bad shape {value!r}")
    if math.prod(value) > MAX_ELEMENTS:
        raise ProtocolError(f"{kind} space of shape {tuple(value)} exceeds {MAX_ELEMENTS} elements")
    return tuple(value)


def _dtype(name: Any, allowed: tuple[str, ...], kind: str) -> np.dtype:
    if name not in allowed:
        raise ProtocolError(f"{kind} space dtype {name!r} is not one of {allowed}")
    return np.dtype(name)


def _ints(value: Any, shape: tuple[int, ...], kind: str, key: str) -> np.ndarray:
    if not isinstance(value, list) or len(value) != math.prod(shape) or not all(
        isinstance(x, int) and not isinstance(x, bool) for x in value
    ):
        raise ProtocolError(f"{kind} space {key!r} must be a list of {math.prod(shape)} ints")
    return np.array(value, dtype=np.int64).reshape(shape)


def _bound_from(value: Any, shape: tuple[int, ...], dtype: np.dtype, key: str) -> np.ndarray:
    def number(x: Any) -> Any:
        if isinstance(x, str) and x in _NONFINITE and dtype.kind == "f":
            return _NONFINITE[x]
        if isinstance(x, (int, float)):
            return x
        raise ProtocolError(f"Box {key!r} holds a bad value {x!r:.40}")

    if isinstance(value, list):
        if len(value) != math.prod(shape):
            raise ProtocolError(f"Box {key!r} has {len(value)} values for shape {shape}")
        return np.array([number(x) for x in value], dtype=dtype).reshape(shape)
    return np.full(shape, number(value), dtype=dtype)


def _from_dict(d: Any, depth: int, budget: list[int]) -> Any:
    from gymnasium import spaces as S

    if not isinstance(d, dict):
        raise ProtocolError(f"a space description must be a dict, got {type(d).__name__}")
    if depth > MAX_DEPTH:
        raise ProtocolError(f"space description nested deeper than {MAX_DEPTH}")
    budget[0] -= 1
    if budget[0] < 0:
        raise ProtocolError(f"space description holds more than {MAX_SPACES} spaces")
    kind = d.get("type")
    if kind == "Box":
        shape = _shape(_field(d, "shape", (list, tuple), kind), kind)
        dtype = _dtype(d.get("dtype"), _BOX_DTYPES, kind)
        low = _bound_from(_field(d, "low", (bool, int, float, str, list), kind), shape, dtype, "low")
        high = _bound_from(_field(d, "high", (bool, int, float, str, list), kind), shape, dtype, "high")
        return S.Box(low=low, high=high, shape=shape, dtype=dtype)
    # default-valued options are left out of the calls: older gymnasium versions lack them
    if kind == "Discrete":
        n, start = _field(d, "n", (int,), kind), _field(d, "start", (int,), kind)
        dtype = _dtype(d.get("dtype", "int64"), _INT_DTYPES, kind)
        return S.Discrete(n, start=start, **({} if dtype == np.int64 else {"dtype": dtype}))
    if kind == "MultiDiscrete":
        shape = _shape(_field(d, "shape", (list, tuple), kind), kind)
        nvec = _ints(_field(d, "nvec", (list,), kind), shape, kind, "nvec")
        start = _ints(_field(d, "start", (list,), kind), shape, kind, "start")
        dtype = _dtype(d.get("dtype", "int64"), _INT_DTYPES, kind)
        return S.MultiDiscrete(nvec, dtype=dtype, **({"start": start} if start.any() else {}))
    if kind == "MultiBinary":
        n = _field(d, "n", (int, list), kind)
        if isinstance(n, list):
            return S.MultiBinary(list(_shape(n, kind)))
        _shape([n], kind)
        return S.MultiBinary(n)
    if kind == "Dict":
        subs = _field(d, "spaces", (dict,), kind)
        if not all(isinstance(k, str) for k in subs):
            raise ProtocolError("Dict space keys must be str")
        return S.Dict({k: _from_dict(v, depth + 1, budget) for k, v in subs.items()})
    if kind == "Tuple":
        subs = _field(d, "spaces", (list, tuple), kind)
        return S.Tuple([_from_dict(v, depth + 1, budget) for v in subs])
    raise _unsupported(repr(kind)[:60])
