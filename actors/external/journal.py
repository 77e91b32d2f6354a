"""CommitJournal: the ids of the chunks a policy server handed on, kept on disk across its restarts.

A client resends every chunk it has no acknowledgement for; the server drops the ones it already
handed on. After a crash the server reads back which those were from this append-only file of
msgpack ``[episode_id, chunk_index]`` records (fsync'd before the acknowledgements go out). Only
the newest ``capacity`` ids are kept -- a client's spool holds far fewer -- and the file is
rewritten with those when it grows to twice that. A record torn by a crash is ignored.
"""
from __future__ import annotations

import logging
import os
from collections import OrderedDict

import msgpack

log = logging.getLogger("runnel")

Key = tuple[str, int]


class CommitJournal:
    def __init__(self, path: str | None, capacity: int = 1_000_000) -> None:
        """``path=None``: in memory only (no restart survival)."""
        self.path, self.capacity = path, capacity
        self._ids: OrderedDict[Key, None] = OrderedDict()
        self._records = 0
        self._file = None
        if path is not None:
            os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
            self._load()
            self._file = open(path, "ab")

    def _load(self) -> None:
        if not os.path.exists(self.path):
            return
        with open(self.path, "rb") as f:
            unpacker = msgpack.Unpacker(f, raw=False, max_buffer_size=1 << 20)
            try:
                for rec in unpacker:
                    if isinstance(rec, list) and len(rec) == 2 and isinstance(rec[0], str) and isinstance(rec[1], int):
                        self._remember((rec[0], rec[1]))
                        self._records += 1
            except (ValueError, msgpack.ExtraData, msgpack.FormatError, msgpack.StackError) as err:
                log.warning("commit journal %s: ignored a damaged tail (%s)", self.path, err)
        log.info("commit journal %s: %d ids", self.path, len(self._ids))

    def _remember(self, key: Key) -> None:
        self._ids[key] = None
        if len(self._ids) > self.capacity:
            self._ids.popitem(last=False)

    def __contains__(self, key: Key) -> bool:
        return key in self._ids

    def __len__(self) -> int:
        return len(self._ids)

    def add(self, keys: list[Key]) -> None:
        """Record ``keys`` durably (written and fsync'd when this returns)."""
        new = [k for k in keys if k not in self._ids]
        for k in new:
            self._remember(k)
        if self._file is None or not new:
            return
        self._file.write(b"".join(msgpack.packb([k[0], k[1]]) for k in new))
        self._file.flush()
        os.fsync(self._file.fileno())
        self._records += len(new)
        if self._records > 2 * self.capacity:
            self._compact()

    def _compact(self) -> None:
        tmp = f"{self.path}.tmp"
        with open(tmp, "wb") as f:
            f.write(b"".join(msgpack.packb([k[0], k[1]]) for k in self._ids))
            f.flush()
            os.fsync(f.fileno())
        self._file.close()
        os.replace(tmp, self.path)
        self._file = open(self.path, "ab")
        self._records = len(self._ids)

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None
