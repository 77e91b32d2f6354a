"""A client of the external-client protocol written from ``protocols/EXTERNAL.md`` alone.

It imports nothing of runnel (only pyzmq, msgpack and the standard library), and so proves the
specification is enough to write a client in another language: frames are built and parsed with
``struct`` as section 3 describes.
"""
from __future__ import annotations

import itertools
import struct
from typing import Any

import msgpack
import zmq

HEADER = struct.Struct("<4sBBHQQQ")
FORMATS = {"<f4": "f", "<f8": "d", "<i8": "q", "<i4": "i", "|b1": "?", "|u1": "B"}


def _align(n: int) -> int:
    return (n + 15) // 16 * 16


def frame(tag: str, value: Any) -> bytes:
    """A codec frame (uncompressed) of ``value``, where ``Array`` objects become ext-type-1 descriptors."""
    region = bytearray()

    def default(obj: Any) -> Any:
        if isinstance(obj, Array):
            offset = _align(len(region))
            region.extend(bytes(offset - len(region)))
            data = struct.pack(f"<{len(obj.values)}{FORMATS[obj.dtype]}", *obj.values)
            region.extend(data)
            desc = struct.pack(f"<QQB{len(obj.shape)}Q", offset, len(data), len(obj.shape), *obj.shape)
            return msgpack.ExtType(1, desc + obj.dtype.encode("ascii"))
        raise TypeError(f"cannot pack {type(obj).__name__}")

    meta = msgpack.packb([tag, value], default=default, use_bin_type=True)
    payload = meta + bytes(_align(len(meta)) - len(meta)) + bytes(region)
    return HEADER.pack(b"RNNL", 1, 0, 0, len(meta), len(payload), len(payload)) + payload


def parse(data: bytes) -> Any:
    """A codec frame's value (uncompressed frames; arrays come back as ``Array``)."""
    magic, version, flags, _, meta_len, body_len, raw_len = HEADER.unpack_from(data)
    assert magic == b"RNNL" and version == 1 and flags == 0, (magic, version, flags)
    payload = data[HEADER.size:HEADER.size + body_len]
    region = payload[_align(meta_len):]

    def ext_hook(code: int, desc: bytes) -> Any:
        offset, nbytes, ndim = struct.unpack_from("<QQB", desc)
        shape = struct.unpack_from(f"<{ndim}Q", desc, 17)
        dtype = desc[17 + 8 * ndim:].decode("ascii")
        count = 1
        for d in shape:
            count *= d
        values = struct.unpack_from(f"<{count}{FORMATS[dtype]}", region, offset)
        return Array(list(values), list(shape), dtype)

    tag, value = msgpack.unpackb(payload[:meta_len], ext_hook=ext_hook, raw=False)
    return value


class Array:
    def __init__(self, values: list, shape: list[int], dtype: str) -> None:
        self.values, self.shape, self.dtype = values, shape, dtype


class SpecClient:
    """Remote inference only, one episode at a time; enough to play and upload CartPole episodes."""

    def __init__(self, address: str, curve: tuple[bytes, bytes, bytes] | None = None) -> None:
        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.DEALER)
        self.sock.linger = 0
        if curve is not None:
            self.sock.curve_serverkey, self.sock.curve_publickey, self.sock.curve_secretkey = curve
        self.sock.connect(address)
        self.ids = itertools.count(1)
        self.unasked: list[dict] = []  # committed messages and other id-0 messages

    def request(self, header: dict, body: bytes | None = None, timeout_ms: int = 10_000) -> tuple[dict, list]:
        rid = next(self.ids)
        header = {**header, "id": rid}
        self.sock.send_multipart([msgpack.packb(header)] + ([body] if body is not None else []))
        while True:
            if not self.sock.poll(timeout_ms):
                raise TimeoutError(f"no reply to {header['op']}")
            parts = self.sock.recv_multipart()
            reply = msgpack.unpackb(parts[0], raw=False)
            if reply["id"] == rid:
                return reply, parts[1:]
            self.unasked.append(reply)

    def hello(self) -> dict:
        reply, _ = self.request({"op": "hello", "protocol": "runnel-external", "version": 1,
                                 "inference_mode": "remote", "name": "spec-client"})
        return reply

    def act(self, episode_id: str, obs: list[float]) -> tuple[int, float, list[float], int]:
        reply, _ = self.request({"op": "act", "episode_id": episode_id, "obs": obs})
        assert reply["op"] == "action", reply
        return int(reply["action"]), float(reply["logp"]), reply["dist"], reply["weights_version"]

    def act_with_frame(self, episode_id: str, obs: list[float]) -> dict:
        """The same request with the observation in a body frame (how large observations travel)."""
        reply, _ = self.request({"op": "act", "episode_id": episode_id},
                                frame("msg", {"obs": Array(obs, [len(obs)], "<f4")}))
        return reply

    def send_chunk(self, episode_id: str, index: int, obs: list[list[float]], actions: list[int],
                   rewards: list[float], logps: list[float], dists: list[list[float]], terminated: bool,
                   t_started: int, version: int) -> dict:
        steps = len(actions)
        chunk = [episode_id, index, Array([x for row in obs for x in row], [steps + 1, len(obs[0])], "<f4"),
                 Array(actions, [steps], "<i8"), Array(rewards, [steps], "<f4"), terminated, False,
                 {"action_logp": Array(logps, [steps], "<f4"),
                  "action_dist_inputs": Array([x for row in dists for x in row], [steps, len(dists[0])], "<f4")},
                 [], t_started, version, 0, 0, None, None]
        reply, _ = self.request({"op": "chunks", "ids": [[episode_id, index]]}, frame("chunks", [chunk]))
        return reply

    def wait_committed(self, key: list, timeout_ms: int = 30_000) -> bool:
        while True:
            if any(m["op"] == "committed" and key in m["ids"] for m in self.unasked):
                return True
            if not self.sock.poll(timeout_ms):
                return False
            self.unasked.append(msgpack.unpackb(self.sock.recv_multipart()[0], raw=False))

    def close(self) -> None:
        self.sock.send_multipart([msgpack.packb({"op": "bye", "id": 0})])
        self.sock.close()
        self.ctx.term()
