"""Codec: exact round trips (property-based), zero-copy decoding, and hostile input."""
from __future__ import annotations

import math
import struct
import tracemalloc
from dataclasses import replace

import gymnasium as gym
import lz4.frame
import msgpack
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from protocols import EpisodeBuilder, EpisodeChunk, Limits, ProtocolError, decode, encode
from protocols import codec
from protocols.codec_values import CHUNK_FIELDS

try:
    from test_spaces import nested_spaces
except ImportError:  # tests/ imported as a package
    from tests.test_spaces import nested_spaces

SETTINGS = dict(deadline=None, derandomize=True,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
DTYPES = ["bool", "int8", "int16", "int32", "int64", "uint8", "uint16", "uint32", "uint64",
          "float16", "float32", "float64", "complex64", "complex128"]
MiB = 1 << 20


# ----------------------------------------------------------------------------- helpers

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


# ----------------------------------------------------------------------------- round trips

@settings(max_examples=60, **SETTINGS)
@given(obs_space=nested_spaces(), act_space=nested_spaces(), steps=st.integers(1, 25),
       seed=st.integers(0, 2**31 - 1), end=st.sampled_from(["none", "terminated", "truncated"]),
       record_infos=st.booleans(), compress=st.booleans(), split=st.integers(1, 10),
       ids=st.sampled_from([(None, None), ("agent_0", "policy_1")]))
def test_chunk_round_trip_random_spaces(obs_space, act_space, steps, seed, end, record_infos,
                                        compress, split, ids):
    round_trip_episode(obs_space, act_space, steps, seed, end, record_infos, compress, split, ids)


@pytest.mark.parametrize("compress", [True, False])
def test_chunk_round_trip_single_step_nested(compress):
    S = gym.spaces
    obs_space = S.Dict({"a": S.Tuple([S.Box(-1, 1, (2, 3)), S.Discrete(4, start=2)]),
                        "b": S.MultiBinary([2, 2]), "c": S.Box(0, 255, (), np.uint8)})
    act_space = S.Tuple([S.MultiDiscrete([3, 5]), S.Dict({"x": S.Box(-2, 2, (1,), np.float64)})])
    for split in (1, 3):
        round_trip_episode(obs_space, act_space, 1, 7, "terminated", True, compress, split, ("a", "m"))
        round_trip_episode(obs_space, act_space, 3, 8, "none", False, compress, split, (None, None))


def round_trip_episode(obs_space, act_space, steps, seed, end, record_infos, compress, split, ids):
    obs_space.seed(seed)
    act_space.seed(seed + 1)
    rng = np.random.default_rng(seed)
    b = EpisodeBuilder(env_runner_index=seed % 5, env_index=seed % 3, weights_version=seed % 1000,
                       record_infos=record_infos)
    b.add_reset(obs_space.sample(), {"seed": seed, "name": "reset"})
    for t in range(steps):
        last = t == steps - 1
        b.add_step(act_space.sample(), float(rng.normal()), obs_space.sample(),
                   terminated=last and end == "terminated", truncated=last and end == "truncated",
                   info={"t": t, "x": [1.5, None, "s", True], "a": np.arange(t % 3), "b": b"\x00"},
                   extra={"action_logp": np.float32(rng.normal()), "vf_preds": rng.normal(),
                          "state": (rng.normal(size=2).astype(np.float32), {"c": np.int16(t)})})
    chunk = replace(b.cut(), t_started=seed % 77, chunk_index=seed % 4, agent_id=ids[0], module_id=ids[1])
    assert_same_chunk(decode(encode(chunk, compress=compress)), chunk)
    parts = chunk.split(split)
    out = decode(encode(parts, compress=compress))
    assert isinstance(out, list) and len(out) == len(parts)
    for got, want in zip(out, parts):
        assert_same_chunk(got, want)
    assert_same_chunk(EpisodeChunk.concat(out), chunk)


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


@pytest.mark.parametrize("compress", [True, False])
def test_plain_message_round_trip_every_dtype(compress, inflate_mode):
    msg = every_dtype_message()
    out = decode(encode(msg, compress=compress))
    assert_same(out, msg)
    assert out["float32"]["0d"].shape == () and out["int64"]["empty"].shape == (0, 3)
    assert out["float64"]["big_endian"].dtype == np.dtype("<f8")
    assert type(out["nested"]["tuple"]) is list and out["scalars"]["np"] == [7, 0.5, True, 2**64 - 1]


json_like = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**63), 2**64 - 1) | st.floats(allow_nan=False)
    | st.text(max_size=8) | st.binary(max_size=8)
    | hnp.arrays(st.sampled_from(DTYPES), hnp.array_shapes(min_dims=0, max_dims=3, min_side=0, max_side=4)),
    lambda children: st.lists(children, max_size=4) | st.tuples(children, children)
    | st.dictionaries(st.text(max_size=5), children, max_size=4),
    max_leaves=12,
)


@settings(max_examples=150, **SETTINGS)
@given(msg=st.dictionaries(st.text(max_size=5), json_like, max_size=5), compress=st.booleans())
def test_plain_message_round_trip_property(msg, compress):
    out = decode(encode(msg, compress=compress))
    assert_same(out, msg)


def _root(a: np.ndarray):
    while isinstance(a, np.ndarray) and a.base is not None:
        a = a.base
    return a


@pytest.fixture(params=["one_go", "piecewise"])
def inflate_mode(request, monkeypatch):
    """Large payloads are inflated piece by piece: force that path on small frames too."""
    if request.param == "piecewise":
        monkeypatch.setattr(codec, "_INFLATE_PIECEWISE", 1000)
        monkeypatch.setattr(codec, "_INFLATE_PIECE", 333)
    return request.param


@pytest.mark.parametrize("compress", [True, False])
def test_decode_is_zero_copy_and_read_only(compress, inflate_mode):
    chunks = [small_chunk(300), small_chunk(20)]
    frame = encode(chunks, compress=compress)
    raw_len = codec._HEADER.unpack_from(frame)[6]
    out = decode(frame)
    arrays = [a for c in out for a in leaves(c) if a.size]
    for a in arrays:
        assert not a.flags.owndata and not a.flags.writeable and a.flags.aligned
        with pytest.raises(ValueError):
            a.flat[0] = 1
    roots = {id(_root(a)) for a in arrays}
    assert len(roots) == 1, "all arrays of a frame view one buffer"
    root = _root(arrays[0])
    if compress:                                    # the one decompressed payload
        assert isinstance(root, (bytes, np.ndarray)) and len(root) == raw_len
    else:
        assert root is frame                        # views into the very bytes that arrived
    # a writable input buffer still gives read-only views that alias it
    data = bytearray(encode(chunks, compress=False))
    lo = np.frombuffer(data, np.uint8).ctypes.data
    for a in (x for c in decode(memoryview(data)) for x in leaves(c) if x.size):
        assert not a.flags.writeable and lo <= a.ctypes.data < lo + len(data)


def test_compressed_frames_are_smaller_and_flagged():
    chunk = small_chunk(200)
    packed, plain = encode(chunk), encode(chunk, compress=False)
    assert packed[:4] == plain[:4] == b"RNNL" and packed[4] == plain[4] == 1
    assert packed[5] == codec.FLAG_COMPRESSED | codec.FLAG_CHECKSUM and plain[5] == codec.FLAG_CHECKSUM
    assert encode(chunk, checksum=False)[5] == codec.FLAG_COMPRESSED and encode(chunk, compress=False, checksum=False)[5] == 0
    assert len(packed) < len(plain)


# --- checksums ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("compress", [True, False])
def test_any_flipped_byte_of_a_checksummed_frame_is_caught(compress):
    frame = encode([small_chunk(40), small_chunk(7)], compress=compress)
    assert codec.verify(frame) is True
    rng = np.random.default_rng(0)
    positions = sorted({*range(codec.HEADER_SIZE + 8), *rng.integers(0, len(frame), 300).tolist(),
                        *range(len(frame) - 8, len(frame))})
    for pos in positions:
        bad = bytearray(frame)
        bad[pos] ^= 1 << int(rng.integers(0, 8))
        assert codec.verify(bytes(bad)) in (False, None)  # None: the flag bit itself was cleared
        with pytest.raises(ProtocolError):
            decode(bytes(bad))


def test_checksum_mismatch_names_itself_and_frames_without_one_still_decode():
    chunk = small_chunk(30)
    frame = bytearray(encode(chunk, compress=False))
    frame[codec.HEADER_SIZE + 100] ^= 0xFF  # an array byte: without the checksum, a silently wrong number
    with pytest.raises(ProtocolError, match="corrupt frame: checksum mismatch"):
        decode(bytes(frame))
    for compress in (True, False):
        old = encode(chunk, compress=compress, checksum=False)  # as every frame was before checksums
        assert codec.verify(old) is None
        assert encode(decode(old), compress=compress, checksum=False) == old


def test_checksummed_frames_keep_the_bounds():
    frame = encode({"a": np.zeros(10_000, np.float32)})
    with pytest.raises(ProtocolError, match="max_frame_bytes"):
        decode(frame, limits=codec.Limits(max_frame_bytes=100))
    with pytest.raises(ProtocolError, match="trailing bytes"):
        decode(frame + b"x")
    with pytest.raises(ProtocolError, match="truncated"):
        decode(frame[:-1])


# ----------------------------------------------------------------------------- encode errors

@pytest.mark.parametrize("value, message", [
    (np.array([object()], dtype=object), "dtype object"),
    (np.array(["a"]), "dtype <U1"),
    (np.zeros(2, dtype=[("a", "<f4")]), "dtype"),
    (np.zeros(2, dtype="datetime64[s]"), "dtype datetime64"),
    ({1, 2}, "cannot encode set"),
    (np.complex64(1j), "cannot encode complex64"),
    (2**70, "does not fit in 64 bits"),
    (-(2**63) - 1, "does not fit in 64 bits"),
    ({"x": small_chunk()}, "top level"),
    ({1: "a"}, "keys must be str"),
    ({"a": [{"b": {2: 0}}]}, "keys must be str"),
])
def test_encode_rejects_unsupported_values(value, message):
    with pytest.raises(ProtocolError, match=message):
        encode({"v": value})


def test_encode_rejects_invalid_chunks():
    with pytest.raises(ProtocolError, match="obs must have 6 rows"):
        encode(small_chunk(5, obs={"pos": np.zeros((5, 3), np.float32)}))
    with pytest.raises(ProtocolError, match="keys must be str"):
        encode(small_chunk(5, infos=[{0: 1}] * 6))
    with pytest.raises(ProtocolError, match="dtype object"):
        encode([small_chunk(), small_chunk(5, rewards=np.zeros(5, object))])


# ----------------------------------------------------------------------------- hostile input

@pytest.mark.parametrize("data", ["text", None, 123, [b"RNNL"], np.zeros(40, np.uint8)])
def test_wrong_input_type(data):
    raises(data, "expects bytes")


def test_empty_and_truncated_header():
    raises(b"", "truncated frame: 0 bytes")
    frame = encode(small_chunk())
    for cut in range(codec.HEADER_SIZE):
        raises(frame[:cut], "truncated frame")


@pytest.mark.parametrize("compress", [True, False])
def test_truncated_body_at_every_cut(compress):
    frame = encode(small_chunk(20), compress=compress)
    for cut in range(codec.HEADER_SIZE, len(frame)):
        raises(frame[:cut], "truncated frame")
        raises(memoryview(frame)[:cut], "truncated frame")
    raises(frame + b"\x00", "trailing bytes")


def test_truncated_lz4_body_with_consistent_header(inflate_mode):
    """The header agrees with the cut body: LZ4 itself must notice the missing end."""
    frame = encode(small_chunk(200))
    body = frame[codec.HEADER_SIZE:]
    _, _, _, _, meta_len, _, raw_len = codec._HEADER.unpack_from(frame)
    for cut in [*range(0, len(body), 7), len(body) - 1]:
        forged = make_frame(b"", compress=False, flags=1, meta_len=meta_len, raw_len=raw_len,
                            body_len=cut)[: codec.HEADER_SIZE] + body[:cut]
        message = raises(forged)
        assert "LZ4" in message or "cannot inflate" in message, message
    trailing = make_frame(b"", flags=1, meta_len=meta_len, raw_len=raw_len, body_len=len(body) + 3)
    raises(trailing[: codec.HEADER_SIZE] + body + b"abc", "trailing bytes after the LZ4 frame")


def test_wrong_magic_version_flags_and_lengths():
    frame = encode(small_chunk())
    raises(b"XXXX" + frame[4:], "not a runnel frame")
    raises(frame[:4] + bytes([2]) + frame[5:], "unsupported frame version 2")
    raises(frame[:5] + bytes([0x81]) + frame[6:], "unknown header flags")
    meta = ["msg", {"a": 1}]
    assert decode(make_frame(meta)) == {"a": 1}
    raises(make_frame(meta, reserved=1), "unknown header flags")
    raises(make_frame(meta, meta_len=0), "bad header")
    raises(make_frame(meta, meta_len=100), "bad header")
    raises(make_frame(meta, raw_len=20), "raw_len=20 != body_len=9")
    raises(make_frame(meta, compress=True, raw_len=10**9), "cannot inflate to the declared")
    raises(make_frame(["msg", {"a": "x" * 100}], compress=True, meta_len=10, raw_len=20),
           "inflates to more than the declared 20")
    raises(make_frame(meta + [1], compress=True, meta_len=3), "malformed frame")
    raises(make_frame(b"\xc1"), "malformed frame")                     # reserved msgpack byte


def test_oversized_frames():
    frame = encode({"a": np.zeros(4096, np.uint8)}, compress=False)
    raises(frame, "exceeds max_frame_bytes=4000", max_frame_bytes=4000)
    raises(frame, "exceeds max_decoded_bytes=4000", max_decoded_bytes=4000)
    raises(frame, "exceeds max_buffer_size=8", max_buffer_size=8)
    assert decode(frame, limits=Limits(max_frame_bytes=len(frame)))["a"].shape == (4096,)


def _zeros_lz4(total: int, piece: int = 4 * MiB) -> bytes:
    ctx = lz4.frame.create_compression_context()
    zeros = bytes(piece)
    parts = [lz4.frame.compress_begin(ctx)]
    parts += [lz4.frame.compress_chunk(ctx, zeros) for _ in range(total // piece)]
    parts.append(lz4.frame.compress_flush(ctx))
    return b"".join(parts)


def _peak_bytes(fn) -> int:
    tracemalloc.start()
    try:
        try:
            fn()
        except ProtocolError:
            pass
        return tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()


def test_decompression_bomb_is_refused_without_allocating_it():
    body = _zeros_lz4(256 * MiB)                  # ~1 MiB that inflates to 256 MiB
    assert len(body) < 1.5 * MiB
    limits = dict(max_decoded_bytes=64 * MiB)
    # honest about its size: refused from the header alone
    honest = make_frame(b"", flags=1, meta_len=1, raw_len=256 * MiB, body_len=len(body))[:32] + body
    raises(honest, "exceeds max_decoded_bytes", **limits)
    assert _peak_bytes(lambda: decode(honest, limits=Limits(**limits))) < 1 * MiB
    # lying about its size: inflation stops at the claimed 8 MiB
    liar = make_frame(b"", flags=1, meta_len=1, raw_len=8 * MiB, body_len=len(body))[:32] + body
    raises(liar, "inflates to more than the declared", **limits)
    assert _peak_bytes(lambda: decode(liar, limits=Limits(**limits))) < 20 * MiB
    # sanity: the measurement sees what decoding does allocate
    big = encode({"a": np.zeros(16 * MiB, np.uint8)})
    assert len(big) < 1 * MiB and _peak_bytes(lambda: decode(big)) >= 16 * MiB


def chunk_meta():
    meta, region = split_frame(encode(small_chunk(5), compress=False))
    return meta, region


def setf(meta, **fields):
    for name, value in fields.items():
        meta[1][CHUNK_FIELDS.index(name)] = value


@pytest.mark.parametrize("change, message", [
    (lambda m: setf(m, obs=desc(0, 20 * 4, (5, 4), b"<f4")), "obs must have 6 rows"),
    (lambda m: setf(m, obs={"pos": desc(0, 5 * 4, (5,), b"<f4")}), "obs must have 6 rows"),
    (lambda m: setf(m, actions=desc(0, 4, (1,), b"<f4")), "actions must have 5 rows"),
    (lambda m: setf(m, rewards=desc(0, 40, (5,), b"<i8")), "rewards must be a float array"),
    (lambda m: setf(m, rewards=[1.0] * 5), "rewards must be a float array"),
    (lambda m: setf(m, obs=desc(1 << 40, 24, (6,), b"<f4")), "outside the"),
    (lambda m: setf(m, obs=desc(0, 10**9, (6,), b"<f4")), "says 1000000000 bytes"),
    (lambda m: setf(m, obs=desc(0, 48, (6,), b"|O")), "dtype b'|O' is not allowed"),
    (lambda m: setf(m, obs=desc(0, 48, (6,), b"<U2")), "not allowed"),
    (lambda m: setf(m, obs=desc(0, 48, (6,), b"V8")), "not allowed"),
    (lambda m: setf(m, obs=desc(0, 48, (6,), b"(2,)<f4")), "not allowed"),
    (lambda m: setf(m, obs=msgpack.ExtType(1, b"\x00" * 10)), "truncated array descriptor"),
    (lambda m: setf(m, obs=msgpack.ExtType(1, b"\x00" * 16 + b"\x28" + b"\x00" * 20)), "ndim=40"),
    (lambda m: setf(m, obs=msgpack.ExtType(7, b"abc")), "unknown msgpack ext type 7"),
    (lambda m: setf(m, obs=[desc(0, 0, (6, 0), b"<f4"), "x"]), "got str"),
    (lambda m: setf(m, obs={"a": {"b": 1}}), "got int"),
    (lambda m: m[1].pop(), "array of 15 to 17 fields, got 14 fields"),
    (lambda m: m[1].append(1), "look_back must be an array or absent, got int"),
    (lambda m: m[1].extend([None, 1]), "state_in must be an array or absent, got int"),
    (lambda m: m[1].extend([None, None, None]), "array of 15 to 17 fields, got 18 fields"),
    (lambda m: setf(m, terminated=1), "terminated/truncated must be bools"),
    (lambda m: setf(m, terminated=True, truncated=True), "both"),
    (lambda m: setf(m, chunk_index=-1), "chunk_index"),
    (lambda m: setf(m, chunk_index=1.0), "chunk_index"),
    (lambda m: setf(m, episode_id=5), "episode_id"),
    (lambda m: setf(m, agent_id=5), "agent_id must be a str or None"),
    (lambda m: setf(m, extra=[1]), "extra must be a map"),
    (lambda m: setf(m, infos={}), "infos must be a list of dicts"),
    (lambda m: setf(m, infos=[1] * 6), "infos must be a list of dicts"),
    (lambda m: setf(m, infos=[{"a": msgpack.Timestamp(1)}] * 6), "unsupported value of type Timestamp"),
    (lambda m: m.__setitem__(0, "chunkz"), "unknown message type tag 'chunkz'"),
    (lambda m: m.__setitem__(0, 7), "expected \\[type tag, body\\]"),
    (lambda m: m.append(1), "expected \\[type tag, body\\]"),
    (lambda m: m.__setitem__(1, {"obs": 1}), "must be an array of 15 to 17 fields, got dict"),
    (lambda m: m.__setitem__(slice(0, 2), ["chunks", {"a": 1}]), "'chunks' body must be a list"),
    (lambda m: m.__setitem__(0, "chunks"), "an episode chunk must be an array of 15 to 17 fields, got str"),
])
def test_bad_chunk_schema(change, message):
    meta, region = chunk_meta()
    change(meta)
    for compress in (False, True):
        raises(make_frame(meta, region, compress=compress), message)


def test_bad_plain_messages():
    raises(make_frame(["msg", {"a": msgpack.Timestamp(1)}]), "unsupported value of type Timestamp")
    raises(make_frame(["msg", {b"k": 1}]), "dict keys must be str")
    raises(make_frame(b"\x92\xa3msg\x81\x01\x02"), "malformed frame")          # int map key
    raises(make_frame(b"\x92\xa3msg\xa2\xff\xfe"), "malformed frame")          # bad utf-8
    deep = {"a": 1}
    for _ in range(40):
        deep = {"d": deep}
    frame = encode(deep)
    raises(frame, "nested deeper than max_depth=32")
    assert decode(frame, limits=Limits(max_depth=64)) == deep
    raises(encode({"l": list(range(100))}), "malformed frame", max_array_len=50)
    raises(encode({"s": "x" * 100}), "malformed frame", max_str_len=50)
    raises(encode({"b": b"x" * 100}), "malformed frame", max_bin_len=50)
    raises(encode({str(i): i for i in range(100)}), "malformed frame", max_map_len=50)
    raises(make_frame(b"\x92\xa3msg" + b"\x91" * 2000 + b"\xc0"), "malformed frame")     # msgpack stack limit


def _assert_valid_or_protocol_error(data: bytes) -> None:
    try:
        out = decode(data)
    except ProtocolError as exc:
        assert str(exc)
        return
    if isinstance(out, EpisodeChunk):
        out.validate()
    elif isinstance(out, list) and out and isinstance(out[0], EpisodeChunk):
        for c in out:
            c.validate()


VALID_FRAMES = [encode(small_chunk(8)), encode(small_chunk(8), compress=False),
                encode([small_chunk(3), small_chunk(2)]), encode(every_dtype_message(), compress=False),
                encode({"a": [1, 2.5, "x"], "b": np.arange(6).reshape(2, 3)})]


@settings(max_examples=400, **SETTINGS)
@given(data=st.data(), which=st.integers(0, len(VALID_FRAMES) - 1), piecewise=st.booleans())
def test_fuzz_flipped_bytes(data, which, piecewise):
    frame = bytearray(VALID_FRAMES[which])
    for _ in range(data.draw(st.integers(1, 4))):
        frame[data.draw(st.integers(0, len(frame) - 1))] = data.draw(st.integers(0, 255))
    with pytest.MonkeyPatch.context() as mp:
        if piecewise:
            mp.setattr(codec, "_INFLATE_PIECEWISE", 100)
            mp.setattr(codec, "_INFLATE_PIECE", 64)
        _assert_valid_or_protocol_error(bytes(frame))


@settings(max_examples=200, **SETTINGS)
@given(noise=st.binary(max_size=300), keep=st.integers(0, 64), which=st.integers(0, len(VALID_FRAMES) - 1))
def test_fuzz_garbage(noise, keep, which):
    _assert_valid_or_protocol_error(noise)
    _assert_valid_or_protocol_error(VALID_FRAMES[which][:keep] + noise)   # a real header, then garbage
