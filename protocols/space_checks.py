"""Is this value in this space: the numbers of observations and actions checked against their spaces.

``protocols.schema`` checks structure, shapes and dtypes; this module checks the values, with whole-
array numpy operations (a chunk's actions in one call, never element by element), so that a
receiver -- a policy server, a learner, a client before it sends -- refuses a value that would
crash or poison training: an index outside a Discrete space makes a learner's ``gather`` fail (on
a GPU a device-side assert, after which the process cannot use the GPU), and one NaN observation turns every weight
into NaN at the next gradient step.

The rules, per leaf space:

* **Discrete, MultiDiscrete, MultiBinary**: whole numbers in the space's range (``start`` to
  ``start + n - 1``; per element for MultiDiscrete; 0 or 1 for MultiBinary). Float arrays are
  accepted when they hold whole numbers; NaN never is. Actions are checked as the policy's
  indices (``value_spec(..., actions=True)``): 0 to ``n - 1``, whatever the space's ``start`` --
  runnel's policies act in that range and hand those values to the environment (the action
  mapping is a cast), and a learner's ``gather`` fails outside it.
* **Box**: finite numbers (for observations unless the receiver allows non-finite ones). The
  bounds are not enforced: chunks carry the policy's raw actions, which a Gaussian puts anywhere
  and env runners clip or rescale into the bounds (``clip_actions``/``normalize_actions``) only
  on the way to the environment, recording the raw ones; and whether an observation leaves its
  Box is the environment's business, as it is for env runners.
"""
from __future__ import annotations

from itertools import chain
from math import isfinite
from typing import Any

import numpy as np

from protocols.errors import ProtocolError


class BadValue(ProtocolError):
    """A value of the right shape and dtype that its space does not hold. ``field`` names where it
    was: ``obs``, ``action``, ``actions``, ``rewards``, ``extra['action_logp']``, with ``[key]`` /
    ``[i]`` for the leaves of Dict / Tuple spaces."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(message)
        self.field = field


class LeafValues:
    """The values one leaf space holds: whole numbers in ``[low, high]`` (integer spaces), or any
    number (Box: ``low`` is None; finite unless the caller allows more)."""

    __slots__ = ("low", "high", "name")

    def __init__(self, desc: dict, actions: bool = False) -> None:
        """``actions``: the policy's indices, from 0 whatever the space's ``start`` (module docstring)."""
        kind = desc.get("type")
        self.low = self.high = None
        if kind == "Discrete":
            start, n = 0 if actions else int(desc.get("start", 0)), int(desc["n"])
            self.low, self.high = np.int64(start), np.int64(start + n - 1)
            self.name = f"Discrete({n})" if start == 0 else f"Discrete({n}, start={start})"
        elif kind == "MultiDiscrete":
            shape = tuple(int(d) for d in desc["shape"])
            nvec = np.asarray(desc["nvec"], np.int64).reshape(shape)
            start = None if actions else desc.get("start")
            start = np.asarray(start, np.int64).reshape(shape) if start else np.zeros(shape, np.int64)
            self.low, self.high, self.name = start, start + nvec - 1, f"MultiDiscrete({nvec.tolist()})"
        elif kind == "MultiBinary":
            self.low, self.high, self.name = np.int64(0), np.int64(1), f"MultiBinary({desc['n']})"
        else:
            self.name = str(kind)

    def check(self, field: str, arr: np.ndarray, finite: bool = True) -> None:
        """Raise BadValue naming ``field``, the first bad element's index and its value."""
        low = self.low
        if low is None:
            if finite and arr.dtype.kind == "f":
                # small arrays (an act's observation) in plain Python: numpy's per-call overhead is
                # most of the cost of a policy server's act path otherwise
                ok = all(map(isfinite, arr.ravel().tolist())) if arr.size <= 64 else np.isfinite(arr).all()
                if not ok:
                    _fail(field, arr, ~np.isfinite(arr), "is not a finite number")
            return
        if low.ndim and arr.shape[arr.ndim - low.ndim:] != low.shape:
            raise BadValue(field, f"{field} has shape {arr.shape}; {self.name} holds values of shape {low.shape}")
        bad = (arr < low) | (arr > self.high)
        if arr.dtype.kind == "f":
            bad |= arr != np.trunc(arr)  # fractions, and NaN (never equal to itself)
        if bad.any():
            _fail(field, arr, bad, f"is not in {self.name}", (low, self.high))


def box_rows_pass(spec: Any, values: list, finite: bool = True) -> bool:
    """True when ``values`` -- many observations of the one Box leaf ``spec`` describes, as numeric
    arrays -- all hold finite numbers, found in one loop without the per-value dispatch of
    ``check_values``; False when the caller must check them one by one (another space, another
    type, or a bad value, which that check names)."""
    if not (isinstance(spec, LeafValues) and spec.low is None):
        return False
    size = 0
    for v in values:
        if type(v) is not np.ndarray or v.dtype.kind not in "biuf":
            return False
        size += v.size
    if not finite or not values:
        return True
    if size <= 256:  # a few small rows: plain Python beats numpy's per-call overhead
        return all(map(isfinite, chain.from_iterable(v.ravel().tolist() for v in values)))
    return bool(np.isfinite(np.concatenate([v.ravel() for v in values])).all())


def check_finite(field: str, value: Any) -> None:
    """A float array (rewards, an extra) holds finite numbers only; other dtypes pass."""
    if isinstance(value, np.ndarray) and value.dtype.kind == "f" and not np.isfinite(value).all():
        _fail(field, value, ~np.isfinite(value), "is not a finite number")


def _fail(field: str, arr: np.ndarray, bad: np.ndarray, reason: str, bounds: tuple | None = None) -> None:
    first = tuple(int(i) for i in np.argwhere(bad)[0])
    at = f"[{', '.join(map(str, first))}]" if first else ""
    if bounds is not None:  # the range at that element (MultiDiscrete's differ by position)
        lo, hi = (np.broadcast_to(b, arr.shape)[first] for b in bounds)
        reason += f" (a whole number from {lo} to {hi})"
    raise BadValue(field, f"{field}{at} = {arr[first].item()!r} {reason}")


def value_spec(desc: dict | None, actions: bool = False) -> Any:
    """``LeafValues`` nested as the space described (``protocols.spaces``) is: a dict for a Dict
    space, a list for a Tuple space; None for None. ``actions``: an action space (its integer
    leaves checked as the policy's indices, from 0)."""
    if desc is None:
        return None
    kind = desc.get("type")
    if kind == "Dict":
        return {k: value_spec(s, actions) for k, s in desc["spaces"].items()}
    if kind == "Tuple":
        return [value_spec(s, actions) for s in desc["spaces"]]
    return LeafValues(desc, actions)


def check_values(field: str, spec: Any, value: Any, finite: bool = True) -> None:
    """Raise BadValue naming the first value of ``value`` (one value, or many stacked on a leading
    axis) that the space ``spec`` (``value_spec``) does not hold; ``finite=False`` lets Box leaves
    hold infinities and NaN."""
    if isinstance(spec, LeafValues):
        spec.check(field, value if isinstance(value, np.ndarray) else np.asarray(value), finite)
    elif isinstance(spec, dict):
        if not isinstance(value, dict) or not set(spec) <= set(value):
            raise BadValue(field, f"{field}: expected a map with keys {sorted(spec)}, got {type(value).__name__}")
        for k, s in spec.items():
            check_values(f"{field}[{k!r}]", s, value[k], finite)
    elif spec is not None:
        if not isinstance(value, (list, tuple)) or len(value) != len(spec):
            raise BadValue(field, f"{field}: expected {len(spec)} items, got {type(value).__name__}")
        for i, (s, v) in enumerate(zip(spec, value)):
            check_values(f"{field}[{i}]", s, v, finite)
