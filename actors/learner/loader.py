"""ChunkReceiver: the learner side of the chunk streams -- receive, check, cut train batches, queue.

One loader thread pulls frames (``protocols.transport.ChunkPuller``: bounded decode, schema check,
drops counted and logged by sender), cuts the stream into train batches of exactly ``batch_size``
steps and puts them into a bounded queue of ``queue_size`` batches. Each batch is also laid out as
a learner ``Batch`` in the loader thread (on GPU: copied in a side CUDA stream), so sampling,
decoding, batching and learning overlap.

Back-pressure: while a finished batch waits for room in the queue, the loader reads nothing, so it
acknowledges nothing; each runner stops after its ``window`` of unread frames (``protocols.transport``).

Stale chunks: without a window, what waits in the sockets' kernel buffers is bounded in bytes, not in
policy versions. A learner slower than its runners (a loaded machine, two learners meeting in an
all-reduce on few cores) then trains on fragments that sat there for many updates -- measured: a weights
lag of ~90 updates that kept IMPALA's CartPole return at its random level. With ``max_weights_lag`` set (Sample Factory's
``max_policy_lag``), a chunk acted by weights older than that many versions behind the one the consumer
last reported (``set_weights_version``) is dropped and counted (``num_env_steps_dropped_stale``) rather
than batched. Dropping costs almost nothing, so the backlog drains at decode speed and what is trained
stays within the bound.

Multi-agent streams (``module_spaces`` given): each chunk is checked against its module's spaces
(``ModuleSchemas``; a chunk of a module the run does not have is dropped and counted like any bad
chunk), and a train batch is one ``ModuleBatches``: the next ``batch_size`` agent steps of the stream,
whatever modules acted in them, laid out per module. One batch for all modules, not one per module,
so that every module trains in the same update on the steps of the same stretch of time: per-module
batches of a fixed size would fill at the rates the modules' agents act, and a module that acts
seldom (or a frozen one, whose steps the learner drops) would hold back or starve the others. The
batch is cut in agent steps (chunk rows), the only count the chunks carry: env steps are known to
the runner that stepped the envs, not to the receiver.

Data-parallel learners (``per_module=True``: several learner actors, each with its own share of the
streams) cannot take that batch: the learners meet at an all-reduce in every SGD step of every module,
so each must step the same modules the same number of times, and one stretch of two learners' streams
holds different modules in different amounts. There each module's steps are cut into batches of their
own, ``batch_size`` agent steps of that module, each a one-module ``ModuleBatches``; the learner's feed
(``actors.learner.feed``) holds them by module and the driver updates the modules every learner holds a
batch of -- a module that acts seldom trains seldom and holds back no other.
"""
from __future__ import annotations

import collections
import logging
import queue
import threading
import traceback
from typing import Any, Callable

import gymnasium as gym
import numpy as np
import torch

from actors.env.multi_agent_runner_parts import chunks_by_module
from actors.learner.batch import Batch, ChunkBatch, chunks_to_batch
from actors.network import node_address
from protocols import nested
from protocols.codec import Limits
from protocols.episode import EpisodeChunk
from protocols.errors import ProtocolError
from protocols.schema import ChunkSchema
from protocols.transport import STREAM_LIMITS, ChunkPuller

log = logging.getLogger(__name__)


class ModuleSchemas:
    """The check of a multi-agent stream: each chunk against the schema of the module it names."""

    def __init__(self, schemas: dict[str, ChunkSchema]) -> None:
        self.schemas = schemas

    def check(self, chunk: EpisodeChunk) -> None:
        schema = self.schemas.get(chunk.module_id)  # type: ignore[arg-type]
        if schema is None:
            raise ProtocolError(f"chunk of agent {chunk.agent_id!r} names module {chunk.module_id!r}, which is not one "
                                f"of this run's modules {sorted(self.schemas)}")
        schema.check(chunk)


class ModuleBatches(dict):
    """A multi-agent train batch: module id -> that module's ``ChunkBatch``, cut from one stretch of the
    stream (``MultiLearnerGroup.update`` trains every trainable module on its part in one update)."""

    @property
    def num_steps(self) -> int:
        """Agent steps, all modules together."""
        return sum(b.num_steps for b in self.values())

    def weights_versions(self) -> tuple[np.ndarray, np.ndarray]:
        """(weights_version, steps) per chunk, all modules together (for the weights lag)."""
        pairs = [b.weights_versions() for b in self.values()]
        return np.concatenate([v for v, _ in pairs]), np.concatenate([n for _, n in pairs])


class ChunkReceiver:
    """``address`` is ``tcp://<node ip>:<random port>``; hand it to runners' ``start_streaming``."""

    def __init__(self, observation_space: gym.Space | None, action_space: gym.Space | None, batch_size: int, *,
                 queue_size: int = 8, hwm: int = 4, host: str | None = None, limits: Limits = STREAM_LIMITS,
                 rcvbuf: int = 0, device: str | torch.device = "cpu", prebuild: bool = True,
                 required_extra: tuple[str, ...] = ("action_logp",), max_log_lines_per_sender: int = 100,
                 module_spaces: dict[str, tuple[gym.Space, gym.Space]] | None = None,
                 max_weights_lag: int | None = None, observation_view: Any = None,
                 learner_connector: Any = None, module_connector: Callable[[str], Any] | None = None,
                 module_view: Callable[[str], Any] | None = None, per_module: bool = False) -> None:
        """``module_spaces``: module id -> (observation, action space) of a multi-agent run's modules:
        batches are ``ModuleBatches`` of ``batch_size`` agent steps (``observation_space`` and
        ``action_space`` are then not used). ``max_weights_lag``: drop chunks acted by weights more than
        this many versions older than the consumer's (None: keep all). ``observation_view``
        (``actors.connectors.ObservationView``): chunks are checked against its recorded space and their
        view is rebuilt here, in the loader thread, before the batch is laid out. ``learner_connector``
        (``actors.connectors.learner.LearnerPipeline``): applied to each batch's chunks here too, after the
        view; a batch it fails on is dropped, counted and logged. ``module_connector``: in a multi-agent
        stream, module id -> that module's pipeline (or None), applied to the module's share of each batch;
        ``module_view``: module id -> that module's ``ObservationView`` (or None), as ``observation_view`` for the
        module's share (its chunks checked against the recorded space). ``per_module`` (with ``module_spaces``):
        each module's steps cut into batches of their own (see the module's docstring)."""
        if batch_size < 1 or queue_size < 1 or hwm < 1:
            raise ValueError(f"batch_size, queue_size and hwm must be >= 1, got {batch_size}, {queue_size}, {hwm}")
        if per_module and module_spaces is None:
            raise ValueError("per_module=True cuts a multi-agent stream per module: give module_spaces too")
        if module_spaces is not None and not module_spaces:
            raise ValueError("module_spaces is empty: give each module's (observation, action) spaces, or None "
                             "for a single-agent stream")
        if max_weights_lag is not None and (isinstance(max_weights_lag, bool) or not isinstance(max_weights_lag, int)
                                            or max_weights_lag < 0):
            raise ValueError(f"max_weights_lag must be None or an int >= 0, got {max_weights_lag!r}")
        self.batch_size = batch_size
        self.max_weights_lag = max_weights_lag
        self.observation_view = observation_view
        if observation_view is not None:
            observation_space = observation_view.recorded_space
        self.num_chunks_without_look_back = 0
        self.learner_connector = learner_connector
        self.module_connector = module_connector
        self.module_view = module_view
        self.num_batches_dropped_by_connector = 0
        self.weights_version = 0
        """The consumer's current weights version (``set_weights_version``), the reference for staleness."""
        self.num_chunks_dropped_stale = 0
        self.num_env_steps_dropped_stale = 0
        self.device = torch.device(device)
        self.prebuild = prebuild
        self.multi_module = module_spaces is not None
        self.module_schemas: ModuleSchemas | None = None
        schema: ChunkSchema | ModuleSchemas
        if module_spaces is None:
            schema = ChunkSchema.for_spaces(observation_space, action_space, required_extra)
            if observation_view is not None:
                schema.look_back_rows = observation_view.piece.look_back
        else:
            self.required_extra = required_extra
            schema = self.module_schemas = ModuleSchemas({})
            for mid, (obs, act) in module_spaces.items():
                self.add_module(mid, obs, act)
        self.puller = ChunkPuller(host or node_address(), schema, hwm=hwm, rcvbuf=rcvbuf, limits=limits,
                                  max_log_lines_per_sender=max_log_lines_per_sender)
        self.address = self.puller.address
        self._queue: queue.Queue[ChunkBatch | ModuleBatches] = queue.Queue(maxsize=queue_size)
        self._ready: collections.deque[ChunkBatch | ModuleBatches] = collections.deque()
        self._pending: collections.deque[EpisodeChunk] = collections.deque()
        self._pending_steps = 0
        self.per_module = per_module
        self._module_pending: dict[str, collections.deque[EpisodeChunk]] = {}
        self._module_pending_steps: dict[str, int] = {}
        self.num_batches_built = 0
        self._stop = threading.Event()
        self._torch_threads = torch.get_num_threads()  # per-thread setting (see actors.env.streaming)
        self._thread = threading.Thread(target=self._loop, name="runnel-chunk-loader", daemon=True)
        self._cuda_stream = None
        if self.device.type == "cuda" and torch.cuda.is_available():
            self._cuda_stream = torch.cuda.Stream(self.device)
        self.error: str | None = None
        self.closed = False

    @property
    def counters(self) -> collections.Counter:
        return self.puller.counters

    @property
    def dropped_by_sender(self) -> collections.Counter:
        return self.puller.dropped_by_sender

    # --- consumer side ------------------------------------------------------------------------
    def start(self) -> "ChunkReceiver":
        self._thread.start()
        return self

    def get_batch(self, timeout: float | None = None) -> ChunkBatch | ModuleBatches | None:
        """The next train batch, or None if none arrived within ``timeout`` seconds."""
        if self.error is not None:
            raise RuntimeError(f"the chunk loader thread failed: {self.error}")
        try:
            return self._queue.get(timeout=timeout) if timeout != 0 else self._queue.get_nowait()
        except queue.Empty:
            return None

    def add_module(self, module_id: str, observation_space: gym.Space, action_space: gym.Space) -> None:
        """A multi-agent stream's chunks of ``module_id`` are accepted from now on (a module added while the
        run goes on), checked against these spaces (or its ``module_view``'s recorded space)."""
        if self.module_schemas is None:
            raise ValueError(f"add_module({module_id!r}): this receiver takes a single-agent stream")
        view = self.module_view(module_id) if self.module_view is not None else None
        schema = ChunkSchema.for_spaces(observation_space if view is None else view.recorded_space, action_space,
                                        self.required_extra)
        if view is not None:
            schema.look_back_rows = view.piece.look_back
        # a new dict, swapped in whole: the loader thread looks schemas up meanwhile
        self.module_schemas.schemas = {**self.module_schemas.schemas, module_id: schema}

    def remove_module(self, module_id: str) -> None:
        """Chunks of ``module_id`` are dropped (and counted) from now on; steps of it already received still
        make their batch, which the learner then drops."""
        if self.module_schemas is not None:
            self.module_schemas.schemas = {k: v for k, v in self.module_schemas.schemas.items() if k != module_id}

    def set_weights_version(self, version: int) -> None:
        """The learner's weights version now: chunks acted more than ``max_weights_lag`` versions before it
        are dropped from here on (the loader thread reads it; an int store is atomic)."""
        self.weights_version = int(version)

    def qsize(self) -> int:
        """Train batches waiting in the learner queue."""
        return self._queue.qsize()

    def batches_waiting_for_room(self) -> int:
        """Batches built while the learner queue was full: until they are queued the loader reads nothing
        more, and the senders' buffers fill up (back-pressure)."""
        return len(self._ready)

    def sender_lost(self, sender: str) -> int:
        """``sender``'s actor died while streaming: its open episodes end here (counted as cut, see
        ``protocols.stream_ledger``). Returns how many were cut."""
        return self.puller.ledger.sender_lost(sender)

    def forget_episodes(self) -> None:
        """Accept again chunks already received (runners restored to a checkpoint sample them anew)."""
        self.puller.ledger.forget()

    def stats(self) -> dict[str, Any]:
        """The puller's counters (received, dropped, duplicates, episodes cut...), batches built, and the
        steps they hold (``num_env_steps_batched``): every step received is batched, still pending or dropped
        as stale (``num_env_steps_dropped_stale``)."""
        out = dict(self.puller.counters)
        out["num_batches_built"] = self.num_batches_built
        out["num_env_steps_batched"] = self.num_batches_built * self.batch_size
        out["learner_queue_size"] = self._queue.qsize()
        out["num_env_steps_pending"] = self._pending_steps
        out["num_chunks_dropped_stale"] = self.num_chunks_dropped_stale
        out["num_env_steps_dropped_stale"] = self.num_env_steps_dropped_stale
        return out

    def close(self, timeout_s: float = 10.0) -> None:
        """Stop the loader thread, close the socket and the ZeroMQ context."""
        if self.closed:
            return
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout_s)
        if self._thread.is_alive():
            log.warning("the chunk loader thread did not stop within %.0f s", timeout_s)
        self.puller.close()
        self.closed = True

    # --- loader thread ------------------------------------------------------------------------
    def _loop(self) -> None:
        puller, stop = self.puller, self._stop
        try:
            torch.set_num_threads(self._torch_threads)
            while not stop.is_set():
                if self._ready:  # batches waiting for room: read nothing (back-pressure)
                    try:
                        self._queue.put(self._ready[0], timeout=0.05)
                        self._ready.popleft()
                    except queue.Full:
                        pass
                    continue
                if not puller.poll(50):
                    continue
                while not self._ready:  # drain what is there, then go back to the stop check
                    chunks = puller.receive()
                    if chunks is None:
                        break
                    if chunks:
                        self._add(chunks)
        except BaseException as err:  # noqa: BLE001 - reported to the consumer by get_batch
            self.error = f"{type(err).__name__}: {err}"
            log.error("chunk loader thread failed:\n%s", traceback.format_exc())

    def _fresh(self, chunks: list[EpisodeChunk]) -> list[EpisodeChunk]:
        """``chunks`` without those acted by weights more than ``max_weights_lag`` versions old (counted)."""
        if self.max_weights_lag is None:
            return chunks
        oldest = self.weights_version - self.max_weights_lag
        fresh = [c for c in chunks if c.weights_version >= oldest]
        if len(fresh) < len(chunks):
            self.num_chunks_dropped_stale += len(chunks) - len(fresh)
            self.num_env_steps_dropped_stale += sum(len(c) for c in chunks if c.weights_version < oldest)
        return fresh

    def _add(self, chunks: list[EpisodeChunk]) -> None:
        chunks = self._fresh(chunks)
        self._pending_steps += sum(len(c) for c in chunks)
        if self.per_module:
            self._add_per_module(chunks)
            return
        self._pending.extend(chunks)
        b = self.batch_size
        while self._pending_steps >= b:
            take, n = self._cut(self._pending)
            self._pending_steps -= n
            if self.multi_module:
                made = {mid: self._make_batch(chunks, self.module_connector(mid) if self.module_connector else None,
                                              self.module_view(mid) if self.module_view else None)
                        for mid, chunks in sorted(chunks_by_module(take).items())}
                self._ready.append(ModuleBatches({mid: b for mid, b in made.items() if b is not None}))
            else:
                batch = self._make_batch(take, self.learner_connector, self.observation_view)
                if batch is not None:
                    self._ready.append(batch)
            self.num_batches_built += 1

    def _cut(self, pending: collections.deque[EpisodeChunk]) -> tuple[list[EpisodeChunk], int]:
        """The next ``batch_size`` steps off ``pending`` (which holds at least that many), and their count."""
        b = self.batch_size
        take: list[EpisodeChunk] = []
        n = 0
        while n < b:
            chunk = pending.popleft()
            if n + len(chunk) <= b or chunk.state_in is not None:
                # a recurrent policy's chunk stays whole: its tail would have no start state to unroll
                # from (it is at most max_seq_len steps, so the batch grows by less than that)
                take.append(chunk)
                n += len(chunk)
            else:  # split: the head completes this batch, the tail starts the next one
                k = b - n
                take.append(chunk.slice(0, k))
                pending.appendleft(chunk.slice(k, len(chunk)))
                n = b
        return take, n

    def _add_per_module(self, chunks: list[EpisodeChunk]) -> None:
        """Each module's steps into its own batches of ``batch_size`` (data-parallel learners)."""
        for mid, module_chunks in sorted(chunks_by_module(chunks).items()):
            pending = self._module_pending.setdefault(mid, collections.deque())
            pending.extend(module_chunks)
            steps = self._module_pending_steps.get(mid, 0) + sum(len(c) for c in module_chunks)
            while steps >= self.batch_size:
                take, n = self._cut(pending)
                steps -= n
                self._pending_steps -= n
                batch = self._make_batch(take, self.module_connector(mid) if self.module_connector else None,
                                         self.module_view(mid) if self.module_view else None)
                if batch is not None:
                    self._ready.append(ModuleBatches({mid: batch}))
                self.num_batches_built += 1
            self._module_pending_steps[mid] = steps

    def _rebuilt(self, chunks: list[EpisodeChunk], view: Any) -> list[EpisodeChunk]:
        """The view rebuilt chunk by chunk; a chunk sent without the look-back rows is dropped and counted."""
        out = []
        for chunk in chunks:
            try:
                out.extend(view.rebuild([chunk]))
            except ValueError as err:
                self.num_chunks_without_look_back += 1
                if self.num_chunks_without_look_back <= 10:
                    log.warning("chunk dropped (%d so far): %s", self.num_chunks_without_look_back, err)
        return out

    def _make_batch(self, chunks: list[EpisodeChunk], connector: Any, view: Any) -> ChunkBatch | None:
        if view is not None:
            chunks = self._rebuilt(chunks, view)
        if connector is not None:
            try:
                chunks = connector(chunks)
            except Exception as err:  # a user's piece: its failure costs this batch, not the job
                self.num_batches_dropped_by_connector += 1
                if self.num_batches_dropped_by_connector <= 10:
                    log.warning("batch dropped: the learner connector failed on it (%d so far): %r",
                                self.num_batches_dropped_by_connector, err)
                return None
        out = ChunkBatch(chunks)
        if not self.prebuild:
            return out
        if self._cuda_stream is None:
            out.batch, out.device = chunks_to_batch(chunks, self.device), self.device
            return out
        # GPU: lay the batch out in pinned host memory, copy it in a side stream, record an event
        # that the learner's stream waits on (ChunkBatch.to_batch) -- the copy overlaps the update.
        host = chunks_to_batch(chunks, torch.device("cpu"))
        with torch.cuda.stream(self._cuda_stream):
            move = lambda t: t.pin_memory().to(self.device, non_blocking=True)  # noqa: E731
            out.batch = Batch(
                obs=nested.map_structure(move, host.obs), all_obs=nested.map_structure(move, host.all_obs),
                actions=nested.map_structure(move, host.actions), rewards=host.rewards, lengths=host.lengths,
                terminated=host.terminated, extra={k: nested.map_structure(move, v) for k, v in host.extra.items()},
                weights_versions=host.weights_versions)
            out.ready_event = torch.cuda.Event()
            out.ready_event.record(self._cuda_stream)
        out.device = self.device
        return out
