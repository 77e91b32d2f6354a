"""What a codec frame's msgpack meta may carry, checked both ways: plain messages and EpisodeChunks.

Apart from the framing (``protocols.codec``) because this is the schema, not the bytes: str dict
keys and bounded nesting for plain messages, and an EpisodeChunk as an array of its fields in
wire order (``CHUNK_FIELDS``), rebuilt and validated on decode.
"""
from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np

from protocols.codec_arrays import ArrayPacker
from protocols.episode import EpisodeChunk
from protocols.errors import ProtocolError

# An EpisodeChunk travels as a msgpack array of its fields in this (wire) order.
CHUNK_FIELDS = ("episode_id", "chunk_index", "obs", "actions", "rewards", "terminated",
                "truncated", "extra", "infos", "t_started", "weights_version",
                "env_runner_index", "env_index", "agent_id", "module_id", "look_back", "state_in")
if CHUNK_FIELDS != tuple(f.name for f in dataclasses.fields(EpisodeChunk)):
    raise ImportError("EpisodeChunk's fields changed: update the codec's wire order and VERSION")
_N_FIELDS = len(CHUNK_FIELDS)
# look_back and state_in are new and usually None: left off the wire then (trailing Nones dropped), so
# peers that predate them read these chunks
_N_REQUIRED = _N_FIELDS - 2

_CONTAINERS = (dict, list, tuple)


def check_keys(obj: Any, where: str, depth: int = 0) -> Any:
    """Encode side: dict keys must be str (msgpack would pack others; receivers refuse them)."""
    if isinstance(obj, dict):
        for key in obj:
            if not isinstance(key, str):
                raise ProtocolError(f"{where}: dict keys must be str, got {key!r:.60}")
        items: Any = obj.values()
    elif isinstance(obj, (list, tuple)):
        items = obj
    else:
        return obj
    if depth >= 500:  # msgpack's own limit is 511
        raise ProtocolError(f"{where}: nested too deeply to encode")
    for item in items:
        if isinstance(item, _CONTAINERS):
            check_keys(item, where, depth + 1)
    return obj


def chunk_to_list(chunk: EpisodeChunk, packer: ArrayPacker) -> list[Any]:
    chunk.validate()
    f = chunk.__dict__
    obs, actions, extra, infos = f["obs"], f["actions"], f["extra"], f["infos"]
    # bare arrays (the common case) skip msgpack's default hook; the rest must have str keys
    obs = packer.array(obs) if type(obs) is np.ndarray else check_keys(obs, "chunk obs")
    if type(actions) is np.ndarray:
        actions = packer.array(actions)
    else:
        check_keys(actions, "chunk actions")
    check_keys(extra, "chunk extra")
    if infos:
        check_keys(infos, "chunk infos")
    return [f["episode_id"], f["chunk_index"], obs, actions, packer.array(f["rewards"]),
            f["terminated"], f["truncated"], extra, infos, f["t_started"], f["weights_version"],
            f["env_runner_index"], f["env_index"], f["agent_id"], f["module_id"],
            *_optional(packer, f["look_back"], f["state_in"])]


def _optional(packer: ArrayPacker, *arrays: Any) -> list[Any]:
    """The optional trailing fields, without the Nones at the end."""
    out = [None if a is None else packer.array(a) for a in arrays]
    while out and out[-1] is None:
        out.pop()
    return out


_LEAVES = frozenset({str, int, float, bool, bytes, type(None), np.ndarray})


def check_plain(obj: Any, depth: int, max_depth: int, where: str) -> None:
    """Only the plain types, str dict keys, bounded depth (msgpack made the rest)."""
    t = type(obj)
    if t is dict:
        items = obj.values()
        for key in obj:
            if type(key) is not str:
                raise ProtocolError(f"{where}: dict keys must be str, got {type(key).__name__}")
    elif t is list:
        items = obj
    elif t in _LEAVES:
        return
    else:
        raise ProtocolError(f"{where}: unsupported value of type {t.__name__}")
    if depth >= max_depth:
        raise ProtocolError(f"{where}: nested deeper than max_depth={max_depth}")
    for item in items:
        if type(item) in _LEAVES:
            continue
        check_plain(item, depth + 1, max_depth, where)


def _structure(obj: Any, depth: int, max_depth: int, where: str) -> Any:
    """A nested obs/action structure: dicts (str keys) and tuples of arrays; lists -> tuples."""
    t = type(obj)
    if t is np.ndarray:
        return obj
    if depth >= max_depth:
        raise ProtocolError(f"{where}: nested deeper than max_depth={max_depth}")
    if t is list:
        return tuple(_structure(v, depth + 1, max_depth, where) for v in obj)
    if t is dict:
        for key in obj:
            if type(key) is not str:
                raise ProtocolError(f"{where}: dict keys must be str, got {type(key).__name__}")
        return {k: _structure(v, depth + 1, max_depth, where) for k, v in obj.items()}
    raise ProtocolError(f"{where} must hold numpy arrays in dicts/tuples, got {t.__name__}")


def chunk_from_list(v: Any, max_depth: int) -> EpisodeChunk:
    """A decoded chunk array -> a validated EpisodeChunk (``max_depth``: ``Limits.max_depth``)."""
    if type(v) is not list or not _N_REQUIRED <= len(v) <= _N_FIELDS:
        got = f"{len(v)} fields" if type(v) is list else type(v).__name__
        raise ProtocolError(f"an episode chunk must be an array of {_N_REQUIRED} to {_N_FIELDS} fields, got {got}")
    (episode_id, chunk_index, obs, actions, rewards, terminated, truncated, extra, infos,
     t_started, weights_version, env_runner_index, env_index, agent_id, module_id) = v[:_N_REQUIRED]
    look_back, state_in = (list(v[_N_REQUIRED:]) + [None, None])[:2]
    for name, value in (("look_back", look_back), ("state_in", state_in)):
        if value is not None and type(value) is not np.ndarray:
            raise ProtocolError(f"chunk {name} must be an array or absent, got {type(value).__name__}")
    if type(terminated) is not bool or type(truncated) is not bool:
        raise ProtocolError(f"chunk terminated/truncated must be bools, got {terminated!r:.20}/{truncated!r:.20}")
    if agent_id is not None and type(agent_id) is not str:
        raise ProtocolError(f"chunk agent_id must be a str or None, got {type(agent_id).__name__}")
    if module_id is not None and type(module_id) is not str:
        raise ProtocolError(f"chunk module_id must be a str or None, got {type(module_id).__name__}")
    if type(rewards) is not np.ndarray or rewards.dtype.kind != "f":
        raise ProtocolError(f"chunk rewards must be a float array, got {type(rewards).__name__}")
    depth = max_depth
    if type(obs) is not np.ndarray:
        obs = _structure(obs, 0, depth, "chunk obs")
    if type(actions) is not np.ndarray:
        actions = _structure(actions, 0, depth, "chunk actions")
    if type(extra) is not dict:
        raise ProtocolError(f"chunk extra must be a map, got {type(extra).__name__}")
    extra = _structure(extra, 0, depth, "chunk extra")
    if type(infos) is not list or any(type(i) is not dict for i in infos):
        raise ProtocolError("chunk infos must be a list of dicts")
    if infos:
        check_plain(infos, 0, depth, "chunk infos")
    # validate() checks ids, the int fields (msgpack gives exact ints), flags and row counts
    return EpisodeChunk(episode_id, chunk_index, obs, actions, rewards, terminated, truncated,
                        extra, infos, t_started, weights_version, env_runner_index, env_index,
                        agent_id, module_id, look_back, state_in).validate()
