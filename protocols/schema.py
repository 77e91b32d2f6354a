"""Checking received episode chunks against the observation and action spaces a receiver expects.

Built from plain space descriptions (``protocols.spaces``), so a receiver -- a learner's loader, a
replay stage, a policy server -- can check chunks from untrusted peers without gymnasium objects.
Structure (Dict keys, Tuple lengths), per-row shapes and numeric dtypes are checked by ``check``;
values -- integer spaces in range, floats finite -- by ``check_values`` (``protocols.space_checks``:
a Box bound is the environment's business, not the wire's).
"""
from __future__ import annotations

from itertools import chain
from math import fsum, isfinite
from typing import Any

import numpy as np

from protocols.episode import EpisodeChunk
from protocols.errors import ProtocolError
from protocols.space_checks import check_finite, check_values, value_spec

_NUMERIC = frozenset("biuf")


class _Leaf:
    __slots__ = ("shape", "dtype", "size", "whole")

    def __init__(self, shape: tuple[int, ...], dtype: str, whole: bool = False) -> None:
        """``whole``: an integer space (Discrete, MultiDiscrete, MultiBinary), whose values are whole numbers."""
        self.shape, self.dtype = shape, np.dtype(dtype)
        self.size = int(np.prod(shape))
        self.whole = whole


def _spec(desc: dict) -> Any:
    kind = desc.get("type")
    if kind == "Dict":
        return {k: _spec(s) for k, s in desc["spaces"].items()}
    if kind == "Tuple":
        return [_spec(s) for s in desc["spaces"]]
    if kind in ("Box", "MultiDiscrete"):
        return _Leaf(tuple(int(d) for d in desc["shape"]), desc.get("dtype", "float32"), kind == "MultiDiscrete")
    if kind == "Discrete":
        return _Leaf((), desc.get("dtype", "int64"), True)
    if kind == "MultiBinary":
        n = desc["n"]
        return _Leaf((int(n),) if isinstance(n, int) else tuple(int(d) for d in n), "int8", True)
    raise ProtocolError(f"cannot check chunks against a space of type {kind!r}")


class ChunkSchema:
    """What a receiver accepts: observation and action structure and shapes, and required extras.

    ``required_extra`` names per-step float arrays every chunk must carry (e.g. the behaviour
    policy's ``action_logp`` that V-trace needs)."""

    def __init__(self, observation: dict | None, action: dict | None,
                 required_extra: tuple[str, ...] = ()) -> None:
        self.obs_spec = None if observation is None else _spec(observation)
        self.act_spec = None if action is None else _spec(action)
        self.obs_values, self.act_values = value_spec(observation), value_spec(action, actions=True)
        self.required_extra = tuple(required_extra)
        self.look_back_rows = 0
        """Rows of ``look_back`` every chunk must carry (a receiver that rebuilds frame stacks); 0: none."""
        spec = self.obs_spec  # one flat float Box (CartPole's kind): ``observation_row`` has a shortcut for it
        self._flat_obs = (spec.dtype, spec.shape[0], float(np.finfo(spec.dtype).max)) if (
            isinstance(spec, _Leaf) and len(spec.shape) == 1 and spec.dtype.kind == "f" and not spec.whole) else None

    @classmethod
    def for_spaces(cls, observation_space: Any, action_space: Any,
                   required_extra: tuple[str, ...] = ()) -> "ChunkSchema":
        """The schema of gymnasium spaces (None: that side is not checked)."""
        from protocols.spaces import space_to_dict

        return cls(None if observation_space is None else space_to_dict(observation_space),
                   None if action_space is None else space_to_dict(action_space), required_extra)

    def check(self, chunk: EpisodeChunk) -> None:
        """Raise ProtocolError naming the first mismatch."""
        steps = len(chunk)
        if self.obs_spec is not None:
            _check("obs", self.obs_spec, chunk.obs, steps + 1)
            if chunk.look_back is not None:
                _check("look_back", self.obs_spec, chunk.look_back, len(chunk.look_back))
        if self.look_back_rows and (chunk.look_back is None or len(chunk.look_back) < self.look_back_rows):
            got = "none" if chunk.look_back is None else len(chunk.look_back)
            raise ProtocolError(f"look_back must hold at least {self.look_back_rows} observation rows (the "
                                f"receiver rebuilds frame stacks from them), got {got}")
        if self.act_spec is not None:
            _check("actions", self.act_spec, chunk.actions, steps)
        for key in self.required_extra:
            value = chunk.extra.get(key)
            if not isinstance(value, np.ndarray) or value.shape != (steps,) or value.dtype.kind != "f":
                got = "nothing" if value is None else f"{getattr(value, 'shape', type(value).__name__)}"
                raise ProtocolError(f"extra[{key!r}] must be a float array of shape ({steps},), got {got}")

    def check_values(self, chunk: EpisodeChunk, finite_obs: bool = True) -> None:
        """The numbers of a chunk ``check`` passed: observations and actions in their spaces, rewards
        and the required extras finite (``finite_obs=False``: Box observations may hold infinities
        and NaN); raise ``space_checks.BadValue`` naming the first that is not."""
        check_values("obs", self.obs_values, chunk.obs, finite_obs)
        if chunk.look_back is not None:
            check_values("look_back", self.obs_values, chunk.look_back, finite_obs)
        check_values("actions", self.act_values, chunk.actions)
        check_finite("rewards", chunk.rewards)
        for key in self.required_extra:
            check_finite(f"extra[{key!r}]", chunk.extra[key])

    def check_observation_values(self, obs: Any, finite: bool = True) -> None:
        """One observation's numbers (after ``observation_from_plain``); raise BadValue (field ``obs``)."""
        check_values("obs", self.obs_values, obs, finite)

    def check_action_values(self, action: Any) -> None:
        """One action's numbers (after ``action_from_plain``); raise BadValue (field ``action``)."""
        check_values("action", self.act_values, action)

    def check_observation(self, obs: Any) -> None:
        """One observation (no time dimension); raise ProtocolError naming the first mismatch."""
        if self.obs_spec is not None:
            _check("observation", self.obs_spec, obs, None)

    def check_observation_rows(self, obs: Any, rows: int) -> None:
        """A block of ``rows`` observations (a leading row dimension); raise ProtocolError naming the first mismatch."""
        if self.obs_spec is not None:
            _check("obs", self.obs_spec, obs, rows)

    def check_action(self, action: Any) -> None:
        """One action (no time dimension), in the module's form."""
        if self.act_spec is not None:
            _check("action", self.act_spec, action, None)


    def observation_row(self, value: Any, finite: bool = True) -> Any:
        """``observation_from_plain`` and ``check_observation_values`` in one call: the act path's.

        A flat list of numbers for a flat float Box is checked by ``fsum`` and ``max``/``min`` over the
        list (numbers only, finite, within the dtype's range) before one conversion -- several times
        cheaper than the general path, which still names what is wrong when the shortcut declines."""
        flat = self._flat_obs
        if finite and flat is not None and type(value) is list and len(value) == flat[1]:
            try:
                total = fsum(value)  # TypeError unless all numbers; NaN or inf when one is
            except (TypeError, ValueError, OverflowError):
                total = None
            if total is not None and isfinite(total) and max(value) <= flat[2] and min(value) >= -flat[2]:
                return np.array(value, dtype=flat[0])
        row = _from_plain("observation", self.obs_spec, value)
        check_values("obs", self.obs_values, row, finite)
        return row

    def observation_rows(self, values: Any, finite: bool = True) -> np.ndarray | None:
        """Many observations of a flat float Box (a batched act) -> one ``[n, size]`` array, converted
        and checked in a few numpy calls; None when the shortcut declines (another space, or some
        row is not a finite observation): the caller then takes them one by one, which names the bad one."""
        flat = self._flat_obs
        if not finite or flat is None or type(values) is not list:
            return None
        if len(values) <= 16:  # a few rows: the checks of ``observation_row`` over all of them at once
            size = flat[1]
            if not all(type(v) is list and len(v) == size for v in values):
                return None
            try:
                total = fsum(chain.from_iterable(values))  # TypeError unless all numbers; NaN or inf when one is
            except (TypeError, ValueError, OverflowError):
                return None
            if not (isfinite(total) and max(map(max, values)) <= flat[2] and min(map(min, values)) >= -flat[2]):
                return None
            return np.array(values, dtype=flat[0])
        try:
            raw = np.array(values)  # a string, nil or map among the numbers shows in the dtype
        except (TypeError, ValueError, OverflowError):
            return None
        if raw.dtype.kind not in _NUMERIC or raw.shape != (len(values), flat[1]):
            return None
        with np.errstate(over="ignore", invalid="ignore"):  # out of float32's range: inf, refused below
            rows = raw.astype(flat[0], copy=False)
        return rows if np.isfinite(rows).all() else None

    def observation_from_plain(self, value: Any) -> Any:
        """One observation in plain msgpack form (numbers, nested lists, maps) -> arrays of the
        space's dtypes; raise ProtocolError naming the first mismatch."""
        return _from_plain("observation", self.obs_spec, value)

    def action_from_plain(self, value: Any) -> Any:
        return _from_plain("action", self.act_spec, value)


def _from_plain(where: str, spec: Any, value: Any) -> Any:
    if isinstance(spec, dict):
        if not isinstance(value, dict) or set(value) != set(spec):
            got = sorted(value) if isinstance(value, dict) else type(value).__name__
            raise ProtocolError(f"{where}: expected a map with keys {sorted(spec)}, got {got}")
        return {k: _from_plain(f"{where}[{k!r}]", spec[k], value[k]) for k in spec}
    if isinstance(spec, list):
        if not isinstance(value, (list, tuple)) or len(value) != len(spec):
            got = f"{len(value)} items" if isinstance(value, (tuple, list)) else type(value).__name__
            raise ProtocolError(f"{where}: expected an array of {len(spec)} items, got {got}")
        return tuple(_from_plain(f"{where}[{i}]", s, v) for i, (s, v) in enumerate(zip(spec, value)))
    if spec is None:
        raise ProtocolError(f"{where}: no space to read it with")
    if isinstance(value, np.ndarray):
        arr = value
    elif (not spec.whole and type(value) is list and len(value) <= 64
          and all(type(v) is float or type(v) is int for v in value)):
        with np.errstate(over="ignore"):  # a float beyond the dtype's range becomes inf, refused by the checks
            arr = np.array(value, dtype=spec.dtype)  # the common act: a flat list of numbers, one numpy call
    else:
        if isinstance(value, (str, bytes, dict)) or value is None:
            raise ProtocolError(f"{where}: expected numbers, got {type(value).__name__}")
        try:
            raw = np.asarray(value)
        except (TypeError, ValueError, OverflowError) as err:  # ragged nesting
            raise ProtocolError(f"{where}: not numbers of dtype {spec.dtype}: {err}") from None
        if raw.dtype.kind not in _NUMERIC:  # strings ("1" would be cast to 1.0), nil, maps among the numbers
            raise ProtocolError(f"{where}: expected numbers, got {_elements(value)}")
        try:
            if not spec.whole:
                with np.errstate(over="ignore"):  # as above: inf, refused by the value checks
                    arr = raw.astype(spec.dtype, copy=False)
            elif raw.dtype.kind == "f" and not (np.isfinite(raw) & (raw == np.trunc(raw))).all():
                # casting to the space's integer dtype would truncate a fraction (and fail on NaN):
                # such numbers stay floats, for check_*_values to refuse as bad values
                arr = raw
            else:
                arr = np.asarray(value, dtype=spec.dtype)  # raises for a whole number the dtype cannot hold
        except (TypeError, ValueError, OverflowError) as err:
            raise ProtocolError(f"{where}: not numbers of dtype {spec.dtype}: {err}") from None
    if arr.shape != spec.shape:
        raise ProtocolError(f"{where} has shape {arr.shape}; the space expects {spec.shape}")
    if arr.dtype.kind not in _NUMERIC:
        raise ProtocolError(f"{where} has dtype {arr.dtype}; expected a bool, int or float dtype")
    return arr


def _elements(value: Any) -> str:
    """The types of a plain list's leaves, for an error message."""
    kinds: set[str] = set()
    stack = [value]
    while stack and len(kinds) < 4:
        item = stack.pop()
        if isinstance(item, (list, tuple)):
            stack.extend(item[:64])
        else:
            kinds.add(type(item).__name__)
    return "items of type " + "/".join(sorted(kinds))


def _check(where: str, spec: Any, value: Any, rows: int | None) -> None:
    """``rows``: the leading (time) dimension every leaf must have; None for a single value."""
    if isinstance(spec, dict):
        if not isinstance(value, dict) or set(value) != set(spec):
            got = sorted(value) if isinstance(value, dict) else type(value).__name__
            raise ProtocolError(f"{where}: expected a dict with keys {sorted(spec)}, got {got}")
        for k in spec:
            _check(f"{where}[{k!r}]", spec[k], value[k], rows)
    elif isinstance(spec, list):
        if not isinstance(value, (tuple, list)) or len(value) != len(spec):
            got = f"{len(value)} items" if isinstance(value, (tuple, list)) else type(value).__name__
            raise ProtocolError(f"{where}: expected a tuple of {len(spec)} items, got {got}")
        for i, (s, v) in enumerate(zip(spec, value)):
            _check(f"{where}[{i}]", s, v, rows)
    else:
        if not isinstance(value, np.ndarray):
            raise ProtocolError(f"{where}: expected an array, got {type(value).__name__}")
        want = spec.shape if rows is None else (rows, *spec.shape)
        if value.shape != want:
            raise ProtocolError(f"{where} has shape {value.shape}; the space expects {want}")
        if value.dtype.kind not in _NUMERIC:
            raise ProtocolError(f"{where} has dtype {value.dtype}; expected a bool, int or float dtype")
