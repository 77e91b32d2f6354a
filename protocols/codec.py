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
"""
from __future__ import annotations

import dataclasses
import functools
import math
import struct
import zlib
from dataclasses import dataclass
from typing import Any

import lz4.frame
import msgpack
import numpy as np

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
_ALIGN = 16
_EXT_ARRAY = 1  # msgpack ext type of an array descriptor
_DESC_HEAD = 17  # descriptor: offset u64 (into the array region), nbytes u64, ndim u8, ...
_MAX_NDIM = 32
_MAX_LZ4_RATIO = 256  # LZ4 cannot inflate more than ~255x: anything claiming more is forged
_SMALL_PAYLOAD = 1 << 18  # below this, join once and compress in one call (less per-call cost)
_INFLATE_PIECEWISE = 1 << 21  # above this, inflate piece by piece into one buffer (see _inflate)
_INFLATE_PIECE = 1 << 19

_MiB = 1 << 20

# Allowed dtypes: bool, ints, uints, floats, complex -- never object/str/void/datetime.
_TYPES = (np.bool_, np.int8, np.int16, np.int32, np.int64, np.uint8, np.uint16, np.uint32,
          np.uint64, np.float16, np.float32, np.float64, np.complex64, np.complex128)
_DECODE_DTYPES = {np.dtype(t).newbyteorder("<").str: np.dtype(t).newbyteorder("<") for t in _TYPES}
_DECODE_DTYPES_B = {k.encode("ascii"): v for k, v in _DECODE_DTYPES.items()}
_ENCODE_DTYPES = {}  # dtype -> (little-endian dtype to convert to or None, its str as bytes)
for _t in _TYPES:
    _le = np.dtype(_t).newbyteorder("<")
    _ENCODE_DTYPES[np.dtype(_t).newbyteorder(">")] = (_le, _le.str.encode("ascii"))
    _ENCODE_DTYPES[_le] = (None, _le.str.encode("ascii"))
_ZEROS = memoryview(bytes(_ALIGN))
_new_ext = functools.partial(tuple.__new__, msgpack.ExtType)
# ... then shape u64 * ndim, then the dtype string (b"<f4")
_DESC_STRUCTS = [struct.Struct(f"<QQB{ndim}Q") for ndim in range(_MAX_NDIM + 1)]

# An EpisodeChunk travels as a msgpack array of its fields in this (wire) order.
_CHUNK_FIELDS = ("episode_id", "chunk_index", "obs", "actions", "rewards", "terminated",
                 "truncated", "extra", "infos", "t_started", "weights_version",
                 "env_runner_index", "env_index", "agent_id", "module_id")
if _CHUNK_FIELDS != tuple(f.name for f in dataclasses.fields(EpisodeChunk)):
    raise ImportError("EpisodeChunk's fields changed: update the codec's wire order and VERSION")
_N_FIELDS = len(_CHUNK_FIELDS)


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
    return (n + _ALIGN - 1) & -_ALIGN


class _Packer:
    """Collects out-of-band array bytes while msgpack walks the object (``default`` hook)."""

    __slots__ = ("parts", "size")

    def __init__(self) -> None:
        self.parts: list[Any] = []
        self.size = 0

    def default(self, obj: Any) -> Any:
        if isinstance(obj, np.ndarray):
            return self.array(obj)
        if isinstance(obj, np.generic) and obj.dtype.kind in "biuf":
            return obj.item()
        if isinstance(obj, int):
            raise ProtocolError(f"integer {obj} does not fit in 64 bits")
        if isinstance(obj, EpisodeChunk):
            raise ProtocolError("an EpisodeChunk can only be encoded at the top level, "
                                "alone or in a list of chunks")
        raise ProtocolError(f"cannot encode {type(obj).__name__}: supported are dict (str keys), "
                            "list, tuple, str, int, float, bool, bytes, None and numpy arrays")

    def array(self, arr: np.ndarray) -> msgpack.ExtType:
        found = _ENCODE_DTYPES.get(arr.dtype)
        if found is None:
            raise ProtocolError(f"cannot encode an array of dtype {arr.dtype}: only bool, "
                                "int, uint, float and complex arrays travel (no object dtypes)")
        convert, dtype_tail = found
        if convert is not None:  # big-endian
            arr = arr.astype(convert)
        if not arr.flags.c_contiguous:
            arr = np.ascontiguousarray(arr)
        nbytes = arr.nbytes
        offset = 0  # empty arrays take no room
        if nbytes:
            size = self.size
            offset = (size + _ALIGN - 1) & -_ALIGN
            if offset != size:
                self.parts.append(_ZEROS[: offset - size])
            self.parts.append(arr)  # the buffer itself: no copy until LZ4/the final join
            self.size = offset + nbytes
        ndim = arr.ndim
        if ndim > _MAX_NDIM:
            raise ProtocolError(f"cannot encode an array with {ndim} > {_MAX_NDIM} dimensions")
        desc = _DESC_STRUCTS[ndim].pack(offset, nbytes, ndim, *arr.shape) + dtype_tail
        return _new_ext((_EXT_ARRAY, desc))  # msgpack.ExtType without its Python-level checks


_CONTAINERS = (dict, list, tuple)


def _check_keys(obj: Any, where: str, depth: int = 0) -> Any:
    """Encode side: dict keys must be str (msgpack would pack others; receivers refuse them)."""
    if isinstance(obj, dict):
        for key in obj:
            if not isinstance(key, str):
                raise ProtocolError(f"{where}: dict keys must be str, got {key!r:.60}")
        items: Any = obj.values()
    elif isinstance(obj, (list, tuple)):
        items = obj
    else:
        return obj
    if depth >= 500:  # msgpack's own limit is 511
        raise ProtocolError(f"{where}: nested too deeply to encode")
    for item in items:
        if isinstance(item, _CONTAINERS):
            _check_keys(item, where, depth + 1)
    return obj


def _chunk_to_list(chunk: EpisodeChunk, packer: _Packer) -> list[Any]:
    chunk.validate()
    f = chunk.__dict__
    obs, actions, extra, infos = f["obs"], f["actions"], f["extra"], f["infos"]
    # bare arrays (the common case) skip msgpack's default hook; the rest must have str keys
    obs = packer.array(obs) if type(obs) is np.ndarray else _check_keys(obs, "chunk obs")
    if type(actions) is np.ndarray:
        actions = packer.array(actions)
    else:
        _check_keys(actions, "chunk actions")
    _check_keys(extra, "chunk extra")
    if infos:
        _check_keys(infos, "chunk infos")
    return [f["episode_id"], f["chunk_index"], obs, actions, packer.array(f["rewards"]),
            f["terminated"], f["truncated"], extra, infos, f["t_started"], f["weights_version"],
            f["env_runner_index"], f["env_index"], f["agent_id"], f["module_id"]]


def encode(obj: Any, *, compress: bool = True, checksum: bool = True) -> bytes:
    """Encode an EpisodeChunk, a list of EpisodeChunks or a plain message into one frame.

    A plain message is built of dicts with str keys, lists, tuples, str, int, float, bool,
    bytes, None and numpy arrays (bool/int/uint/float/complex dtypes, any shape). Raises
    ProtocolError for anything else, and for a chunk that fails ``EpisodeChunk.validate()``.
    """
    packer = _Packer()
    if isinstance(obj, EpisodeChunk):
        meta_obj: Any = ["chunk", _chunk_to_list(obj, packer)]
    elif isinstance(obj, list) and obj and all(isinstance(c, EpisodeChunk) for c in obj):
        meta_obj = ["chunks", [_chunk_to_list(c, packer) for c in obj]]
    else:
        _check_keys(obj, "message")
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
    try:
        return _decode(data, limits or DEFAULT_LIMITS)
    except ProtocolError:
        raise
    except Exception as exc:  # msgpack, lz4, numpy, unicode, recursion ... all mean a bad frame
        raise ProtocolError(f"malformed frame: {type(exc).__name__}: {exc}") from exc


def _decode(data: Any, limits: Limits) -> Any:
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
    ext_hook = _array_hook(buf, base + data_start, region_len)
    n = meta_len
    meta = msgpack.unpackb(
        meta_view, ext_hook=ext_hook, raw=False, strict_map_key=True, use_list=True,
        max_str_len=min(limits.max_str_len, n), max_bin_len=min(limits.max_bin_len, n),
        max_array_len=min(limits.max_array_len, n), max_map_len=min(limits.max_map_len, n // 2),
        max_ext_len=min(_DESC_HEAD + 8 * _MAX_NDIM + 16, n),
    )
    if type(meta) is not list or len(meta) != 2 or type(meta[0]) is not str:
        raise ProtocolError("bad frame meta: expected [type tag, body]")
    tag, body = meta
    if tag == "msg":
        _check_plain(body, 0, limits.max_depth, "message")
        return body
    if tag == "chunk":
        return _chunk_from_list(body, limits)
    if tag == "chunks":
        if type(body) is not list:
            raise ProtocolError(f"'chunks' body must be a list, got {type(body).__name__}")
        return [_chunk_from_list(c, limits) for c in body]
    raise ProtocolError(f"unknown message type tag {tag[:40]!r}; expected 'msg', 'chunk' or 'chunks'")


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


def _bad_descriptor(code: int, desc: bytes) -> ProtocolError:
    if code != _EXT_ARRAY:
        return ProtocolError(f"unknown msgpack ext type {code}")
    if len(desc) <= _DESC_HEAD:
        return ProtocolError("truncated array descriptor")
    ndim = desc[_DESC_HEAD - 1]
    if ndim > _MAX_NDIM or len(desc) <= _DESC_HEAD + 8 * ndim:
        return ProtocolError(f"bad array descriptor (ndim={ndim}, {len(desc)} bytes)")
    return ProtocolError(f"array dtype {desc[_DESC_HEAD + 8 * ndim:][:16]!r} is not allowed; "
                         f"allowed: {sorted(_DECODE_DTYPES)}")


def _array_hook(buf: Any, start: int, region_len: int):
    """msgpack ext_hook: descriptor -> read-only np.frombuffer view of the array region."""
    writable = not memoryview(buf).readonly
    dtypes, structs, frombuffer, prod = _DECODE_DTYPES_B, _DESC_STRUCTS, np.frombuffer, math.prod

    def hook(code: int, desc: bytes) -> np.ndarray:  # hot: literals are _DESC_HEAD etc.
        size = len(desc)
        ndim = desc[16] if size > 17 else 255
        end = 17 + 8 * ndim
        dtype = dtypes.get(desc[end:]) if code == 1 and ndim <= 32 and size > end else None
        if dtype is None:
            raise _bad_descriptor(code, desc)
        offset, nbytes, _, *shape = structs[ndim].unpack_from(desc)
        count = shape[0] if ndim == 1 else prod(shape)
        if count * dtype.itemsize != nbytes:
            raise ProtocolError(f"array descriptor says {nbytes} bytes for shape {shape} of {dtype}")
        if offset + nbytes > region_len:
            raise ProtocolError(f"array [{offset}, {offset + nbytes}) is outside the "
                                f"{region_len}-byte array region")
        if not nbytes:
            arr = np.empty(shape, dtype)
            arr.flags.writeable = False
            return arr
        arr = frombuffer(buf, dtype, count, start + offset)
        if ndim != 1:
            arr = arr.reshape(shape)
        if writable:  # a bytearray/writable memoryview input: still hand out read-only views
            arr.flags.writeable = False
        return arr

    return hook


_LEAVES = frozenset({str, int, float, bool, bytes, type(None), np.ndarray})


def _check_plain(obj: Any, depth: int, max_depth: int, where: str) -> None:
    """Only the plain types, str dict keys, bounded depth (msgpack made the rest)."""
    t = type(obj)
    if t is dict:
        items = obj.values()
        for key in obj:
            if type(key) is not str:
                raise ProtocolError(f"{where}: dict keys must be str, got {type(key).__name__}")
    elif t is list:
        items = obj
    elif t in _LEAVES:
        return
    else:
        raise ProtocolError(f"{where}: unsupported value of type {t.__name__}")
    if depth >= max_depth:
        raise ProtocolError(f"{where}: nested deeper than max_depth={max_depth}")
    for item in items:
        if type(item) in _LEAVES:
            continue
        _check_plain(item, depth + 1, max_depth, where)


def _structure(obj: Any, depth: int, max_depth: int, where: str) -> Any:
    """A nested obs/action structure: dicts (str keys) and tuples of arrays; lists -> tuples."""
    t = type(obj)
    if t is np.ndarray:
        return obj
    if depth >= max_depth:
        raise ProtocolError(f"{where}: nested deeper than max_depth={max_depth}")
    if t is list:
        return tuple(_structure(v, depth + 1, max_depth, where) for v in obj)
    if t is dict:
        for key in obj:
            if type(key) is not str:
                raise ProtocolError(f"{where}: dict keys must be str, got {type(key).__name__}")
        return {k: _structure(v, depth + 1, max_depth, where) for k, v in obj.items()}
    raise ProtocolError(f"{where} must hold numpy arrays in dicts/tuples, got {t.__name__}")


def _chunk_from_list(v: Any, limits: Limits) -> EpisodeChunk:
    if type(v) is not list or len(v) != _N_FIELDS:
        got = f"{len(v)} fields" if type(v) is list else type(v).__name__
        raise ProtocolError(f"an episode chunk must be an array of {_N_FIELDS} fields, got {got}")
    (episode_id, chunk_index, obs, actions, rewards, terminated, truncated, extra, infos,
     t_started, weights_version, env_runner_index, env_index, agent_id, module_id) = v
    if type(terminated) is not bool or type(truncated) is not bool:
        raise ProtocolError(f"chunk terminated/truncated must be bools, got {terminated!r:.20}/{truncated!r:.20}")
    if agent_id is not None and type(agent_id) is not str:
        raise ProtocolError(f"chunk agent_id must be a str or None, got {type(agent_id).__name__}")
    if module_id is not None and type(module_id) is not str:
        raise ProtocolError(f"chunk module_id must be a str or None, got {type(module_id).__name__}")
    if type(rewards) is not np.ndarray or rewards.dtype.kind != "f":
        raise ProtocolError(f"chunk rewards must be a float array, got {type(rewards).__name__}")
    depth = limits.max_depth
    if type(obs) is not np.ndarray:
        obs = _structure(obs, 0, depth, "chunk obs")
    if type(actions) is not np.ndarray:
        actions = _structure(actions, 0, depth, "chunk actions")
    if type(extra) is not dict:
        raise ProtocolError(f"chunk extra must be a map, got {type(extra).__name__}")
    extra = _structure(extra, 0, depth, "chunk extra")
    if type(infos) is not list or any(type(i) is not dict for i in infos):
        raise ProtocolError("chunk infos must be a list of dicts")
    if infos:
        _check_plain(infos, 0, depth, "chunk infos")
    # validate() checks ids, the int fields (msgpack gives exact ints), flags and row counts
    return EpisodeChunk(episode_id, chunk_index, obs, actions, rewards, terminated, truncated,
                        extra, infos, t_started, weights_version, env_runner_index, env_index,
                        agent_id, module_id).validate()
