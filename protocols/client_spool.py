"""The PolicyClient's spool: episode chunks sent but not yet committed by the server, resent until they are.

Apart from ``protocols.client`` because it is the client's delivery guarantee on its own: keep
each chunk (optionally on disk, to outlive a crash), offer it again when unacknowledged or after
a reconnect, and drop it once committed or refused. Not locked by itself: the client calls it
under its lock, and the connection hands it the acknowledgements.
"""
from __future__ import annotations

import logging
import os
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, Iterator

import zmq

from protocols import external as wire
from protocols.client_connection import Connection
from protocols.codec import encode
from protocols.episode import EpisodeChunk

log = logging.getLogger("runnel.client")

BUSY_RETRY_S = 0.5
"""How soon a chunk the server was too busy to take is offered again."""


@dataclass
class Spooled:
    frame: bytes
    steps: int
    version: int = -1  # the weights version that acted (-1: unknown, loaded from a spool directory)
    sent_at: float = 0.0  # 0: not sent since the last (re)connect
    received: bool = False


class ChunkSpool:
    """Unacknowledged chunks by ``(episode_id, chunk_index)``, in the order they were cut."""

    def __init__(self, conn: Connection, lock: threading.RLock, directory: str | None, resend_after_s: float) -> None:
        """``directory``: keep a copy of every chunk there until it is committed (None: memory only)."""
        self._conn = conn
        self._spool: OrderedDict[tuple[str, int], Spooled] = OrderedDict()
        self._spool_freed = threading.Condition(lock)
        self.spool_dir = directory
        self.resend_after_s = resend_after_s
        self.rejected: list[tuple[tuple[str, int], str]] = []
        self.committed: list[tuple[str, int]] = []
        self.num_stale = 0  # chunks the server dropped as acted on by weights too old to train on
        self.steps = 0  # env steps in the spool (chunks loaded from a spool directory count 0)
        self.server_version = -1  # the newest weights version replies about chunks announced

    def __len__(self) -> int:
        return len(self._spool)

    def __iter__(self) -> Iterator[tuple[str, int]]:
        return iter(self._spool)

    def add(self, chunk: EpisodeChunk) -> None:
        """Keep the chunk until the server commits it, and send it now (room is the caller's business)."""
        key = (chunk.episode_id, chunk.chunk_index)
        entry = Spooled(encode([chunk], compress=True), len(chunk), int(chunk.weights_version))
        self._spool[key] = entry
        self.steps += entry.steps
        if self.spool_dir is not None:
            _write_atomically(self._spool_path(key), entry.frame)
        self._send_chunk(key, entry)

    def steps_from(self, version: int) -> int:
        """Env steps of spooled chunks acted on by weights ``version`` or newer."""
        return sum(e.steps for e in self._spool.values() if e.version >= version)

    def _spool_path(self, key: tuple[str, int]) -> str:
        return os.path.join(self.spool_dir, f"{key[0].encode('ascii').hex()}_{key[1]}.chunk")

    def load(self, directory: str) -> None:
        """Chunks an earlier process with this spool directory left unacknowledged."""
        os.makedirs(directory, exist_ok=True)
        for name in sorted(os.listdir(directory)):
            stem, ext = os.path.splitext(name)
            eid_hex, _, index = stem.rpartition("_")
            try:
                key = (bytes.fromhex(eid_hex).decode("ascii"), int(index))
            except ValueError:
                continue
            if ext == ".chunk":
                with open(os.path.join(directory, name), "rb") as f:
                    self._spool[key] = Spooled(f.read(), 0)
        if self._spool:
            log.info("resending %d chunk(s) left in %s", len(self._spool), directory)

    def _send_chunk(self, key: tuple[str, int], entry: Spooled) -> None:
        try:
            self._conn.send_chunk(key, entry.frame)
            entry.sent_at = time.monotonic()
        except zmq.Again:  # the pipe is full (server gone): the next maintenance round retries
            entry.sent_at = 0.0

    def resend(self, everything: bool = False) -> None:
        """Offer again what went unacknowledged too long (``everything``: all of it, after a hello)."""
        now = time.monotonic()
        for key, entry in self._spool.items():
            if everything or entry.sent_at == 0.0 or (not entry.received and now - entry.sent_at > self.resend_after_s):
                entry.received = False
                self._send_chunk(key, entry)

    def on_message(self, header: dict) -> None:
        """What the server said about chunks: received, committed, refused or too busy to take."""
        op = header["op"]
        version = header.get("weights_version")
        if type(version) is int and version > self.server_version:
            self.server_version = version
        if op == wire.COMMITTED:
            self._on_committed(header.get("ids"))
        elif op == wire.RECEIVED:
            for item in header.get("ids") or ():
                entry = self._spool.get(tuple(item)) if isinstance(item, list) else None
                if entry is not None:
                    entry.received = True
            self._on_committed(header.get("committed") or [])
        elif op == wire.ERROR and header.get("ids"):  # about chunks: nothing waits for these
            code = header.get("code")
            for item in header["ids"]:
                key = tuple(item) if isinstance(item, list) else None
                if code == wire.BAD_CHUNK and self._drop(key):
                    self.rejected.append((key, str(header.get("message"))))
                    log.error("the server refused chunk %s: %s", key, header.get("message"))
                elif code == wire.STALE and self._drop(key):  # not a bug: this client ran ahead of training
                    self.num_stale += 1
                elif code == wire.HELLO_FIRST:
                    self._conn.rehello()
                    return
                elif key in self._spool:  # busy: try again soon
                    entry = self._spool[key]
                    entry.received = False
                    entry.sent_at = time.monotonic() - self.resend_after_s + BUSY_RETRY_S

    def _on_committed(self, ids: Any) -> None:
        for item in ids if isinstance(ids, list) else ():
            key = (item[0], item[1]) if isinstance(item, list) and len(item) == 2 else None
            if key is not None and self._drop(key):
                self.committed.append(key)

    def _drop(self, key: Any) -> bool:
        """Forget a chunk (committed, or refused for good); False if the spool did not hold it."""
        entry = self._spool.pop(key, None)
        if entry is None:
            return False
        self.steps -= entry.steps
        if self.spool_dir is not None:
            try:
                os.unlink(self._spool_path(key))
            except FileNotFoundError:
                pass
        self._spool_freed.notify_all()
        return True


def _write_atomically(path: str, data: bytes) -> None:
    tmp = f"{path}.tmp"
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
