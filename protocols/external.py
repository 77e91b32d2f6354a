"""The external-client protocol's message framing, shared by ``protocols.client`` and the policy server.

``protocols/EXTERNAL.md`` is the specification; this module is its executable core. A message
is a ZeroMQ multipart message of one or two parts:

* part 0, the **header**: a msgpack map with str keys, at most ``MAX_HEADER_BYTES``; it always
  has ``"op"`` (str) and ``"id"`` (int: the client's request id, echoed by the reply; 0 for
  messages the server sends unasked, and taken as 0 when a request leaves it out);
* part 1 (some ops only), the **body**: one codec frame (``protocols.codec``) holding arrays --
  an observation, an action and its extras, episode chunks, exported policy weights.

Nothing here trusts its input: headers are unpacked with small msgpack bounds and checked for
their fields; every problem raises ``ProtocolError``, which the server turns into an ``error``
reply (errors are data, never a dropped connection without a word). ``ERRORS`` is the one table
of error codes -- whether each is fatal, what it means, what a client should do -- that the
server's replies take ``fatal`` from and EXTERNAL.md renders (``errors_markdown``).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import msgpack

from protocols.errors import ProtocolError

PROTOCOL = "runnel-external"
VERSION = 2
"""The version this side speaks: 2 is version 1 plus the multi-agent messages (EXTERNAL.md section 10)."""
VERSIONS = (1, 2)
"""The versions a server accepts in a hello; a connection that said 1 may not send the multi-agent ops."""
MAX_HEADER_BYTES = 64 * 1024
"""Largest header part; a bigger one is refused before it is unpacked."""
MAX_ID_LEN = 64
"""Longest episode id (ASCII str)."""

# client -> server
HELLO, START, ACT, END, CHUNKS, WEIGHTS, PING, BYE = "hello", "start", "act", "end", "chunks", "weights", "ping", "bye"
MA_START, MA_ACT, MA_END = "ma_start", "ma_act", "ma_end"  # version 2: multi-agent episodes, recorded by the server
# server -> client
WELCOME, STARTED, ACTION, ENDED, RECEIVED, COMMITTED, POLICY, PONG, ERROR = (
    "welcome", "started", "action", "ended", "received", "committed", "policy", "pong", "error")
MA_ACTION = "ma_action"

MA_OPS = frozenset({MA_START, MA_ACT, MA_END})
CLIENT_OPS = frozenset({HELLO, START, ACT, END, CHUNKS, WEIGHTS, PING, BYE}) | MA_OPS
REQUIRED_FIELDS: dict[str, dict[str, tuple[type, ...]]] = {
    HELLO: {"protocol": (str,), "version": (int,), "inference_mode": (str,)},
    START: {"episode_id": (str,)},
    ACT: {},  # one of "episode_id" (str) and "episode_ids" (list: a batched request), see OPTIONAL_FIELDS
    END: {"episode_id": (str,)},
    CHUNKS: {"ids": (list,)},
    WEIGHTS: {"have": (int,)},
    PING: {}, BYE: {},
    MA_START: {"episode_id": (str,)},
    MA_ACT: {"episode_id": (str,), "agents": (list,), "obs": (list,)},
    MA_END: {"episode_id": (str,)},
}
"""Fields each client op must carry, with their msgpack types (an op may carry more)."""
OPTIONAL_FIELDS: dict[str, dict[str, tuple[type, ...]]] = {
    HELLO: {"name": (str,), "observation_space": (dict,), "action_space": (dict,)},
    ACT: {"episode_id": (str,), "episode_ids": (list,), "explore": (bool,)},
    MA_ACT: {"rewards": (list,), "terminated": (list,), "truncated": (list,), "explore": (bool,)},
    MA_END: {"agents": (list,), "obs": (list,), "rewards": (list,), "terminated": (list,), "truncated": (list,)},
}
"""Fields an op may carry, with their types: one of another type is refused (``bad_message``); fields
named nowhere are ignored."""
MAX_CHUNK_IDS = 4096
"""Most chunks in one ``chunks`` message."""
BODY_OPS = frozenset({CHUNKS})
"""Client ops that come with a body part (``act`` has one only when its observation is not in the header)."""

# error codes: every ``error`` reply is ``{"op": "error", "id", "code", "message", "fatal"}`` (``error``
# below), ``fatal`` taken from ERRORS; errors about chunks add ``ids``
BAD_MESSAGE = "bad_message"
HELLO_FIRST = "hello_first"
PROTOCOL_MISMATCH = "protocol"
VERSION_MISMATCH = "version"
BAD_MODE = "inference_mode"
SPACES_MISMATCH = "spaces"
SERVER_FULL = "server_full"
BANNED = "banned"
UNKNOWN_EPISODE = "unknown_episode"
TOO_MANY_EPISODES = "too_many_episodes"
TOO_MANY_REQUESTS = "too_many_requests"
BATCH_TOO_LARGE = "batch_too_large"
BAD_OBSERVATION = "bad_observation"
BAD_VALUE = "bad_value"
BAD_CHUNK = "bad_chunk"
BUSY = "busy"
STALE = "stale"
BAD_AGENT = "bad_agent"
TOO_MANY_AGENTS = "too_many_agents"
UNKNOWN_AGENT = "unknown_agent"
NOT_SUPPORTED = "not_supported"
SERVER_ERROR = "server_error"


@dataclass(frozen=True)
class ErrorCode:
    """One error code: whether it refuses the connection, what it means, what a client should do."""

    fatal: bool
    """The connection is refused: retrying without changing something gets the same error."""
    means: str
    then: str
    """What a client should do on receiving it."""


ERRORS: dict[str, ErrorCode] = {
    BAD_MESSAGE: ErrorCode(False, "the message breaks the wire rules: a header that cannot be read -- no msgpack map "
                           "of at most 64 KiB, `op` no str, `id` no int in [0, 2^63) (the reply then has `id` 0 and "
                           "`unparsed: true`) -- an unknown op, a field missing or of the wrong type, a wrong number "
                           "of parts, an `act` body that is no frame of a map with `obs`, a `chunks` message "
                           "without usable `ids`",
                           "fix the sender: nothing was done, and the same message gets the same reply"),
    HELLO_FIRST: ErrorCode(False, "the connection has not said hello (it is new, reconnected, or the server "
                           "restarted); a `chunks` request's reply has its `ids`",
                           "say hello, then send the request again and every chunk not yet committed"),
    PROTOCOL_MISMATCH: ErrorCode(True, "the hello's `protocol` is not \"runnel-external\"",
                                 "check the client: this server speaks the runnel external-client protocol"),
    VERSION_MISMATCH: ErrorCode(True, "the hello's `version` is not the one this server speaks (the message names it)",
                                "use a client of the server's protocol version"),
    BAD_MODE: ErrorCode(True, "the hello's `inference_mode` is not \"remote\", \"local\" or \"\"",
                        "ask for \"remote\", \"local\" or \"\" (the server's choice)"),
    SPACES_MISMATCH: ErrorCode(True, "the hello's `observation_space` or `action_space` is not the server's",
                               "connect to the server trained for this environment, or send its spaces"),
    SERVER_FULL: ErrorCode(True, "the server serves as many connections as it may",
                           "connect later, or to another server"),
    BANNED: ErrorCode(True, "the connection sent more than `max_protocol_errors` malformed messages; the server "
                      "ignores it from now on",
                      "fix the client; only a new connection is heard again"),
    UNKNOWN_EPISODE: ErrorCode(False, "an `act` for an episode not started on this connection (or forgotten: "
                               "ended, the connection said hello again, the server restarted)",
                               "send `start` for it, then the `act` again"),
    TOO_MANY_EPISODES: ErrorCode(False, "a `start` beyond `limits.max_open_episodes` episodes open on the connection",
                                 "`end` episodes before starting more"),
    TOO_MANY_REQUESTS: ErrorCode(False, "an `act` beyond `limits.max_requests_in_flight` unanswered ones",
                                 "wait for replies before sending more"),
    BATCH_TOO_LARGE: ErrorCode(False, "a batched `act` with more `episode_ids` than `limits.max_batch` (the reply's "
                               "`limit`); nothing was computed",
                               "send the episodes in requests of at most `max_batch` ids"),
    BAD_OBSERVATION: ErrorCode(False, "an `act`'s observation or action of the wrong structure, shape or type; "
                               "nothing was computed",
                               "send it in the form of the welcome's spaces"),
    BAD_VALUE: ErrorCode(False, "an `act`'s observation or action holds a value its space does not (`episode_id`, "
                         "`field` say which); nothing was computed, the episode stays open",
                         "fix the value and send the `act` again, or `end` the episode"),
    BAD_CHUNK: ErrorCode(False, "the chunks of `ids` are refused for good: a body that cannot be decoded (all of "
                         "the message's ids), or a chunk that breaks the rules of section 3 or does not fit the "
                         "spaces or values of section 4 (`field` names a refused value)",
                         "drop those chunks from the spool, never send them again, report a bug"),
    BUSY: ErrorCode(False, "the server holds as much untrained experience as it may; the chunks of `ids` were "
                    "not taken", "send those chunks again later, in the order they were cut"),
    STALE: ErrorCode(False, "the chunks of `ids` were acted on by weights more than `limits.max_policy_lag` versions "
                     "older than the server's `weights_version` (in the reply): they will never be trained on; also "
                     "sent unasked (`id` 0) for held chunks that new weights made too old",
                     "drop those chunks from the spool (not a bug: the client ran ahead of training) and act with "
                     "newer weights (local inference: fetch them now)"),
    BAD_AGENT: ErrorCode(False, "a multi-agent message names an agent id that is no str of 1 to 64 printable ASCII "
                         "characters nor an int in [-2^63, 2^63), names one twice (or two whose str() is alike), or "
                         "uses `__all__` where an agent goes (`agent_id` says which); nothing was recorded",
                         "send agent ids as the env names them (str or int), each once per list"),
    TOO_MANY_AGENTS: ErrorCode(False, "a multi-agent message lists more agents than `limits.max_agents`, or an "
                               "episode (or all of the connection's, section 10) would hold more (the reply's "
                               "`limit`); nothing was recorded",
                               "act for fewer agents at a time, or end episodes"),
    UNKNOWN_AGENT: ErrorCode(False, "a multi-agent message gives a reward or a done flag for an agent that has not "
                             "acted in the episode (or is done already), or an observation for an agent the run's "
                             "`policy_mapping_fn` maps to no module (`agent_id` says which); nothing was recorded",
                             "give rewards and flags only to agents that acted since their last observation; "
                             "check the agent ids against the env the server trains for"),
    SERVER_ERROR: ErrorCode(False, "the server failed to compute this request (a bug, logged on the server); nothing "
                            "was computed, and the server serves on",
                            "send the request again later; if it keeps failing, report it"),
    NOT_SUPPORTED: ErrorCode(False, "`weights` for a policy that cannot run in the client (or any `weights` to a "
                             "multi-agent server); `chunks` to a multi-agent server, which records episodes itself "
                             "(with `ids`)", "use remote inference; a multi-agent client sends `ma_act`/`ma_end`, "
                             "no chunks"),
}
"""Every error code the server sends; ``error`` takes ``fatal`` from here, and EXTERNAL.md's table is
``errors_markdown()``."""


def errors_markdown() -> str:
    """The error table of EXTERNAL.md, rendered from ``ERRORS``."""
    rows = ["| code | fatal | means | a client should |", "|---|---|---|---|"]
    rows += [f"| `{code}` | {'yes' if e.fatal else 'no'} | {e.means} | {e.then} |" for code, e in ERRORS.items()]
    return "\n".join(rows)


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
    """A client request's op, fields and part count (server side); ProtocolError names the first problem."""
    op = header["op"]
    fields = REQUIRED_FIELDS.get(op)
    if fields is None:
        raise ProtocolError(f"unknown op {op[:40]!r}; client ops: {sorted(CLIENT_OPS)}")
    for name, types in fields.items():
        if name not in header:
            raise ProtocolError(f"{op!r} needs field {name!r} ({_names(types)}); it is missing")
        _check_type(op, name, header[name], types)
    for name, types in OPTIONAL_FIELDS.get(op, {}).items():
        if name in header:
            _check_type(op, name, header[name], types)
    if op == ACT and ("episode_id" in header) == ("episode_ids" in header):
        raise ProtocolError("'act' needs either 'episode_id' (str) or 'episode_ids' (a list of str for a batched "
                            "request), " + ("not both" if "episode_id" in header else "got neither"))
    want = 2 if op in BODY_OPS or (op == ACT and "obs" not in header) else 1
    if parts != want:
        raise ProtocolError(f"{op!r} is a message of {want} part(s) here, got {parts}"
                            + (" (an act without 'obs' in its header carries it in a body)" if op == ACT else ""))
    eid = header.get("episode_id")
    if eid is not None:
        check_episode_id(eid)


def _names(types: tuple[type, ...]) -> str:
    return "/".join(t.__name__ for t in types)


def _check_type(op: str, name: str, value: Any, types: tuple[type, ...]) -> None:
    # msgpack has bools apart from ints: True is no version and 1 is no explore flag
    if not isinstance(value, types) or (isinstance(value, bool) and bool not in types):
        raise ProtocolError(f"{op!r} field {name!r} must be {_names(types)}, got {type(value).__name__} "
                            f"{value!r:.60}")


def check_episode_id(eid: Any) -> str:
    if not isinstance(eid, str) or not 0 < len(eid) <= MAX_ID_LEN or not eid.isascii() or not eid.isprintable():
        raise ProtocolError(f"episode id must be 1 to {MAX_ID_LEN} printable ASCII characters, got {eid!r:.80}")
    return eid


def chunk_ids(raw: Any, limit: int = MAX_CHUNK_IDS) -> list[tuple[str, int]]:
    """The ``ids`` of a ``chunks`` message: ``[[episode_id, chunk_index], ...]``."""
    if not isinstance(raw, list) or not 0 < len(raw) <= limit:
        got = f"{len(raw)} items" if isinstance(raw, list) else type(raw).__name__
        raise ProtocolError(f"'ids' must list 1 to {limit} [episode_id, chunk_index] pairs, got {got}")
    out = []
    for item in raw:
        if (not isinstance(item, list) or len(item) != 2 or not isinstance(item[1], int)
                or isinstance(item[1], bool) or not 0 <= item[1] < 1 << 31):
            raise ProtocolError(f"each id must be [episode_id, chunk_index >= 0], got {item!r:.80}")
        out.append((check_episode_id(item[0]), item[1]))
    return out


def error(rid: int, code: str, message: str, **fields: Any) -> dict[str, Any]:
    """An ``error`` reply; ``fatal`` is the code's (``ERRORS``), ``fields`` add what the code promises (``ids``...)."""
    return {"op": ERROR, "id": rid, "code": code, "message": message, "fatal": ERRORS[code].fatal, **fields}


class ServerError(RuntimeError):
    """An ``error`` reply from the server, raised in the client (``code`` is one of the codes above)."""

    def __init__(self, code: str, message: str, fatal: bool = False) -> None:
        super().__init__(f"policy server: {message} [{code}]")
        self.code, self.server_message, self.fatal = code, message, fatal
