"""Chunk streams over ZeroMQ, torch-free: senders send codec frames, a receiver reads and checks them.

Wire format: a sender (DEALER) sends one multipart message per batch of chunks, ``[sender id, seq,
frame]``. The sender id is short ASCII (``b"env-runner-3"``) so that a bad frame can be logged naming
who sent it; ``seq`` is the frame's number in that sender's stream (8 bytes, little-endian, from 1);
the frame is ``protocols.encode(list_of_chunks)``. The receiver (ROUTER) answers each message it reads
with ``[seq]`` echoed back: an acknowledgment, no more. Nothing is pickled. Only numpy, msgpack, lz4
and zmq are needed, so a simulator's own Python (an external client) can speak it too.

Back-pressure, counted in frames (credit-based): a sender given a ``window`` sends a frame only while
fewer than ``window`` of its frames are unacknowledged, i.e. not yet read by the receiver. A receiver
that stops reading (its learner queue is full) stops the senders after exactly ``window`` frames each,
however large the frames and however big the kernel's socket buffers: what a slow learner finds
waiting for it is a known number of fragments, so its data lags a bounded number of updates. An
acknowledgment covers every frame up to its ``seq`` (a frame lost with a dropped connection does not
hold a credit forever), and a sender that hears nothing for ``ack_timeout_s`` while waiting assumes
its frames were lost, says so in the log and takes its credits back (``num_credit_resets``): a
receiver that merely paused then finds at most the high-water marks' worth more.

Without a window, and beyond it, both ends have a high-water mark (``hwm`` messages; ZeroMQ applies it
per connection): frames in flight per sender are bounded by ``2 * hwm`` plus what the kernel's socket
buffers hold (``sndbuf``/``rcvbuf`` bound those too when set).
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


SEQ_BYTES = 8
"""Width of a frame's sequence number on the wire (unsigned, little-endian)."""

SENDER_COUNTERS = ("num_frames_sent", "num_bytes_sent", "send_blocked_s", "num_credit_resets")
"""The keys of ``ChunkSender.counters()``."""


class ChunkSender:
    """A DEALER socket that sends ``[sender id, seq, encode(chunks)]``, at most ``window`` frames ahead of
    the receiver's acknowledgments (None: no window), and blocks at the high-water mark.

    ``frames_sent`` counts a frame from the moment ZeroMQ accepted it, under a lock that a reader
    of the counters takes too: whoever has seen a frame arrive and then reads the counters finds
    it counted."""

    def __init__(self, address: str, sender_id: str, *, hwm: int = 4, compress: bool = True, sndbuf: int = 0,
                 context: zmq.Context | None = None, window: int | None = None, ack_timeout_s: float = 60.0) -> None:
        if window is not None and (isinstance(window, bool) or not isinstance(window, int) or window < 1):
            raise ValueError(f"window must be None or an int >= 1 (frames sent ahead of the receiver), got {window!r}")
        if ack_timeout_s <= 0:
            raise ValueError(f"ack_timeout_s must be > 0 seconds, got {ack_timeout_s!r}")
        self.address, self.compress = address, compress
        self.window, self.ack_timeout_s = window, ack_timeout_s
        self.sender_id = sender_id.encode("ascii")[:MAX_SENDER_ID]
        self._own_ctx = context is None
        self._ctx = context or zmq.Context()
        self._sock = self._ctx.socket(zmq.DEALER)
        self._sock.setsockopt(zmq.SNDHWM, hwm)
        self._sock.setsockopt(zmq.LINGER, 0)
        if sndbuf:
            self._sock.setsockopt(zmq.SNDBUF, sndbuf)
        self._sock.connect(address)
        self._lock = threading.Lock()
        self._frames_sent = 0  # also the last seq sent
        self._acked = 0  # the highest seq acknowledged
        self._bytes_sent = 0
        self._credit_resets = 0
        self._blocked_s = 0.0
        self._blocked_since: float | None = None
        self._waiting_for: str | None = None

    def counters(self) -> dict[str, float]:
        """Frames and bytes sent, credit resets, and seconds ``send`` waited (for credit or for room at
        the high-water mark; the current wait included)."""
        with self._lock:
            since = self._blocked_since
            blocked = self._blocked_s + (time.perf_counter() - since if since is not None else 0.0)
            return {"num_frames_sent": self._frames_sent, "num_bytes_sent": self._bytes_sent,
                    "send_blocked_s": blocked, "num_credit_resets": self._credit_resets}

    @property
    def frames_sent(self) -> int:
        with self._lock:
            return self._frames_sent

    @property
    def frames_unacknowledged(self) -> int:
        """Frames sent that the receiver has not yet said it read (as far as the acks read so far tell)."""
        with self._lock:
            return self._frames_sent - self._acked

    @property
    def waiting_for(self) -> str | None:
        """What a blocked ``send`` waits for: "credit" (``window`` frames unacknowledged), "room" (the
        high-water mark), or None when not waiting."""
        return self._waiting_for

    @property
    def blocked_s(self) -> float:
        return self.counters()["send_blocked_s"]

    def send(self, chunks: list[EpisodeChunk], stop: threading.Event | None = None) -> bool:
        return self.send_frame(encode(chunks, compress=self.compress), stop)

    def send_frame(self, frame: bytes, stop: threading.Event | None = None, poll_ms: int = 50) -> bool:
        """Queue one frame; wait while ``window`` frames are unacknowledged or the high-water mark is
        reached. False if ``stop`` was set first."""
        credit_wait_since: float | None = None
        while True:
            self._read_acks()
            with self._lock:
                if self.window is not None and self._frames_sent - self._acked >= self.window:
                    now = time.perf_counter()
                    credit_wait_since = credit_wait_since or now
                    if now - credit_wait_since > self.ack_timeout_s:
                        self._reset_credits(now - credit_wait_since)
                        credit_wait_since = None
                        continue
                    self._start_wait("credit")
                    ready_for = zmq.POLLIN  # an acknowledgment
                else:
                    seq = (self._frames_sent + 1).to_bytes(SEQ_BYTES, "little")
                    try:
                        self._sock.send_multipart([self.sender_id, seq, frame], flags=zmq.NOBLOCK, copy=False)
                    except zmq.Again:
                        self._start_wait("room")
                        ready_for = zmq.POLLOUT
                    else:
                        self._frames_sent += 1
                        self._bytes_sent += len(frame)
                        self._end_wait()
                        return True
            if stop is not None and stop.is_set():
                with self._lock:
                    self._end_wait()
                return False
            self._sock.poll(poll_ms, ready_for)

    def _read_acks(self) -> None:
        """Take in every acknowledgment waiting (this thread alone uses the socket)."""
        while True:
            try:
                parts = self._sock.recv_multipart(flags=zmq.NOBLOCK)
            except zmq.Again:
                return
            if len(parts) == 1 and len(parts[0]) == SEQ_BYTES:
                seq = int.from_bytes(parts[0], "little")
                with self._lock:  # never past what was sent: a confused peer cannot lend credit
                    self._acked = max(self._acked, min(seq, self._frames_sent))

    def _reset_credits(self, waited_s: float) -> None:
        """Take the credits back: the receiver paused for long (an evaluation, a checkpoint) or a dropped
        connection lost the frames; either way waiting longer gains nothing (the high-water marks still bound
        what a paused receiver finds). Logged once per sender, counted always."""
        self._credit_resets += 1
        level = logging.WARNING if self._credit_resets == 1 else logging.DEBUG
        log.log(level, "%s: no acknowledgment from %s for %.0f s with %d frame(s) unacknowledged: the receiver "
                "paused or the connection lost them; sending on (further resets are counted in num_credit_resets, "
                "not logged)", self.sender_id.decode("ascii", "replace"), self.address, waited_s,
                self._frames_sent - self._acked)
        self._acked = self._frames_sent

    def _start_wait(self, what: str) -> None:
        self._waiting_for = what
        if self._blocked_since is None:
            self._blocked_since = time.perf_counter()

    def _end_wait(self) -> None:
        self._waiting_for = None
        since, self._blocked_since = self._blocked_since, None
        if since is not None:
            self._blocked_s += time.perf_counter() - since

    def close(self) -> None:
        self._sock.close(linger=0)
        if self._own_ctx:
            self._ctx.term()


class ChunkPuller:
    """A bound ROUTER socket that turns incoming messages into checked episode chunks and acknowledges
    each message it reads (``[seq]`` back to its sender, whatever the frame holds: the credit is for
    reading it, not for its contents).

    A message that is not ``[sender id, seq, frame]``, a frame that fails bounded decoding, a frame
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
        self._sock = self._ctx.socket(zmq.ROUTER)  # sends to a gone or full peer are dropped, never block
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
            peer, *parts = self._sock.recv_multipart(flags=zmq.NOBLOCK)
        except zmq.Again:
            return None
        # counted before the acknowledgment goes out: a sender's next frame (which that credit lets through)
        # can then never be counted as sent while this one is not yet counted as received
        self.counters["num_frames_received"] += 1
        if len(parts) == 3 and len(parts[1]) == SEQ_BYTES:
            try:
                self._sock.send_multipart([peer, parts[1]], flags=zmq.NOBLOCK)
            except zmq.ZMQError:  # the peer is gone or not reading: it has no use for the credit
                pass
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
        if len(parts) != 3 or len(parts[1]) != SEQ_BYTES:
            c["num_frames_dropped_bad_envelope"] += 1
            shape = f"{len(parts)} parts" if len(parts) != 3 else f"a {len(parts[1])}-byte seq"
            self._drop(sender_name(parts[0]) if parts else "<unknown sender>", "a message",
                       f"expected [sender id, {SEQ_BYTES}-byte seq, frame], got {shape}")
            return []
        sender, frame = sender_name(parts[0]), parts[2]
        try:
            obj = decode(frame, limits=self.limits)
        except ProtocolError as err:
            c["num_frames_dropped_decode_error"] += 1
            self._drop(sender, f"a frame of {len(frame)} bytes", err)
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
