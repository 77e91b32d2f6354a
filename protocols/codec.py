"""The wire/disk codec: versioned frames of LZ4-compressed msgpack with out-of-band numpy arrays.

Frame layout (all integers little-endian)::

    header (32 bytes): magic b"RNNL" | version u8 | flags u8 | reserved u16 (0)
                       | meta_len u64 | body_len u64 | raw_len u64
    body (body_len bytes): LZ4 frame of the payload if flags & COMPRESSED, else the payload
    trailer (4 bytes, if flags & CHECKSUM): CRC-32 (zlib's, IEEE polynomial) u32 of header + body
    payload (raw_len bytes): msgpack "meta" (meta_len bytes) | zero padding to 16
                             | array region (each array's bytes, 16-byte aligned)

The msgpack meta is ``[tag, body]`` with tag ``"msg"`` (a plain message), ``"chunk"`` (one
EpisodeChunk as an array of its 15 fields in dataclass order) or ``"chunks"`` (a list of
those). A numpy array in the meta is a small ext-type descriptor (offset and length into the
array region, shape, little-endian dtype string); its bytes never pass through msgpack.

Encoding copies array bytes only into the LZ4 stream (or once into the frame when
``compress=False``); non-contiguous or big-endian arrays are made contiguous little-endian once.
Numpy scalars travel as Python scalars. Dict keys must be ``str``; tuples in plain messages come
back as lists, while nested observations/actions/extras of an EpisodeChunk come back as tuples.

Integrity: ``encode`` appends a CRC-32 of the header and the body (what is stored or sent, after
compression) unless ``checksum=False``; ``decode`` verifies it before reading anything else, so
a frame with a flipped bit raises instead of decoding into wrong numbers. Frames without the
flag (older recordings, senders that leave it out) still decode. CRC-32 over xxhash or CRC-32C:
all three are far faster than LZ4 here (zlib.crc32 7 GB/s, crc32c 33 GB/s, xxh3 88 GB/s on the
2-core dev VM), so the checksum costs a few percent at most, and zlib's needs no dependency in
the light client (``protocols/client.py``) or in the C client (zlib's ``crc32``).

Decoding is zero-copy and bounded: decoded arrays are **read-only views** into the
decompressed payload (or into the input buffer for uncompressed frames) -- copy one with
``np.array(a)`` to modify it or to let the frame's memory go. Frame size, declared and actual
decompressed size, msgpack sizes, nesting depth, array descriptors, dtypes and the EpisodeChunk
schema are all checked; every problem raises :class:`protocols.errors.ProtocolError`.
``decode_chunks`` reads a frame of chunks one chunk at a time, so a receiver refuses the broken
chunks alone and still knows which they were.

This module is the framing (header, LZ4, checksum, bounds); the array descriptors live in
``protocols.codec_arrays`` and what the meta may hold (plain messages, the chunk's wire order)
in ``protocols.codec_values``.
"""
from __future__ import annotations

import struct
import zlib
from dataclasses import dataclass
from typing import Any

import lz4.frame
import msgpack
import numpy as np

from protocols.codec_arrays import ALIGN, MAX_DESCRIPTOR_LEN, ArrayPacker, array_hook
from protocols.codec_values import check_keys, check_plain, chunk_from_list, chunk_to_list
from protocols.episode import EpisodeChunk
from protocols.errors import ProtocolError

MAGIC = b"RNNL"
VERSION = 1
FLAG_COMPRESSED = 0x01
FLAG_CHECKSUM = 0x02
CHECKSUM_SIZE = 4
_CRC = struct.Struct("<I")
_HEADER = struct.Struct("<4sBBHQQQ")
HEADER_SIZE = _HEADER.size  # 32: keeps the payload 16-byte aligned inside a bytes object
_MAX_LZ4_RATIO = 256  # LZ4 cannot inflate more than ~255x: anything claiming more is forged
_SMALL_PAYLOAD = 1 << 18  # below this, join once and compress in one call (less per-call cost)
_INFLATE_PIECEWISE = 1 << 21  # above this, inflate piece by piece into one buffer (see _inflate)
_INFLATE_PIECE = 1 << 19

_MiB = 1 << 20


@dataclass(frozen=True)
class Limits:
    """Bounds for decoding untrusted frames; anything beyond them raises ProtocolError."""

    max_frame_bytes: int = 256 * _MiB
    """Largest frame accepted (header + body, compressed or not)."""
    max_decoded_bytes: int = 1024 * _MiB
    """Largest payload (msgpack + array bytes) after decompression. Checked against the
    header before anything is allocated, then enforced while inflating."""
    max_buffer_size: int = 64 * _MiB
    """Largest msgpack section of the payload (everything but the raw array bytes)."""
    max_str_len: int = 16 * _MiB
    """Longest msgpack string."""
    max_bin_len: int = 64 * _MiB
    """Longest msgpack bytes value (array bytes are out of band and not counted here)."""
    max_array_len: int = 1 << 24
    """Most elements in one msgpack array (list/tuple)."""
    max_map_len: int = 1 << 20
    """Most entries in one msgpack map (dict)."""
    max_depth: int = 32
    """Deepest nesting of dicts/lists/tuples in a message or a chunk's obs/actions/extra."""


DEFAULT_LIMITS = Limits()


def _align(n: int) -> int:
    return (n + ALIGN - 1) & -ALIGN


def encode(obj: Any, *, compress: bool = True, checksum: bool = True) -> bytes:
    """Encode an EpisodeChunk, a list of EpisodeChunks or a plain message into one frame.

    A plain message is built of dicts with str keys, lists, tuples, str, int, float, bool,
    bytes, None and numpy arrays (bool/int/uint/float/complex dtypes, any shape). Raises
    ProtocolError for anything else, and for a chunk that fails ``EpisodeChunk.validate()``.
    """
    packer = ArrayPacker()
    if isinstance(obj, EpisodeChunk):
        meta_obj: Any = ["chunk", chunk_to_list(obj, packer)]
    elif isinstance(obj, list) and obj and all(isinstance(c, EpisodeChunk) for c in obj):
        meta_obj = ["chunks", [chunk_to_list(c, packer) for c in obj]]
    else:
        check_keys(obj, "message")
        meta_obj = ["msg", obj]
    try:
        meta = msgpack.packb(meta_obj, default=packer.default, use_bin_type=True, datetime=False)
    except ProtocolError:
        raise
    except (TypeError, ValueError, OverflowError) as exc:
        raise ProtocolError(f"cannot encode message: {exc}") from exc
    parts: list[Any] = [meta]
    raw_len = len(meta)
    if packer.size:
        data_start = _align(raw_len)
        parts.append(bytes(data_start - raw_len))
        parts.extend(packer.parts)
        raw_len = data_start + packer.size
    flag_crc = FLAG_CHECKSUM if checksum else 0
    if not compress:
        header = _HEADER.pack(MAGIC, VERSION, flag_crc, 0, len(meta), raw_len, raw_len)
        return b"".join([header, *parts, *_trailer(header, parts, checksum)])
    if raw_len <= _SMALL_PAYLOAD:
        body_parts = [lz4.frame.compress(b"".join(parts), store_size=True)]
    else:
        ctx = lz4.frame.create_compression_context()
        body_parts = [lz4.frame.compress_begin(ctx, source_size=raw_len)]
        body_parts.extend(lz4.frame.compress_chunk(ctx, p) for p in parts)
        body_parts.append(lz4.frame.compress_flush(ctx))
    body_len = sum(len(p) for p in body_parts)
    header = _HEADER.pack(MAGIC, VERSION, FLAG_COMPRESSED | flag_crc, 0, len(meta), body_len, raw_len)
    return b"".join([header, *body_parts, *_trailer(header, body_parts, checksum)])


def _trailer(header: bytes, parts: list[Any], checksum: bool) -> list[bytes]:
    if not checksum:
        return []
    crc = zlib.crc32(header)
    for p in parts:
        crc = zlib.crc32(p, crc)
    return [_CRC.pack(crc)]


def verify(data: bytes | bytearray | memoryview) -> bool | None:
    """Whether a frame's checksum matches (None: the frame carries none). Reads the header and
    hashes the bytes; decodes nothing."""
    view = memoryview(data).cast("B") if isinstance(data, memoryview) else memoryview(data)
    if len(view) < HEADER_SIZE:
        raise ProtocolError(f"truncated frame: {len(view)} bytes, shorter than the {HEADER_SIZE}-byte header")
    flags = view[5]
    if not flags & FLAG_CHECKSUM:
        return None
    if len(view) < HEADER_SIZE + CHECKSUM_SIZE:
        return False
    return zlib.crc32(view[:-CHECKSUM_SIZE]) == _CRC.unpack_from(view, len(view) - CHECKSUM_SIZE)[0]


def decode(data: bytes | bytearray | memoryview, *, limits: Limits | None = None) -> Any:
    """Decode one frame made by :func:`encode`; raise ProtocolError for any bad input.

    Returns an EpisodeChunk, a list of them, or the plain message. Arrays are read-only
    zero-copy views into the frame's (decompressed) buffer.
    """
    limits = limits or DEFAULT_LIMITS
    tag, body = _bounded(_decode_meta, data, limits)
    return _bounded(_from_meta, tag, body, limits)


def decode_chunks(data: bytes | bytearray | memoryview, *,
                  limits: Limits | None = None) -> list[EpisodeChunk | ProtocolError]:
    """A frame of episode chunks with each chunk decoded on its own: per chunk, the EpisodeChunk or
    the ProtocolError saying what is wrong with it -- so a receiver refuses just the broken ones.

    Raises ProtocolError when the frame as a whole cannot be read (corrupt, truncated, over the
    limits) or holds no chunks (a plain message).
    """
    limits = limits or DEFAULT_LIMITS
    tag, body = _bounded(_decode_meta, data, limits)
    if tag == "chunk":
        items = [body]
    elif tag == "chunks" and type(body) is list:
        items = body
    else:
        got = f"a {type(body).__name__}" if tag == "chunks" else f"type tag {tag[:40]!r}"
        raise ProtocolError(f"expected a frame of episode chunks (type tag 'chunks' with a list), got {got}")
    return [_one_chunk(item, limits.max_depth) for item in items]


def _one_chunk(item: Any, max_depth: int) -> EpisodeChunk | ProtocolError:
    try:
        return _bounded(chunk_from_list, item, max_depth)
    except ProtocolError as err:
        return err


def _bounded(fn: Any, *args: Any) -> Any:
    """``fn(*args)`` with whatever a bad frame makes it raise turned into ProtocolError."""
    try:
        return fn(*args)
    except ProtocolError:
        raise
    except Exception as exc:  # msgpack, lz4, numpy, unicode, recursion ... all mean a bad frame
        raise ProtocolError(f"malformed frame: {type(exc).__name__}: {exc}") from exc


def _from_meta(tag: str, body: Any, limits: Limits) -> Any:
    if tag == "msg":
        check_plain(body, 0, limits.max_depth, "message")
        return body
    if tag == "chunk":
        return chunk_from_list(body, limits.max_depth)
    if tag == "chunks":
        if type(body) is not list:
            raise ProtocolError(f"'chunks' body must be a list, got {type(body).__name__}")
        return [chunk_from_list(c, limits.max_depth) for c in body]
    raise ProtocolError(f"unknown message type tag {tag[:40]!r}; expected 'msg', 'chunk' or 'chunks'")


def _decode_meta(data: Any, limits: Limits) -> tuple[str, Any]:
    """The frame's checks, inflation and msgpack meta: ``(type tag, body)``, arrays bound to the buffer."""
    if not isinstance(data, (bytes, bytearray, memoryview)):
        raise ProtocolError(f"decode expects bytes, bytearray or memoryview, got {type(data).__name__}")
    if isinstance(data, memoryview) and (data.ndim != 1 or data.format != "B"):
        data = data.cast("B")  # raises (wrapped) for non-contiguous views
    size = len(data)
    if size > limits.max_frame_bytes:
        raise ProtocolError(f"frame of {size} bytes exceeds max_frame_bytes={limits.max_frame_bytes}")
    if size < HEADER_SIZE:
        raise ProtocolError(f"truncated frame: {size} bytes, shorter than the {HEADER_SIZE}-byte header")
    magic, version, flags, reserved, meta_len, body_len, raw_len = _HEADER.unpack_from(data)
    if magic != MAGIC:
        raise ProtocolError(f"not a runnel frame: magic {bytes(magic)!r}, expected {MAGIC!r}")
    if version != VERSION:
        raise ProtocolError(f"unsupported frame version {version}; this side speaks version {VERSION}")
    if flags & ~(FLAG_COMPRESSED | FLAG_CHECKSUM) or reserved:
        raise ProtocolError(f"unknown header flags {flags:#x}/{reserved:#x}")
    trailer = CHECKSUM_SIZE if flags & FLAG_CHECKSUM else 0
    if body_len != size - HEADER_SIZE - trailer:
        what = "truncated frame" if body_len > size - HEADER_SIZE - trailer else "trailing bytes after frame"
        raise ProtocolError(f"{what}: header says {body_len} body bytes, got {size - HEADER_SIZE - trailer}")
    if trailer:
        view = memoryview(data)
        expected = _CRC.unpack_from(view, size - CHECKSUM_SIZE)[0]
        got = zlib.crc32(view[: size - CHECKSUM_SIZE])
        if got != expected:
            raise ProtocolError(f"corrupt frame: checksum mismatch (trailer says {expected:#010x}, the "
                                f"{size - CHECKSUM_SIZE} header and body bytes hash to {got:#010x})")
    if raw_len > limits.max_decoded_bytes:
        raise ProtocolError(f"payload of {raw_len} bytes exceeds max_decoded_bytes={limits.max_decoded_bytes}")
    if not 0 < meta_len <= raw_len:
        raise ProtocolError(f"bad header: meta_len={meta_len}, raw_len={raw_len}")
    if meta_len > limits.max_buffer_size:
        raise ProtocolError(f"msgpack section of {meta_len} bytes exceeds max_buffer_size={limits.max_buffer_size}")
    if flags & FLAG_COMPRESSED:
        if raw_len > _MAX_LZ4_RATIO * body_len + 65536:
            raise ProtocolError(f"{body_len} compressed bytes cannot inflate to the declared {raw_len}")
        buf, base = _inflate(memoryview(data)[HEADER_SIZE : HEADER_SIZE + body_len], raw_len), 0
    else:
        if raw_len != body_len:
            raise ProtocolError(f"uncompressed frame: raw_len={raw_len} != body_len={body_len}")
        buf, base = data, HEADER_SIZE
    data_start = _align(meta_len)
    region_len = max(0, raw_len - data_start)
    meta_view = memoryview(buf)[base : base + meta_len]
    ext_hook = array_hook(buf, base + data_start, region_len)
    n = meta_len
    meta = msgpack.unpackb(
        meta_view, ext_hook=ext_hook, raw=False, strict_map_key=True, use_list=True,
        max_str_len=min(limits.max_str_len, n), max_bin_len=min(limits.max_bin_len, n),
        max_array_len=min(limits.max_array_len, n), max_map_len=min(limits.max_map_len, n // 2),
        max_ext_len=min(MAX_DESCRIPTOR_LEN, n),
    )
    if type(meta) is not list or len(meta) != 2 or type(meta[0]) is not str:
        raise ProtocolError("bad frame meta: expected [type tag, body]")
    return meta[0], meta[1]


def _inflate(body: memoryview, raw_len: int) -> Any:
    """Decompress one LZ4 frame to exactly ``raw_len`` bytes, never allocating more.

    python-lz4 decompresses into a temporary buffer and copies that into the bytes it returns.
    A large payload is therefore inflated piece by piece into one buffer of our own: one big
    allocation instead of two (fresh pages, i.e. page faults, are what large decodes cost).
    """
    ctx = lz4.frame.create_decompression_context()
    if raw_len <= _INFLATE_PIECEWISE:
        payload, read, eof = lz4.frame.decompress_chunk(ctx, body, max_length=raw_len)
        filled = len(payload)
    else:
        payload = np.empty(raw_len, np.uint8)
        out = memoryview(payload)
        read = filled = 0
        eof = False
        while filled < raw_len and not eof:
            piece, n_read, eof = lz4.frame.decompress_chunk(
                ctx, body[read:], max_length=min(_INFLATE_PIECE, raw_len - filled))
            out[filled : filled + len(piece)] = piece
            filled += len(piece)
            read += n_read
            if not (piece or n_read):
                break  # no progress: the input ended
    if not eof:
        if read < len(body):
            raise ProtocolError(f"LZ4 body inflates to more than the declared {raw_len} bytes")
        raise ProtocolError("truncated LZ4 frame: the body ends before the LZ4 end mark")
    if read != len(body):
        raise ProtocolError(f"{len(body) - read} trailing bytes after the LZ4 frame")
    if filled != raw_len:
        raise ProtocolError(f"LZ4 body inflates to {filled} bytes, header declared {raw_len}")
    return payload
