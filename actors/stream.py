"""Chunk streams of the asynchronous algorithms: env runners PUSH, the learner side PULLs.

Wire format: one ZeroMQ multipart message per sampled fragment, ``[sender id, frame]``. The
sender id is short ASCII (``b"env-runner-3"``) so that a bad frame can be logged naming who sent
it; the frame is ``protocols.encode(list_of_chunks)`` -- every chunk a fragment produced (one per
sub-env and episode segment). Nothing is pickled.

Back-pressure: the runner's PUSH socket and the receiver's PULL socket both have a high-water
mark (``hwm`` frames; ZeroMQ applies it per connection). The receiver's loader thread stops
reading while its batch queue is full, so the PULL queue fills, then the PUSH queue, and the
runner's ``send`` blocks -- a slow learner slows the runners down instead of growing memory.
Frames in flight per runner are bounded by ``2 * hwm`` plus what the kernel's socket buffers
hold (``sndbuf``/``rcvbuf`` bound those too when set).

Threads:

* ``RunnerStream`` (inside an env runner, Ray actor or local): one background thread that samples
  ``rollout_fragment_length`` steps per sub-env, sends the fragment's chunks and, between
  fragments, applies weights that the actor's main thread received (``set_pending_weights``).
  The actor's main thread stays free for ``ping``/``get_stream_metrics``/weights calls.
* ``ChunkReceiver`` (next to the learner): one loader thread that receives frames, decodes them
  with bounded ``protocols.decode`` (``Limits``), checks every chunk against the observation and
  action spaces, and cuts the stream into train batches of exactly ``batch_size`` steps, which
  it puts into a bounded queue of ``queue_size`` batches. Each batch is also laid out as a
  learner ``Batch`` in the loader thread (on GPU: copied in a side CUDA stream), so sampling,
  decoding, batching and learning overlap. A frame or chunk that fails decoding or the checks is
  counted and dropped with one log line naming its sender; the loader goes on.
"""
from __future__ import annotations

import collections
import logging
import queue
import threading
import time
import traceback
from typing import Any

import gymnasium as gym
import numpy as np
import torch
import zmq

from actors.learner import Batch, chunks_to_batch
from protocols import nested
from protocols.codec import Limits, decode, encode
from protocols.episode import EpisodeChunk
from protocols.errors import ProtocolError

log = logging.getLogger(__name__)

STREAM_LIMITS = Limits(max_frame_bytes=64 << 20, max_decoded_bytes=256 << 20, max_buffer_size=16 << 20,
                       max_str_len=1 << 20, max_bin_len=16 << 20, max_array_len=1 << 20, max_map_len=1 << 16,
                       max_depth=16)
"""Decode bounds for chunk frames: a fragment of thousands of steps of large observations fits
with room to spare; a forged frame claiming more is rejected before anything is allocated."""

_MAX_SENDER_ID = 64


def node_address() -> str:
    """This node's IP as Ray sees it (reachable from other nodes), else loopback."""
    try:
        import ray

        if ray.is_initialized():
            return ray.util.get_node_ip_address()
    except Exception:  # noqa: BLE001 - no Ray, or no node: a single machine
        pass
    return "127.0.0.1"


def sender_name(raw: Any) -> str:
    """A printable name for a sender id taken off the wire (untrusted)."""
    b = bytes(raw)[:_MAX_SENDER_ID]
    text = b.decode("ascii", "replace")
    return "".join(ch if ch.isprintable() else "?" for ch in text) or "<empty sender id>"


# --- space checks -----------------------------------------------------------------------------
class SpaceChecker:
    """Checks decoded chunks against the observation/action spaces the learner was built for.

    Structure (Dict keys, Tuple lengths), per-row shapes and numeric dtypes are checked; values
    are not (a Box bound is the env's business). Raises ProtocolError naming the first mismatch.
    """

    _NUMERIC = frozenset("biuf")

    def __init__(self, observation_space: gym.Space | None, action_space: gym.Space | None,
                 required_extra: tuple[str, ...] = ("action_logp",)) -> None:
        self.obs_spec = None if observation_space is None else self._spec(observation_space)
        self.act_spec = None if action_space is None else self._spec(action_space)
        self.required_extra = tuple(required_extra)

    @classmethod
    def _spec(cls, space: gym.Space) -> Any:
        if isinstance(space, gym.spaces.Dict):
            return {k: cls._spec(s) for k, s in space.spaces.items()}
        if isinstance(space, gym.spaces.Tuple):
            return [cls._spec(s) for s in space.spaces]
        if space.shape is None:
            raise ValueError(f"cannot check chunks against the space {space}: it has no shape")
        return _Leaf(tuple(int(d) for d in space.shape))

    def check(self, chunk: EpisodeChunk) -> None:
        steps = len(chunk)
        if self.obs_spec is not None:
            self._check("obs", self.obs_spec, chunk.obs, steps + 1)
        if self.act_spec is not None:
            self._check("actions", self.act_spec, chunk.actions, steps)
        for key in self.required_extra:
            value = chunk.extra.get(key)
            if not isinstance(value, np.ndarray) or value.shape != (steps,) or value.dtype.kind != "f":
                got = "nothing" if value is None else f"{getattr(value, 'shape', type(value).__name__)}"
                raise ProtocolError(f"extra[{key!r}] must be a float array of shape ({steps},), got {got}")

    def _check(self, where: str, spec: Any, value: Any, rows: int) -> None:
        if isinstance(spec, dict):
            if not isinstance(value, dict) or set(value) != set(spec):
                got = sorted(value) if isinstance(value, dict) else type(value).__name__
                raise ProtocolError(f"{where}: expected a dict with keys {sorted(spec)}, got {got}")
            for k in spec:
                self._check(f"{where}[{k!r}]", spec[k], value[k], rows)
        elif isinstance(spec, list):
            if not isinstance(value, (tuple, list)) or len(value) != len(spec):
                got = f"{len(value)} items" if isinstance(value, (tuple, list)) else type(value).__name__
                raise ProtocolError(f"{where}: expected a tuple of {len(spec)} items, got {got}")
            for i, (s, v) in enumerate(zip(spec, value)):
                self._check(f"{where}[{i}]", s, v, rows)
        else:
            if not isinstance(value, np.ndarray):
                raise ProtocolError(f"{where}: expected an array, got {type(value).__name__}")
            if value.shape != (rows, *spec.shape):
                raise ProtocolError(f"{where} has shape {value.shape}; the space expects {(rows, *spec.shape)}")
            if value.dtype.kind not in self._NUMERIC:
                raise ProtocolError(f"{where} has dtype {value.dtype}; expected a bool, int or float dtype")


class _Leaf:
    __slots__ = ("shape",)

    def __init__(self, shape: tuple[int, ...]) -> None:
        self.shape = shape


# --- sending ----------------------------------------------------------------------------------
class ChunkSender:
    """A PUSH socket that sends ``[sender id, encode(chunks)]`` and blocks at the high-water mark."""

    def __init__(self, address: str, sender_id: str, *, hwm: int = 4, compress: bool = True, sndbuf: int = 0,
                 context: zmq.Context | None = None) -> None:
        self.address, self.compress = address, compress
        self.sender_id = sender_id.encode("ascii")[:_MAX_SENDER_ID]
        self._own_ctx = context is None
        self._ctx = context or zmq.Context()
        self._sock = self._ctx.socket(zmq.PUSH)
        self._sock.setsockopt(zmq.SNDHWM, hwm)
        self._sock.setsockopt(zmq.LINGER, 0)
        if sndbuf:
            self._sock.setsockopt(zmq.SNDBUF, sndbuf)
        self._sock.connect(address)
        self.frames_sent = 0
        self.bytes_sent = 0
        self._blocked_s = 0.0
        self._blocked_since: float | None = None

    @property
    def blocked_s(self) -> float:
        """Seconds ``send`` waited for room under the high-water mark (back-pressure), the current wait included."""
        since = self._blocked_since
        return self._blocked_s + (time.perf_counter() - since if since is not None else 0.0)

    def send(self, chunks: list[EpisodeChunk], stop: threading.Event | None = None) -> bool:
        return self.send_frame(encode(chunks, compress=self.compress), stop)

    def send_frame(self, frame: bytes, stop: threading.Event | None = None, poll_ms: int = 50) -> bool:
        """Queue one frame; wait while the high-water mark is reached. False if ``stop`` was set first."""
        sent = False
        try:
            while True:
                try:
                    self._sock.send_multipart([self.sender_id, frame], flags=zmq.NOBLOCK, copy=False)
                    sent = True
                    break
                except zmq.Again:
                    if self._blocked_since is None:
                        self._blocked_since = time.perf_counter()
                    if stop is not None and stop.is_set():
                        break
                    self._sock.poll(poll_ms, zmq.POLLOUT)
        finally:
            since, self._blocked_since = self._blocked_since, None
            if since is not None:
                self._blocked_s += time.perf_counter() - since
        if not sent:
            return False
        self.frames_sent += 1
        self.bytes_sent += len(frame)
        return True

    def close(self) -> None:
        self._sock.close(linger=0)
        if self._own_ctx:
            self._ctx.term()


class RunnerStream:
    """The sampling thread of a streaming env runner (see the module docstring)."""

    def __init__(self, runner: Any, address: str, *, hwm: int = 4, compress: bool = True, sndbuf: int = 0,
                 stall_timeout_s: float = 60.0) -> None:
        self.runner, self.address = runner, address
        self.hwm, self.compress, self.sndbuf = hwm, compress, sndbuf
        self.stall_timeout_s = stall_timeout_s
        self.sender_id = f"env-runner-{runner.worker_index}"
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._pending: tuple[Any, int] | None = None
        self._returns: list[float] = []
        self._lengths: list[int] = []
        self._sender: ChunkSender | None = None
        self.error: str | None = None
        self._status = ("starting", time.monotonic())  # (state, since): one tuple, replaced atomically
        self.fragments_sent = 0
        self.weight_updates_applied = 0
        # torch.set_num_threads only reaches the thread that calls it (OpenMP's per-thread
        # setting): a new thread would run with one intra-op thread per core, which on a busy
        # machine makes each small forward pass dozens of times slower. Carry the setting over.
        self._torch_threads = torch.get_num_threads()
        self._thread = threading.Thread(target=self._loop, name=f"runnel-stream-{runner.worker_index}", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def alive(self) -> bool:
        return self._thread.is_alive()

    def set_pending_weights(self, weights: Any, version: int) -> None:
        """Called from the actor's main thread; the sampling thread applies it before its next fragment."""
        with self._lock:
            self._pending = (weights, version)

    def _apply_pending_weights(self) -> None:
        with self._lock:
            pending, self._pending = self._pending, None
        if pending is not None:
            self.runner.set_weights(*pending)
            self.weight_updates_applied += 1

    @property
    def state(self) -> str:
        return self._status[0]

    def _set_state(self, state: str) -> None:
        self._status = (state, time.monotonic())  # never a new state with the old time (see metrics)

    def _loop(self) -> None:
        r = self.runner
        try:
            torch.set_num_threads(self._torch_threads)
            self._sender = ChunkSender(self.address, self.sender_id, hwm=self.hwm, compress=self.compress,
                                       sndbuf=self.sndbuf)
            if r._obs is None:
                r._reset_all()
            hold_back = r.s.batch_mode == "complete_episodes"
            steps = r.s.rollout_fragment_length
            while not self._stop.is_set():
                self._apply_pending_weights()
                self._set_state("sampling")
                chunks = r._run(steps, r.s.explore, False, hold_back)
                with self._lock:  # episode metrics move here, under the lock metrics() takes
                    self._returns.extend(r._new_returns)
                    self._lengths.extend(r._new_lengths)
                    r._new_returns, r._new_lengths = [], []
                if not chunks:
                    continue
                self._set_state("sending")
                if not self._sender.send(chunks, self._stop):
                    break
                self.fragments_sent += 1
            self._set_state("stopped")
        except BaseException as err:  # noqa: BLE001 - reported through metrics(), which the driver polls
            self.error = f"{type(err).__name__}: {err}"
            self._set_state("failed")
            log.error("%s: sampling thread failed:\n%s", self.sender_id, traceback.format_exc())
        finally:
            if self._sender is not None:
                self._sender.close()

    def metrics(self) -> dict[str, Any]:
        """Episodes finished since the last call, lifetime counters and stream counters.

        Raises RuntimeError when the sampling thread died or made no progress for
        ``stall_timeout_s`` while sampling (a hung environment), so that the driver's actor
        manager treats this runner as failed and recreates it."""
        if self.error is not None:
            raise RuntimeError(f"{self.sender_id}: sampling thread failed: {self.error}")
        if not self._thread.is_alive() and not self._stop.is_set():
            raise RuntimeError(f"{self.sender_id}: sampling thread is not running")
        state, since = self._status
        stalled = time.monotonic() - since
        if state == "sampling" and stalled > self.stall_timeout_s:  # blocked sending is back-pressure, not a stall
            raise RuntimeError(f"{self.sender_id}: no fragment sampled for {stalled:.0f} s (a hung environment?)")
        r = self.runner
        with self._lock:
            returns, lengths = self._returns, self._lengths
            self._returns, self._lengths = [], []
        s = self._sender
        return {
            "episode_returns": returns,
            "episode_lengths": lengths,
            "num_env_steps_sampled_lifetime": r.num_env_steps_sampled_lifetime,
            "num_episodes_lifetime": r.num_episodes_lifetime,
            "num_sub_env_restarts": r.env.num_restarts,
            "weights_version": r.weights_version,
            "num_weight_updates_applied": self.weight_updates_applied,
            "num_frames_sent": s.frames_sent if s else 0,
            "num_bytes_sent": s.bytes_sent if s else 0,
            "send_blocked_s": s.blocked_s if s else 0.0,
        }

    def stop(self, timeout_s: float = 10.0) -> bool:
        """Stop sampling (a blocked send gives up) and join the thread. True if it ended."""
        self._stop.set()
        self._thread.join(timeout_s)
        return not self._thread.is_alive()


# --- receiving --------------------------------------------------------------------------------
class ChunkBatch(list):
    """A train batch: its chunks (a plain list for ``Learner.update``), plus the learner-ready
    ``Batch`` the loader thread built from them, when it did.

    Batches hold exactly ``batch_size`` steps: a chunk that straddles two batches is cut with
    ``EpisodeChunk.slice`` (both pieces keep its ``chunk_index``; ``t_started`` tells them apart;
    the first piece bootstraps from the observation where it was cut)."""

    def __init__(self, chunks: list[EpisodeChunk]) -> None:
        super().__init__(chunks)
        self.batch: Batch | None = None
        self.device: torch.device | None = None
        self.ready_event: Any = None  # CUDA event recorded after the side-stream copy

    @property
    def num_steps(self) -> int:
        return sum(len(c) for c in self)

    def weights_versions(self) -> tuple[np.ndarray, np.ndarray]:
        """(weights_version, steps) per chunk."""
        return (np.fromiter((c.weights_version for c in self), np.int64, len(self)),
                np.fromiter((len(c) for c in self), np.int64, len(self)))

    def to_batch(self, device: torch.device) -> Batch:
        """The learner ``Batch`` on ``device``: the prebuilt one when it matches, else built now."""
        if self.batch is not None and self.device == device:
            if self.ready_event is not None:  # the copy ran in the loader's CUDA stream
                stream = torch.cuda.current_stream(device)
                stream.wait_event(self.ready_event)
                nested.map_structure(lambda t: t.record_stream(stream),
                                     [self.batch.obs, self.batch.all_obs, self.batch.actions, self.batch.extra])
                self.ready_event = None
            return self.batch
        return chunks_to_batch(list(self), device)


def batch_from(chunks: list[EpisodeChunk], device: torch.device) -> Batch:
    """``chunks_to_batch`` that reuses a ChunkBatch's prebuilt batch (use it in update functions)."""
    if isinstance(chunks, ChunkBatch):
        return chunks.to_batch(device)
    return chunks_to_batch(chunks, device)


class ChunkReceiver:
    """PULL socket + loader thread + bounded queue of train batches (see the module docstring).

    ``address`` is ``tcp://<node ip>:<random port>``; hand it to runners' ``start_streaming``.
    """

    def __init__(self, observation_space: gym.Space | None, action_space: gym.Space | None, batch_size: int, *,
                 queue_size: int = 8, hwm: int = 4, host: str | None = None, limits: Limits = STREAM_LIMITS,
                 rcvbuf: int = 0, device: str | torch.device = "cpu", prebuild: bool = True,
                 required_extra: tuple[str, ...] = ("action_logp",), max_log_lines_per_sender: int = 100) -> None:
        if batch_size < 1 or queue_size < 1 or hwm < 1:
            raise ValueError(f"batch_size, queue_size and hwm must be >= 1, got {batch_size}, {queue_size}, {hwm}")
        self.batch_size, self.limits = batch_size, limits
        self.checker = SpaceChecker(observation_space, action_space, required_extra)
        self.device = torch.device(device)
        self.prebuild = prebuild
        self.max_log_lines_per_sender = max_log_lines_per_sender
        self._ctx = zmq.Context()
        self._sock = self._ctx.socket(zmq.PULL)
        self._sock.setsockopt(zmq.RCVHWM, hwm)
        self._sock.setsockopt(zmq.LINGER, 0)
        if rcvbuf:
            self._sock.setsockopt(zmq.RCVBUF, rcvbuf)
        ip = host or node_address()
        port = self._sock.bind_to_random_port(f"tcp://{ip}")
        self.address = f"tcp://{ip}:{port}"
        self._queue: queue.Queue[ChunkBatch] = queue.Queue(maxsize=queue_size)
        self._ready: collections.deque[ChunkBatch] = collections.deque()
        self._pending: collections.deque[EpisodeChunk] = collections.deque()
        self._pending_steps = 0
        self._stop = threading.Event()
        self._torch_threads = torch.get_num_threads()  # see RunnerStream: per-thread setting
        self._thread = threading.Thread(target=self._loop, name="runnel-chunk-loader", daemon=True)
        self._cuda_stream = None
        if self.device.type == "cuda" and torch.cuda.is_available():
            self._cuda_stream = torch.cuda.Stream(self.device)
        self.error: str | None = None
        self.closed = False
        self._log_lines: collections.Counter = collections.Counter()
        self.counters = collections.Counter({
            "num_frames_received": 0, "num_chunks_received": 0, "num_env_steps_received": 0,
            "num_batches_built": 0, "num_frames_dropped_bad_envelope": 0, "num_frames_dropped_decode_error": 0,
            "num_frames_dropped_not_chunks": 0, "num_chunks_dropped_invalid": 0,
            "num_env_steps_dropped": 0,
        })
        self.dropped_by_sender: collections.Counter = collections.Counter()

    # --- consumer side ------------------------------------------------------------------------
    def start(self) -> "ChunkReceiver":
        self._thread.start()
        return self

    def get_batch(self, timeout: float | None = None) -> ChunkBatch | None:
        """The next train batch, or None if none arrived within ``timeout`` seconds."""
        if self.error is not None:
            raise RuntimeError(f"the chunk loader thread failed: {self.error}")
        try:
            return self._queue.get(timeout=timeout) if timeout != 0 else self._queue.get_nowait()
        except queue.Empty:
            return None

    def qsize(self) -> int:
        """Train batches waiting in the learner queue."""
        return self._queue.qsize()

    def stats(self) -> dict[str, Any]:
        out = dict(self.counters)
        out["learner_queue_size"] = self._queue.qsize()
        out["num_env_steps_pending"] = self._pending_steps
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
        self._sock.close(linger=0)
        self._ctx.term()
        self.closed = True

    # --- loader thread ------------------------------------------------------------------------
    def _loop(self) -> None:
        sock, stop = self._sock, self._stop
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
                if not sock.poll(50, zmq.POLLIN):
                    continue
                while not self._ready:  # drain what is there, then go back to the stop check
                    try:
                        parts = sock.recv_multipart(flags=zmq.NOBLOCK)
                    except zmq.Again:
                        break
                    self._handle(parts)
        except BaseException as err:  # noqa: BLE001 - reported to the consumer by get_batch
            self.error = f"{type(err).__name__}: {err}"
            log.error("chunk loader thread failed:\n%s", traceback.format_exc())

    def _drop(self, sender: str, what: str, reason: Any) -> None:
        """Count a drop against its sender and log one line (up to a cap per sender)."""
        self.dropped_by_sender[sender] += 1
        n = self._log_lines[sender] = self._log_lines[sender] + 1
        if n <= self.max_log_lines_per_sender:
            more = "; further drops from this sender are counted, not logged" if n == self.max_log_lines_per_sender else ""
            log.warning("dropped %s from %s: %s%s", what, sender, reason, more)

    def _handle(self, parts: list[bytes]) -> None:
        c = self.counters
        c["num_frames_received"] += 1
        if len(parts) != 2:
            c["num_frames_dropped_bad_envelope"] += 1
            self._drop(sender_name(parts[0]) if parts else "<unknown sender>", "a message",
                       f"expected 2 parts [sender id, frame], got {len(parts)}")
            return
        sender = sender_name(parts[0])
        try:
            obj = decode(parts[1], limits=self.limits)
        except ProtocolError as err:
            c["num_frames_dropped_decode_error"] += 1
            self._drop(sender, f"a frame of {len(parts[1])} bytes", err)
            return
        if isinstance(obj, EpisodeChunk):
            obj = [obj]
        if not isinstance(obj, list) or not obj or not all(isinstance(x, EpisodeChunk) for x in obj):
            c["num_frames_dropped_not_chunks"] += 1
            self._drop(sender, "a frame", f"it holds a {type(obj).__name__}, not episode chunks")
            return
        good: list[EpisodeChunk] = []
        first_error, bad_steps = None, 0
        for chunk in obj:
            try:
                self.checker.check(chunk)
                good.append(chunk)
            except ProtocolError as err:
                first_error = first_error or err
                bad_steps += len(chunk)
        if first_error is not None:
            n_bad = len(obj) - len(good)
            c["num_chunks_dropped_invalid"] += n_bad
            c["num_env_steps_dropped"] += bad_steps
            self._drop(sender, f"{n_bad} of {len(obj)} chunk(s) of a frame", first_error)
        if good:
            steps = sum(len(ch) for ch in good)
            c["num_chunks_received"] += len(good)
            c["num_env_steps_received"] += steps
            self._add(good, steps)

    def _add(self, chunks: list[EpisodeChunk], steps: int) -> None:
        self._pending.extend(chunks)
        self._pending_steps += steps
        b = self.batch_size
        while self._pending_steps >= b:
            take: list[EpisodeChunk] = []
            n = 0
            while n < b:
                chunk = self._pending.popleft()
                if n + len(chunk) <= b:
                    take.append(chunk)
                    n += len(chunk)
                else:  # split: the head completes this batch, the tail starts the next one
                    k = b - n
                    take.append(chunk.slice(0, k))
                    self._pending.appendleft(chunk.slice(k, len(chunk)))
                    n = b
            self._pending_steps -= b
            self._ready.append(self._make_batch(take))
            self.counters["num_batches_built"] += 1

    def _make_batch(self, chunks: list[EpisodeChunk]) -> ChunkBatch:
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
