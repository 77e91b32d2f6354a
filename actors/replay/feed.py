"""ReplayFeed: a replay stage's intake when runners stream to it (replay as a Ray actor).

One thread pulls chunk frames with ``protocols.transport.ChunkPuller`` (bounded decode, schema
check, drops counted by sender) and inserts them. An insert that the rate limiter holds back keeps
the thread waiting with the chunks in hand, so it stops reading: the receive queue fills, then the
runners' send queues, and sampling slows to the ratio the limiter allows -- memory stays bounded.
"""
from __future__ import annotations

import logging
import threading
import traceback
from typing import Any

from actors.replay.rate_limiter import RateLimiterTimeout
from protocols.schema import ChunkSchema
from protocols.transport import ChunkPuller

log = logging.getLogger(__name__)


class ReplayFeed:
    def __init__(self, buffer: Any, schema: ChunkSchema, host: str, *, hwm: int = 4, rcvbuf: int = 0) -> None:
        self.buffer = buffer
        self.puller = ChunkPuller(host, schema, hwm=hwm, rcvbuf=rcvbuf)
        self.address = self.puller.address
        self.error: str | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="runnel-replay-feed", daemon=True)

    def start(self) -> "ReplayFeed":
        self._thread.start()
        return self

    def _loop(self) -> None:
        try:
            while not self._stop.is_set():
                if not self.puller.poll(50):
                    continue
                chunks = self.puller.receive()
                while chunks and not self._stop.is_set():
                    try:
                        self.buffer.add(chunks, timeout_s=0.5)
                        break
                    except RateLimiterTimeout:
                        continue  # the learner has not caught up: keep waiting (and not reading)
        except BaseException as err:  # noqa: BLE001 - reported through check_health
            self.error = f"{type(err).__name__}: {err}"
            log.error("replay feed thread failed:\n%s", traceback.format_exc())

    def check_health(self) -> None:
        if self.error is not None:
            raise RuntimeError(f"the replay feed thread failed: {self.error}")

    def counters(self) -> dict[str, int]:
        return dict(self.puller.counters)

    def stop(self, timeout_s: float = 10.0) -> None:
        self._stop.set()
        self._thread.join(timeout_s)
        self.puller.close()
