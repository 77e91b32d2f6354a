"""Sequence replay for recurrent Q-learning (R2D2, Kapturowski et al. 2019): whole chunks stored as sequences.

A recurrent module's runners cut episodes into chunks of at most ``max_seq_len`` steps, each carrying the
recurrent state it started from (``EpisodeChunk.state_in``). This buffer keeps each such chunk in one slot
of preallocated arrays -- its ``T + 1`` observations (the last is the bootstrap observation), ``T`` actions
and rewards, its start state and whether its episode terminated at its end -- padded to ``max_seq_len``.
Slots are overwritten oldest first. A batch is a set of slots, drawn uniformly or (``prioritized``) in
proportion to ``priority ** alpha``, where a sequence's priority is R2D2's mix of its steps' absolute TD
errors: ``eta * max + (1 - eta) * mean``. Returns are not computed here: the loss needs the online and target
networks over the whole sequence anyway (``pipeline.algorithms.dqn.recurrent``).

Burn-in (``burn_in=True``): each stored sequence remembers the slot of the chunk before it in its episode (while
that slot still holds it), and a batch carries that chunk's steps and stored state (``burn_obs``,
``burn_lengths``, ``burn_state``), which the loss unrolls without gradients to refresh the state its sequence
starts from. Chunks do not overlap, so every stored step is trained (R2D2 overlaps its sequences by half to
the same end); a sequence whose previous chunk is gone, or that starts its episode, gets length 0 and its own
stored state.

The samples-per-insert limiter counts env steps, as the transition buffer's does (a batch of ``batch_size``
steps is ``batch_size // max_seq_len`` sequences, at least one), so ``training_intensity`` keeps its meaning.
``get_state`` holds everything as numpy arrays and JSON-able values (no pickle).
"""
from __future__ import annotations

import threading
from typing import Any, Callable

import numpy as np

from actors.core import ReplayRole
from actors.metrics import MetricsLogger
from actors.replay.rate_limiter import RateLimiter
from actors.replay.replay import ReplaySettings, log_counts, n_step_range, prioritized_draw, priority_arrays
from actors.replay.storage import RingStorage, unflatten
from actors.replay.sum_tree import SumTree
from protocols import nested
from protocols.codec import decode
from protocols.episode import EpisodeChunk

class SequenceReplay(ReplayRole):
    def __init__(self, settings: ReplaySettings, max_seq_len: int, burn_in: bool = False) -> None:
        problems = settings.problems()
        if not isinstance(max_seq_len, int) or max_seq_len < 1:
            problems.append(f"max_seq_len must be an int >= 1, got {max_seq_len!r}")
        elif settings.capacity // max_seq_len < 2:
            problems.append(f"capacity={settings.capacity} env steps hold fewer than 2 sequences of max_seq_len="
                            f"{max_seq_len}: raise the capacity to at least {2 * max_seq_len}")
        if problems:
            raise ValueError("invalid sequence replay settings: " + "; ".join(problems))
        self.settings, self.max_seq_len, self.burn_in = settings, max_seq_len, bool(burn_in)
        self.latest: dict[str, list[int]] = {}
        """Episode id -> [chunk_index, slot, stamp] of its newest stored chunk, for episodes not ended."""
        self.num_written = 0
        self.n_lo, self.n_hi = n_step_range(settings.n_step)
        self.num_slots = settings.capacity // max_seq_len
        self.lock = threading.RLock()
        self.spec: dict[str, Any] | None = None
        self.obs: list[np.ndarray] = []
        self.actions: list[np.ndarray] = []
        self.cols: dict[str, np.ndarray] = {}
        self.head = 0
        self.filled = 0
        self.num_steps = 0
        self.tree = SumTree(self.num_slots) if settings.prioritized else None
        self.max_priority = 1.0
        self.limiter = None if settings.samples_per_insert is None else RateLimiter(
            settings.samples_per_insert, settings.min_size_to_sample, settings.error_buffer, lock=self.lock)
        self.rng = np.random.default_rng(settings.seed)
        self.metrics = MetricsLogger()
        self.num_inserts = 0
        self.num_samples = 0

    def __len__(self) -> int:
        """Stored env steps (the real steps of every stored sequence)."""
        return self.num_steps

    # --- adding -------------------------------------------------------------------------------
    def add(self, chunks: list[EpisodeChunk] | EpisodeChunk | bytes, timeout_s: float | None = None) -> None:
        """Store chunks (a list, one chunk, or a codec frame of them) as sequences; ValueError for a chunk
        without its start state, longer than ``max_seq_len``, or unlike the first chunk in structure."""
        if isinstance(chunks, (bytes, bytearray, memoryview)):
            chunks = decode(chunks)
        chunks = [c.validate() for c in ([chunks] if isinstance(chunks, EpisodeChunk) else chunks)]
        chunks = [c for c in chunks if len(c)]
        if not chunks:
            return
        with self.lock:
            self._check(chunks)
            n = sum(len(c) for c in chunks)
            if self.limiter is not None:
                self.limiter.await_insert(n, self._timeout(timeout_s))
            for c in chunks:
                self._store(c)
            self.num_inserts += n
            if self.limiter is not None:
                self.limiter.record_insert(n, size=len(self))
            self._log("inserts", n)

    def _check(self, chunks: list[EpisodeChunk]) -> None:
        """Refuse the whole call before storing any of it."""
        spec = self.spec or RingStorage.spec_of(chunks[0])
        state_shape = None if self.spec is None else self.cols["state_in"].shape[1:]
        for c in chunks:
            if c.state_in is None:
                raise ValueError(f"chunk {c.episode_id}#{c.chunk_index} has no state_in: a recurrent module's runners "
                                 f"store each chunk's start state (model_config use_lstm=True on the runners too)")
            if len(c) > self.max_seq_len:
                raise ValueError(f"chunk {c.episode_id}#{c.chunk_index} has {len(c)} steps, more than max_seq_len="
                                 f"{self.max_seq_len}: runners of a recurrent module cut chunks to max_seq_len; give "
                                 f"the buffer the module's max_seq_len")
            RingStorage.check(c, spec)
            shape = np.shape(c.state_in)
            if state_shape is None:
                state_shape = shape
            elif shape != state_shape:
                raise ValueError(f"chunk {c.episode_id}#{c.chunk_index} has a start state of shape {shape}; the "
                                 f"stored ones have {state_shape}")

    def _allocate(self, chunk: EpisodeChunk) -> None:
        self.spec = spec = RingStorage.spec_of(chunk)
        s, t = self.num_slots, self.max_seq_len
        self.obs = [np.zeros((s, t + 1, *shape), dtype) for shape, dtype in spec["obs"]["leaves"]]
        self.actions = [np.zeros((s, t, *shape), dtype) for shape, dtype in spec["actions"]["leaves"]]
        self.cols = {"rewards": np.zeros((s, t), np.float32), "lengths": np.zeros(s, np.int64),
                     "terminated": np.zeros(s, np.bool_),
                     "state_in": np.zeros((s, *np.shape(chunk.state_in)), np.float32),
                     "stamp": np.full(s, -1, np.int64), "prev": np.full(s, -1, np.int64),
                     "prev_stamp": np.full(s, -1, np.int64)}

    def _store(self, chunk: EpisodeChunk) -> None:
        if self.spec is None:
            self._allocate(chunk)
        slot, n = self.head, len(chunk)
        self.num_steps += n - int(self.cols["lengths"][slot])
        for ring, leaf in zip(self.obs, nested.flatten(chunk.obs)):
            ring[slot, : n + 1] = leaf
            ring[slot, n + 1:] = 0
        for ring, leaf in zip(self.actions, nested.flatten(chunk.actions)):
            ring[slot, :n] = leaf
            ring[slot, n:] = 0
        self.cols["rewards"][slot, :n] = chunk.rewards
        self.cols["rewards"][slot, n:] = 0.0
        self.cols["lengths"][slot] = n
        self.cols["terminated"][slot] = chunk.terminated
        self.cols["state_in"][slot] = chunk.state_in
        prev = self.latest.pop(chunk.episode_id, None)
        linked = prev is not None and prev[0] == chunk.chunk_index - 1
        self.cols["prev"][slot], self.cols["prev_stamp"][slot] = (prev[1], prev[2]) if linked else (-1, -1)
        self.cols["stamp"][slot] = self.num_written
        if not (chunk.terminated or chunk.truncated):
            self.latest[chunk.episode_id] = [int(chunk.chunk_index), int(slot), self.num_written]
        self.num_written += 1
        if len(self.latest) > 2 * self.num_slots:  # episodes abandoned mid-way (a runner restarted): forget them
            stamps = self.cols["stamp"]
            self.latest = {e: v for e, v in self.latest.items() if stamps[v[1]] == v[2]}
        if self.tree is not None:
            self.tree.update(np.array([slot]), np.array([self.max_priority**self.settings.alpha]))
        self.head = (slot + 1) % self.num_slots
        self.filled = max(self.filled, slot + 1)

    def can_add(self, num_steps: int) -> bool:
        return self.limiter is None or self.limiter.can_insert(num_steps)

    # --- sampling -----------------------------------------------------------------------------
    def sequences_per_batch(self, batch_size: int) -> int:
        return max(1, batch_size // self.max_seq_len)

    def can_sample(self, batch_size: int) -> bool:
        with self.lock:
            if self.limiter is not None:
                return self.limiter.can_sample(batch_size)
            return len(self) >= self.settings.min_size_to_sample

    def sample(self, batch_size: int, timeout_s: float | None = None, num_batches: int = 1) -> dict[str, Any]:
        """``num_batches`` batches in a row, each ``batch_size // max_seq_len`` sequences (at least one):
        ``obs`` ``[B, max_seq_len + 1, ...]``, ``actions`` ``[B, max_seq_len, ...]``, ``rewards`` and ``mask``
        (the real steps) ``[B, max_seq_len]``, ``lengths``, ``terminated`` (the episode ended with the sequence's
        last step), ``state_in``, ``n_steps`` (the n of each sequence's returns), ``weights`` (importance
        weights, ones when uniform) and ``indices`` (slots, for ``update_priorities``). The rate limiter
        counts ``batch_size`` steps per batch."""
        if not isinstance(batch_size, int) or batch_size < 1:
            raise ValueError(f"batch_size must be an int >= 1, got {batch_size!r}")
        if not isinstance(num_batches, int) or num_batches < 1:
            raise ValueError(f"num_batches must be an int >= 1, got {num_batches!r}")
        per_batch = self.sequences_per_batch(batch_size)
        steps = batch_size * num_batches
        with self.lock:
            if self.limiter is not None:
                self.limiter.await_sample(steps, self._timeout(timeout_s))
            elif len(self) < self.settings.min_size_to_sample:
                raise RuntimeError(f"cannot sample: the buffer holds {len(self)} steps and min_size_to_sample="
                                   f"{self.settings.min_size_to_sample}; add more chunks first (check can_sample())")
            slots, weights = self._draw(per_batch * num_batches, per_batch)
            lengths = self.cols["lengths"].take(slots)
            n = np.full(len(slots), self.n_hi) if self.n_lo == self.n_hi else \
                self.rng.integers(self.n_lo, self.n_hi + 1, len(slots))
            batch = {
                "obs": unflatten(self.spec["obs"]["skeleton"], [r.take(slots, axis=0) for r in self.obs]),
                "actions": unflatten(self.spec["actions"]["skeleton"], [r.take(slots, axis=0) for r in self.actions]),
                "rewards": self.cols["rewards"].take(slots, axis=0),
                "mask": np.arange(self.max_seq_len)[None, :] < lengths[:, None],
                "lengths": lengths,
                "terminated": self.cols["terminated"].take(slots),
                "state_in": self.cols["state_in"].take(slots, axis=0),
                "n_steps": n.astype(np.int64),
                "weights": weights,
                "indices": slots,
            }
            if self.burn_in:
                batch.update(self._previous(slots, batch["state_in"]))
            self.num_samples += steps
            if self.limiter is not None:
                self.limiter.record_sample(steps)
            self._log("samples", steps)
            return batch

    def _previous(self, slots: np.ndarray, own_state: np.ndarray) -> dict[str, Any]:
        """The burn-in part of a batch: each sequence's previous chunk (steps and stored state), where stored."""
        prev = self.cols["prev"].take(slots)
        there = (prev >= 0) & (self.cols["stamp"].take(np.maximum(prev, 0)) == self.cols["prev_stamp"].take(slots))
        src = np.where(there, prev, slots)
        lengths = np.where(there, self.cols["lengths"].take(src), 0)
        obs = [r.take(src, axis=0)[:, : self.max_seq_len] for r in self.obs]
        state = np.where(there.reshape(-1, *[1] * (own_state.ndim - 1)), self.cols["state_in"].take(src, axis=0),
                         own_state)
        return {"burn_obs": unflatten(self.spec["obs"]["skeleton"], obs), "burn_lengths": lengths, "burn_state": state}

    def _draw(self, count: int, per_batch: int) -> tuple[np.ndarray, np.ndarray]:
        if self.tree is None:
            return self.rng.integers(0, self.filled, count).astype(np.int64), np.ones(count, np.float32)
        return prioritized_draw(self.tree, self.rng, count, per_batch, self.filled, self.settings.beta)

    def update_priorities(self, indices: Any, priorities: Any) -> None:
        """Set sampled sequences' priorities to (|p| + epsilon) ** alpha (a no-op for uniform replay); ``p``
        is the sequence's mix of TD errors."""
        idx, pri = priority_arrays(indices, priorities, self.num_slots, "slots")
        if self.tree is None or not len(idx):
            return
        with self.lock:
            raw = np.abs(pri) + self.settings.epsilon
            self.max_priority = max(self.max_priority, float(raw.max()))
            self.tree.update(idx, raw**self.settings.alpha)

    # --- stage --------------------------------------------------------------------------------
    def _timeout(self, timeout_s: float | None) -> float | None:
        return self.settings.timeout_s if timeout_s is None else timeout_s

    def _log(self, key: str, n: int) -> None:
        log_counts(self.metrics, key, n, len(self), self.num_samples, self.num_inserts)
        self.metrics.log_value("num_sequences", self.filled, reduce="max", window=1)

    def get_metrics(self) -> dict[str, Any]:
        return self.metrics.export()

    def get_intake_state(self) -> None:
        return None  # no learner pipeline runs here

    def set_intake_state(self, state: dict[str, Any]) -> None:
        pass

    def ping(self) -> str:
        return "ok"

    def apply(self, fn: Callable[["SequenceReplay"], Any]) -> Any:
        return fn(self)

    def stop(self) -> None:
        if self.limiter is not None:
            self.limiter.close()

    # --- state --------------------------------------------------------------------------------
    def get_state(self) -> dict[str, Any]:
        """Arrays and JSON-able values only: the slots (``obs``/``actions`` by leaf index, the columns), the
        structure spec, ring position, sum tree, limiter, generator state, counters and metrics."""
        with self.lock:
            return {
                "kind": "sequences", "max_seq_len": self.max_seq_len, "num_slots": self.num_slots,
                "spec": self.spec, "obs": {str(i): a.copy() for i, a in enumerate(self.obs)},
                "actions": {str(i): a.copy() for i, a in enumerate(self.actions)},
                "cols": {k: v.copy() for k, v in self.cols.items()},
                "head": self.head, "filled": self.filled, "num_steps": self.num_steps,
                "latest": {e: list(v) for e, v in self.latest.items()}, "num_written": self.num_written,
                "sum_tree": None if self.tree is None else self.tree.get_state(),
                "max_priority": self.max_priority,
                "limiter": None if self.limiter is None else self.limiter.get_state(),
                "rng": self.rng.bit_generator.state,
                "num_inserts": self.num_inserts, "num_samples": self.num_samples,
                "metrics": self.metrics.get_state(),
            }

    def set_state(self, state: dict[str, Any]) -> None:
        if state.get("kind") != "sequences" or int(state["max_seq_len"]) != self.max_seq_len \
                or int(state["num_slots"]) != self.num_slots:
            raise ValueError(f"this replay state is not a sequence buffer of max_seq_len={self.max_seq_len} and "
                             f"{self.num_slots} slots (got kind={state.get('kind')!r}, max_seq_len="
                             f"{state.get('max_seq_len')!r}, num_slots={state.get('num_slots')!r}): restore with the "
                             f"same model_config max_seq_len and replay capacity")
        with self.lock:
            self.spec = state["spec"]  # JSON-able as RingStorage.spec_of made it
            self.obs = [np.array(state["obs"][str(i)]) for i in range(len(state["obs"]))]
            self.actions = [np.array(state["actions"][str(i)]) for i in range(len(state["actions"]))]
            self.cols = {k: np.array(v) for k, v in state["cols"].items()}
            self.head, self.filled, self.num_steps = int(state["head"]), int(state["filled"]), int(state["num_steps"])
            self.latest = {str(e): [int(x) for x in v] for e, v in state["latest"].items()}
            self.num_written = int(state["num_written"])
            self.max_priority = float(state["max_priority"])
            if self.tree is not None:
                if state.get("sum_tree") is not None:
                    self.tree.set_state(state["sum_tree"])
                else:  # saved by a uniform buffer: every stored sequence at max priority
                    self.tree = SumTree(self.num_slots)
                    self.tree.update(np.arange(self.filled), np.full(self.filled, self.max_priority**self.settings.alpha))
            if self.limiter is not None:
                self.limiter.set_state(state.get("limiter") or {
                    "inserts": state["num_inserts"], "samples": state["num_samples"], "size": len(self)})
            self.rng.bit_generator.state = state["rng"]
            self.num_inserts, self.num_samples = int(state["num_inserts"]), int(state["num_samples"])
            self.metrics.set_state(state["metrics"])

