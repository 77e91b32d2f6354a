"""The inference protocol: env runners ask a central inference server for their actions (SEED style).

A runner holds a ZeroMQ DEALER socket connected to the server's ROUTER. Each message is one part:
one codec frame (``protocols.codec``; no compression, checksummed) holding a plain message.

* runner -> server, ``act``: ``{"op": "act", "runner": int, "seq": int, "explore": bool,
  "timestep": int, "obs": nested arrays [k, ...]}`` -- the observations of the runner's k sub-envs
  at one step; ``runner`` is the runner's worker index (exploration noise is drawn per runner),
  ``seq`` counts the runner's requests (a resent request keeps its number), ``timestep`` is the
  run's env steps as the runner knows them (exploration schedules); optional ``"lane": int`` (0 when
  absent, below ``MAX_LANES``): a runner that keeps two requests out at once (double buffering: one half of
  its sub-envs steps while the other half's actions are inferred) sends each half on its own lane, and
  the server keeps one observation buffer and one shared-memory mapping per lane;
* server -> runner, ``actions``: ``{"op": "actions", "seq": int, "weights_version": int,
  "actions": [k, ...], "logp": [k], "dist_inputs": [k, d]}`` -- the module's actions (before the
  env's rescaling), their log-probabilities and the distribution inputs, which the chunks carry;
* a recurrent module (``use_lstm``): the runner keeps its sub-envs' states and each ``act`` carries them,
  ``"state": float32 [k, 2, cell]`` (hidden and cell state; zeros where an episode starts), and the answer
  the states after the step, ``"state_out": float32 [k, 2, cell]``. The server keeps no state of its own, so
  a restarted server serves on with no loss;
* server -> runner, ``error``: ``{"op": "error", "seq": int, "message": str, "code": str}`` -- the
  request could not be served (a malformed frame, observations that do not fit the space); the runner
  raises, naming the message, so its stage group recreates it. ``code`` "shm_unavailable" is the one
  exception: the server could not open the runner's shared-memory segment (below), and the runner
  sends the request again with its observations in a new segment, or inline.

Shared memory (a runner and its server on one node, ``actors.inference.shared_obs``): instead of
``"obs"``, an ``act`` may carry ``"obs_shm": {"path": str, "shape": [int, ...], "dtype": str}`` --
one array of the runner's observations, written into a memory-mapped file under ``/dev/shm`` before the
request is sent and left untouched until the answer arrives. The server maps the file once, copies
the block out and checks it against the observation space as it checks inline observations.

Replies echo ``seq``; a runner drops a reply whose ``seq`` is not the one it waits for (the answer
to a request it has since resent). Nothing here is pickled; only numpy, msgpack, lz4 and zmq.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from protocols.codec import Limits, decode, encode
from protocols.errors import ProtocolError

ACT, ACTIONS, ERROR = "act", "actions", "error"

LIMITS = Limits(max_frame_bytes=256 << 20, max_decoded_bytes=256 << 20, max_buffer_size=1 << 20,
                max_str_len=64 << 10, max_bin_len=1 << 20, max_array_len=4096, max_map_len=256, max_depth=16)
"""Decode bounds: a request of a few thousand Atari frames fits; a forged frame claiming more is refused."""


MAX_LANES = 8
"""Lanes a runner may use (requests it keeps out at once)."""

SHM_DTYPE_KINDS = "biuf"
"""Dtype kinds an observation block in shared memory may have (numbers and flags: nothing with objects)."""


@dataclass
class SharedBlock:
    """Where a runner put one step's observations in shared memory."""

    path: str
    shape: tuple[int, ...]
    dtype: np.dtype


@dataclass
class ActRequest:
    runner: int
    seq: int
    explore: bool
    timestep: int
    obs: Any
    """Nested arrays with one leading row per sub-env (None when they are in ``shared``)."""
    rows: int
    shared: SharedBlock | None = None
    lane: int = 0
    """Which of the runner's requests out at once this is (``MAX_LANES``)."""
    state: np.ndarray | None = None
    """A recurrent module's states the rows act from, float32 ``[rows, 2, cell]`` (None: not recurrent)."""


@dataclass
class ServerError:
    """An ``error`` answer: the server's ``message`` and its ``code`` ("shm_unavailable": send again)."""

    seq: int
    message: str
    code: str

    def __str__(self) -> str:
        return f"seq {self.seq}: {self.message}"


@dataclass
class ActReply:
    seq: int
    weights_version: int
    actions: np.ndarray
    logp: np.ndarray
    dist_inputs: np.ndarray
    state_out: np.ndarray | None = None
    """A recurrent module's states after the step (None: not recurrent)."""


def act_request(runner: int, seq: int, obs: Any, explore: bool, timestep: int,
                shared: SharedBlock | None = None, lane: int = 0, state: np.ndarray | None = None) -> bytes:
    """``shared``: the observations are in shared memory there (``obs`` is then not sent); ``state``: a recurrent
    module's states the rows act from."""
    msg = {"op": ACT, "runner": int(runner), "seq": int(seq), "explore": bool(explore), "timestep": int(timestep)}
    if lane:
        msg["lane"] = int(lane)
    if state is not None:
        msg["state"] = state
    if shared is None:
        msg["obs"] = obs
    else:
        msg["obs_shm"] = {"path": shared.path, "shape": [int(n) for n in shared.shape], "dtype": shared.dtype.str}
    return encode(msg, compress=False)


def actions_reply(seq: int, weights_version: int, actions: np.ndarray, logp: np.ndarray,
                  dist_inputs: np.ndarray, state_out: np.ndarray | None = None) -> bytes:
    msg = {"op": ACTIONS, "seq": int(seq), "weights_version": int(weights_version), "actions": actions,
           "logp": logp, "dist_inputs": dist_inputs}
    if state_out is not None:
        msg["state_out"] = state_out
    return encode(msg, compress=False)


ERROR_CODES = ("bad_request", "failed", "shm_unavailable")


def error_reply(seq: int, message: str, code: str = "failed") -> bytes:
    if code not in ERROR_CODES:
        raise ValueError(f"error code {code!r} is not one of {list(ERROR_CODES)}")
    return encode({"op": ERROR, "seq": int(seq), "message": str(message)[:4000], "code": code}, compress=False)


def _fields(frame: bytes, op: str, types: dict[str, type]) -> dict:
    msg = decode(frame, limits=LIMITS)
    if not isinstance(msg, dict) or msg.get("op") not in (op, ERROR):
        got = msg.get("op") if isinstance(msg, dict) else type(msg).__name__
        raise ProtocolError(f"expected an {op!r} message, got {got!r}")
    if msg["op"] == ERROR:
        return msg
    for key, kind in types.items():
        value = msg.get(key)
        if type(value) is not kind:  # bool is not int here: a flag where a count belongs is malformed
            raise ProtocolError(f"{op!r} message field {key!r} must be {kind.__name__}, got {type(value).__name__}")
    return msg


def read_request(frame: bytes) -> ActRequest:
    """A runner's frame -> its request; raise ProtocolError if it is not a well-formed ``act``."""
    msg = _fields(frame, ACT, {"runner": int, "seq": int, "explore": bool, "timestep": int})
    if msg["op"] == ERROR:
        raise ProtocolError("a runner sent an 'error' message")
    lane = msg.get("lane", 0)
    if type(lane) is not int or not 0 <= lane < MAX_LANES:
        raise ProtocolError(f"'act' message field 'lane' must be an int in [0, {MAX_LANES}), got {lane!r:.50}")
    if "obs_shm" in msg:
        if "obs" in msg:
            raise ProtocolError("an 'act' message carries 'obs' or 'obs_shm', not both")
        shared = _shared_block(msg["obs_shm"])
        request = ActRequest(msg["runner"], msg["seq"], msg["explore"], msg["timestep"], None, shared.shape[0], shared,
                             lane)
    else:
        rows = _rows(msg.get("obs"), "obs")
        request = ActRequest(msg["runner"], msg["seq"], msg["explore"], msg["timestep"], msg["obs"], rows, lane=lane)
    if "state" in msg:
        request.state = _states(msg["state"], request.rows, "state")
    return request


def _states(state: Any, rows: int, where: str) -> np.ndarray:
    """Recurrent states: float32 ``[rows, 2, cell]``, finite (what the module may be handed)."""
    if (not isinstance(state, np.ndarray) or state.dtype != np.float32 or state.ndim != 3 or len(state) != rows
            or state.shape[1] != 2 or state.shape[2] < 1):
        got = f"{state.dtype} {state.shape}" if isinstance(state, np.ndarray) else type(state).__name__
        raise ProtocolError(f"{where!r} must be a float32 array [{rows}, 2, cell], got {got}")
    if not np.isfinite(state).all():
        raise ProtocolError(f"{where!r} holds NaN or infinite values")
    return state


def _shared_block(ref: Any) -> SharedBlock:
    if not isinstance(ref, dict) or set(ref) != {"path", "shape", "dtype"}:
        raise ProtocolError(f"'obs_shm' must be a map of 'path', 'shape' and 'dtype', got {ref!r:.200}")
    path, shape, dtype = ref["path"], ref["shape"], ref["dtype"]
    if type(path) is not str or not path:
        raise ProtocolError(f"'obs_shm' path must be a non-empty str, got {path!r:.200}")
    if (type(shape) is not list or not 1 <= len(shape) <= 8
            or not all(type(n) is int and 0 <= n < 1 << 31 for n in shape) or shape[0] < 1):
        raise ProtocolError(f"'obs_shm' shape must be 1-8 non-negative ints, the first >= 1, got {shape!r:.200}")
    try:
        dt = np.dtype(dtype) if type(dtype) is str and len(dtype) <= 8 else None
    except TypeError:
        dt = None
    if dt is None or dt.kind not in SHM_DTYPE_KINDS or dt.hasobject:
        raise ProtocolError(f"'obs_shm' dtype must be a numeric dtype string such as '|u1' or '<f4', got {dtype!r:.50}")
    return SharedBlock(path, tuple(shape), dt)


def read_reply(frame: bytes) -> ActReply | ServerError:
    """A server's frame -> the actions, or the error it sent."""
    msg = _fields(frame, ACTIONS, {"seq": int, "weights_version": int})
    if msg["op"] == ERROR:
        code = msg.get("code", "failed")
        return ServerError(msg.get("seq") if type(msg.get("seq")) is int else -1, str(msg.get("message")),
                           code if code in ERROR_CODES else "failed")
    arrays = [msg.get(k) for k in ("actions", "logp", "dist_inputs")]
    if not all(isinstance(a, np.ndarray) for a in arrays) or len({len(a) for a in arrays}) != 1:
        raise ProtocolError("an 'actions' message needs arrays 'actions', 'logp' and 'dist_inputs' of one length")
    state_out = _states(msg["state_out"], len(arrays[0]), "state_out") if "state_out" in msg else None
    return ActReply(msg["seq"], msg["weights_version"], *arrays, state_out=state_out)


def _rows(obs: Any, where: str) -> int:
    """The one leading dimension every array of ``obs`` shares (at least 1 row)."""
    if isinstance(obs, np.ndarray):
        if obs.ndim == 0 or len(obs) == 0:
            raise ProtocolError(f"{where} must hold at least one row, got shape {obs.shape}")
        return len(obs)
    if isinstance(obs, dict):
        leaves = list(obs.values())
    elif isinstance(obs, (list, tuple)):
        leaves = list(obs)
    else:
        raise ProtocolError(f"{where} must be arrays (nested in dicts/lists), got {type(obs).__name__}")
    if not leaves:
        raise ProtocolError(f"{where} is empty")
    counts = {_rows(v, where) for v in leaves}
    if len(counts) != 1:
        raise ProtocolError(f"{where}: arrays with different numbers of rows {sorted(counts)}")
    return counts.pop()
