"""Messages for fuzzing the policy server, drawn from the protocol's own schemas, each with the
replies ``protocols/EXTERNAL.md`` promises for it (``tests/test_external_fuzz.py`` sends them; the
act and chunks messages are in ``tests/external_fuzz_bodies.py``).

``Conn`` models one connection as the spec describes it: has it said hello, which episodes are
open. Each ``gen_*`` draws one message of its op -- valid, or with one thing wrong: a field of
``protocols.external``'s field tables missing or of the wrong type, a value out of range, NaN, an
oversize list or string, an extra field, a garbage, truncated or corrupt body, a chunk breaking a
rule of section 3 -- and returns it with the replies the spec promises, updating the model as the
server must. What the spec says decides the order of the checks: a message whose header is
malformed gets ``bad_message`` whether or not its connection said hello; otherwise a connection
without hello gets ``hello_first``; then the body, the episode, the values.
"""
from __future__ import annotations

import itertools
import math
import string
from dataclasses import dataclass, field
from typing import Any, Callable

import gymnasium as gym
import msgpack
from hypothesis import strategies as st

from protocols import external as wire
from protocols.codec import decode
from protocols.spaces import space_to_dict

OBS = [0.01, -0.02, 0.03, 0.04]
MAX_BATCH, MAX_OPEN, FRAGMENT = 4, 6, 20
"""The fuzzed server's limits (``max_batch``, ``max_open_episodes``, ``fragment_length``)."""
SPACES = {k: space_to_dict(getattr(gym.make("CartPole-v1"), k)) for k in ("observation_space", "action_space")}
FATAL = frozenset({"protocol", "version", "inference_mode", "spaces", "server_full", "banned"})
"""The error codes EXTERNAL.md calls fatal."""
_TAGS = itertools.count()  # ids never repeat across examples: the server remembers the chunks it committed

TEXT = st.text(st.characters(codec="utf-8"), max_size=8)
INTS = st.integers(-(1 << 63), (1 << 64) - 1)
"""Every integer msgpack carries."""
NEGATIVE = st.integers(-(1 << 63), -1)
JUNK: dict[type, st.SearchStrategy] = {  # values of every msgpack type but the one named
    str: st.one_of(st.integers(-5, 5), st.floats(), st.none(), st.booleans(), st.lists(st.integers(0, 3), max_size=2)),
    int: st.one_of(TEXT, st.floats(), st.none(), st.booleans(), st.lists(INTS, max_size=2),
                   st.dictionaries(TEXT, INTS, max_size=2)),
    list: st.one_of(TEXT, INTS, st.none(), st.booleans(), st.dictionaries(TEXT, INTS, max_size=2)),
    dict: st.one_of(TEXT, INTS, st.none(), st.lists(INTS, max_size=2)),
    bool: st.one_of(INTS, TEXT, st.none(), st.floats()),
}
BAD_EIDS = st.one_of(st.just(""), st.text(string.ascii_letters, min_size=65, max_size=400),
                     st.sampled_from(["tab\there", "caf\u00e9", "nul\x00", "new\nline"]))
NONFINITE = st.sampled_from([math.nan, math.inf, -math.inf])


@dataclass
class Reply:
    """One reply the spec promises: its ``op`` (an error's ``code``) and what it must carry."""

    op: str
    code: str | None = None
    fields: dict = field(default_factory=dict)
    """Header fields the reply must have, with these values (``id`` defaults to the request's)."""
    mentions: str | None = None
    """Text an error's message must name (the bad field)."""
    check: Callable[[dict, list], None] | None = None
    """Further checks of (header, body parts)."""


def err(code: str, mentions: str | None = None, **fields: Any) -> Reply:
    return Reply(wire.ERROR, code, fields, mentions)


@dataclass
class Step:
    what: str
    parts: list[bytes]
    replies: list[Reply]
    hello_after: bool = False
    """Whether the connection has said hello afterwards (what a ping then gets)."""
    rid: int = 0
    """The request's id."""


class Conn:
    def __init__(self) -> None:
        self.tag = f"f{next(_TAGS)}"
        self.hello = False
        self.episodes: list[str] = []
        self._eids = itertools.count()
        self._rids = itertools.count(1)

    def eid(self) -> str:
        return f"{self.tag}-{next(self._eids)}"

    def rid(self) -> int:
        return next(self._rids)

    def step(self, what: str, header: dict, replies: list[Reply], *body: bytes) -> Step:
        return Step(what, [msgpack.packb(header, use_bin_type=True), *body], replies, self.hello, header["id"])

    def needs_hello(self, replies: list[Reply], ids: list | None = None) -> list[Reply]:
        """``replies`` if the connection said hello, else ``hello_first`` (with a chunks message's ids)."""
        if self.hello:
            return replies
        return [err(wire.HELLO_FIRST, **({} if ids is None else {"ids": ids}))]


def how(data: st.DataObject, *ways: str) -> str:
    return data.draw(st.sampled_from(ways), label="mutation")


def field_error(data: st.DataObject, c: Conn, h: dict, way: str, *body: bytes) -> Step:
    """A field of the op's schema left out or of the wrong type: ``bad_message`` naming it, hello or not."""
    op = h["op"]
    schema = {**wire.REQUIRED_FIELDS[op], **wire.OPTIONAL_FIELDS.get(op, {})}
    if way == "missing":
        name = data.draw(st.sampled_from(sorted(wire.REQUIRED_FIELDS[op] or ["episode_id"])))
        h.pop(name, None)
    else:
        name = data.draw(st.sampled_from(sorted(schema)))
        h[name] = data.draw(JUNK[schema[name][0]], label=name)
    return c.step(f"{op}: {name} {way}", h, [err(wire.BAD_MESSAGE, mentions=repr(name))], *body)


def extra_field(data: st.DataObject, h: dict) -> None:
    h["x_" + data.draw(TEXT)] = data.draw(st.one_of(TEXT, INTS, st.none(), st.lists(INTS, max_size=3)))


# --- hello, start, end, weights, ping, bye, unknown ops, unreadable headers ---------------------------
def gen_hello(data: st.DataObject, c: Conn) -> Step:
    h = {"op": "hello", "id": c.rid(), "protocol": wire.PROTOCOL, "version": wire.VERSION,
         "inference_mode": data.draw(st.sampled_from(["remote", "", "local"]))}
    way = how(data, "valid", "missing", "wrong type", "extra field", "protocol", "version", "inference_mode",
              "other spaces", "junk spaces", "same spaces", "huge name")
    if way in ("missing", "wrong type"):
        return field_error(data, c, h, way)
    if way in ("protocol", "version", "inference_mode", "other spaces", "junk spaces"):
        if way == "protocol":
            h["protocol"] = data.draw(TEXT.filter(lambda s: s != wire.PROTOCOL))
        elif way == "version":
            h["version"] = data.draw(st.integers(-(1 << 63), (1 << 64) - 1).filter(lambda v: v not in wire.VERSIONS))
        elif way == "inference_mode":
            h["inference_mode"] = data.draw(TEXT.filter(lambda s: s not in ("remote", "local", "")))
        else:
            key = data.draw(st.sampled_from(sorted(SPACES)))
            h[key] = ({"type": "Discrete", "n": 3} if way == "other spaces" else data.draw(st.dictionaries(
                st.sampled_from(["type", "shape", "dtype", "low", "high", "n", "spaces", "nvec"]),
                st.one_of(TEXT, INTS, st.lists(st.integers(-2, 5), max_size=3), st.none()), max_size=4)))
        return c.step(f"hello: {way}", h, [err("spaces" if "spaces" in way else way)])  # the connection is as before
    if way == "extra field":
        extra_field(data, h)
    elif way == "same spaces":
        h.update(SPACES)
    elif way == "huge name":
        h["name"] = "n" * 60_000
    mode = h["inference_mode"] or "remote"
    c.hello, c.episodes = True, []

    def welcome(r: dict, _: list) -> None:
        assert r["inference_mode"] == mode and r["protocol"] == wire.PROTOCOL and r["version"] == wire.VERSION
        assert r["limits"]["max_batch"] == MAX_BATCH and r["fragment_length"] == FRAGMENT
        assert r["observation_space"] == SPACES["observation_space"] and isinstance(r["server_id"], str)

    return c.step(f"hello: {way}", h, [Reply(wire.WELCOME, check=welcome)])


def episode_header(data: st.DataObject, c: Conn, op: str, reuse: str) -> tuple[dict, str] | Step:
    """A ``start``/``end`` header and how it was drawn (``reuse``: for an open episode), or the Step of
    a header the spec refuses whatever the connection's state."""
    way = how(data, reuse, "fresh", "missing", "wrong type", "bad id", "extra field")
    eid = data.draw(st.sampled_from(c.episodes)) if way == reuse and c.episodes else c.eid()
    h = {"op": op, "id": c.rid(), "episode_id": eid}
    if way in ("missing", "wrong type"):
        return field_error(data, c, h, way)
    if way == "bad id":
        h["episode_id"] = data.draw(BAD_EIDS)
        return c.step(f"{op}: bad id", h, [err(wire.BAD_MESSAGE, mentions="episode id")])
    if way == "extra field":
        extra_field(data, h)
    return h, way


def gen_start(data: st.DataObject, c: Conn) -> Step:
    drawn = episode_header(data, c, "start", "open again")
    if isinstance(drawn, Step):
        return drawn
    h, way = drawn
    eid = h["episode_id"]
    if c.hello and eid not in c.episodes and len(c.episodes) >= MAX_OPEN:
        return c.step(f"start: {way}, {MAX_OPEN} open", h, [err(wire.TOO_MANY_EPISODES)])
    replies = c.needs_hello([Reply(wire.STARTED, fields={"episode_id": eid})])
    if c.hello and eid not in c.episodes:
        c.episodes.append(eid)
    return c.step(f"start: {way}", h, replies)


def gen_end(data: st.DataObject, c: Conn) -> Step:
    drawn = episode_header(data, c, "end", "open")
    if isinstance(drawn, Step):
        return drawn
    h, way = drawn
    replies = c.needs_hello([])  # end has no reply
    if h["episode_id"] in c.episodes:
        c.episodes.remove(h["episode_id"])
    return c.step(f"end: {way}", h, replies)


def gen_weights(data: st.DataObject, c: Conn) -> Step:
    way = how(data, "none held", "current", "other version", "missing", "wrong type")
    have = {"none held": -1, "current": 0}.get(way) if way != "other version" else data.draw(
        st.integers(-(1 << 63), (1 << 64) - 1).filter(lambda v: v != 0))
    h = {"op": "weights", "id": c.rid(), "have": have}
    if way in ("missing", "wrong type"):
        return field_error(data, c, h, way)

    def policy(r: dict, body: list) -> None:
        assert r["changed"] is (way != "current") and r["weights_version"] == 0
        assert len(body) == (1 if r["changed"] else 0)
        if body:
            assert isinstance(decode(body[0]), dict)  # the exported policy

    return c.step(f"weights: {way}", h, c.needs_hello([Reply(wire.POLICY, check=policy)]))


def gen_ping(data: st.DataObject, c: Conn) -> Step:
    h = {"op": "ping", "id": c.rid()}
    if how(data, "valid", "extra field") == "extra field":
        extra_field(data, h)
    return c.step("ping", h, c.needs_hello([Reply(wire.PONG, check=lambda r, _: isinstance(r["server_id"], str))]))


def gen_bye(data: st.DataObject, c: Conn) -> Step:
    c.hello, c.episodes = False, []  # the server forgets the connection; bye has no reply
    return c.step("bye", {"op": "bye", "id": c.rid()}, [])


def gen_unknown_op(data: st.DataObject, c: Conn) -> Step:
    op = data.draw(st.one_of(TEXT, st.just("x" * 20_000)).filter(lambda s: s not in wire.CLIENT_OPS), label="op")
    return c.step("unknown op", {"op": op, "id": c.rid()}, [err(wire.BAD_MESSAGE, mentions="unknown op")])


def gen_unreadable(data: st.DataObject, c: Conn) -> Step:
    """A header the server cannot read: answered with id 0 and ``unparsed``, hello or not."""
    way = how(data, "not msgpack", "not a map", "no op", "op not a str", "bad id", "oversize", "empty")
    raw = {
        "not msgpack": lambda: b"\xc1" + data.draw(st.binary(max_size=40)),
        "not a map": lambda: msgpack.packb(data.draw(st.one_of(INTS, TEXT, st.lists(INTS, max_size=3)))),
        "no op": lambda: msgpack.packb({"id": 1}),
        "op not a str": lambda: msgpack.packb({"op": data.draw(JUNK[str]), "id": 1}),
        "bad id": lambda: msgpack.packb({"op": "ping", "id": data.draw(st.one_of(
            st.integers(max_value=-1, min_value=-(1 << 63)), st.integers(1 << 63, (1 << 64) - 1), TEXT, st.floats(),
            st.none(), st.booleans()))}),
        "oversize": lambda: msgpack.packb({"op": "ping", "id": 1, "pad": "x" * (wire.MAX_HEADER_BYTES + 10)}),
        "empty": lambda: b"",
    }[way]()
    return Step(f"unreadable header: {way}", [raw], [err(wire.BAD_MESSAGE, id=0, unparsed=True)], c.hello)


def prelude(data: st.DataObject, c: Conn) -> list[Step]:
    """Most connections start as a client does: hello, then a few episodes (so acts find them open)."""
    if data.draw(st.integers(0, 3), label="hello first") == 0:
        return []
    c.hello = True
    steps = [c.step("hello", {"op": "hello", "id": c.rid(), "protocol": wire.PROTOCOL, "version": wire.VERSION,
                               "inference_mode": "remote"}, [Reply(wire.WELCOME)])]
    for _ in range(data.draw(st.integers(0, 3), label="episodes")):
        eid = c.eid()
        c.episodes.append(eid)
        steps.append(c.step("start", {"op": "start", "id": c.rid(), "episode_id": eid},
                            [Reply(wire.STARTED, fields={"episode_id": eid})]))
    return steps
