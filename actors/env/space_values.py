"""Whether a value lies in a gymnasium space and, when it does not, why: the observation check of
``actors.env.multi_agent_checks``.

gymnasium's ``Space.contains`` answers only yes or no, and its Box refuses a float64 array for a
float32 Box (``np.can_cast``) although runnel's modules convert observations to their own dtype
anyway. Here a Box holds any numeric array of its shape whose values lie within its bounds (NaN
never does), a Discrete any whole number in its range (a Python int, a numpy integer, a 0-d integer
array, as gymnasium accepts); Dict and Tuple spaces are checked leaf by leaf, and every other space
falls back to ``Space.contains``. The answer is a short reason ("[2] = 7.5 is outside [-1.0, 1.0]")
that an error message can quote. A checker is built once per space (``problem_finder``) because env
runners call it on every observation of every step.
"""
from __future__ import annotations

from collections.abc import Mapping
from operator import le
from typing import Any, Callable

import gymnasium as gym
import numpy as np

ProblemFinder = Callable[[Any], "str | None"]
"""value -> None when the space holds it, else why not (a phrase that follows the value's name)."""


def short_repr(value: Any, limit: int = 80) -> str:
    """``repr(value)``, cut to ``limit`` characters: error messages quote values, which may be large arrays."""
    text = " ".join(repr(value).split())  # one line: an array's repr wraps
    return text if len(text) <= limit else text[: limit - 3] + "..."


def problem_finder(space: gym.Space) -> ProblemFinder:
    """The checker of values of ``space``."""
    if isinstance(space, gym.spaces.Box):
        return _box(space)
    if isinstance(space, gym.spaces.Discrete):
        return _discrete(space)
    if isinstance(space, gym.spaces.Dict):
        return _dict(space)
    if isinstance(space, gym.spaces.Tuple):
        return _tuple(space)
    return _other(space)


SMALL = 16
"""Boxes of at most this many values are checked in plain Python first: for a few values one pass
over a list is several times cheaper than numpy's comparisons (every observation of every step)."""


def _box(space: gym.spaces.Box) -> ProblemFinder:
    low, high, shape = space.low, space.high, space.shape
    small = low.size <= SMALL
    lows, highs = (low.ravel().tolist(), high.ravel().tolist()) if small else (None, None)
    flat = len(shape) == 1

    def problem(value: Any) -> str | None:
        if small and type(value) is np.ndarray and value.shape == shape and value.dtype.kind in "biuf":
            # NaN fails every comparison, so it falls through to the full check, which names it
            values = value.tolist() if flat else value.ravel().tolist()
            if all(map(le, lows, values)) and all(map(le, values, highs)):
                return None
        arr = value
        if type(arr) is not np.ndarray:
            try:
                arr = np.asarray(value)
            except (TypeError, ValueError):
                return f"is {short_repr(value)}, not an array of numbers"
        if arr.dtype.kind not in "biuf":
            return f"is {short_repr(value)}, not an array of numbers"
        if arr.shape != shape:
            return f"has shape {arr.shape}; the space's is {shape}"
        inside = (arr >= low) & (arr <= high)
        if inside.all():
            return None
        at = tuple(int(i) for i in np.argwhere(~inside)[0])
        where = f"[{', '.join(map(str, at))}]" if at else ""
        return f"{where} = {arr[at].item()!r} is outside [{low[at].item()!r}, {high[at].item()!r}]"

    return problem


def _discrete(space: gym.spaces.Discrete) -> ProblemFinder:
    start, end = int(space.start), int(space.start + space.n)

    def problem(value: Any) -> str | None:
        if isinstance(value, (int, np.integer)):
            number = int(value)
        elif isinstance(value, np.ndarray) and value.shape == () and value.dtype.kind in "iu":
            number = int(value)
        else:
            return f"is {short_repr(value)}; {space} holds whole numbers"
        if start <= number < end:
            return None
        return f"= {number} is outside {space} ({start} to {end - 1})"

    return problem


def _dict(space: gym.spaces.Dict) -> ProblemFinder:
    parts = {key: problem_finder(sub) for key, sub in space.spaces.items()}

    def problem(value: Any) -> str | None:
        if not isinstance(value, Mapping):
            return f"is {short_repr(value)}; the space holds dicts with keys {list(parts)}"
        if value.keys() != parts.keys():
            missing = [k for k in parts if k not in value]
            if missing:
                return f"lacks the key {missing[0]!r} (the space's keys: {list(parts)})"
            extra = next(k for k in value if k not in parts)
            return f"has the key {extra!r}, which the space lacks (its keys: {list(parts)})"
        for key, part in parts.items():
            why = part(value[key])
            if why is not None:
                return f"[{key!r}] {why}"
        return None

    return problem


def _tuple(space: gym.spaces.Tuple) -> ProblemFinder:
    parts = [problem_finder(sub) for sub in space.spaces]

    def problem(value: Any) -> str | None:
        if not isinstance(value, (tuple, list)) or len(value) != len(parts):
            return f"is {short_repr(value)}; the space holds tuples of {len(parts)} items"
        for i, (part, item) in enumerate(zip(parts, value)):
            why = part(item)
            if why is not None:
                return f"[{i}] {why}"
        return None

    return problem


def _other(space: gym.Space) -> ProblemFinder:
    def problem(value: Any) -> str | None:
        try:
            inside = space.contains(value)
        except Exception:  # noqa: BLE001 - a value of a type the space cannot even compare is not in it
            inside = False
        return None if inside else f"is {short_repr(value)}, which {space} does not hold"

    return problem


BatchProblemFinder = Callable[[Any, "list[Any]"], "tuple[int, str] | None"]
"""(stacked batch, the values it was stacked from) -> None when the space holds every row, else the
first bad row's index and why (the phrase ``problem_finder`` gives for that value)."""


def batch_problem_finder(space: gym.Space) -> BatchProblemFinder:
    """The checker of a batch of values of ``space``: for a Box, a few vectorized comparisons over the
    whole stacked batch (the rows are looked at one by one only when one is bad); for other spaces,
    ``problem_finder`` row by row."""
    single = problem_finder(space)

    def rows(values: list[Any]) -> tuple[int, str] | None:
        for k, value in enumerate(values):
            why = single(value)
            if why is not None:
                return k, why
        return None

    if not isinstance(space, gym.spaces.Box):
        return lambda batch, values: rows(values)
    low, high, shape = space.low, space.high, space.shape

    def problem(batch: Any, values: list[Any]) -> tuple[int, str] | None:
        if (type(batch) is np.ndarray and batch.shape[1:] == shape and batch.dtype.kind in "biuf"
                and (batch >= low).all() and (batch <= high).all()):  # NaN fails both: looked at below
            return None
        return rows(values)

    return problem

