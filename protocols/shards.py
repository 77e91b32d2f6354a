"""Shard files of recorded experience: append-only records of codec frames, an index at the end.

A recording is a directory of shard files plus ``manifest.json``. One writer owns each shard (no
cross-process locking: every writer picks names no other writer uses), appends records, and on
close writes an index and a fixed trailer. A shard whose writer died has no trailer: a reader
scans it record by record and stops at the first record that is incomplete or damaged (a torn
tail), counting what it skipped. Nothing is pickled; every record is a codec frame (see
``protocols.codec``), decoded with bounds and, where the frame carries one, its checksum verified.

Layout (integers little-endian)::

    file header (16 bytes): magic b"RNLSHARD" | format_version u16 | reserved u16 | reserved u32
    record (repeated):      magic b"RREC" | kind u8 | reserved 3 bytes | length u64 | frame (length bytes)
    trailer (24 bytes):     magic b"RIDX" | reserved u32 | index_offset u64 | magic b"RNLSHEND"

``kind`` 1 is a data record: a frame holding a list of ``EpisodeChunk`` (one sample round, or one
whole episode). ``kind`` 2 is the index record, written once on close: a frame holding
``{"offsets": [...], "steps": [...], "episodes": n, "chunks": n, "meta": {...}}`` over the data
records. ``format_version`` grows when the layout changes; a reader reads every version up to
its own and refuses newer ones with an error naming both.
"""
from __future__ import annotations

import os
import struct
from dataclasses import dataclass, field
from typing import Any, BinaryIO, Iterator

from protocols.codec import Limits, decode, encode
from protocols.episode import EpisodeChunk
from protocols.errors import ProtocolError

FORMAT_VERSION = 1
SUFFIX = ".rshard"
FILE_MAGIC = b"RNLSHARD"
RECORD_MAGIC = b"RREC"
KIND_DATA = 1
KIND_INDEX = 2
_FILE_HEADER = struct.Struct("<8sHHI")
_RECORD = struct.Struct("<4sB3xQ")
_TRAILER = struct.Struct("<4s4xQ8s")
TRAILER_MAGIC = (b"RIDX", b"RNLSHEND")
FILE_HEADER_SIZE = _FILE_HEADER.size
RECORD_HEADER_SIZE = _RECORD.size
TRAILER_SIZE = _TRAILER.size

# Records on disk may be large (a whole Atari episode); the bound only stops a damaged length
# field from asking for absurd memory.
DEFAULT_LIMITS = Limits(max_frame_bytes=1 << 31, max_decoded_bytes=1 << 33)


def file_header() -> bytes:
    return _FILE_HEADER.pack(FILE_MAGIC, FORMAT_VERSION, 0, 0)


def record_header(kind: int, length: int) -> bytes:
    return _RECORD.pack(RECORD_MAGIC, kind, length)


def trailer(index_offset: int) -> bytes:
    return _TRAILER.pack(TRAILER_MAGIC[0], index_offset, TRAILER_MAGIC[1])


@dataclass
class ShardScan:
    """What reading one shard found."""

    path: str
    format_version: int = 0
    complete: bool = False
    """The shard has its index and trailer (its writer closed it)."""
    records: int = 0
    """Data records read intact."""
    damaged_bytes: int = 0
    """Bytes after the last intact record that could not be read (a torn or damaged tail)."""
    damage: str = ""
    """Why reading stopped early ("" when it did not)."""
    damaged_records: int = 0
    """Records whose framing was intact but whose frame failed to decode (checksum, bounds) -- skipped."""
    offsets: list[int] = field(default_factory=list)


class ShardReader:
    """Reads one shard: its records in file order, bounded memory (one record at a time)."""

    def __init__(self, path: str, limits: Limits | None = None) -> None:
        self.path = str(path)
        self.limits = limits or DEFAULT_LIMITS
        self.scan = ShardScan(self.path)
        self._size = os.path.getsize(self.path)
        with open(self.path, "rb") as f:
            head = f.read(FILE_HEADER_SIZE)
            if len(head) < FILE_HEADER_SIZE:
                self.scan.damage = f"file is {len(head)} bytes, shorter than a shard header"
                self.scan.damaged_bytes = len(head)
                self._index = None
                return
            magic, version, _, _ = _FILE_HEADER.unpack(head)
            if magic != FILE_MAGIC:
                raise ProtocolError(f"{self.path} is not a runnel shard (starts with {magic!r}, "
                                    f"expected {FILE_MAGIC!r})")
            if version > FORMAT_VERSION:
                raise ProtocolError(f"{self.path} has shard format version {version}; this runnel reads "
                                    f"versions up to {FORMAT_VERSION}: upgrade runnel to read it")
            self.scan.format_version = version
            self._index = self._read_index(f)

    def _read_index(self, f: BinaryIO) -> dict | None:
        if self._size < FILE_HEADER_SIZE + TRAILER_SIZE:
            return None
        f.seek(self._size - TRAILER_SIZE)
        m1, offset, m2 = _TRAILER.unpack(f.read(TRAILER_SIZE))
        if (m1, m2) != TRAILER_MAGIC or not FILE_HEADER_SIZE <= offset < self._size - TRAILER_SIZE:
            return None
        try:
            kind, frame = self._record_at(f, offset, self._size - TRAILER_SIZE)
            index = decode(frame, limits=self.limits) if kind == KIND_INDEX else None
        except ProtocolError:
            return None  # a damaged index: fall back to scanning the records
        if not isinstance(index, dict) or not isinstance(index.get("offsets"), list):
            return None
        self.scan.complete = True
        return index

    def _record_at(self, f: BinaryIO, offset: int, end: int) -> tuple[int, bytes]:
        f.seek(offset)
        head = f.read(RECORD_HEADER_SIZE)
        if len(head) < RECORD_HEADER_SIZE:
            raise ProtocolError(f"record header at byte {offset} is cut off")
        magic, kind, length = _RECORD.unpack(head)
        if magic != RECORD_MAGIC or kind not in (KIND_DATA, KIND_INDEX):
            raise ProtocolError(f"no record at byte {offset} (found {magic!r}, kind {kind})")
        if length > self.limits.max_frame_bytes or offset + RECORD_HEADER_SIZE + length > end:
            raise ProtocolError(f"record at byte {offset} claims {length} bytes; the file ends first")
        frame = f.read(length)
        if len(frame) < length:
            raise ProtocolError(f"record at byte {offset} is cut off")
        return kind, frame

    @property
    def index(self) -> dict | None:
        """The shard's index (offsets, steps per record, counts, writer meta), or None if it has none."""
        return self._index

    def frames(self) -> Iterator[tuple[int, bytes]]:
        """``(offset, frame)`` of every intact data record, in file order; stops at a damaged tail."""
        if self.scan.format_version == 0:
            return
        end = self._size - TRAILER_SIZE if self._index is not None else self._size
        offsets = self._index["offsets"] if self._index is not None else None
        with open(self.path, "rb") as f:
            if offsets is not None:
                for off in offsets:
                    if not isinstance(off, int):
                        raise ProtocolError(f"{self.path}: index holds a non-integer offset {off!r}")
                    try:
                        kind, frame = self._record_at(f, off, end)
                    except ProtocolError as e:
                        self.scan.damaged_records += 1
                        self.scan.damage = self.scan.damage or str(e)
                        continue
                    self.scan.records += 1
                    yield off, frame
                return
            off = FILE_HEADER_SIZE
            while off < end:
                try:
                    kind, frame = self._record_at(f, off, end)
                except ProtocolError as e:
                    self.scan.damage = str(e)
                    self.scan.damaged_bytes = end - off
                    return
                if kind == KIND_INDEX:  # an index without a valid trailer: the close was cut off
                    self.scan.damaged_bytes = end - off - RECORD_HEADER_SIZE - len(frame)
                    if self.scan.damaged_bytes:
                        self.scan.damage = "shard close was cut off after its index"
                    return
                self.scan.records += 1
                self.scan.offsets.append(off)
                yield off, frame
                off += RECORD_HEADER_SIZE + len(frame)

    def chunks(self) -> Iterator[EpisodeChunk]:
        """Every chunk of every intact record, in file order; damaged records are skipped and counted."""
        for off, frame in self.frames():
            try:
                records = decode_record(frame, self.limits, f"{self.path} at byte {off}")
            except ProtocolError as e:
                self.scan.damaged_records += 1
                self.scan.damage = self.scan.damage or str(e)
                continue
            yield from records


def decode_record(frame: bytes, limits: Limits | None = None, where: str = "record") -> list[EpisodeChunk]:
    """The chunks of one data record's frame."""
    value = decode(frame, limits=limits or DEFAULT_LIMITS)
    if isinstance(value, EpisodeChunk):
        return [value]
    if not isinstance(value, list) or not all(isinstance(c, EpisodeChunk) for c in value):
        raise ProtocolError(f"{where}: a data record must hold episode chunks, got {type(value).__name__}")
    return value


def encode_record(chunks: list[EpisodeChunk]) -> bytes:
    return encode(list(chunks), compress=True)


class ShardWriter:
    """Appends data records to one new shard file; ``close`` adds the index and the trailer.

    Not thread-safe: one writer per shard, used from one thread. The file is created exclusively,
    so two writers can never share it.
    """

    def __init__(self, path: str, meta: dict[str, Any] | None = None) -> None:
        self.path = str(path)
        self.meta = dict(meta or {})
        self._f: BinaryIO | None = open(self.path, "xb")  # noqa: SIM115 -- closed by close()/abort()
        self._f.write(file_header())
        self.size = FILE_HEADER_SIZE
        self.offsets: list[int] = []
        self.steps: list[int] = []
        self.chunks = 0
        self.episodes = 0

    def append(self, frame: bytes | memoryview, steps: int, chunks: int, episodes_done: int) -> int:
        """Writes one data record (a frame of chunks) and returns its offset."""
        if self._f is None:
            raise ValueError(f"shard {self.path} is closed")
        off = self.size
        self._f.write(record_header(KIND_DATA, len(frame)))
        self._f.write(frame)
        self.size += RECORD_HEADER_SIZE + len(frame)
        self.offsets.append(off)
        self.steps.append(int(steps))
        self.chunks += int(chunks)
        self.episodes += int(episodes_done)
        return off

    def flush(self, fsync: bool = False) -> None:
        if self._f is not None:
            self._f.flush()
            if fsync:
                os.fsync(self._f.fileno())

    def close(self, fsync: bool = True) -> None:
        """Writes the index and the trailer, then closes (and fsyncs, by default)."""
        if self._f is None:
            return
        index = encode({"offsets": self.offsets, "steps": self.steps, "chunks": self.chunks,
                        "episodes": self.episodes, "meta": self.meta}, compress=True)
        off = self.size
        self._f.write(record_header(KIND_INDEX, len(index)))
        self._f.write(index)
        self._f.write(trailer(off))
        self.size += RECORD_HEADER_SIZE + len(index) + TRAILER_SIZE
        self.flush(fsync)
        self._f.close()
        self._f = None
        if fsync:
            fsync_dir(os.path.dirname(self.path) or ".")

    @property
    def closed(self) -> bool:
        return self._f is None


def fsync_dir(path: str) -> None:
    """Makes a new file's directory entry durable (POSIX; a no-op where directories cannot be opened)."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)
