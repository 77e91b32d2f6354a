"""ServerStream: the sending thread of a streaming policy server (IMPALA, APPO, the remote replay).

A streaming env runner samples fragment after fragment and pushes them (``actors.env.streaming``);
a policy server has nothing to sample -- its clients send the chunks. This stream is the runner's
(same thread, ZeroMQ socket, ``[sender id, seq, frame]`` messages, credit window, high-water mark,
counters and health check), with one step changed: take what the server holds (``PolicyServer.take_for_stream``)
and push it as one frame. The receiver -- the learner's loader or the replay actor's intake --
cannot tell a server from a runner.

A frame ZeroMQ accepted is *handed on*: the server then records and commits its chunks
(``PolicyServer.pushed``), which acknowledges them to their clients. A frame still waiting for room
when the stream is stopped is not: its chunks go back to the front of the server's queue
(``PolicyServer.not_pushed``). Frames ZeroMQ accepted but had not delivered yet when the stream is
stopped or its receiver goes away are lost with the socket, as an env runner's are (at most the
high-water mark plus the socket buffer). A send blocked at the high-water mark is back-pressure:
while it waits, the server's pending steps grow until its clients are told ``busy``.

Waiting for clients is not a stall: the stream never reports the "sampling" state that
``check_health`` watches, so only a failed thread gets the slot recreated.
"""
from __future__ import annotations

import threading
from typing import Any, Protocol

from actors.env.streaming import RunnerStream
from protocols.episode import EpisodeChunk
from protocols.transport import ChunkSender


class StreamSource(Protocol):
    """What the stream needs of its server (``actors.external.policy_server.PolicyServer``)."""

    worker_index: int
    metrics: Any

    def take_for_stream(self, stop: threading.Event) -> list[EpisodeChunk]: ...

    def pushed(self, chunks: list[EpisodeChunk]) -> None: ...

    def not_pushed(self, chunks: list[EpisodeChunk]) -> None: ...

    def wake_stream(self) -> None: ...


class ServerStream(RunnerStream):
    def __init__(self, server: StreamSource, address: str, *, hwm: int = 4, compress: bool = True,
                 sndbuf: int = 0, window: int | None = None) -> None:
        super().__init__(server, address, hwm=hwm, compress=compress, sndbuf=sndbuf, window=window)
        self.sender_id = f"policy-server-{server.worker_index}"  # how the receiver's log names it

    def _step(self, sender: ChunkSender) -> bool:
        """Push what clients sent (waiting for it at most ``sample_wait_s``). False if stopped while
        the send waited for room."""
        server = self.runner
        self._set_state("waiting")
        chunks = server.take_for_stream(self._stop)
        if not chunks:
            return True
        self._set_state("sending")
        if not sender.send(chunks, self._stop):
            server.not_pushed(chunks)
            return False
        self.num_env_steps_sent += sum(len(c) for c in chunks)
        server.pushed(chunks)
        return True

    def stop(self, timeout_s: float = 10.0) -> bool:
        """Stop pushing (a blocked send gives up; its chunks go back to the server) and join the
        thread. True if it ended."""
        self._stop.set()
        self.runner.wake_stream()  # after the flag: a take that wakes finds it set
        return super().stop(timeout_s)
