"""ServerStream: the sending thread of a streaming policy server (IMPALA, APPO, the remote replay).

A streaming env runner samples fragment after fragment and pushes them (``actors.env.streaming``);
a policy server has nothing to sample -- its clients send the chunks. This thread takes what the
server holds (``PolicyServer.take_for_stream``) and pushes it as one codec frame over the same
transport env runners use (``protocols.transport.ChunkSender``: a PUSH socket, ``[sender id, frame]``
messages, the same high-water mark and socket buffer), so the receiver -- the learner's loader or
the replay actor's intake -- cannot tell a server from a runner.

A frame ZeroMQ accepted is *handed on*: the server then records and commits its chunks
(``PolicyServer.pushed``), which acknowledges them to their clients. A frame still waiting for room
when the stream is stopped is not: its chunks go back to the front of the server's queue
(``PolicyServer.not_pushed``). A send blocked at the high-water mark is back-pressure: while it
waits, the server's pending steps grow until clients are told ``busy``.

A thread that dies is reported by ``check_health``, which the server's ``get_metrics`` calls, so the
driver recreates the slot. Waiting for clients is not a stall: a server has no stall timeout.
"""
from __future__ import annotations

import logging
import threading
import traceback
from typing import Any, Protocol

from protocols.episode import EpisodeChunk
from protocols.transport import ChunkSender

log = logging.getLogger("runnel")


class StreamSource(Protocol):
    """What the stream needs of its server (``actors.external.policy_server.PolicyServer``)."""

    worker_index: int
    metrics: Any

    def take_for_stream(self, stop: threading.Event) -> list[EpisodeChunk]: ...

    def pushed(self, chunks: list[EpisodeChunk]) -> None: ...

    def not_pushed(self, chunks: list[EpisodeChunk]) -> None: ...

    def wake_stream(self) -> None: ...


class ServerStream:
    def __init__(self, server: StreamSource, address: str, *, hwm: int = 4, compress: bool = True,
                 sndbuf: int = 0) -> None:
        self.server, self.address = server, address
        self.hwm, self.compress, self.sndbuf = hwm, compress, sndbuf
        self.sender_id = f"policy-server-{server.worker_index}"
        self._stop = threading.Event()
        self._sender: ChunkSender | None = None
        self._counters_lock = threading.Lock()
        self._reported = {"num_frames_sent": 0, "num_bytes_sent": 0, "send_blocked_s": 0.0}
        self.error: str | None = None
        self._thread = threading.Thread(target=self._loop, name=f"runnel-server-stream-{server.worker_index}",
                                        daemon=True)

    def start(self) -> None:
        self._thread.start()

    def alive(self) -> bool:
        return self._thread.is_alive()

    def _loop(self) -> None:
        try:
            self._sender = ChunkSender(self.address, self.sender_id, hwm=self.hwm, compress=self.compress,
                                       sndbuf=self.sndbuf)
            while not self._stop.is_set():
                chunks = self.server.take_for_stream(self._stop)
                if not chunks:
                    continue
                if not self._sender.send(chunks, self._stop):
                    self.server.not_pushed(chunks)  # stopped while the receiver had no room
                    break
                self.server.pushed(chunks)
        except BaseException as err:  # noqa: BLE001 - reported through check_health, which the driver polls
            self.error = f"{type(err).__name__}: {err}"
            log.error("%s: stream thread failed:\n%s", self.sender_id, traceback.format_exc())
        finally:
            if self._sender is not None:
                self.log_counters()
                self._sender.close()

    def log_counters(self) -> None:
        """The sender's counters into the server's logger as deltas, under the keys env runners use
        (``stream/runner_num_frames_sent``...), so the plan's stream section adds servers in."""
        sender = self._sender
        if sender is None:
            return
        with self._counters_lock:
            now = sender.counters()
            for key, value in now.items():
                if value != self._reported[key]:
                    self.server.metrics.log_value(f"stream/runner_{key}", value - self._reported[key],
                                                  reduce="lifetime_sum")
            self._reported = now

    def check_health(self) -> None:
        """Raise RuntimeError if the thread failed or ended without being stopped."""
        if self.error is not None:
            raise RuntimeError(f"{self.sender_id}: stream thread failed: {self.error}")
        if not self._thread.is_alive() and not self._stop.is_set():
            raise RuntimeError(f"{self.sender_id}: stream thread is not running")

    def stop(self, timeout_s: float = 10.0) -> bool:
        """Stop pushing (a blocked send gives up; its chunks go back to the server) and join the
        thread. True if it ended."""
        self._stop.set()
        self.server.wake_stream()  # after the flag: a take that wakes finds it set
        if self._thread.ident is not None:
            self._thread.join(timeout_s)
        return not self._thread.is_alive()
