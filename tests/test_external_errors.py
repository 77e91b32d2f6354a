"""Error replies as EXTERNAL.md promises them: one table of codes (``protocols.external.ERRORS``)
decides ``fatal``; chunks that break section 3's rules are ``bad_chunk`` errors naming their ids (so
a spooling client drops exactly those); a wrong protocol, an oversize batch and an unreadable header
each get their own recognisable reply; a flood of malformed messages ends in a ban, hello or not."""
from __future__ import annotations

import math

import msgpack
import pytest
import zmq

from protocols import external as wire
from protocols.codec import encode
from tests.external_fuzz_bodies import codec_chunk, spec_chunk
from tests.external_fuzz_model import FATAL
from tests.spec_client import Array, SpecClient, frame
from tests.test_external import ids, make_server, server  # noqa: F401 - the server fixture
from tests.test_external_validation import spec  # noqa: F401 - a SpecClient that said hello to the server

GOOD_OBS = [0.01, -0.02, 0.03, 0.04]


def next_reply(spec: SpecClient) -> dict:
    """A reply after the one ``request`` returned (several answer one chunks message)."""
    assert spec.sock.poll(10_000), "no further reply"
    return msgpack.unpackb(spec.sock.recv_multipart()[0], raw=False)


def test_one_table_says_which_codes_are_fatal():
    assert {code for code, e in wire.ERRORS.items() if e.fatal} == FATAL
    assert all(e.means and e.then for e in wire.ERRORS.values())
    table = wire.errors_markdown().splitlines()
    assert len(table) == 2 + len(wire.ERRORS) and all(f"| `{code}` |" in wire.errors_markdown() for code in wire.ERRORS)
    assert wire.error(3, wire.BANNED, "x")["fatal"] is True and wire.error(3, wire.BUSY, "x")["fatal"] is False
    with pytest.raises(KeyError):
        wire.error(3, "no_such_code", "x")


def corrupt(frame_bytes: bytes) -> bytes:
    out = bytearray(frame_bytes)
    out[40] ^= 0xFF
    return bytes(out)


def with_field(fields: list, at: int, value) -> list:
    """A spec chunk's fields with field ``at`` replaced."""
    fields[at] = value
    return fields


BROKEN = {  # name -> body of one chunk with id ["c", 0] that breaks a rule of section 3
    "checksum mismatch": lambda: corrupt(encode([codec_chunk("c", 0)])),
    "not a frame": lambda: b"RNNL" + b"\xff" * 40,
    "T observation rows": lambda: frame("chunks", [with_field(spec_chunk("c", 0), 2, Array([0.0] * 12, [3, 4], "<f4"))]),
    "terminated and truncated": lambda: frame("chunks", [with_field(with_field(spec_chunk("c", 0), 5, True), 6, True)]),
    "14 fields": lambda: frame("chunks", [spec_chunk("c", 0)[:14]]),
    "18 fields": lambda: frame("chunks", [spec_chunk("c", 0) + [None] * 3]),
    "rewards as a plain list": lambda: frame("chunks", [with_field(spec_chunk("c", 0), 4, [1.0, 1.0, 1.0])]),
    "a str t_started": lambda: frame("chunks", [with_field(spec_chunk("c", 0), 9, "0")]),
}


@pytest.mark.parametrize("name", sorted(BROKEN))
def test_a_chunk_breaking_the_rules_is_a_bad_chunk_naming_its_id(server, spec, name):  # noqa: F811
    reply, _ = spec.request({"op": "chunks", "ids": [["c", 0]]}, BROKEN[name]())
    assert reply["code"] == wire.BAD_CHUNK and reply["ids"] == [["c", 0]] and not reply["fatal"]
    assert "'c'" in reply["message"] or "['c', 0]" in reply["message"]
    assert spec.request({"op": "chunks", "ids": [["d", 0]]}, encode([codec_chunk("d", 0)]))[0]["ids"] == [["d", 0]]
    assert ids(server.sample(1)) == [("d", 0)]
    metrics = server.get_metrics()  # counted after the reply went out: read after the next one
    assert metrics["external/num_bad_chunks"]["value"] == 1
    assert metrics["external/num_protocol_errors"]["value"] == 1  # malformed: counts toward a ban


def test_only_the_broken_chunks_of_a_message_are_refused(server, spec):  # noqa: F811
    both = frame("chunks", [spec_chunk("ok", 0), with_field(spec_chunk("broken", 0), 5, 1)])
    reply, _ = spec.request({"op": "chunks", "ids": [["ok", 0], ["broken", 0]]}, both)
    assert reply["op"] == "received" and reply["ids"] == [["ok", 0]]
    refused = next_reply(spec)
    assert refused["code"] == wire.BAD_CHUNK and refused["ids"] == [["broken", 0]] and "terminated" in refused["message"]
    # a body that cannot be read as one chunk per id refuses all of its ids, in one reply
    reply, _ = spec.request({"op": "chunks", "ids": [["a", 0], ["b", 0]]}, frame("chunks", [spec_chunk("a", 0)]))
    assert reply["code"] == wire.BAD_CHUNK and reply["ids"] == [["a", 0], ["b", 0]] and "1 chunk(s) for 2" in reply["message"]
    reply, _ = spec.request({"op": "chunks", "ids": [["nobody", 0]]})  # no body part at all
    assert reply["code"] == wire.BAD_CHUNK and reply["ids"] == [["nobody", 0]]
    # without usable ids there is nothing to name: bad_message
    reply, _ = spec.request({"op": "chunks", "ids": [["", 0]]}, frame("chunks", [spec_chunk("x", 0)]))
    assert reply["code"] == wire.BAD_MESSAGE and "ids" not in reply and "episode id" in reply["message"]
    assert ids(server.sample(1)) == [("ok", 0)]


def test_a_refused_copy_of_a_busy_chunk_lets_the_episode_go_on(tmp_path):
    """The client drops a chunk refused as bad_chunk: its episode's later chunks must not wait for it."""
    srv = make_server(tmp_path, max_pending_steps=1)
    spec = SpecClient(srv.address)
    try:
        spec.hello()

        def send(key: tuple, body: bytes) -> dict:
            return spec.request({"op": "chunks", "ids": [list(key)]}, body)[0]

        assert send(("other", 0), encode([codec_chunk("other", 0)]))["op"] == "received"  # fills the server
        assert send(("ep", 0), encode([codec_chunk("ep", 0)]))["code"] == wire.BUSY
        assert ids(srv.sample(1)) == [("other", 0)]
        assert send(("ep", 1), encode([codec_chunk("ep", 1)]))["code"] == wire.BUSY  # ("ep", 0) comes first
        assert send(("ep", 0), corrupt(encode([codec_chunk("ep", 0)])))["code"] == wire.BAD_CHUNK
        assert send(("ep", 1), encode([codec_chunk("ep", 1)]))["op"] == "received"
    finally:
        spec.close()
        srv.stop()


def test_a_hello_in_another_protocol_or_version_is_refused_for_good(spec):
    hello = {"op": "hello", "protocol": "http", "version": 1, "inference_mode": "remote"}
    reply, _ = spec.request(hello)
    assert reply["code"] == wire.PROTOCOL_MISMATCH and reply["fatal"] and "'http'" in reply["message"]
    reply, _ = spec.request({**hello, "protocol": wire.PROTOCOL, "version": 3})
    assert reply["code"] == wire.VERSION_MISMATCH and reply["fatal"] and "version 3" in reply["message"]
    reply, _ = spec.request({**hello, "protocol": wire.PROTOCOL, "name": 7})
    assert reply["code"] == wire.BAD_MESSAGE and not reply["fatal"] and "'name'" in reply["message"]


def test_a_batched_act_over_max_batch_is_batch_too_large(tmp_path):
    srv = make_server(tmp_path, max_batch=2)
    spec = SpecClient(srv.address)
    try:
        assert spec.hello()["limits"]["max_batch"] == 2
        eids = ["b0", "b1", "b2"]
        for eid in eids:
            assert spec.request({"op": "start", "episode_id": eid})[0]["op"] == "started"
        reply, _ = spec.request({"op": "act", "episode_ids": eids, "obs": [GOOD_OBS] * 3})
        assert reply["code"] == wire.BATCH_TOO_LARGE and not reply["fatal"] and reply["limit"] == 2
        assert "3 episode_ids" in reply["message"] and "max_batch = 2" in reply["message"]
        reply, _ = spec.request({"op": "act", "episode_ids": eids[:2], "obs": [GOOD_OBS] * 2})
        assert reply["op"] == "action" and len(reply["action"]) == 2
    finally:
        spec.close()
        srv.stop()


def test_errors_to_unreadable_headers_have_id_0_and_say_unparsed(spec):
    for raw in (b"\xc1garbage", msgpack.packb([1, 2]), msgpack.packb({"op": "ping", "id": -1}),
                msgpack.packb({"op": 5, "id": 9})):
        spec.sock.send_multipart([raw])
        reply = next_reply(spec)
        assert reply["code"] == wire.BAD_MESSAGE and reply["id"] == 0 and reply["unparsed"] is True
    reply, _ = spec.request({"op": "launch", "id": 5})  # readable: its id is echoed, nothing marked
    assert reply["code"] == wire.BAD_MESSAGE and "unparsed" not in reply and "'launch'" in reply["message"]
    reply, _ = spec.request({"op": "act", "episode_id": "e", "obs": GOOD_OBS, "explore": "yes"})
    assert reply["code"] == wire.BAD_MESSAGE and "'explore'" in reply["message"]
    reply, _ = spec.request({"op": "act", "episode_id": "e", "episode_ids": ["e"], "obs": GOOD_OBS})
    assert reply["code"] == wire.BAD_MESSAGE and "not both" in reply["message"]


def test_floods_of_malformed_messages_are_banned_with_or_without_hello(tmp_path):
    srv = make_server(tmp_path, max_protocol_errors=3)
    ctx = zmq.Context()
    socks = [ctx.socket(zmq.DEALER) for _ in range(3)]
    hello = msgpack.packb({"op": "hello", "id": 1, "protocol": wire.PROTOCOL, "version": 1, "inference_mode": ""})
    garbage = [b"\xc1"]
    chunk = [msgpack.packb({"op": "chunks", "id": 2, "ids": [["z", 0]]}), b"not a frame"]

    def answers(sock, parts, n: int) -> list[str]:
        sock.send_multipart(parts)
        out = []
        for _ in range(n):
            assert sock.poll(10_000)
            reply = msgpack.unpackb(sock.recv_multipart()[0], raw=False)
            out.append(reply.get("code", reply["op"]))
        return out

    try:
        stranger, hello_then_garbage, rehello = socks
        for s in socks:
            s.linger = 0
            s.connect(srv.address)
        assert [answers(stranger, garbage, 1) for _ in range(3)] == [["bad_message"]] * 3
        assert answers(stranger, garbage, 2) == ["bad_message", "banned"]  # the 4th is one too many
        assert answers(hello_then_garbage, [hello], 1) == ["welcome"]
        assert [answers(hello_then_garbage, chunk, 1) for _ in range(3)] == [["bad_chunk"]] * 3
        assert answers(hello_then_garbage, chunk, 2) == ["bad_chunk", "banned"]
        # saying hello again does not wipe the count
        assert answers(rehello, garbage, 1) + answers(rehello, garbage, 1) == ["bad_message"] * 2
        assert answers(rehello, [hello], 1) == ["welcome"]
        assert answers(rehello, garbage, 1) == ["bad_message"]
        assert answers(rehello, garbage, 2) == ["bad_message", "banned"]
        for s in socks:  # ignored from now on
            s.send_multipart([msgpack.packb({"op": "ping", "id": 3})])
        assert not any(s.poll(300) for s in socks)
        assert srv.get_metrics()["external/num_banned"]["value"] == 3 and srv.error is None
    finally:
        for s in socks:
            s.close()
        ctx.term()
        srv.stop()


def test_a_nan_in_a_chunk_is_a_value_not_a_malformed_message(server, spec):  # noqa: F811
    fields = spec_chunk("v", 0)
    fields[4].values[1] = math.nan
    reply, _ = spec.request({"op": "chunks", "ids": [["v", 0]]}, frame("chunks", [fields]))
    assert reply["code"] == wire.BAD_CHUNK and reply["field"] == "rewards" and reply["ids"] == [["v", 0]]
    assert spec.request({"op": "ping"})[0]["op"] == "pong"  # the count (if any) is done by now
    assert server.get_metrics()["external/num_protocol_errors"]["value"] == 0  # refused, but no step toward a ban


def test_the_spec_holds_the_servers_error_table():
    """EXTERNAL.md's table is rendered from the same table the server takes ``fatal`` from."""
    from pathlib import Path

    spec = (Path(__file__).resolve().parents[1] / "protocols" / "EXTERNAL.md").read_text()
    assert wire.errors_markdown() in spec


def test_a_failing_forward_pass_gets_server_error_and_serving_goes_on(tmp_path):
    """Defence in depth: whatever makes inference raise, the batch's requests are answered with
    ``server_error`` and the server thread serves on."""
    server = make_server(tmp_path)
    spec = SpecClient(server.address)
    forward, calls = server.policy.forward, []

    def failing_once(*args, **kwargs):
        calls.append(1)
        if len(calls) == 1:
            raise FloatingPointError("a forward pass that breaks")
        return forward(*args, **kwargs)

    server.policy.forward = failing_once
    try:
        spec.hello()
        spec.request({"op": "start", "episode_id": "e"})
        reply, _ = spec.request({"op": "act", "episode_id": "e", "obs": [0.0] * 4})
        assert reply["op"] == "error" and reply["code"] == wire.SERVER_ERROR and not reply["fatal"]
        assert "FloatingPointError" in reply["message"]
        assert spec.act("e", [0.0] * 4)[0] in (0, 1)  # the same episode, served again
        assert server.error is None
        assert server.get_metrics()["external/num_server_errors"]["value"] == 1
    finally:
        spec.close()
        server.stop()
