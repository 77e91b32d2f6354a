"""The external-client protocol's message framing, shared by ``protocols.client`` and the policy server.

``protocols/EXTERNAL.md`` is the specification; this module is its executable core. A message
is a ZeroMQ multipart message of one or two parts:

* part 0, the **header**: a msgpack map with str keys, at most ``MAX_HEADER_BYTES``; it always
  has ``"op"`` (str) and ``"id"`` (int: the client's request id, echoed by the reply; 0 for
  messages the server sends unasked);
* part 1 (some ops only), the **body**: one codec frame (``protocols.codec``) holding arrays --
  an observation, an action and its extras, episode chunks, exported policy weights.

Nothing here trusts its input: headers are unpacked with small msgpack bounds and checked for
their required fields; every problem raises ``ProtocolError``, which the server turns into an
``error`` reply (errors are data, never a dropped connection without a word).
"""
from __future__ import annotations

from typing import Any

import msgpack

from protocols.errors import ProtocolError

PROTOCOL = "runnel-external"
VERSION = 1
MAX_HEADER_BYTES = 64 * 1024
"""Largest header part; a bigger one is refused before it is unpacked."""
MAX_ID_LEN = 64
"""Longest episode id (ASCII str)."""

# client -> server
HELLO, START, ACT, END, CHUNKS, WEIGHTS, PING, BYE = "hello", "start", "act", "end", "chunks", "weights", "ping", "bye"
# server -> client
WELCOME, STARTED, ACTION, ENDED, RECEIVED, COMMITTED, POLICY, PONG, ERROR = (
    "welcome", "started", "action", "ended", "received", "committed", "policy", "pong", "error")

CLIENT_OPS = frozenset({HELLO, START, ACT, END, CHUNKS, WEIGHTS, PING, BYE})
REQUIRED_FIELDS: dict[str, dict[str, tuple[type, ...]]] = {
    HELLO: {"protocol": (str,), "version": (int,), "inference_mode": (str,)},
    START: {"episode_id": (str,)},
    ACT: {},  # "episode_id" (str), or "episode_ids" (list) for a batched request
    END: {"episode_id": (str,)},
    CHUNKS: {"ids": (list,)},
    WEIGHTS: {"have": (int,)},
    PING: {}, BYE: {},
}
"""Fields each client op must carry, with their msgpack types (an op may carry more)."""
BODY_OPS = frozenset({CHUNKS})
"""Client ops that come with a body part (``act`` has one only when its observation is not in the header)."""

# error codes (``{"op": "error", "id": ..., "code": ..., "message": ..., "fatal": bool}``)
BAD_MESSAGE = "bad_message"          # unparsable header/body, missing or mistyped field, unknown op
HELLO_FIRST = "hello_first"          # this connection has not said hello (new connection, server restarted)
VERSION_MISMATCH = "version"         # protocol name/version not spoken here (fatal)
SPACES_MISMATCH = "spaces"           # the client's spaces differ from the server's (fatal)
BAD_MODE = "inference_mode"          # inference mode not offered (fatal)
UNKNOWN_EPISODE = "unknown_episode"  # act/end for an episode this connection did not start
TOO_MANY_EPISODES = "too_many_episodes"
TOO_MANY_REQUESTS = "too_many_requests"
BAD_OBSERVATION = "bad_observation"  # observation does not fit the observation space
BAD_VALUE = "bad_value"              # an act's observation or action has the right shape but a value its
                                     # space does not hold (NaN, out of range); the reply names episode_id and field
BAD_CHUNK = "bad_chunk"              # a chunk failed its checks (the others in the message may be fine)
BUSY = "busy"                        # the server holds as much unconsumed experience as it may: resend later
STALE = "stale"                      # a chunk acted on by weights older than the server's max_policy_lag: drop it
NOT_SUPPORTED = "not_supported"      # e.g. weights for local inference of a policy that cannot be exported
SERVER_FULL = "server_full"          # too many connections (fatal)
BANNED = "banned"                    # too many protocol errors: further messages are ignored (fatal)


def pack(header: dict[str, Any]) -> bytes:
    return msgpack.packb(header, use_bin_type=True)


def header_packer() -> Any:
    """``pack`` without building a packer per call: for one thread's hot path (a packer is not thread-safe)."""
    return msgpack.Packer(use_bin_type=True).pack


def unpack_header(raw: bytes) -> dict[str, Any]:
    """A header part -> its map, bounded; raises ProtocolError for anything malformed."""
    if len(raw) > MAX_HEADER_BYTES:
        raise ProtocolError(f"header of {len(raw)} bytes exceeds {MAX_HEADER_BYTES}")
    try:
        header = msgpack.unpackb(raw, raw=False, strict_map_key=True,
                                 max_str_len=MAX_HEADER_BYTES, max_bin_len=MAX_HEADER_BYTES,
                                 max_array_len=16384, max_map_len=256, max_ext_len=0)
    except Exception as err:  # noqa: BLE001 - msgpack raises several types for bad input
        raise ProtocolError(f"header is not msgpack: {type(err).__name__}: {err}") from None
    if not isinstance(header, dict):
        raise ProtocolError(f"header must be a msgpack map, got {type(header).__name__}")
    op, rid = header.get("op"), header.get("id", 0)
    if not isinstance(op, str):
        raise ProtocolError(f"header 'op' must be a str, got {type(op).__name__}")
    if not isinstance(rid, int) or isinstance(rid, bool) or not 0 <= rid < 1 << 63:
        raise ProtocolError(f"header 'id' must be an int in [0, 2**63), got {rid!r}")
    return header


def check_request(header: dict[str, Any], parts: int) -> None:
    """A client request's op, required fields and part count (server side)."""
    op = header["op"]
    fields = REQUIRED_FIELDS.get(op)
    if fields is None:
        raise ProtocolError(f"unknown op {op!r}; client ops: {sorted(CLIENT_OPS)}")
    for name, types in fields.items():
        value = header.get(name)
        if not isinstance(value, types) or isinstance(value, bool):
            raise ProtocolError(f"{op!r} needs {name!r} of type {'/'.join(t.__name__ for t in types)}, "
                                f"got {type(value).__name__}")
    if op == ACT and not isinstance(header.get("episode_id", header.get("episode_ids")), (str, list)):
        raise ProtocolError("'act' needs 'episode_id' (str) or 'episode_ids' (list of str)")
    want = 2 if op in BODY_OPS or (op == ACT and "obs" not in header) else 1
    if parts != want:
        raise ProtocolError(f"{op!r} is a message of {want} part(s) here, got {parts}"
                            + (" (an act without 'obs' in its header carries it in a body)" if op == ACT else ""))
    eid = header.get("episode_id")
    if eid is not None:
        check_episode_id(eid)


def check_episode_id(eid: Any) -> str:
    if not isinstance(eid, str) or not 0 < len(eid) <= MAX_ID_LEN or not eid.isascii() or not eid.isprintable():
        raise ProtocolError(f"episode id must be 1 to {MAX_ID_LEN} printable ASCII characters, got {eid!r:.80}")
    return eid


def chunk_ids(raw: Any, limit: int) -> list[tuple[str, int]]:
    """The ``ids`` of a ``chunks`` message: ``[[episode_id, chunk_index], ...]``."""
    if not isinstance(raw, list) or not 0 < len(raw) <= limit:
        raise ProtocolError(f"'ids' must list 1 to {limit} [episode_id, chunk_index] pairs")
    out = []
    for item in raw:
        if (not isinstance(item, list) or len(item) != 2 or not isinstance(item[1], int)
                or isinstance(item[1], bool) or not 0 <= item[1] < 1 << 31):
            raise ProtocolError(f"each id must be [episode_id, chunk_index >= 0], got {item!r:.80}")
        out.append((check_episode_id(item[0]), item[1]))
    return out


def error(rid: int, code: str, message: str, fatal: bool = False) -> dict[str, Any]:
    return {"op": ERROR, "id": rid, "code": code, "message": message, "fatal": fatal}


class ServerError(RuntimeError):
    """An ``error`` reply from the server, raised in the client (``code`` is one of the codes above)."""

    def __init__(self, code: str, message: str, fatal: bool = False) -> None:
        super().__init__(f"policy server: {message} [{code}]")
        self.code, self.server_message, self.fatal = code, message, fatal
