"""Act and chunks messages for fuzzing the policy server (``tests/test_external_fuzz.py``): observations
and actions in headers and in bodies, batched acts, and chunks as EXTERNAL.md section 3 lays them out,
each valid or with one thing wrong, with the replies the spec promises (the model and the other ops:
``tests/external_fuzz_model.py``).
"""
from __future__ import annotations

import math
from typing import Any, Callable

import numpy as np
from hypothesis import strategies as st

from protocols import external as wire
from protocols.codec import encode
from protocols.episode import EpisodeChunk
from tests.external_fuzz_model import (BAD_EIDS, FRAGMENT, INTS, JUNK, MAX_BATCH, NEGATIVE, NONFINITE, OBS, TEXT, Conn,
                                       Reply, Step, err, extra_field, field_error, how)
from tests.spec_client import Array, frame


# --- act: one episode (header or body), batched ------------------------------------------------------
def _episode(data: st.DataObject, c: Conn) -> str:
    if c.episodes and data.draw(st.integers(0, 3), label="open episode") > 0:
        return data.draw(st.sampled_from(c.episodes))
    return c.eid()


def _action_check(given: Any = None) -> Callable[[dict, list], None]:
    def check(r: dict, _: list) -> None:
        assert r["action"] in (0, 1) and (given is None or r["action"] == given)
        assert r["logp"] <= 0 and len(r["dist"]) == 2 and r["weights_version"] == 0

    return check


def gen_act(data: st.DataObject, c: Conn) -> Step:
    eid = _episode(data, c)
    h: dict[str, Any] = {"op": "act", "id": c.rid(), "episode_id": eid, "obs": list(OBS)}
    way = how(data, "valid", "extra field", "explore", "missing", "wrong type", "bad id", "both ids", "no obs",
              "obs length", "obs type", "obs nonfinite", "action", "action out of range", "action type")
    if way in ("missing", "wrong type"):
        return field_error(data, c, h, way)
    header_error = {"bad id": "episode id", "both ids": "not both", "no obs": "part"}.get(way)
    if way == "bad id":
        h["episode_id"] = data.draw(BAD_EIDS)
    elif way == "both ids":
        h["episode_ids"] = [eid]
    elif way == "no obs":
        del h["obs"]
    if header_error is not None:
        return c.step(f"act: {way}", h, [err(wire.BAD_MESSAGE, mentions=header_error)])
    reply = Reply(wire.ACTION, check=_action_check())
    if way == "extra field":
        extra_field(data, h)
    elif way == "explore":
        h["explore"] = data.draw(st.booleans())
    elif way == "obs length":
        h["obs"] = [0.5] * data.draw(st.integers(0, 300).filter(lambda n: n != 4))
        reply = err(wire.BAD_OBSERVATION)
    elif way == "obs type":
        h["obs"] = data.draw(st.one_of(TEXT, st.binary(max_size=8), st.none(), st.dictionaries(TEXT, INTS, max_size=2),
                                       st.lists(TEXT, min_size=4, max_size=4), st.just([[1.0, 2.0]] * 4)))
        reply = err(wire.BAD_OBSERVATION)
    elif way == "obs nonfinite":
        h["obs"][data.draw(st.integers(0, 3))] = data.draw(NONFINITE)
        reply = err(wire.BAD_VALUE, episode_id=eid, field="obs")
    elif way == "action":
        h["action"] = data.draw(st.sampled_from([0, 1, 0.0, 1.0]))
        reply = Reply(wire.ACTION, check=_action_check(int(h["action"])))
    elif way == "action out of range":
        h["action"] = data.draw(st.sampled_from([2, 7, -1, 1 << 40, 0.5, math.nan, math.inf]))
        reply = err(wire.BAD_VALUE, episode_id=eid, field="action")
    elif way == "action type":
        h["action"] = data.draw(st.one_of(TEXT, st.just([0, 1]), st.just([]), st.dictionaries(TEXT, INTS, max_size=2)))
        reply = err(wire.BAD_OBSERVATION)
    if c.hello and eid not in c.episodes:
        reply = err(wire.UNKNOWN_EPISODE, mentions=repr(eid))
    return c.step(f"act: {way}", h, c.needs_hello([reply]))


def gen_act_body(data: st.DataObject, c: Conn) -> Step:
    eid = _episode(data, c)
    h: dict[str, Any] = {"op": "act", "id": c.rid(), "episode_id": eid}
    obs = np.array(OBS, np.float32)
    body = encode({"obs": obs}, compress=data.draw(st.booleans()))
    way = how(data, "valid", "spec frame", "garbage", "truncated", "corrupt", "not a map", "no obs", "obs shape",
              "obs nonfinite", "action out of range", "obs in the header too", "no body", "extra part")
    parts = [body]
    reply = Reply(wire.ACTION, check=_action_check())
    body_error = way in ("garbage", "truncated", "corrupt", "not a map", "no obs")
    if way == "spec frame":
        parts = [frame("msg", {"obs": Array(OBS, [4], "<f4")})]
    elif way == "garbage":
        parts = [b"XX" + data.draw(st.binary(max_size=64))]
    elif way == "truncated":
        parts = [body[:data.draw(st.integers(0, len(body) - 1))]]
    elif way == "corrupt":
        parts = [_flip(data, body)]
    elif way == "not a map":
        parts = [encode(data.draw(st.lists(INTS, max_size=3)))]
    elif way == "no obs":
        parts = [encode({"action": 1})]
    elif way == "obs shape":
        parts = [encode({"obs": np.zeros(data.draw(st.integers(0, 9).filter(lambda n: n != 4)), np.float32)})]
        reply = err(wire.BAD_OBSERVATION)
    elif way == "obs nonfinite":
        obs[data.draw(st.integers(0, 3))] = data.draw(NONFINITE)
        parts = [encode({"obs": obs})]
        reply = err(wire.BAD_VALUE, episode_id=eid, field="obs")
    elif way == "action out of range":
        parts = [encode({"obs": obs, "action": data.draw(st.sampled_from([2, -3, 0.25]))})]
        reply = err(wire.BAD_VALUE, episode_id=eid, field="action")
    elif way in ("obs in the header too", "no body", "extra part"):
        if way == "obs in the header too":
            h["obs"] = list(OBS)
        parts = {"no body": [], "extra part": [body, b"x"]}.get(way, parts)
        return c.step(f"act body: {way}", h, [err(wire.BAD_MESSAGE, mentions="part")], *parts)
    if body_error:
        reply = err(wire.BAD_MESSAGE)  # the body is read before the episode is looked up
    elif c.hello and eid not in c.episodes:
        reply = err(wire.UNKNOWN_EPISODE)
    return c.step(f"act body: {way}", h, c.needs_hello([reply]), *parts)


def gen_act_batch(data: st.DataObject, c: Conn) -> Step:
    known = bool(c.episodes) and data.draw(st.booleans())
    k = data.draw(st.integers(1, MAX_BATCH))
    eids = [data.draw(st.sampled_from(c.episodes)) if known else c.eid() for _ in range(k)]
    obs = [list(OBS) for _ in range(k)]
    h: dict[str, Any] = {"op": "act", "id": c.rid(), "episode_ids": eids, "obs": obs}
    way = how(data, "valid", "too large", "obs count", "empty", "bad id", "not a list", "obs nonfinite", "obs shape",
              "actions", "actions count", "action out of range")
    i = data.draw(st.integers(0, k - 1))

    def actions(given: list) -> Callable[[dict, list], None]:
        def check(r: dict, _: list) -> None:
            assert len(r["action"]) == len(r["logp"]) == len(r["dist"]) == k
            assert all(a in (0, 1) and (g is None or a == g) for a, g in zip(r["action"], given))

        return check

    reply = Reply(wire.ACTION, check=actions([None] * k))
    if way == "not a list":
        h["episode_ids"] = data.draw(JUNK[list])
        return c.step("batched act: not a list", h, [err(wire.BAD_MESSAGE, mentions="'episode_ids'")])
    if way == "too large":
        n = MAX_BATCH + data.draw(st.integers(1, 3))
        h["episode_ids"], h["obs"] = [c.eid() for _ in range(n)], [list(OBS) for _ in range(n)]
        return c.step("batched act: too large", h, c.needs_hello([err(wire.BATCH_TOO_LARGE, mentions=str(MAX_BATCH),
                                                                      limit=MAX_BATCH)]))
    if way in ("obs count", "empty", "bad id", "actions count"):
        if way == "obs count":
            h["obs"] = obs[:k - 1] if data.draw(st.booleans()) else obs + [list(OBS)]
        elif way == "empty":
            h["episode_ids"], h["obs"] = [], []
        elif way == "bad id":
            eids[i] = data.draw(st.one_of(BAD_EIDS, INTS))
        else:
            h["action"] = [0] * (k + 1)
        return c.step(f"batched act: {way}", h, c.needs_hello([err(wire.BAD_MESSAGE)]))
    if way == "obs nonfinite":
        obs[i][data.draw(st.integers(0, 3))] = data.draw(NONFINITE)
        reply = err(wire.BAD_VALUE, episode_id=eids[i], field="obs")
    elif way == "obs shape":
        obs[i] = [0.0] * 3
        reply = err(wire.BAD_OBSERVATION)
    elif way == "actions":
        h["action"] = data.draw(st.lists(st.sampled_from([0, 1, None]), min_size=k, max_size=k))
        reply = Reply(wire.ACTION, check=actions(h["action"]))
    elif way == "action out of range":
        h["action"] = [None] * k
        h["action"][i] = 7
        reply = err(wire.BAD_VALUE, episode_id=eids[i], field="action")
    if c.hello and any(e not in c.episodes for e in eids):
        reply = err(wire.UNKNOWN_EPISODE)
    return c.step(f"batched act: {way}", h, c.needs_hello([reply]))


def _flip(data: st.DataObject, frame_bytes: bytes) -> bytes:
    """One byte changed: the checksum (or the header's own checks) catches it."""
    at = data.draw(st.integers(0, len(frame_bytes) - 1))
    out = bytearray(frame_bytes)
    out[at] ^= data.draw(st.integers(1, 255))
    return bytes(out)


# --- chunks ------------------------------------------------------------------------------------------
def spec_chunk(eid: str, index: int, steps: int = 3, obs_dim: int = 4, dist_dim: int = 2) -> list:
    """A chunk as EXTERNAL.md section 3 lays it out: an array of 15 fields (arrays as ``Array``)."""
    return [eid, index, Array([0.0] * ((steps + 1) * obs_dim), [steps + 1, obs_dim], "<f4"),
            Array([t % 2 for t in range(steps)], [steps], "<i8"), Array([1.0] * steps, [steps], "<f4"), False, False,
            {"action_logp": Array([-0.7] * steps, [steps], "<f4"),
             "action_dist_inputs": Array([0.1] * (steps * dist_dim), [steps, dist_dim], "<f4")},
            [], 0, 0, 0, 0, None, None]


def codec_chunk(eid: str, index: int, steps: int = 3) -> EpisodeChunk:
    return EpisodeChunk(eid, index, np.zeros((steps + 1, 4), np.float32), np.arange(steps) % 2,
                        np.ones(steps, np.float32), extra={"action_logp": np.full(steps, -0.7, np.float32),
                                                           "action_dist_inputs": np.zeros((steps, 2), np.float32)})


CHUNK_JUNK = [JUNK[str], st.one_of(JUNK[int], NEGATIVE), TEXT, TEXT, st.lists(st.floats(), max_size=3),
              JUNK[bool], JUNK[bool], JUNK[dict], st.one_of(TEXT, INTS, st.none(), st.just([1]), st.just([{}])),
              *[st.one_of(JUNK[int], NEGATIVE)] * 4, INTS, st.floats()]
"""Per field of the chunk array: values that break its type (section 3's table)."""
VALUE_BREAKS = {"actions out of range": (3, "actions"), "reward nan": (4, "rewards"), "obs inf": (2, "obs"),
                "logp nan": ("action_logp", "extra['action_logp']"),
                "dist inf": ("action_dist_inputs", "extra['action_dist_inputs']")}


def gen_chunks(data: st.DataObject, c: Conn) -> Step:
    eid, index = c.eid(), data.draw(st.integers(0, 3))
    key = [eid, index]
    h: dict[str, Any] = {"op": "chunks", "id": c.rid(), "ids": [key]}
    way = how(data, "valid", "valid codec", "valid pair", "ids missing", "ids wrong type", "ids empty", "bad id item",
              "garbage", "truncated", "corrupt", "plain message", "chunks not a list", "more chunks than ids",
              "fewer chunks than ids", "no body", "extra part", "T obs rows", "both flags", "14 fields", "18 fields",
              "wrong type", "other episode", "other index", *VALUE_BREAKS, "too long", "no steps", "no dist",
              "no logp", "dist width", "obs width")
    if way in ("ids missing", "ids wrong type", "ids empty", "bad id item"):
        if way == "ids missing":
            del h["ids"]
        elif way == "ids wrong type":
            h["ids"] = data.draw(JUNK[list])
        elif way == "ids empty":
            h["ids"] = []
        else:
            h["ids"] = [key, data.draw(st.sampled_from([[eid], [eid, -1], [eid, "0"], [eid, True], [5, 0], ["", 0],
                                                         [eid, 0, 1], eid, [eid, 1 << 31], [eid, None]]))]
        return c.step(f"chunks: {way}", h, [err(wire.BAD_MESSAGE, mentions="id")], frame("chunks", [spec_chunk(eid, index)]))
    fields = spec_chunk(eid, index)
    chunks, ids, body = [fields], [key], None
    whole = way in ("garbage", "truncated", "corrupt", "plain message", "chunks not a list", "more chunks than ids",
                    "fewer chunks than ids", "no body", "extra part")
    value_field = None
    if way == "valid codec":
        body = encode([codec_chunk(eid, index)], compress=data.draw(st.booleans()))
    elif way == "valid pair":
        ids, chunks = [key, [eid, index + 1]], [fields, spec_chunk(eid, index + 1)]
    elif way == "garbage":
        body = b"XX" + data.draw(st.binary(max_size=64))
    elif way == "truncated":
        good = encode([codec_chunk(eid, index)], compress=data.draw(st.booleans()))
        body = good[:data.draw(st.integers(0, len(good) - 1))]
    elif way == "corrupt":
        body = _flip(data, encode([codec_chunk(eid, index)], compress=data.draw(st.booleans())))
    elif way == "plain message":
        body = encode({"chunks": 1})
    elif way == "chunks not a list":
        body = frame("chunks", data.draw(st.one_of(TEXT, INTS, st.dictionaries(TEXT, INTS, max_size=2))))
    elif way == "more chunks than ids":
        chunks = [fields, spec_chunk(eid, index + 1)]
    elif way == "fewer chunks than ids":
        ids = [key, [eid, index + 1]]
    elif way == "T obs rows":
        fields[2] = Array([0.0] * 12, [3, 4], "<f4")
    elif way == "both flags":
        fields[5] = fields[6] = True
    elif way in ("14 fields", "18 fields"):
        fields = chunks[0] = fields[:14] if way == "14 fields" else fields + [None] * 3
    elif way == "wrong type":
        at = data.draw(st.integers(0, 14), label="field")
        fields[at] = data.draw(CHUNK_JUNK[at], label=f"field {at}")
    elif way == "other episode":
        fields[0] = eid + "x"
    elif way == "other index":
        fields[1] = index + 1
    elif way in VALUE_BREAKS:
        at, value_field = VALUE_BREAKS[way]
        where = fields[7][at] if isinstance(at, str) else fields[at]
        where.values[data.draw(st.integers(0, 2))] = 5 if way == "actions out of range" else (
            math.nan if "nan" in way else math.inf)
    elif way in ("too long", "no steps", "dist width", "obs width"):
        fields = chunks[0] = spec_chunk(eid, index, steps={"too long": FRAGMENT + 1, "no steps": 0}.get(way, 3),
                                        dist_dim=3 if way == "dist width" else 2, obs_dim=3 if way == "obs width" else 4)
    elif way in ("no dist", "no logp"):
        del fields[7]["action_dist_inputs" if way == "no dist" else "action_logp"]
    if body is None:
        body = frame("chunks", chunks)
    parts = {"no body": [], "extra part": [body, b"x"]}.get(way, [body])
    h["ids"] = ids
    if way.startswith("valid"):
        replies = [Reply(wire.RECEIVED, fields={"ids": ids, "committed": []})]
    elif whole:
        replies = [err(wire.BAD_CHUNK, ids=ids)]
    else:
        bad = err(wire.BAD_CHUNK, ids=[key], **({} if value_field is None else {"field": value_field}))
        replies = [bad]
        if data.draw(st.booleans(), label="with a good chunk"):  # the good one is taken, the bad one alone refused
            good = [eid + "-ok", 0]
            h["ids"] = [good, key]
            parts = [frame("chunks", [spec_chunk(*good), fields])]
            replies = [Reply(wire.RECEIVED, fields={"ids": [good], "committed": []}), bad]
    return c.step(f"chunks: {way}", h, c.needs_hello(replies, ids=h["ids"]), *parts)
