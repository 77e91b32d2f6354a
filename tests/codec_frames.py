"""What the codec tests share: frames taken apart and forged by hand from the documented layout, a small
chunk, deep equality for decoded values, a message of every dtype, and the fixture that forces piecewise
inflation on small frames (``test_codec.py``: round trips and encoding; ``test_codec_hostile.py``: hostile input)."""
from __future__ import annotations

import math
import struct
from dataclasses import replace

import lz4.frame
import msgpack
import numpy as np
import pytest
from hypothesis import HealthCheck

from protocols import EpisodeBuilder, EpisodeChunk, Limits, ProtocolError, decode
from protocols import codec

SETTINGS = dict(deadline=None, derandomize=True,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
DTYPES = ["bool", "int8", "int16", "int32", "int64", "uint8", "uint16", "uint32", "uint64",
          "float16", "float32", "float64", "complex64", "complex128"]
MiB = 1 << 20


def assert_same(got, want, *, chunk_structure: bool = False, path: str = "") -> None:
    """Deep equality: arrays bit-exact with dtype and shape; dicts stay dicts; in chunk
    structures tuples stay tuples, in plain messages tuples may come back as lists."""
    if isinstance(want, np.ndarray):
        assert isinstance(got, np.ndarray), path
        assert got.dtype == want.dtype.newbyteorder("<") or got.dtype == want.dtype, path
        assert got.shape == want.shape, path
        assert got.tobytes() == np.ascontiguousarray(want.astype(got.dtype)).tobytes(), path
    elif isinstance(want, dict):
        assert type(got) is dict and list(got) == list(want), path
        for k in want:
            assert_same(got[k], want[k], chunk_structure=chunk_structure, path=f"{path}.{k}")
    elif isinstance(want, (list, tuple)):
        expected_type = tuple if chunk_structure and isinstance(want, tuple) else (list, tuple)
        assert isinstance(got, expected_type) and len(got) == len(want), path
        for i, (g, w) in enumerate(zip(got, want)):
            assert_same(g, w, chunk_structure=chunk_structure, path=f"{path}[{i}]")
    elif isinstance(want, np.generic):
        assert type(got) is type(want.item()) and got == want.item(), path
    elif isinstance(want, float) and math.isnan(want):
        assert isinstance(got, float) and math.isnan(got), path
    else:
        assert type(got) is type(want) and got == want, path


def assert_same_chunk(got: EpisodeChunk, want: EpisodeChunk) -> None:
    assert isinstance(got, EpisodeChunk)
    for name in ("obs", "actions", "extra"):
        assert_same(getattr(got, name), getattr(want, name), chunk_structure=True, path=name)
    assert_same(got.rewards, want.rewards, path="rewards")
    assert_same(got.infos, want.infos, path="infos")
    for name in ("episode_id", "chunk_index", "terminated", "truncated", "t_started",
                 "weights_version", "env_runner_index", "env_index", "agent_id", "module_id"):
        assert getattr(got, name) == getattr(want, name) and type(getattr(got, name)) is type(getattr(want, name)), name


def leaves(obj):
    if isinstance(obj, EpisodeChunk):
        yield from leaves([obj.obs, obj.actions, obj.rewards, obj.extra, obj.infos])
    elif isinstance(obj, dict):
        for v in obj.values():
            yield from leaves(v)
    elif isinstance(obj, (list, tuple)):
        for v in obj:
            yield from leaves(v)
    elif isinstance(obj, np.ndarray):
        yield obj


def split_frame(frame: bytes):
    """(header fields, msgpack meta with ExtTypes kept, array region) of a valid frame."""
    magic, version, flags, reserved, meta_len, body_len, raw_len = codec._HEADER.unpack_from(frame)
    payload = frame[codec.HEADER_SIZE:]
    if flags & codec.FLAG_COMPRESSED:
        payload = lz4.frame.decompress(payload)
    meta = msgpack.unpackb(payload[:meta_len], raw=False)
    return meta, payload[codec._align(meta_len):]


def make_frame(meta, region: bytes = b"", *, compress: bool = False, magic: bytes = b"RNNL",
               version: int = 1, flags: int | None = None, reserved: int = 0,
               meta_len: int | None = None, raw_len: int | None = None, body_len: int | None = None) -> bytes:
    """Build a frame by hand from the documented layout (any field can be forged)."""
    packed = meta if isinstance(meta, bytes) else msgpack.packb(meta, use_bin_type=True)
    payload = packed + bytes(codec._align(len(packed)) - len(packed)) + region if region else packed
    body = lz4.frame.compress(payload) if compress else payload
    header = struct.pack("<4sBBHQQQ", magic, version, int(compress) if flags is None else flags, reserved,
                         len(packed) if meta_len is None else meta_len,
                         len(body) if body_len is None else body_len,
                         len(payload) if raw_len is None else raw_len)
    return header + body


def desc(offset: int, nbytes: int, shape: tuple, dtype: bytes) -> msgpack.ExtType:
    return msgpack.ExtType(1, struct.pack("<QQB", offset, nbytes, len(shape))
                           + struct.pack(f"<{len(shape)}Q", *shape) + dtype)


def small_chunk(steps: int = 5, **changes) -> EpisodeChunk:
    b = EpisodeBuilder(record_infos=True)
    b.add_reset({"pos": np.zeros(3, np.float32), "img": np.zeros((2, 2), np.uint8)}, {"start": 1})
    for t in range(1, steps + 1):
        b.add_step(np.int64(t % 2), 1.0, {"pos": np.full(3, t, np.float32), "img": np.full((2, 2), t % 256, np.uint8)},
                   terminated=t == steps, info={"t": t}, extra={"action_logp": np.float32(-t)})
    return replace(b.cut(), **changes)


def raises(data, match: str | None = None, **limits):
    with pytest.raises(ProtocolError, match=match) as info:
        decode(data, limits=Limits(**limits) if limits else None)
    return str(info.value)


def every_dtype_message() -> dict:
    rng = np.random.default_rng(1)
    msg = {}
    for name in DTYPES:
        dt = np.dtype(name)
        values = rng.integers(0, 100, (3, 4)).astype(dt)
        msg[name] = {"2d": values, "0d": values[1, 2, ...], "empty": np.zeros((0, 3), dt),
                     "empty2": np.zeros((2, 0, 5), dt), "strided": values[:, ::2],
                     "fortran": np.asfortranarray(values), "big_endian": values.astype(dt.newbyteorder(">"))}
    msg["scalars"] = {"s": "héllo ✓", "i": -(2**63), "u": 2**64 - 1, "f": 1.5, "inf": math.inf,
                      "nan": math.nan, "t": True, "f0": False, "none": None, "b": b"\x00\xff",
                      "np": [np.int32(7), np.float32(0.5), np.bool_(True), np.uint64(2**64 - 1)]}
    msg["nested"] = {"list": [1, [2, [3, {"x": ()}]]], "tuple": (1, "a", (2.0,)), "empty": {}}
    return msg


@pytest.fixture(params=["one_go", "piecewise"])
def inflate_mode(request, monkeypatch):
    """Large payloads are inflated piece by piece: force that path on small frames too."""
    if request.param == "piecewise":
        monkeypatch.setattr(codec, "_INFLATE_PIECEWISE", 1000)
        monkeypatch.setattr(codec, "_INFLATE_PIECE", 333)
    return request.param
