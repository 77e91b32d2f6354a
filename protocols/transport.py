"""Chunk streams over ZeroMQ, torch-free: senders PUSH codec frames, a receiver PULLs and checks them.

Wire format: one multipart message per batch of chunks, ``[sender id, frame]``. The sender id is
short ASCII (``b"env-runner-3"``) so that a bad frame can be logged naming who sent it; the frame
is ``protocols.encode(list_of_chunks)``. Nothing is pickled. Only numpy, msgpack, lz4 and zmq are
needed, so a simulator's own Python (an external client) can speak it too.

Back-pressure: both ends have a high-water mark (``hwm`` messages; ZeroMQ applies it per
connection). A receiver that stops reading lets its PULL queue fill, then the sender's PUSH queue,
and ``ChunkSender.send`` blocks -- a slow consumer slows producers down instead of growing memory.
Frames in flight per sender are bounded by ``2 * hwm`` plus what the kernel's socket buffers hold
(``sndbuf``/``rcvbuf`` bound those too when set).
"""
from __future__ import annotations

import collections
import logging
import threading
import time
from typing import Any

import zmq

from protocols.codec import Limits, decode, encode
from protocols.episode import EpisodeChunk
from protocols.errors import ProtocolError
from protocols.schema import ChunkSchema
from protocols.stream_ledger import StreamLedger

log = logging.getLogger(__name__)

STREAM_LIMITS = Limits(max_frame_bytes=64 << 20, max_decoded_bytes=256 << 20, max_buffer_size=16 << 20,
                       max_str_len=1 << 20, max_bin_len=16 << 20, max_array_len=1 << 20, max_map_len=1 << 16,
                       max_depth=16)
"""Decode bounds for chunk frames: a fragment of thousands of steps of large observations fits
with room to spare; a forged frame claiming more is rejected before anything is allocated."""

MAX_SENDER_ID = 64


def sender_name(raw: Any) -> str:
    """A printable name for a sender id taken off the wire (untrusted)."""
    text = bytes(raw)[:MAX_SENDER_ID].decode("ascii", "replace")
    return "".join(ch if ch.isprintable() else "?" for ch in text) or "<empty sender id>"


def compress_by_default(observation: dict) -> bool:
    """Whether frames of these observations (a space description) are worth LZ4: integer,
    pixel-like arrays shrink 20x and more; float vectors ~1.3x, for a large share of a small
    fragment's encoding time."""
    kind = observation.get("type")
    if kind == "Dict":
        return any(compress_by_default(s) for s in observation["spaces"].values())
    if kind == "Tuple":
        return any(compress_by_default(s) for s in observation["spaces"])
    if kind != "Box":
        return False
    size = 1
    for d in observation["shape"]:
        size *= int(d)
    return "int" in observation["dtype"] and size >= 64


class ChunkSender:
    """A PUSH socket that sends ``[sender id, encode(chunks)]`` and blocks at the high-water mark.

    ``frames_sent`` counts a frame from the moment ZeroMQ accepted it, under a lock that a reader
    of the counters takes too: whoever has seen a frame arrive and then reads the counters finds
    it counted."""

    def __init__(self, address: str, sender_id: str, *, hwm: int = 4, compress: bool = True, sndbuf: int = 0,
                 context: zmq.Context | None = None) -> None:
        self.address, self.compress = address, compress
        self.sender_id = sender_id.encode("ascii")[:MAX_SENDER_ID]
        self._own_ctx = context is None
        self._ctx = context or zmq.Context()
        self._sock = self._ctx.socket(zmq.PUSH)
        self._sock.setsockopt(zmq.SNDHWM, hwm)
        self._sock.setsockopt(zmq.LINGER, 0)
        if sndbuf:
            self._sock.setsockopt(zmq.SNDBUF, sndbuf)
        self._sock.connect(address)
        self._lock = threading.Lock()
        self._frames_sent = 0
        self._bytes_sent = 0
        self._blocked_s = 0.0
        self._blocked_since: float | None = None

    def counters(self) -> dict[str, float]:
        """Frames and bytes sent, and seconds ``send`` waited for room (the current wait included)."""
        with self._lock:
            since = self._blocked_since
            blocked = self._blocked_s + (time.perf_counter() - since if since is not None else 0.0)
            return {"num_frames_sent": self._frames_sent, "num_bytes_sent": self._bytes_sent,
                    "send_blocked_s": blocked}

    @property
    def frames_sent(self) -> int:
        with self._lock:
            return self._frames_sent

    @property
    def blocked_s(self) -> float:
        return self.counters()["send_blocked_s"]

    def send(self, chunks: list[EpisodeChunk], stop: threading.Event | None = None) -> bool:
        return self.send_frame(encode(chunks, compress=self.compress), stop)

    def send_frame(self, frame: bytes, stop: threading.Event | None = None, poll_ms: int = 50) -> bool:
        """Queue one frame; wait while the high-water mark is reached. False if ``stop`` was set first."""
        parts = [self.sender_id, frame]
        while True:
            with self._lock:
                try:
                    self._sock.send_multipart(parts, flags=zmq.NOBLOCK, copy=False)
                except zmq.Again:
                    if self._blocked_since is None:
                        self._blocked_since = time.perf_counter()
                else:
                    self._frames_sent += 1
                    self._bytes_sent += len(frame)
                    self._end_wait()
                    return True
            if stop is not None and stop.is_set():
                with self._lock:
                    self._end_wait()
                return False
            self._sock.poll(poll_ms, zmq.POLLOUT)

    def _end_wait(self) -> None:
        since, self._blocked_since = self._blocked_since, None
        if since is not None:
            self._blocked_s += time.perf_counter() - since

    def close(self) -> None:
        self._sock.close(linger=0)
        if self._own_ctx:
            self._ctx.term()


class ChunkPuller:
    """A bound PULL socket that turns incoming messages into checked episode chunks.

    A message that is not ``[sender id, frame]``, a frame that fails bounded decoding, a frame
    that holds no chunks, and a chunk that fails the schema are counted and dropped with one log
    line naming the sender (up to ``max_log_lines_per_sender`` lines each); the puller goes on.
    A chunk already received (same episode and chunk index) is dropped and counted by ``ledger``
    (``protocols.stream_ledger``), which also counts what a lost sender leaves unfinished.
    ``address`` is ``tcp://<host>:<random port>``; hand it to the senders.
    """

    def __init__(self, host: str, schema: ChunkSchema, *, hwm: int = 4, rcvbuf: int = 0,
                 limits: Limits = STREAM_LIMITS, max_log_lines_per_sender: int = 100) -> None:
        self.schema, self.limits = schema, limits
        self.max_log_lines_per_sender = max_log_lines_per_sender
        self._ctx = zmq.Context()
        self._sock = self._ctx.socket(zmq.PULL)
        self._sock.setsockopt(zmq.RCVHWM, hwm)
        self._sock.setsockopt(zmq.LINGER, 0)
        if rcvbuf:
            self._sock.setsockopt(zmq.RCVBUF, rcvbuf)
        port = self._sock.bind_to_random_port(f"tcp://{host}")
        self.address = f"tcp://{host}:{port}"
        self._log_lines: collections.Counter = collections.Counter()
        self.counters = collections.Counter({
            "num_frames_received": 0, "num_chunks_received": 0, "num_env_steps_received": 0,
            "num_frames_dropped_bad_envelope": 0, "num_frames_dropped_decode_error": 0,
            "num_frames_dropped_not_chunks": 0, "num_chunks_dropped_invalid": 0, "num_env_steps_dropped": 0,
        })
        self.dropped_by_sender: collections.Counter = collections.Counter()
        self.ledger = StreamLedger(self.counters)

    @property
    def closed(self) -> bool:
        return self._ctx.closed

    def poll(self, timeout_ms: int) -> bool:
        """True if a message is waiting."""
        return bool(self._sock.poll(timeout_ms, zmq.POLLIN))

    def receive(self) -> list[EpisodeChunk] | None:
        """The good chunks of the next waiting message (maybe none), or None if nothing is waiting."""
        try:
            parts = self._sock.recv_multipart(flags=zmq.NOBLOCK)
        except zmq.Again:
            return None
        return self._handle(parts)

    def close(self) -> None:
        self._sock.close(linger=0)
        self._ctx.term()

    def _drop(self, sender: str, what: str, reason: Any) -> None:
        self.dropped_by_sender[sender] += 1
        n = self._log_lines[sender] = self._log_lines[sender] + 1
        if n <= self.max_log_lines_per_sender:
            more = "; further drops from this sender are counted, not logged" if n == self.max_log_lines_per_sender else ""
            log.warning("dropped %s from %s: %s%s", what, sender, reason, more)

    def _handle(self, parts: list[bytes]) -> list[EpisodeChunk]:
        c = self.counters
        c["num_frames_received"] += 1
        if len(parts) != 2:
            c["num_frames_dropped_bad_envelope"] += 1
            self._drop(sender_name(parts[0]) if parts else "<unknown sender>", "a message",
                       f"expected 2 parts [sender id, frame], got {len(parts)}")
            return []
        sender = sender_name(parts[0])
        try:
            obj = decode(parts[1], limits=self.limits)
        except ProtocolError as err:
            c["num_frames_dropped_decode_error"] += 1
            self._drop(sender, f"a frame of {len(parts[1])} bytes", err)
            return []
        if isinstance(obj, EpisodeChunk):
            obj = [obj]
        if not isinstance(obj, list) or not obj or not all(isinstance(x, EpisodeChunk) for x in obj):
            c["num_frames_dropped_not_chunks"] += 1
            self._drop(sender, "a frame", f"it holds a {type(obj).__name__}, not episode chunks")
            return []
        good: list[EpisodeChunk] = []
        first_error, bad_steps = None, 0
        for chunk in obj:
            try:
                self.schema.check(chunk)
                good.append(chunk)
            except ProtocolError as err:
                first_error = first_error or err
                bad_steps += len(chunk)
        if first_error is not None:
            n_bad = len(obj) - len(good)
            c["num_chunks_dropped_invalid"] += n_bad
            c["num_env_steps_dropped"] += bad_steps
            self._drop(sender, f"{n_bad} of {len(obj)} chunk(s) of a frame", first_error)
        new = [ch for ch in good if self.ledger.admit(sender, ch)]
        if len(new) < len(good):
            self._drop(sender, f"{len(good) - len(new)} chunk(s) already received", "duplicate (episode id, chunk index)")
        c["num_chunks_received"] += len(new)
        c["num_env_steps_received"] += sum(len(ch) for ch in new)
        return new
