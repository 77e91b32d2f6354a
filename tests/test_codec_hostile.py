"""Codec: hostile input -- wrong types, truncation at every cut, forged headers, oversized frames,
decompression bombs, bad chunk schemas, and fuzzed bytes: every frame decodes or raises ProtocolError."""
from __future__ import annotations

import tracemalloc

import lz4.frame
import msgpack
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from protocols import EpisodeChunk, Limits, ProtocolError, decode, encode
from protocols import codec
from protocols.codec_values import CHUNK_FIELDS
from tests.codec_frames import MiB, SETTINGS, desc, every_dtype_message, make_frame, raises, small_chunk, split_frame
from tests.codec_frames import inflate_mode  # noqa: F401 - the fixture


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
