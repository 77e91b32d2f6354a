"""The replay stage: episode chunks in, n-step training batches out, under a samples-per-insert limit.

Chunks go into a ring of preallocated rows (``storage``), each observation once. Batches are
drawn uniformly among stored steps or, with ``prioritized``, in proportion to ``priority **
alpha`` on a sum tree (Schaul et al., 2016), and their n-step returns are computed at sample time,
vectorized over the batch, never across an episode end. A ``RateLimiter`` keeps samples per
insert near ``samples_per_insert``; ``add`` and ``sample`` wait on it, sharing one lock with the
storage so that the counters always describe what is stored.

One seeded generator drives every random choice, and ``get_state`` holds everything (rings,
episode map, sum tree, limiter counters, generator state), so a restored buffer returns the same
batches as the original would have.
"""
from __future__ import annotations

import numbers
import threading
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable

import numpy as np

from actors.core import ReplayRole
from actors.metrics import MetricsLogger
from actors.replay.rate_limiter import RateLimiter, RateLimiterTimeout, limiter_problems
from actors.replay.storage import RingStorage
from actors.replay.sum_tree import SumTree
from protocols.codec import decode, encode
from protocols.episode import EpisodeChunk

if TYPE_CHECKING:
    from actors.replay.intake import ReplayIntake


def _real(x: Any) -> bool:
    return isinstance(x, numbers.Real) and not isinstance(x, bool)


def _int(x: Any) -> bool:
    return isinstance(x, numbers.Integral) and not isinstance(x, bool)


def n_step_range(n_step: Any) -> tuple[int, int] | None:
    """``(lo, hi)`` for a valid ``n_step`` (an int >= 1 or a pair 1 <= lo <= hi), else None."""
    if _int(n_step) and n_step >= 1:
        return int(n_step), int(n_step)
    if isinstance(n_step, (tuple, list)) and len(n_step) == 2 and all(map(_int, n_step)) \
            and 1 <= n_step[0] <= n_step[1]:
        return int(n_step[0]), int(n_step[1])
    return None


@dataclass
class ReplaySettings:
    """What a replay buffer stores, how it samples and how fast sampling may run ahead of inserts."""

    capacity: int = 50_000
    """Rows in the ring, about one per env step (an episode of N steps takes N + 1 rows). Allocated
    once, on the first add; the oldest rows are overwritten first."""
    prioritized: bool = False
    """Sample in proportion to priority ** alpha (PER) instead of uniformly."""
    alpha: float = 0.6
    """PER: how strongly priorities shape sampling, >= 0 (0: uniform)."""
    beta: float = 0.4
    """PER: importance-weight exponent in [0, 1] (1: full correction of the sampling bias)."""
    epsilon: float = 1e-6
    """PER: added to |priority| so no stored step becomes impossible to sample, >= 0."""
    n_step: int | tuple[int, int] = 1
    """Steps per return: an int >= 1, or (lo, hi) to draw n uniformly from lo..hi per sampled row."""
    gamma: float = 0.99
    """Discount in [0, 1] of the n-step returns and of the bootstrap (``discounts`` = gamma ** n)."""
    samples_per_insert: float | None = None
    """Transitions sampled per transition inserted that the rate limiter keeps to (None: no limit)."""
    min_size_to_sample: int = 1
    """Stored transitions needed before the first sample (waits with a limit, raises without)."""
    error_buffer: float | tuple[float, float] | None = None
    """How far the ratio may stray, in sampled transitions: a number e (band spi * min_size +- e), or
    explicit (min_diff, max_diff). None: max(1, samples_per_insert) * 1000, wide enough for batches
    and adds of up to ~1000 transitions each."""
    timeout_s: float | None = 60.0
    """How long add/sample wait on the rate limiter before raising RateLimiterTimeout (None: forever)."""
    seed: int | None = None
    """Seed of the generator behind every random choice (None: fresh entropy, not reproducible)."""

    def problems(self) -> list[str]:
        """Every invalid value, with the valid choices (empty: all valid)."""
        out = []
        cap, min_size = self.capacity, self.min_size_to_sample
        if not _int(cap) or cap < 2:
            out.append(f"capacity must be an int >= 2 (rows, about one per env step), got {cap!r}")
        elif _int(min_size) and cap <= min_size:
            out.append(f"capacity={cap} rows hold at most {cap - 1} transitions (one row per episode holds only "
                       f"its last observation), fewer than min_size_to_sample={min_size}: raise capacity above "
                       f"{min_size} or lower min_size_to_sample")
        if not isinstance(self.prioritized, bool):
            out.append(f"prioritized must be True or False, got {self.prioritized!r}")
        if not _real(self.alpha) or not self.alpha >= 0:
            out.append(f"alpha must be a number >= 0, got {self.alpha!r}")
        if not _real(self.beta) or not 0 <= self.beta <= 1:
            out.append(f"beta must be a number in [0, 1], got {self.beta!r}")
        if not _real(self.epsilon) or not self.epsilon >= 0:
            out.append(f"epsilon must be a number >= 0, got {self.epsilon!r}")
        if n_step_range(self.n_step) is None:
            out.append(f"n_step must be an int >= 1 or a pair (lo, hi) of ints with 1 <= lo <= hi, got {self.n_step!r}")
        if not _real(self.gamma) or not 0 <= self.gamma <= 1:
            out.append(f"gamma must be a number in [0, 1], got {self.gamma!r}")
        if self.timeout_s is not None and (not _real(self.timeout_s) or not self.timeout_s > 0):
            out.append(f"timeout_s must be a number > 0 or None (wait forever), got {self.timeout_s!r}")
        if self.seed is not None and (not _int(self.seed) or self.seed < 0):
            out.append(f"seed must be None or an int >= 0, got {self.seed!r}")
        return out + limiter_problems(self.samples_per_insert, min_size, self.error_buffer)


def priority_arrays(indices: Any, priorities: Any, size: int, unit: str) -> tuple[np.ndarray, np.ndarray]:
    """``update_priorities``' arguments as flat arrays, or ValueError naming what is wrong with them."""
    idx, pri = np.asarray(indices).reshape(-1), np.asarray(priorities, np.float64).reshape(-1)
    if len(idx) != len(pri):
        raise ValueError(f"update_priorities got {len(idx)} indices but {len(pri)} priorities: pass one each")
    if len(idx) and (idx.dtype.kind not in "iu" or idx.min() < 0 or idx.max() >= size):
        raise ValueError(f"indices must be {unit} in [0, {size}) as returned by sample()")
    if not np.all(np.isfinite(pri)):
        raise ValueError(f"priorities must be finite, got {pri[~np.isfinite(pri)][:5]!r}")
    return idx, pri


def prioritized_draw(tree: SumTree, rng: np.random.Generator, count: int, per_batch: int, population: int,
                     beta: float) -> tuple[np.ndarray, np.ndarray]:
    """``count`` entries drawn in proportion to their priorities, and their importance weights
    ``(population * P(i)) ** -beta`` normalised by the largest within each batch of ``per_batch``."""
    total = tree.total()
    drawn = tree.sample(rng.random(count) * total)
    weights = ((population * tree.get(drawn) / total) ** -beta).reshape(-1, per_batch)
    return drawn, (weights / weights.max(axis=1, keepdims=True)).reshape(-1).astype(np.float32)


def log_counts(metrics: MetricsLogger, key: str, n: int, size: int, num_samples: int, num_inserts: int) -> None:
    """A buffer's counters after an insert or a sample of ``n`` steps."""
    metrics.log_value(key, n, reduce="lifetime_sum")
    metrics.log_value("size", size, reduce="max", window=1)
    metrics.log_value("samples_per_insert", num_samples / max(1, num_inserts), reduce="max", window=1)


MAX_BATCHES_PER_CALL = 32
"""Batches a plan draws at once for one learner call, at most: they are drawn together, so a long run
of them would train on stale priorities; a training step that allows more makes several calls."""


class ReplayBuffer(ReplayRole):
    def __init__(self, settings: ReplaySettings | None = None, intake: ReplayIntake | None = None,
                 view: Any = None) -> None:
        """``intake``: the algorithm's learner pipeline, applied to every chunk before it is stored
        (``actors.replay.intake``). ``view``: the runners' env-to-module view (``actors.connectors.ObservationView``,
        e.g. frame stacking): chunks are stored as recorded, one frame per step, with the look-back rows the
        view needs, and each drawn batch's ``obs`` and ``next_obs`` are the view rebuilt from them -- what the
        module acted on. Without it, batches hold the stored observations."""
        settings = settings if settings is not None else ReplaySettings()
        problems = settings.problems()
        if problems:
            raise ValueError("invalid replay settings: " + "; ".join(problems))
        self.settings = settings
        self.n_lo, self.n_hi = n_step_range(settings.n_step)
        self.lock = threading.RLock()
        self.view = view
        self.storage = RingStorage(settings.capacity, 0 if view is None else view.piece.look_back)
        self.tree = SumTree(settings.capacity) if settings.prioritized else None
        self.max_priority = 1.0  # raw (|p| + epsilon); new steps get max_priority ** alpha
        self.limiter = None if settings.samples_per_insert is None else RateLimiter(
            settings.samples_per_insert, settings.min_size_to_sample, settings.error_buffer, lock=self.lock)
        self.rng = np.random.default_rng(settings.seed)
        self.metrics = MetricsLogger()
        self.num_inserts = 0
        self.num_samples = 0
        self._feed: Any = None  # the stream intake, when runners stream to this stage
        self.intake = intake

    def __len__(self) -> int:
        """Stored transitions (rows that can be sampled)."""
        return self.storage.num_steps

    def _timeout(self, timeout_s: float | None) -> float | None:
        return self.settings.timeout_s if timeout_s is None else timeout_s

    def _blocked_s(self) -> float:
        lim = self.limiter
        return 0.0 if lim is None else lim.insert_blocked_s + lim.sample_blocked_s

    # --- adding -------------------------------------------------------------------------------
    def add(self, chunks: list[EpisodeChunk] | EpisodeChunk | bytes, timeout_s: float | None = None) -> None:
        """Store chunks (a list, one chunk, or a codec frame of them), waiting on the rate limiter for
        their total number of steps; ValueError when they do not match the first chunk's structure."""
        if isinstance(chunks, (bytes, bytearray, memoryview)):
            chunks = decode(chunks)
        chunks = [c.validate() for c in ([chunks] if isinstance(chunks, EpisodeChunk) else chunks)]
        n = sum(len(c) for c in chunks)
        if not n:
            return
        with self.lock:
            if self.intake is None:
                self._check(chunks)
            self._wait("insert", n, timeout_s)
            if self.intake is not None:  # after the wait (which lets go of the lock): pieces see what is stored, together
                chunks = self._through_intake(chunks)
                n = sum(len(c) for c in chunks)
                if not n:
                    return
                self._check(chunks)
            self._store(chunks)
            self.num_inserts += n
            if self.limiter is not None:
                self.limiter.record_insert(n, size=len(self))
            self._log("inserts", n)

    def prefill(self, chunks: list[EpisodeChunk]) -> int:
        """Store recorded chunks before training starts, without the rate limiter: they fill the table
        (and count toward ``min_size_to_sample``) but are not inserts, so they unlock no updates by
        themselves -- the replay ratio holds from the first sampled step on. Returns the steps stored."""
        chunks = [c.validate() for c in chunks]
        with self.lock:
            chunks = self._through_intake(chunks)
            n = sum(len(c) for c in chunks)
            if not n:
                return 0
            self._check(chunks)
            self._store(chunks)
            if self.limiter is not None:
                self.limiter.record_prefill(n, len(self))
            self._log("prefilled", n)
        return n

    def _through_intake(self, chunks: list[EpisodeChunk]) -> list[EpisodeChunk]:
        """What the intake (under the lock: its pieces' state changes with what they see) makes of ``chunks``."""
        if self.intake is None or not chunks:
            return chunks
        refused = self.intake.num_chunks_refused
        out = self.intake(chunks)
        if self.intake.num_chunks_refused > refused:
            self.metrics.log_value("learner_connector/num_chunks_refused", self.intake.num_chunks_refused - refused,
                                   reduce="lifetime_sum")
        return out

    def _check(self, chunks: list[EpisodeChunk]) -> None:
        """Refuse the whole call before storing any of it."""
        spec = self.storage.spec or RingStorage.spec_of(chunks[0])
        for c in chunks:
            RingStorage.check(c, spec)

    def _store(self, chunks: list[EpisodeChunk]) -> None:
        touched = [self.storage.add(c) for c in chunks]
        if self.tree is not None:
            # One tree update for the call, from the final state of every touched row: new steps
            # (and closing rows that just became steps) at max priority, overwritten rows and
            # closing rows at 0.
            rows = np.concatenate(touched)
            steps = self.storage.cols["has_action"][rows]
            self.tree.update(rows, np.where(steps, self.max_priority**self.settings.alpha, 0.0))

    def can_add(self, num_steps: int) -> bool:
        return self.limiter is None or self.limiter.can_insert(num_steps)

    # --- sampling -----------------------------------------------------------------------------
    def can_sample(self, batch_size: int) -> bool:
        with self.lock:
            if self.limiter is not None:
                return self.limiter.can_sample(batch_size)
            return len(self) >= self.settings.min_size_to_sample

    def sample(self, batch_size: int, timeout_s: float | None = None, num_batches: int = 1) -> dict[str, Any]:
        """A batch of ``batch_size`` transitions with n-step returns (see the module docstring).
        ``num_batches`` > 1: that many batches drawn at once, in a row (``num_batches * batch_size``
        rows; importance weights normalised within each batch), for a learner that makes several
        updates in one call; the rate limiter counts every row."""
        if not _int(batch_size) or batch_size < 1:
            raise ValueError(f"batch_size must be an int >= 1, got {batch_size!r}")
        if not _int(num_batches) or num_batches < 1:
            raise ValueError(f"num_batches must be an int >= 1, got {num_batches!r}")
        s = self.settings
        per_batch, batch_size = batch_size, batch_size * num_batches
        with self.lock:
            self._wait("sample", batch_size, timeout_s)
            if self.limiter is None and len(self) < s.min_size_to_sample:  # min_size_to_sample >= 1
                raise RuntimeError(
                    f"cannot sample: the buffer holds {len(self)} transitions and min_size_to_sample="
                    f"{s.min_size_to_sample}; add more chunks first (check can_sample()), or set "
                    "samples_per_insert so that sample() waits for inserts")
            rows, weights = self._draw(batch_size, per_batch)
            n = self.n_hi if self.n_lo == self.n_hi else self.rng.integers(self.n_lo, self.n_hi + 1, batch_size)
            ret, boot, used, term = self.storage.n_step(rows, n, s.gamma)
            batch = {
                "obs": self._observations(rows),
                "actions": self.storage.gather("actions", rows),
                "rewards": ret.astype(np.float32),
                "next_obs": self._observations(boot),
                "n_steps": used,
                "terminateds": term,
                "discounts": np.where(term, 0.0, np.float64(s.gamma) ** used).astype(np.float32),
                "weights": weights,
                "indices": rows,
            }
            self.num_samples += batch_size
            if self.limiter is not None:
                self.limiter.record_sample(batch_size)
            self._log("samples", batch_size)
            return batch

    def _observations(self, rows: np.ndarray) -> Any:
        """What the module saw at ``rows``: the stored observations, or the view rebuilt from their look-back.
        (A drawn row's look-back is whole -- ``_draw`` sees to it -- and its bootstrap row's look-back lies
        within the row's own and the steps after it, so it is whole too.)"""
        if self.view is None:
            return self.storage.gather("obs", rows)
        idx, _ = self.storage.stack_rows(rows)
        return self.view.piece.view_gather(self.storage.obs[0], idx)

    def _draw(self, batch_size: int, per_batch: int) -> tuple[np.ndarray, np.ndarray]:
        if self.tree is not None:
            return self._draw_prioritized(batch_size, per_batch)
        has_action, filled = self.storage.cols["has_action"], self.storage.filled
        parts, need = [], batch_size
        for _ in range(8):
            # Each stored episode has one closing row that is not a step: draw a few extra
            # candidates so one round almost always suffices, and drop the non-steps (and, with a
            # view, the few steps whose look-back rows were evicted before them).
            cand = self.rng.integers(0, filled, need + need // 4 + 8)
            cand = cand[has_action[cand]]
            if self.storage.look_back:
                cand = cand[self.storage.stack_rows(cand)[1]]
            cand = cand[:need]
            parts.append(cand)
            need -= len(cand)
            if not need:
                break
        else:  # few steps among many rows: draw from the exact list instead
            parts.append(self.rng.choice(self._drawable(), need))
        rows = parts[0] if len(parts) == 1 else np.concatenate(parts)
        return rows.astype(np.int64, copy=False), np.ones(batch_size, np.float32)

    def _drawable(self) -> np.ndarray:
        """Every row a batch may hold: the stored steps (whose look-back rows are all stored, with a view)."""
        rows = np.flatnonzero(self.storage.cols["has_action"][: self.storage.filled])
        if self.storage.look_back:
            rows = rows[self.storage.stack_rows(rows)[1]]
        if not len(rows):
            raise RuntimeError(f"no stored step can be drawn: the view's look-back ({self.storage.look_back} rows) "
                               f"of every step was evicted; raise the replay buffer's capacity "
                               f"({self.storage.capacity} rows)")
        return rows

    def _draw_prioritized(self, batch_size: int, per_batch: int) -> tuple[np.ndarray, np.ndarray]:
        """PER's draw; with a view, a step whose look-back rows were evicted gets priority 0 once drawn (its
        rows never come back) and the batch is drawn again."""
        s = self.settings
        for _ in range(8):
            rows, weights = prioritized_draw(self.tree, self.rng, batch_size, per_batch, len(self), s.beta)
            if not self.storage.look_back:
                return rows, weights
            valid = self.storage.stack_rows(rows)[1]
            if valid.all():
                return rows, weights
            self.tree.update(np.unique(rows[~valid]), 0.0)
        lost = np.setdiff1d(np.flatnonzero(self.storage.cols["has_action"][: self.storage.filled]), self._drawable())
        self.tree.update(lost, 0.0)
        return prioritized_draw(self.tree, self.rng, batch_size, per_batch, len(self), s.beta)

    def update_priorities(self, indices: Any, priorities: Any) -> None:
        """Set sampled rows' priorities to (|p| + epsilon) ** alpha (a no-op for uniform replay).
        A row overwritten since it was sampled keeps priority 0 if it is no step now, and otherwise
        takes the priority meant for its old transition (rare: as in RLlib's buffers)."""
        idx, pri = priority_arrays(indices, priorities, self.settings.capacity, "rows")
        if self.tree is None or not len(idx):
            return
        with self.lock:
            keep = self.storage.cols["has_action"][idx]
            raw = np.abs(pri[keep]) + self.settings.epsilon
            if len(raw):
                self.max_priority = max(self.max_priority, float(raw.max()))
                self.tree.update(idx[keep], raw**self.settings.alpha)

    # --- stage --------------------------------------------------------------------------------
    def _wait(self, kind: str, n: int, timeout_s: float | None) -> None:
        """Wait on the rate limiter (if any) and log the time blocked, also when the wait fails."""
        before = self._blocked_s()
        try:
            if self.limiter is not None:
                wait = self.limiter.await_insert if kind == "insert" else self.limiter.await_sample
                wait(n, self._timeout(timeout_s))
        finally:
            self.metrics.log_value("blocked_s", self._blocked_s() - before, reduce="lifetime_sum")

    def _log(self, key: str, n: int) -> None:
        log_counts(self.metrics, key, n, len(self), self.num_samples, self.num_inserts)

    def get_metrics(self) -> dict[str, Any]:
        """What was logged since the last call (``MetricsLogger.export``); raises if the stream
        intake failed, so the stage group treats this stage as failed."""
        if self._feed is not None:
            self._feed.check_health()
        return self.metrics.export()

    # --- as a remote stage: fed by runners' streams, sampled by a learner -----------------------
    def start_receiving(self, observation_space: Any, action_space: Any, hwm: int = 4, rcvbuf: int = 0) -> str:
        """Start (or keep) the thread that inserts the chunks runners stream here; returns the
        address (``tcp://<node ip>:<port>``) to hand to their ``start_streaming``."""
        if self._feed is None:
            from actors.network import node_address
            from actors.replay.feed import ReplayFeed

            schema = self.stream_schema(observation_space, action_space)
            self._feed = ReplayFeed(self, schema, node_address(), hwm=hwm, rcvbuf=rcvbuf).start()
        return self._feed.address

    def stream_schema(self, observation_space: Any, action_space: Any) -> Any:
        """What a streamed chunk is checked against: the spaces, or with a view the recorded frames' space and
        the look-back rows the view needs (``observation_space`` is then the view's, not the chunks')."""
        from protocols.schema import ChunkSchema

        schema = ChunkSchema.for_spaces(observation_space if self.view is None else self.view.recorded_space,
                                        action_space)
        schema.look_back_rows = self.storage.look_back
        return schema

    def sample_encoded(self, batch_size: int, timeout_s: float | None = None) -> bytes | None:
        """``sample()`` as one codec frame -- how a batch crosses to a learner in another process --
        or None when the rate limiter held it back for ``timeout_s`` (the caller asks again)."""
        try:
            return encode(self.sample(batch_size, timeout_s), compress=False)
        except RateLimiterTimeout:
            return None

    def feed_counters(self) -> dict[str, int]:
        """Frames, chunks and env steps the stream intake received and dropped."""
        return {} if self._feed is None else self._feed.counters()

    def ping(self) -> str:
        return "ok"

    def apply(self, fn: Callable[["ReplayBuffer"], Any]) -> Any:
        return fn(self)

    def stop(self) -> None:
        if self.limiter is not None:
            self.limiter.close()  # wake waiting add/sample calls with an error
        if self._feed is not None:
            self._feed.stop()

    # --- state --------------------------------------------------------------------------------
    def get_state(self) -> dict[str, Any]:
        """Nested dicts with str keys whose leaves are numpy arrays or JSON-able values (no pickle):
        ``storage`` (RingStorage.get_state: rings under ``obs``/``actions`` by leaf index, columns,
        the open-episode map), ``sum_tree`` (or None), ``max_priority``, ``limiter`` (or None),
        ``rng`` (the generator's bit_generator state), counters and ``metrics``."""
        with self.lock:
            return {
                "storage": self.storage.get_state(),
                "sum_tree": None if self.tree is None else self.tree.get_state(),
                "max_priority": self.max_priority,
                "limiter": None if self.limiter is None else self.limiter.get_state(),
                "rng": self.rng.bit_generator.state,
                "num_inserts": self.num_inserts,
                "num_samples": self.num_samples,
                "metrics": self.metrics.get_state(),
                "intake": None if self.intake is None else self.intake.get_state(),
            }

    def get_intake_state(self) -> dict[str, Any] | None:
        """The intake's state alone (a checkpoint that leaves the buffer out keeps its pipeline's state)."""
        with self.lock:
            return None if self.intake is None else self.intake.get_state()

    def set_intake_state(self, state: dict[str, Any]) -> None:
        with self.lock:
            if self.intake is not None:
                self.intake.set_state(state)

    def snapshot(self, max_bytes: int | None = None) -> dict[str, Any] | None:
        """``get_state()`` for a snapshot the driver keeps, or None when the stored arrays exceed
        ``max_bytes``: a copy that large would hold intake and sampling up while it is made, and fill the
        driver's memory."""
        if max_bytes is not None and self.storage.nbytes() > max_bytes:
            return None
        return self.get_state()

    def set_state(self, state: dict[str, Any]) -> None:
        with self.lock:
            self.storage.set_state(state["storage"])
            self.max_priority = float(state["max_priority"])
            if self.tree is not None and state.get("sum_tree") is not None:
                self.tree.set_state(state["sum_tree"])
            elif self.tree is not None:  # saved by a uniform buffer: every stored step at max priority
                self.tree = SumTree(self.settings.capacity)
                steps = np.flatnonzero(self.storage.cols.get("has_action", np.zeros(0, bool)))
                self.tree.update(steps, self.max_priority**self.settings.alpha)
            if self.limiter is not None:
                self.limiter.set_state(state.get("limiter") or {
                    "inserts": state["num_inserts"], "samples": state["num_samples"], "size": len(self)})
            self.rng.bit_generator.state = state["rng"]
            self.num_inserts, self.num_samples = int(state["num_inserts"]), int(state["num_samples"])
            self.metrics.set_state(state["metrics"])
            if self.intake is not None and state.get("intake") is not None:
                self.intake.set_state(state["intake"])
