"""Numpy arrays in a codec frame: msgpack ext-type descriptors pointing into an aligned array region.

Apart from the framing (``protocols.codec``) because it is the one place that knows an array's
descriptor layout and the allowed dtypes: ``ArrayPacker`` writes descriptors while msgpack packs,
``array_hook`` turns them back into read-only views while msgpack unpacks.
"""
from __future__ import annotations

import functools
import math
import struct
from typing import Any

import msgpack
import numpy as np

from protocols.episode import EpisodeChunk
from protocols.errors import ProtocolError

ALIGN = 16
"""Alignment of the array region in the payload and of each array in it."""
_EXT_ARRAY = 1  # msgpack ext type of an array descriptor
_DESC_HEAD = 17  # descriptor: offset u64 (into the array region), nbytes u64, ndim u8, ...
_MAX_NDIM = 32
MAX_DESCRIPTOR_LEN = _DESC_HEAD + 8 * _MAX_NDIM + 16
"""Longest ext value a decoder accepts: the head, the most dimensions and a dtype string."""

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
_ZEROS = memoryview(bytes(ALIGN))
_new_ext = functools.partial(tuple.__new__, msgpack.ExtType)
# ... then shape u64 * ndim, then the dtype string (b"<f4")
_DESC_STRUCTS = [struct.Struct(f"<QQB{ndim}Q") for ndim in range(_MAX_NDIM + 1)]


class ArrayPacker:
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
            offset = (size + ALIGN - 1) & -ALIGN
            if offset != size:
                self.parts.append(_ZEROS[: offset - size])
            self.parts.append(arr)  # the buffer itself: no copy until LZ4/the final join
            self.size = offset + nbytes
        ndim = arr.ndim
        if ndim > _MAX_NDIM:
            raise ProtocolError(f"cannot encode an array with {ndim} > {_MAX_NDIM} dimensions")
        desc = _DESC_STRUCTS[ndim].pack(offset, nbytes, ndim, *arr.shape) + dtype_tail
        return _new_ext((_EXT_ARRAY, desc))  # msgpack.ExtType without its Python-level checks


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


def array_hook(buf: Any, start: int, region_len: int):
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
