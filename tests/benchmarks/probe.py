"""A fixed single-threaded workload whose speed tells how fast the host runs now (the soak's reference)."""
from __future__ import annotations

import time

import numpy as np

PROBE_FLOATS = 1 << 20
"""The probe's array: 4 MB, beyond the caches, so the memory's speed counts as well as the clock's."""
_ARRAY: list[np.ndarray] = []  # allocated and touched once: no page faults inside a timed round


def probe_speed(rounds: int = 5) -> float:
    """How fast the machine runs a fixed single-threaded workload now: rounds per CPU-second of the calling
    thread (the median of ``rounds``), each a Python loop and a few passes over a 4 MB array. A host that
    slows down (its clock, or neighbours sharing its memory) slows this as much as it slows the run; a run
    that gets slower by itself leaves it where it was."""
    if not _ARRAY:
        _ARRAY.append(np.ones(PROBE_FLOATS, np.float32))
    a = _ARRAY[0]
    speeds = []
    for _ in range(rounds):
        t = time.thread_time()
        total = 0
        for i in range(20_000):
            total += i * i
        for _ in range(4):
            a *= np.float32(1.0000001)
        speeds.append(1.0 / max(time.thread_time() - t, 1e-9))
    return float(np.median(speeds))
