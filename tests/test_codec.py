"""Codec: exact round trips (property-based), zero-copy decoding, checksums, encode errors (hostile input:
``test_codec_hostile.py``; shared helpers: ``codec_frames.py``)."""
from __future__ import annotations

from dataclasses import replace

import gymnasium as gym
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from protocols import EpisodeBuilder, EpisodeChunk, ProtocolError, decode, encode
from protocols import codec
from tests.codec_frames import DTYPES, SETTINGS, assert_same, assert_same_chunk, every_dtype_message, leaves, small_chunk
from tests.codec_frames import inflate_mode  # noqa: F401 - the fixture

try:
    from test_spaces import nested_spaces
except ImportError:  # tests/ imported as a package
    from tests.test_spaces import nested_spaces


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
