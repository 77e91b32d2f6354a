"""Piecewise-linear schedules over env steps (learning rates, epsilon, entropy coefficients)."""
from __future__ import annotations


def piecewise(schedule: float | list, t: int) -> float:
    """A constant, or ``[[t0, v0], [t1, v1], ...]`` interpolated linearly (held after the last)."""
    if not isinstance(schedule, (list, tuple)):
        return float(schedule)
    points = sorted((int(a), float(b)) for a, b in schedule)
    if t <= points[0][0]:
        return points[0][1]
    for (t0, v0), (t1, v1) in zip(points, points[1:]):
        if t < t1:
            return v0 + (v1 - v0) * (t - t0) / (t1 - t0)
    return points[-1][1]
