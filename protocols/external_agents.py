"""The agent lists of the external-client protocol's multi-agent messages (EXTERNAL.md section 10).

A multi-agent ``ma_act`` or ``ma_end`` names agents in plain msgpack lists -- ``agents`` (with one
observation each in ``obs``), ``rewards`` as ``[agent_id, reward]`` pairs, ``terminated`` and
``truncated`` as lists of agent ids (``"__all__"`` for the whole episode, in ``ma_end`` only). Lists,
not maps: agent ids may be ints, and header maps have str keys only.

Shared by the server (which trusts nothing) and the Python client (which checks what it sends, so a
caller's mistake raises at the call instead of coming back as an error). The shape of a list is a
wire rule (``ProtocolError``: ``bad_message``); what an agent id or reward holds is a value, refused
with an ``AgentError`` that names the agent and its error code.
"""
from __future__ import annotations

import math
from typing import Any

from protocols import external as wire
from protocols.errors import ProtocolError

MAX_AGENT_ID_LEN = 64
"""Longest str agent id (printable ASCII), as long as an episode id."""
ALL = "__all__"
"""The key of the episode-wide flag in ``terminated``/``truncated``; never an agent id."""


class AgentError(ProtocolError):
    """An agent refused for its value: ``code`` is the error code, ``agent_id`` the agent (None: no one
    agent), ``limit`` the limit passed (``too_many_agents``)."""

    def __init__(self, code: str, agent_id: Any, message: str, limit: int | None = None) -> None:
        super().__init__(message)
        self.code, self.agent_id, self.limit = code, agent_id, limit

    def reply(self, rid: int, episode_id: str) -> dict[str, Any]:
        """The ``error`` reply: the code, the agent (as sent) and the episode."""
        fields: dict[str, Any] = {"episode_id": episode_id, "agent_id": _wire_safe(self.agent_id)}
        if self.limit is not None:
            fields["limit"] = self.limit
        return wire.error(rid, self.code, f"episode {episode_id!r}: {self}", **fields)


def _wire_safe(agent_id: Any) -> Any:
    """An agent id as the reply can carry it (a refused one may be anything msgpack decoded)."""
    if agent_id is None or isinstance(agent_id, (str, int)) and not isinstance(agent_id, bool):
        return agent_id if not isinstance(agent_id, str) else agent_id[:80]
    return repr(agent_id)[:80]


def check_agent_id(agent_id: Any) -> Any:
    """``agent_id`` if it is one (a str of 1 to 64 printable ASCII characters other than "__all__", or an
    int that fits 64 bits), else ``AgentError(bad_agent)``."""
    if isinstance(agent_id, bool) or not isinstance(agent_id, (str, int)):
        raise AgentError(wire.BAD_AGENT, agent_id, f"agent id {agent_id!r:.80} is a {type(agent_id).__name__}; "
                         f"agent ids are str or int")
    if isinstance(agent_id, int):
        if not -(1 << 63) <= agent_id < 1 << 63:
            raise AgentError(wire.BAD_AGENT, agent_id, f"agent id {agent_id} does not fit 64 bits")
        return agent_id
    if agent_id == ALL:
        raise AgentError(wire.BAD_AGENT, agent_id, f"{ALL!r} is no agent: it names the whole episode, in "
                         f"ma_end's terminated/truncated only")
    if not 0 < len(agent_id) <= MAX_AGENT_ID_LEN or not agent_id.isascii() or not agent_id.isprintable():
        raise AgentError(wire.BAD_AGENT, agent_id, f"agent id {agent_id!r:.80} must be 1 to {MAX_AGENT_ID_LEN} "
                         f"printable ASCII characters")
    return agent_id


def agent_ids(raw: list, limit: int, field: str = "agents") -> list[Any]:
    """A list of distinct agent ids, at most ``limit`` of them (two ids whose str() is alike count as one
    agent: chunks carry the str)."""
    if len(raw) > limit:
        raise AgentError(wire.TOO_MANY_AGENTS, None, f"{len(raw)} agents in {field!r}; limits.max_agents = "
                         f"{limit}", limit=limit)
    seen: dict[str, Any] = {}
    for aid in raw:
        check_agent_id(aid)
        other = seen.get(str(aid), seen)
        if other is not seen:
            twice = other == aid and type(other) is type(aid)
            raise AgentError(wire.BAD_AGENT, aid, f"agent {aid!r} is named twice in {field!r}" if twice else
                             f"agents {other!r} and {aid!r} in {field!r} have the same str(), which chunks carry: "
                             f"give them distinct ids")
        seen[str(aid)] = aid
    return list(raw)


def reward_pairs(raw: Any, limit: int) -> dict[Any, float]:
    """``rewards``: ``[[agent_id, reward], ...]`` -> ``{agent_id: reward}`` (an agent at most once; finite)."""
    if not isinstance(raw, list) or any(not isinstance(p, list) or len(p) != 2 for p in raw):
        raise ProtocolError(f"'rewards' must be a list of [agent_id, reward] pairs, got {raw!r:.80}")
    ids = agent_ids([p[0] for p in raw], limit, "rewards")
    out = {}
    for aid, (_, reward) in zip(ids, raw):
        if isinstance(reward, bool) or not isinstance(reward, (int, float)):
            raise ProtocolError(f"the reward of agent {aid!r} must be a number, got {type(reward).__name__}")
        if not math.isfinite(reward):
            raise AgentError(wire.BAD_AGENT, aid, f"the reward of agent {aid!r} is {reward}; rewards must be finite")
        out[aid] = float(reward)
    return out


def done_flags(raw: Any, limit: int, field: str, allow_all: bool) -> tuple[list[Any], bool]:
    """``terminated``/``truncated``: agent ids, and whether ``"__all__"`` is among them (ma_end only)."""
    if not isinstance(raw, list):
        raise ProtocolError(f"{field!r} must be a list of agent ids, got {type(raw).__name__}")
    whole = ALL in raw
    if whole and not allow_all:
        raise AgentError(wire.BAD_AGENT, ALL, f"{ALL!r} in ma_act's {field!r}: an episode ends with ma_end")
    return agent_ids([a for a in raw if a != ALL], limit, field), whole
