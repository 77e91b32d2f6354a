"""ChunkIntake: the experience clients send, from arrival to acknowledgement -- bounded decoding,
busy gates, dedup by ``(episode_id, chunk_index)``, the chunks held for the driver, and the commit
that journals what it took and queues the acknowledgements.

Apart from the act path because its state crosses threads: the server thread takes chunks in,
the driver's thread (``PolicyServer.sample``) takes them out, both under the server's lock.
"""
from __future__ import annotations

import threading
from collections import OrderedDict
from typing import Callable

import numpy as np

from actors.external.endpoint import ServerEndpoint
from actors.external.journal import CommitJournal, Key
from actors.external.settings import ExternalSettings
from actors.metrics import MetricsLogger
from protocols import external as wire
from protocols.codec import Limits, decode_chunks
from protocols.episode import EpisodeChunk
from protocols.errors import ProtocolError
from protocols.schema import ChunkSchema
from protocols.space_checks import check_finite


class EpisodeTally:
    """Episode returns and lengths from the chunks clients send, summed as they arrive -- including
    chunks dropped as stale, which were played all the same -- so what the server reports is what
    clients' episodes scored, however much of them training used. An episode counts only from all
    its chunks in order (one refused as bad leaves it unreported rather than shorter and worse)."""

    def __init__(self, max_open: int = 100_000) -> None:
        self._open: OrderedDict[str, list] = OrderedDict()  # episode id -> [return, length, next chunk index]
        self._max_open = max_open
        self.finished: list[tuple[float, int]] = []

    def add(self, chunk: EpisodeChunk) -> None:
        acc = self._open.pop(chunk.episode_id, None) if chunk.chunk_index else [0.0, 0, 0]
        if acc is None or acc[2] != chunk.chunk_index:
            return
        acc[0] += chunk.ret
        acc[1] += len(chunk)
        acc[2] += 1
        if chunk.is_done:
            self.finished.append((acc[0], acc[1]))
        else:
            self._open[chunk.episode_id] = acc  # to the end: the oldest open ones are the abandoned ones
            if len(self._open) > self._max_open:
                self._open.popitem(last=False)

    def take_finished(self) -> list[tuple[float, int]]:
        out, self.finished = self.finished, []
        return out


class ChunkIntake:
    def __init__(self, lock: threading.Condition, endpoint: ServerEndpoint, journal: CommitJournal,
                 metrics: MetricsLogger, counts: dict[str, int], external: ExternalSettings, schema: ChunkSchema,
                 dist_dim: int, worker_index: int, weights_version: Callable[[], int],
                 state_shape: tuple[int, int] | None = None) -> None:
        """``lock``: the server's lock, which the caller holds around ``commit`` and ``take``;
        ``counts``: the server thread's counters; ``weights_version``: the version the server acts with
        now (chunks lagging it by more than ``max_policy_lag`` are stale); ``state_shape``: a recurrent
        policy's state ``(2, cell)``, which every chunk must carry as ``state_in`` (None: no chunk may)."""
        self.x, self.schema, self.dist_dim, self.worker_index = external, schema, dist_dim, worker_index
        self.state_shape = state_shape
        self.journal, self.metrics = journal, metrics
        self._lock = lock
        self._send, self._wake = endpoint.send, endpoint.wake
        self._counts = counts
        self._version = weights_version
        self.chunk_limits = Limits(max_frame_bytes=self.x.max_frame_bytes, max_decoded_bytes=4 * self.x.max_frame_bytes,
                                   max_buffer_size=min(self.x.max_frame_bytes, 64 << 20))
        self._pending: list[tuple[Key, EpisodeChunk]] = []
        self._pending_keys: set[Key] = set()
        self.pending_steps = 0
        self._owner: dict[Key, bytes] = {}  # who to acknowledge a chunk to (the latest connection that sent it)
        # episode id -> [next chunk index it may hand in, highest index refused] for episodes with chunks
        # refused as busy: the rest wait their turn, so each episode reaches training in order (on_chunks)
        self._gates: OrderedDict[str, list[int]] = OrderedDict()
        self._delivered: list[Key] = []  # handed on by the last sample call, not yet confirmed
        self._delivered_keys: set[Key] = set()
        self._outbox: list[tuple[bytes, dict]] = []  # messages other threads ask the server thread to send
        self.episodes = EpisodeTally()  # under the lock, like the rest

    # --- the server thread ----------------------------------------------------------------------
    def on_chunks(self, route: bytes, rid: int, ids: list[Key], bodies: list[bytes]) -> bool:
        """A ``chunks`` message whose ``ids`` parsed; ``bodies``: its parts after the header (one frame,
        unless the message is broken). Every id gets its answer: ``received`` (with ``committed``),
        ``busy``, or ``bad_chunk`` -- one reply with all the ids when the body cannot be decoded as one
        chunk per id, else one per refused chunk. Returns whether the message broke the wire rules (a
        body or a chunk that cannot be decoded, a chunk under another id): that counts toward a ban."""
        whole: ProtocolError | None = None
        try:
            if len(bodies) != 1:
                raise ProtocolError(f"a chunks message has 2 parts, the header and one frame of the chunks; got "
                                    f"{1 + len(bodies)}")
            chunks: list = decode_chunks(bodies[0], limits=self.chunk_limits)
            if len(chunks) != len(ids):
                raise ProtocolError(f"the body holds {len(chunks)} chunk(s) for {len(ids)} id(s): one per id, in order")
        except ProtocolError as err:
            whole, chunks = err, [err] * len(ids)
        accepted, committed, busy, bad, stale = [], [], [], [], []
        malformed = whole is not None
        with self._lock:
            for key, chunk in zip(ids, chunks):
                gate = self._gates.get(key[0])
                # refused before anything else: the client drops it, so it passes its episode's gate
                if isinstance(chunk, ProtocolError) or (chunk.episode_id, chunk.chunk_index) != key:
                    malformed = True
                    bad.append((key, chunk if isinstance(chunk, ProtocolError) else
                                f"chunk {(chunk.episode_id, chunk.chunk_index)} sent under id {key}"))
                elif key in self.journal:
                    committed.append(list(key))
                elif key in self._pending_keys or key in self._delivered_keys:
                    self._owner[key] = route  # acknowledge to the connection that sent it last
                    accepted.append(list(key))
                    self._counts["num_duplicate_chunks"] += 1
                elif self._is_stale(chunk):  # before busy: a chunk too old to train on is not worth a resend
                    if self._check_chunk(chunk) is None:  # played all the same: its rewards count
                        self.episodes.add(chunk)
                    stale.append(list(key))
                elif self.pending_steps >= self.x.max_pending_steps or (gate is not None and key[1] > gate[0]):
                    # Busy. An episode with a refused chunk hands in the rest in order, room or not: taken
                    # out of order, its chunks would reach the replay as separate pieces (n-step returns stop
                    # at every cut) and its return would be reported without the late chunks' rewards.
                    busy.append(list(key))
                    if gate is None:
                        self._gates[key[0]] = [key[1], key[1]]
                        if len(self._gates) > 100_000:  # episodes whose clients never came back
                            self._gates.popitem(last=False)
                    else:
                        gate[1] = max(gate[1], key[1])
                    continue
                else:
                    problem = self._check_chunk(chunk)
                    if problem is not None:  # refused for good: never acknowledged, never handed on
                        bad.append((key, problem))
                        self._pass_gate(gate, key)  # the client drops it: the episode goes on without it
                        continue
                    chunk.env_runner_index = self.worker_index
                    self.episodes.add(chunk)
                    self._pending.append((key, chunk))
                    self._pending_keys.add(key)
                    self.pending_steps += len(chunk)
                    self._owner[key] = route
                    accepted.append(list(key))
                    self._counts["num_chunks_received"] += 1
                self._pass_gate(gate, key)
            self._counts["num_duplicate_chunks"] += len(committed)
            if accepted:
                self._lock.notify_all()
        version = self._version()  # in every reply about chunks: a local-inference client sees new weights
        if accepted or committed:
            self._send(route, {"op": wire.RECEIVED, "id": rid, "ids": accepted, "committed": committed,
                               "weights_version": version})
        if busy:
            self._counts["num_busy_replies"] += 1
            self._send(route, {**wire.error(rid, wire.BUSY, f"the server holds {self.pending_steps} env steps "
                                            f"not yet trained on; resend later"), "ids": busy,
                               "weights_version": version})
        if stale:
            self._counts["num_stale_chunks"] += len(stale)
            self._send(route, self._stale_reply(rid, stale, version))
        self._counts["num_bad_chunks"] += len(bad)
        if whole is not None:
            self._send(route, wire.error(rid, wire.BAD_CHUNK, f"the body of chunk(s) {[list(k) for k in ids]!r:.200} "
                                         f"cannot be decoded: {whole}", ids=[list(k) for k in ids]))
            return True
        for key, problem in bad:
            reply = wire.error(rid, wire.BAD_CHUNK, f"chunk {key[0]!r} #{key[1]}: {problem}", ids=[list(key)])
            if hasattr(problem, "field"):  # a value its space does not hold (space_checks.BadValue)
                reply["field"] = problem.field
            self._send(route, reply)
        return malformed

    def _pass_gate(self, gate: list[int] | None, key: Key) -> None:
        """Chunk ``key`` is through (taken, or known): its episode's next chunk may come -- the next
        one the server does not hold yet (one taken before the gate closed is never sent again)."""
        if gate is None or key[1] != gate[0]:
            return
        gate[0] += 1
        while gate[0] <= gate[1] and self._holds((key[0], gate[0])):
            gate[0] += 1
        if gate[0] > gate[1]:
            del self._gates[key[0]]

    def _is_stale(self, chunk: EpisodeChunk) -> bool:
        lag = self.x.max_policy_lag
        return lag is not None and self._version() - chunk.weights_version > lag

    def _stale_reply(self, rid: int, ids: list, version: int) -> dict:
        return {**wire.error(rid, wire.STALE, f"acted on by weights more than {self.x.max_policy_lag} version(s) "
                                              f"older than the server's {version}: not trained on; drop these and "
                                              f"act with newer weights"), "ids": ids, "weights_version": version}

    def _holds(self, key: Key) -> bool:
        return key in self._pending_keys or key in self._delivered_keys or key in self.journal

    def _check_chunk(self, chunk: EpisodeChunk) -> ProtocolError | None:
        """What is wrong with a chunk (a ``space_checks.BadValue`` names the field), or None."""
        try:
            chunk.validate()
            if len(chunk) == 0 or len(chunk) > self.x.max_chunk_steps:
                raise ProtocolError(f"a chunk must have 1 to {self.x.max_chunk_steps} steps, got {len(chunk)}")
            if len(chunk) > self.x.fragment_length:
                raise ProtocolError(f"a chunk must have at most fragment_length = {self.x.fragment_length} steps "
                                    f"(the server's welcome), got {len(chunk)}")
            self.schema.check(chunk)
            dists = chunk.extra.get("action_dist_inputs")
            if not isinstance(dists, np.ndarray) or dists.shape != (len(chunk), self.dist_dim) or dists.dtype.kind != "f":
                raise ProtocolError(f"extra['action_dist_inputs'] must be a float array of shape "
                                    f"({len(chunk)}, {self.dist_dim}), got {getattr(dists, 'shape', type(dists).__name__)}")
            self._check_state(chunk)
            # values last, each a vectorized pass: an action outside the space would crash a learner
            self.schema.check_values(chunk, finite_obs=not self.x.allow_nonfinite_observations)
            check_finite("extra['action_dist_inputs']", dists)
        except ProtocolError as err:
            return err
        return None

    def _check_state(self, chunk: EpisodeChunk) -> None:
        """A recurrent policy's learners unroll each chunk from its ``state_in``: one of the policy's shape, its
        hidden half in [-1, 1] as an LSTM's output always is (``validate`` has checked float32 and finite)."""
        st, want = chunk.state_in, self.state_shape
        if want is None:
            if st is not None:
                raise ProtocolError("state_in: this policy is not recurrent; send chunks without one")
            return
        if st is None:
            raise ProtocolError(f"state_in missing: this policy is recurrent, and each chunk carries the state "
                                f"{list(want)} (hidden, cell) its first step acted from (EXTERNAL.md 9.8)")
        if st.shape != want:
            raise ProtocolError(f"state_in of shape {list(st.shape)}; this policy's state is {list(want)} "
                                f"(hidden, cell)")
        if np.abs(st[0]).max() > 1.0:
            raise ProtocolError("state_in: the hidden state (row 0) must lie in [-1, 1], an LSTM's output range")

    def add_recorded(self, chunks: list[EpisodeChunk]) -> None:
        """Chunks the server cut itself (multi-agent episodes it records): pending like those clients
        send, with no sender to acknowledge them to. Their ids are the server's own, so none repeats."""
        with self._lock:
            for chunk in chunks:
                key = (chunk.episode_id, chunk.chunk_index)
                chunk.env_runner_index = self.worker_index
                self._pending.append((key, chunk))
                self._pending_keys.add(key)
                self.pending_steps += len(chunk)
            self._counts["num_chunks_received"] += len(chunks)
            if chunks:
                self._lock.notify_all()

    def take_outbox(self) -> list[tuple[bytes, dict]]:
        """The acknowledgements commits queued, for the server thread to send."""
        with self._lock:
            out, self._outbox = self._outbox, []
        return out

    # --- the driver's side (the caller holds the lock) ----------------------------------------------
    def fresh_steps(self) -> int:
        """Env steps of pending chunks acted on by the current weights."""
        version = self._version()
        return sum(len(c) for _, c in self._pending if c.weights_version >= version)

    def take(self, want: int, freshest_first: bool = False) -> list[EpisodeChunk]:
        """Pending chunks to hand on; they count as delivered until the next ``commit_delivered``.
        ``freshest_first``: those of the newest weights first (on-policy training), else in arrival order."""
        # whole chunks until the request is covered (like a runner's round: a replay ratio or a train
        # batch sized for it stays right); the rest waits for the next call
        self._drop_stale()
        order = self._pending
        if freshest_first:  # stable: arrival order within a version
            order = sorted(order, key=lambda item: -item[1].weights_version)
        count = steps = 0
        for _, chunk in order:
            if steps >= want:
                break
            count, steps = count + 1, steps + len(chunk)
        taken = order[:count]
        self._pending = order[count:]
        self._pending_keys.difference_update(key for key, _ in taken)
        self.pending_steps -= steps
        self._delivered = [key for key, _ in taken]
        self._delivered_keys = set(self._delivered)
        return [c for _, c in taken]

    def _drop_stale(self) -> None:
        """Pending chunks that new weights made stale are dropped and their senders told (unasked)."""
        if self.x.max_policy_lag is None or not self._pending:
            return
        keep, by_route, dropped = [], {}, 0
        for key, chunk in self._pending:
            if self._is_stale(chunk):
                self._pending_keys.discard(key)
                self.pending_steps -= len(chunk)
                route = self._owner.pop(key, None)
                if route is not None:
                    by_route.setdefault(route, []).append(list(key))
                dropped += 1
            else:
                keep.append((key, chunk))
        if dropped:
            self._pending = keep
            self.metrics.log_value("external/num_stale_chunks", dropped, reduce="lifetime_sum")
            version = self._version()
            self._outbox.extend((route, self._stale_reply(0, ids, version)) for route, ids in by_route.items())
            self._wake()

    def commit_delivered(self) -> None:
        """What the last ``take`` handed on arrived: commit it."""
        self.commit(self._delivered)

    def commit(self, keys: list[Key]) -> None:
        """``keys`` were handed on: journal them, then acknowledge them to their senders."""
        if not keys:
            return
        self.journal.add(keys)
        if keys is self._delivered:
            self._delivered, self._delivered_keys = [], set()
        by_route: dict[bytes, list] = {}
        for key in keys:
            route = self._owner.pop(key, None)
            if route is not None:
                by_route.setdefault(route, []).append(list(key))
        version = self._version()
        self._outbox.extend((route, {"op": wire.COMMITTED, "id": 0, "ids": ids, "weights_version": version})
                            for route, ids in by_route.items())
        self.metrics.log_value("external/num_chunks_committed", len(keys), reduce="lifetime_sum")
        self._wake()

    def untake(self, chunks: list[EpisodeChunk]) -> None:
        """The last ``take``'s ``chunks`` were not handed on after all (a stream stopped before the
        receiver had room): pending again, first in line, and not committed."""
        taken = list(zip(self._delivered, chunks))
        self._pending[:0] = taken
        self._pending_keys.update(key for key, _ in taken)
        self.pending_steps += sum(len(c) for _, c in taken)
        self._delivered, self._delivered_keys = [], set()
