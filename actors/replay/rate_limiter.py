"""A samples-per-insert rate limiter with Reverb's ``SampleToInsertRatio`` semantics.

It keeps the replay ratio of an off-policy run -- transitions sampled per transition inserted --
near ``samples_per_insert`` whatever the relative speed of env runners and learners: a fast
producer waits for the learner, a fast learner waits for fresh data. The state is one number,
``diff = inserts * samples_per_insert - samples`` (counted in transitions), kept inside
``[min_diff, max_diff]``:

* an insert of ``n`` may proceed while the table fills (``size < min_size_to_sample``: no sample can
  run yet, so an insert that crosses the fill-up point goes in whole) or when
  ``diff + n * samples_per_insert <= max_diff``;
* a sample of ``n`` may proceed when ``size >= min_size_to_sample`` and ``diff - n >= min_diff``.

A number ``error_buffer`` ``e`` centres the band on the fill-up point: ``offset = spi *
min_size_to_sample``, ``min_diff = offset - e``, ``max_diff = offset + e``. Waiting happens on a
``threading.Condition`` that every recorded insert or sample notifies, never by polling.

To wait and record as one step, hold ``limiter.lock`` (re-entrant) around both; a replay buffer
passes its own lock so that its storage and the counters change together.
"""
from __future__ import annotations

import numbers
import threading
import time
from typing import Any

DEFAULT_ERROR_BUFFER_FACTOR = 1000.0
"""``error_buffer=None`` means ``max(1.0, spi) * 1000``: a band wide enough that sample batches and
adds of up to ~1000 transitions each never wait on each other forever, while the ratio still
holds to within that many transitions over a run."""


class RateLimiterTimeout(RuntimeError):
    """An insert or sample waited longer than its timeout for the other side to catch up."""


def default_error_buffer(samples_per_insert: float) -> float:
    return max(1.0, float(samples_per_insert)) * DEFAULT_ERROR_BUFFER_FACTOR


def _is_number(x: Any) -> bool:
    return isinstance(x, numbers.Real) and not isinstance(x, bool)


def diff_bounds(samples_per_insert: float, min_size_to_sample: int, error_buffer: Any) -> tuple[float, float]:
    """``(min_diff, max_diff)`` for valid settings."""
    if error_buffer is None:
        error_buffer = default_error_buffer(samples_per_insert)
    if _is_number(error_buffer):
        offset = float(samples_per_insert) * min_size_to_sample
        return offset - float(error_buffer), offset + float(error_buffer)
    lo, hi = error_buffer
    return float(lo), float(hi)


def limiter_problems(samples_per_insert: Any, min_size_to_sample: Any, error_buffer: Any) -> list[str]:
    """Every invalid limiter setting, each with the valid choices and the fix (empty: all valid)."""
    out = []
    if isinstance(min_size_to_sample, bool) or not isinstance(min_size_to_sample, numbers.Integral) \
            or min_size_to_sample < 1:
        out.append(f"min_size_to_sample must be an int >= 1, got {min_size_to_sample!r}")
    if samples_per_insert is None:
        return out  # unlimited: only min_size_to_sample applies, error_buffer is unused
    if not _is_number(samples_per_insert) or not samples_per_insert > 0:
        out.append(f"samples_per_insert must be a number > 0 or None (no limit), got {samples_per_insert!r}")
        return out
    pair = isinstance(error_buffer, (tuple, list)) and len(error_buffer) == 2 and all(map(_is_number, error_buffer))
    if not (error_buffer is None or _is_number(error_buffer) or pair):
        out.append(f"error_buffer must be None, a number or a (min_diff, max_diff) pair, got {error_buffer!r}")
        return out
    if out:
        return out
    spi, min_size = float(samples_per_insert), int(min_size_to_sample)
    min_diff, max_diff = diff_bounds(spi, min_size, error_buffer)
    need = 2 * max(1.0, spi)
    if max_diff - min_diff < need:
        out.append(
            f"error_buffer={error_buffer!r} gives max_diff - min_diff = {max_diff - min_diff:g}, less than "
            f"2 * max(1, samples_per_insert) = {need:g}: this could block samples and/or inserts completely; "
            f"use an error_buffer of at least {need / 2:g} (or a pair at least {need:g} apart)"
        )
    if min_diff > spi * min_size:
        out.append(
            f"min_diff = {min_diff:g} is above samples_per_insert * min_size_to_sample = {spi * min_size:g}: "
            f"sampling would deadlock as soon as min_size_to_sample={min_size} items are inserted; "
            f"lower min_diff to at most {spi * min_size:g}"
        )
    return out


class RateLimiter:
    def __init__(self, samples_per_insert: float | None, min_size_to_sample: int = 1,
                 error_buffer: float | tuple[float, float] | None = None,
                 lock: threading.RLock | None = None) -> None:
        problems = limiter_problems(samples_per_insert, min_size_to_sample, error_buffer)
        if problems:
            raise ValueError("; ".join(problems))
        self.samples_per_insert = None if samples_per_insert is None else float(samples_per_insert)
        self.min_size_to_sample = int(min_size_to_sample)
        self.error_buffer = error_buffer
        if self.samples_per_insert is None:
            self.min_diff, self.max_diff = -float("inf"), float("inf")
        else:
            self.min_diff, self.max_diff = diff_bounds(self.samples_per_insert, self.min_size_to_sample, error_buffer)
        self.lock = lock if lock is not None else threading.RLock()
        self._cond = threading.Condition(self.lock)
        self.inserts = 0
        self.samples = 0
        self.size = 0
        self.insert_blocked_s = 0.0
        self.sample_blocked_s = 0.0
        self._closed = False

    # --- checks (no waiting) -------------------------------------------------------------------
    @property
    def diff(self) -> float:
        spi = self.samples_per_insert
        return 0.0 if spi is None else self.inserts * spi - self.samples

    def can_insert(self, n: int) -> bool:
        with self.lock:
            # while the table fills no sample may run, so refusing an insert could only deadlock: an insert
            # that crosses min_size_to_sample proceeds whole, and samples then bring diff back into the band
            if self.samples_per_insert is None or self.size < self.min_size_to_sample:
                return True
            return self.diff + n * self.samples_per_insert <= self.max_diff

    def can_sample(self, n: int) -> bool:
        with self.lock:
            if self.size < self.min_size_to_sample:
                return False
            return self.samples_per_insert is None or self.diff - n >= self.min_diff

    def snapshot(self) -> tuple[int, int, int]:
        """``(inserts, samples, size)`` read together."""
        with self.lock:
            return self.inserts, self.samples, self.size

    # --- waiting ------------------------------------------------------------------------------
    def await_insert(self, n: int, timeout_s: float | None = None) -> None:
        """Return once an insert of ``n`` may proceed; RateLimiterTimeout after ``timeout_s`` (None: forever)."""
        self._await("insert", n, self.can_insert, timeout_s)

    def await_sample(self, n: int, timeout_s: float | None = None) -> None:
        """Return once a sample of ``n`` may proceed; RateLimiterTimeout after ``timeout_s`` (None: forever)."""
        with self.lock:
            spi = self.samples_per_insert
            # Inserts stop at max_diff (or at the fill-up point), so a sample needing more than
            # that could never run: say so now rather than after a timeout.
            if spi is not None and self.min_diff + n > max(self.max_diff, spi * self.min_size_to_sample):
                raise ValueError(
                    f"a sample of {n} transitions can never proceed: it needs diff >= min_diff + {n} = "
                    f"{self.min_diff + n:g}, but inserts stop at diff <= max_diff = {self.max_diff:g}; sample "
                    f"smaller batches or widen error_buffer (now {self.error_buffer!r}) to at least {n / 2 + spi:g}"
                )
        self._await("sample", n, self.can_sample, timeout_s)

    def _await(self, kind: str, n: int, ready: Any, timeout_s: float | None) -> None:
        with self._cond:
            if self._closed:
                raise RuntimeError(f"rate limiter is closed: cannot {kind} {n} transitions")
            if ready(n):
                return
            start = time.monotonic()
            ok = self._cond.wait_for(lambda: self._closed or ready(n), timeout_s)
            waited = time.monotonic() - start
            if kind == "insert":
                self.insert_blocked_s += waited
            else:
                self.sample_blocked_s += waited
            if self._closed:
                raise RuntimeError(f"rate limiter was closed while waiting to {kind} {n} transitions")
            if not ok:
                raise RateLimiterTimeout(self._timeout_message(kind, n, waited))

    def _timeout_message(self, kind: str, n: int, waited: float) -> str:
        spi = self.samples_per_insert
        head = (f"{kind} of {n} transitions waited {waited:.3g}s: inserts={self.inserts}, samples={self.samples}, "
                f"size={self.size}, diff = inserts * samples_per_insert - samples = {self.diff:g}, "
                f"band [min_diff, max_diff] = [{self.min_diff:g}, {self.max_diff:g}] "
                f"(samples_per_insert={spi}, min_size_to_sample={self.min_size_to_sample}, "
                f"error_buffer={self.error_buffer!r}). ")
        if kind == "sample" and self.size < self.min_size_to_sample:
            return head + (f"Sampling needs size >= min_size_to_sample={self.min_size_to_sample}: insert more "
                           "(is anything adding?) or lower min_size_to_sample.")
        if kind == "sample":
            return head + (f"A sample needs diff - {n} >= min_diff: inserts must catch up (is anything adding?); "
                           "raise samples_per_insert, widen error_buffer, or raise the timeout.")
        fix = (f" This insert alone needs {n * spi:g} of the band's {self.max_diff - self.min_diff:g}: add fewer "
               "steps per call or widen error_buffer." if n * spi > self.max_diff - self.min_diff else "")
        return head + (f"An insert needs diff + {n} * samples_per_insert <= max_diff: samples must catch up (is "
                       "anything sampling?); lower samples_per_insert, widen error_buffer, or raise the timeout." + fix)

    # --- recording ----------------------------------------------------------------------------
    def record_insert(self, n: int, size: int | None = None) -> None:
        """Count an insert of ``n``; ``size`` is the table size after it (default: size + n; less when
        the insert evicted old items)."""
        with self._cond:
            self.inserts += int(n)
            self.size = self.size + int(n) if size is None else int(size)
            self._cond.notify_all()

    def record_prefill(self, n: int, size: int) -> None:
        """``n`` items stored before training (from a recording). They stand in for the warm-up inserts
        the ratio's offset (``samples_per_insert * min_size_to_sample``) waits for -- at most that many --
        so sampling starts at once, but beyond it they allow no samples of their own: only the
        inserts that follow do, at the configured ratio."""
        with self._cond:
            if self.samples_per_insert is not None and _is_number(self.error_buffer if self.error_buffer is not None
                                                                  else 0.0):
                self.inserts += min(int(n), max(0, self.min_size_to_sample - self.inserts))
            self.size = int(size)
            self._cond.notify_all()

    def record_sample(self, n: int) -> None:
        with self._cond:
            self.samples += int(n)
            self._cond.notify_all()

    def close(self) -> None:
        """Wake every waiter with a RuntimeError; later waits fail at once (the stage is stopping)."""
        with self._cond:
            self._closed = True
            self._cond.notify_all()

    # --- state --------------------------------------------------------------------------------
    def get_state(self) -> dict[str, Any]:
        with self.lock:
            return {"inserts": self.inserts, "samples": self.samples, "size": self.size,
                    "insert_blocked_s": self.insert_blocked_s, "sample_blocked_s": self.sample_blocked_s}

    def set_state(self, state: dict[str, Any]) -> None:
        with self._cond:
            self.inserts, self.samples = int(state["inserts"]), int(state["samples"])
            self.size = int(state["size"])
            self.insert_blocked_s = float(state.get("insert_blocked_s", 0.0))
            self.sample_blocked_s = float(state.get("sample_blocked_s", 0.0))
            self._cond.notify_all()
