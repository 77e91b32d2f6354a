"""MetricsLogger: per-stage metrics that remote stages ship to the driver as partial aggregates.

Stages never send raw value streams: ``export()`` yields a small per-mode partial aggregate of what
changed since the last export, chosen so that the driver's ``merge()`` is exact, i.e. folding
exports in gives the numbers one logger would have produced had it seen every value itself.

* Windowed mean/min/max keep the last N values across reduces: episode returns arrive irregularly,
  so a per-iteration view would be noisy or, in an iteration without finished episodes, empty.
* Windowless mean/min/max cover one reduce period but repeat the previous result when the period is
  empty, so a learner statistic does not flip to NaN in an iteration with no update. They hold
  (sum, count) or a running extreme, never a list, because learners log on every minibatch.
* ``sum`` counts per iteration; ``lifetime_sum`` must outlive reduces and checkpoints. Integer
  inputs stay ints, so step counters compare and serialise as ints.

Export and reduce periods are separate because one stage may report its own results and feed a
parent. After ``set_state`` the export period restarts empty, so a restored stage never re-sends
deltas its parent already counted. One lock guards every public method: a runner logs from its
sampling thread while the actor's main thread exports.
"""
from __future__ import annotations

import contextlib
import math
import numbers
import threading
import time
from collections import deque
from collections.abc import Iterator, Mapping
from typing import Any

import numpy as np

REDUCE_MODES = ("mean", "min", "max", "sum", "lifetime_sum")
_WINDOWABLE = ("mean", "min", "max")
Number = int | float


def _as_number(key: str, value: Any, reduce: str) -> Number:
    t = type(value)  # fast path: plain Python numbers (per-episode logging sits on the sampling path)
    if t is float:
        return value
    if t is int:
        return float(value) if reduce == "mean" else value
    if isinstance(value, np.ndarray) and value.ndim == 0:
        value = value.item()
    if isinstance(value, numbers.Integral):  # bool and numpy ints included
        out: Number = int(value)
    elif isinstance(value, numbers.Real):
        out = float(value)
    else:
        raise TypeError(f"metric {key!r}: value must be a real number, got {type(value).__name__}")
    return float(out) if reduce == "mean" else out


def _check_mode(key: str, reduce: Any, window: Any) -> int | None:
    if reduce not in REDUCE_MODES:
        raise ValueError(f"metric {key!r}: unknown reduce {reduce!r}; expected one of {REDUCE_MODES}")
    if window is None:
        return None
    if isinstance(window, bool) or not isinstance(window, numbers.Integral) or window < 1:
        raise ValueError(f"metric {key!r}: window must be None or an int >= 1, got {window!r}")
    if reduce not in _WINDOWABLE:
        raise ValueError(f"metric {key!r}: window only applies to {_WINDOWABLE}, not reduce={reduce!r}")
    return int(window)


def _nan_to_none(x: Any) -> Any:  # JSON has no NaN
    return None if isinstance(x, float) and math.isnan(x) else x


def _none_to_nan(x: Any) -> Any:
    return math.nan if x is None else x


class _Stat:
    """One key's aggregates: ``acc``/``count`` for the reduce period, ``exp_*`` for the export period."""

    def __init__(self, reduce: str, window: int | None) -> None:
        self.reduce, self.window = reduce, window
        self.values: deque[Number] = deque(maxlen=window)  # windowed: the sliding window
        self.pending: deque[Number] = deque(maxlen=window)  # windowed: not yet exported
        self.extreme = min if reduce == "min" else max
        self.acc: Number | None = None if reduce in ("min", "max") else 0
        self.count = 0
        self.last: Number = math.nan
        self.reset_export()

    def reset_export(self) -> None:
        self.exp_acc: Number | None = None if self.reduce in ("min", "max") else 0
        self.exp_count = 0
        self.pending.clear()

    def add(self, v: Number) -> None:
        self.exp_count += 1
        if self.window is not None:
            self.values.append(v)
            self.pending.append(v)
        elif self.reduce in ("min", "max"):
            self.acc = v if self.acc is None else self.extreme(self.acc, v)
            self.exp_acc = v if self.exp_acc is None else self.extreme(self.exp_acc, v)
        else:
            self.acc += v
            self.exp_acc += v
            self.count += 1

    def add_partial_mean(self, total: Number, count: int) -> None:
        self.acc, self.count = self.acc + total, self.count + count
        self.exp_acc, self.exp_count = self.exp_acc + total, self.exp_count + count

    def peek(self) -> Number:
        if self.window is not None:
            if not self.values:
                return math.nan
            return sum(self.values) / len(self.values) if self.reduce == "mean" else self.extreme(self.values)
        if self.reduce == "mean":
            return self.acc / self.count if self.count else self.last
        if self.reduce in ("min", "max"):
            return self.last if self.acc is None else self.acc
        return self.acc

    def reduce_period(self) -> Number:
        out = self.peek()
        if self.window is None:
            self.last = out
            if self.reduce in ("min", "max"):
                self.acc = None
            elif self.reduce != "lifetime_sum":
                self.acc, self.count = 0, 0
        return out

    def export(self) -> dict | None:
        if self.exp_count == 0:
            return None
        entry: dict[str, Any] = {"reduce": self.reduce, "window": self.window}
        if self.window is not None:
            entry["values"] = list(self.pending)
        elif self.reduce == "mean":
            entry.update(sum=self.exp_acc, count=self.exp_count)
        else:
            entry["value"] = self.exp_acc
        self.reset_export()
        return entry


class MetricsLogger:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._stats: dict[str, _Stat] = {}

    def log_value(self, key: str, value: float, reduce: str = "mean", window: int | None = None) -> None:
        with self._lock:
            number = _as_number(key, value, reduce)
            stat = self._stats.get(key)
            if stat is None or stat.reduce != reduce or stat.window != window:
                stat = self._stat(key, reduce, window)  # creates, or raises naming the clash
            stat.add(number)

    def log_values(self, key: str, values: list[float], reduce: str = "mean", window: int | None = None) -> None:
        """Log several values under one key at once (one lock, one check)."""
        with self._lock:
            numbers = [_as_number(key, v, reduce) for v in values]
            stat = self._stat(key, reduce, window)
            for number in numbers:
                stat.add(number)

    def log_episodes(self, returns: list[float], lengths: list[int], window: int | None = None) -> None:
        """The episode statistics every acting stage reports: return mean/min/max and length over
        ``window`` episodes, and how many episodes ended (this period and lifetime)."""
        if returns:
            self.log_values("episode_return_mean", returns, window=window)
            self.log_values("episode_return_min", returns, reduce="min", window=window)
            self.log_values("episode_return_max", returns, reduce="max", window=window)
            self.log_values("episode_len_mean", lengths, window=window)
        self.log_value("num_episodes", len(returns), reduce="sum")
        self.log_value("num_episodes_lifetime", len(returns), reduce="lifetime_sum")

    def log_dict(
        self, values: dict[str, Any], *, prefix: str = "", reduce: str = "mean", window: int | None = None
    ) -> None:
        with self._lock:
            items = [(k, _as_number(k, v, reduce)) for k, v in _flatten(values, prefix)]
            for k, _ in items:  # validate everything before logging anything
                self._check_key(k, reduce, window)
            for k, v in items:
                self._stat(k, reduce, window).add(v)

    @contextlib.contextmanager
    def log_time(self, key: str, reduce: str = "mean") -> Iterator[None]:
        with self._lock:
            self._check_key(key, reduce, None)  # fail before the timed block, not after it
        start = time.perf_counter()
        try:
            yield
        finally:
            self.log_value(key, time.perf_counter() - start, reduce=reduce)

    def peek(self, key: str, default: float = float("nan")) -> float:
        with self._lock:
            stat = self._stats.get(key)
            return default if stat is None else stat.peek()

    def reduce(self) -> dict:
        with self._lock:
            out: dict[str, Any] = {}
            for key, stat in self._stats.items():
                *parents, leaf = key.split("/")
                node = out
                for p in parents:
                    node = node.setdefault(p, {})
                node[leaf] = stat.reduce_period()
            return out

    def keys(self) -> list[str]:
        with self._lock:
            return list(self._stats)

    def delete(self, prefix: str) -> None:
        """Forget ``prefix`` and every key under it (a removed module's ``learners/<module_id>``)."""
        with self._lock:
            for key in [k for k in self._stats if k == prefix or k.startswith(f"{prefix}/")]:
                del self._stats[key]

    def __contains__(self, key: str) -> bool:
        with self._lock:
            return key in self._stats

    def export(self) -> dict[str, dict]:
        with self._lock:
            entries = {key: stat.export() for key, stat in self._stats.items()}
            return {k: e for k, e in entries.items() if e is not None}

    def merge(self, exported: dict[str, dict], prefix: str = "") -> None:
        with self._lock:
            for key, entry in exported.items():
                key = f"{prefix}/{key}" if prefix else key
                reduce = entry.get("reduce")
                window = self._check_key(key, reduce, entry.get("window"))
                if window is None and reduce == "mean":  # parse the payload before creating the key
                    total, count = _as_number(key, entry["sum"], reduce), int(entry["count"])
                    self._stat(key, reduce, window).add_partial_mean(total, count)
                    continue
                parsed = [_as_number(key, v, reduce) for v in (entry["values"] if window else [entry["value"]])]
                stat = self._stat(key, reduce, window)
                for v in parsed:
                    stat.add(v)

    def get_state(self) -> dict:
        with self._lock:
            metrics = {
                key: dict(reduce=s.reduce, window=s.window, values=[_nan_to_none(v) for v in s.values],
                          acc=_nan_to_none(s.acc), count=s.count, last=_nan_to_none(s.last))
                for key, s in self._stats.items()
            }
            return {"metrics": metrics}

    def set_state(self, state: dict) -> None:
        stats: dict[str, _Stat] = {}
        for key, st in state["metrics"].items():
            s = _Stat(st["reduce"], _check_mode(key, st["reduce"], st["window"]))
            s.values.extend(_none_to_nan(v) for v in st["values"])
            s.acc = st["acc"] if s.reduce in ("min", "max") else _none_to_nan(st["acc"])  # None: empty
            s.count, s.last = st["count"], _none_to_nan(st["last"])
            stats[key] = s
        with self._lock:
            self._stats = stats

    # -- internals (caller holds the lock) -------------------------------------------------------
    def _check_key(self, key: str, reduce: str, window: int | None) -> int | None:
        window = _check_mode(key, reduce, window)
        stat = self._stats.get(key)
        if stat is not None and (stat.reduce, stat.window) != (reduce, window):
            raise ValueError(
                f"metric {key!r} has reduce={stat.reduce!r}, window={stat.window}; "
                f"cannot use it with reduce={reduce!r}, window={window}"
            )
        if stat is None:
            for other in self._stats:  # reduce() nests on "/": a key cannot be both leaf and branch
                if other.startswith(key + "/") or key.startswith(other + "/"):
                    raise ValueError(f"metric {key!r} clashes with {other!r}: one would nest inside the other")
        return window

    def _stat(self, key: str, reduce: str, window: int | None) -> _Stat:
        window = self._check_key(key, reduce, window)
        stat = self._stats.get(key)
        if stat is None:
            stat = self._stats[key] = _Stat(reduce, window)
        return stat


def _flatten(values: Mapping[str, Any], prefix: str) -> Iterator[tuple[str, Any]]:
    for k, v in values.items():
        key = f"{prefix}/{k}" if prefix else str(k)
        if isinstance(v, Mapping):
            yield from _flatten(v, key)
        else:
            yield key, v
