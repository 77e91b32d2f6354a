"""What a ``MultiAgentEpisode`` refuses: the checks of what an env and a policy hand it, as plain functions.

Apart from ``protocols.multi_agent_episode`` because the rules of what can be recorded are read on their
own, and the recording reads better without them. Each check runs before anything of the call it guards
is recorded, and raises a ``ValueError`` that names the agent, what is wrong and the fix; the episode
passes in the state a check needs. (``actors.env.multi_agent_checks`` is the env runner's fuller check of
an env, against its spaces; these are the ones the recorder cannot do without.)
"""
from __future__ import annotations

from collections.abc import Callable, Collection, Mapping
from itertools import repeat
from operator import is_
from typing import Any

from protocols.agent_record import AgentID, AgentRecord

ALL = "__all__"
"""The key of the episode-wide flags in terminateds/truncateds; never an agent id."""


def check_look_back(look_back: Mapping[str, int]) -> None:
    for mid, n in look_back.items():
        if n < 0:
            raise ValueError(f"look_back[{mid!r}] = {n}: give a number of rows >= 0")


class MappingError(ValueError):
    """``policy_mapping_fn`` raised, or named no module that exists. The user's error: a runner meeting it is
    not restarted (the restarted one would meet it again), the run ends with this message instead
    (``runnel_user_code``, read by the stage groups and the streaming thread's health check)."""

    runnel_user_code = True


def mapped_module(policy_mapping_fn: Callable[..., Any], agent_id: AgentID, episode: Any,
                  module_ids: Collection[str] | None) -> str:
    """The module ``policy_mapping_fn`` picks for ``agent_id``, checked; a ``MappingError`` otherwise."""
    try:
        module_id = policy_mapping_fn(agent_id, episode)
    except Exception as err:
        raise MappingError(f"policy_mapping_fn raised {type(err).__name__} for agent {agent_id!r}: {err}") from err
    check_module_id(agent_id, module_id, module_ids)
    return module_id


def check_module_id(agent_id: AgentID, module_id: Any, module_ids: Collection[str] | None) -> None:
    """What ``policy_mapping_fn`` gave for ``agent_id`` must name a module that exists (any str when
    ``module_ids`` is None)."""
    if not isinstance(module_id, str) or not module_id:
        raise MappingError(f"policy_mapping_fn mapped agent {agent_id!r} to {module_id!r}; "
                         "it must return a module id (a non-empty str)")
    if module_ids is not None and module_id not in module_ids:
        raise MappingError(f"policy_mapping_fn mapped agent {agent_id!r} to module {module_id!r}, which "
                         f"does not exist; modules: {sorted(module_ids)}. Add it to "
                         "`.multi_agent(policies=...)` or fix the mapping")


def check_reset(obs: Mapping[AgentID, Any], episode_id: str, started: bool) -> None:
    if started:
        raise ValueError(f"add_reset called twice on episode {episode_id}: an episode starts once; "
                         "record the next reset in a new MultiAgentEpisode")
    if not obs:
        raise ValueError("reset gave no observation for any agent: at least one agent must observe to act")


def check_running(what: str, episode_id: str, started: bool, done: bool) -> None:
    if not started:
        raise ValueError(f"{what} before add_reset: give episode {episode_id} the reset observations first")
    if done:
        raise ValueError(f"{what} on episode {episode_id}, which is already done; record the next episode "
                         "in a new MultiAgentEpisode")


def check_joining(joining: list[AgentID], wire_ids: Mapping[str, AgentID],
                  module_for: Callable[[AgentID], str]) -> None:
    """Agents about to join: valid ids, distinct on the wire (``wire_ids``: str(id) -> id of those joined),
    each mapped to a module (``module_for``, which remembers the mapping)."""
    wire_ids = dict(wire_ids)
    for aid in joining:
        if aid == ALL:
            raise ValueError(f"observation under {ALL!r}, which is not an agent id: it is the key of the "
                             "episode-wide flags in terminateds/truncateds only")
        if not isinstance(aid, (str, int)) or isinstance(aid, bool):
            raise ValueError(f"agent id {aid!r} is a {type(aid).__name__}; agent ids must be str or int")
        other = wire_ids.setdefault(str(aid), aid)
        if other != aid or type(other) is not type(aid):
            raise ValueError(f"agents {other!r} and {aid!r} have the same str() and would be one agent on "
                             "the wire: give them distinct ids")
        module_for(aid)


def check_extras(actions: Mapping[AgentID, Any], extras: Mapping[AgentID, Any]) -> None:
    for aid in extras:
        if aid not in actions:
            raise ValueError(f"extras for agent {aid!r}, which is given no action: "
                             "pass an agent's extras with its action")


def check_actions(agent_ids: list[AgentID], extras: list[tuple[tuple, tuple]], agents: Mapping[AgentID, AgentRecord],
                  agents_to_act: Callable[[], list[AgentID]]) -> None:
    """Actions only for agents to act, each with the policy outputs (``extras``: (keys, row)) it had before."""
    for aid, (keys, _) in zip(agent_ids, extras):
        a = agents.get(aid)
        if a is None or not a.ready:
            raise ValueError(_not_ready(aid, a, agents_to_act()))
        if a.extra_keys is not None and keys != a.extra_keys and set(keys) != set(a.extra_keys):
            raise ValueError(f"agent {aid!r}: extra keys changed mid-episode, {sorted(a.extra_keys)} -> "
                             f"{sorted(keys)}; give an agent the same policy outputs at every step")


def _not_ready(aid: AgentID, a: AgentRecord | None, to_act: list[AgentID]) -> str:
    if a is None:
        why = "it has had no observation in this episode"
    elif a.done:
        why = "it is done"
    else:
        why = "it already acted and has had no new observation since"
    return f"action for agent {aid!r}, but {why}; agents that may act now: {to_act}"


def plain_step(obs: Mapping[AgentID, Any], rewards: Mapping[AgentID, float], terminateds: Mapping[AgentID, bool],
               truncateds: Mapping[AgentID, bool], playing: Collection[AgentID]) -> bool:
    """The common step, recorded without looking at each rule: every observation and reward is for an
    agent that is ``playing`` (joined, not done), rewards are floats, and no flag is set."""
    return (obs.keys() <= playing and rewards.keys() <= playing
            and all(map(is_, map(type, rewards.values()), repeat(float)))  # no Python frame per reward
            and not any(terminateds.values()) and not any(truncateds.values()))


def check_step(obs: Mapping[AgentID, Any], rewards: Mapping[AgentID, float], agents: Mapping[AgentID, AgentRecord],
               episode_id: str) -> None:
    """Refuse a step that cannot be recorded, before anything of it is (those joining are ``check_joining``'s)."""
    for aid in obs:
        a = agents.get(aid)
        if a is not None and a.done:
            raise ValueError(f"observation for agent {aid!r}, which finished earlier in episode {episode_id}: "
                             "a done agent must not come back in the same episode")
    for aid, r in rewards.items():
        if type(r) is not float and (isinstance(r, (str, bytes)) or not _is_number(r)):
            raise ValueError(f"reward {r!r:.40} for agent {aid!r} is not a number; rewards must be floats")
        a = agents.get(aid)
        if a is not None and a.done and float(r) != 0.0:
            raise ValueError(f"reward {r!r} for agent {aid!r}, which finished earlier in episode {episode_id}: "
                             "give an agent its rewards up to the step that ends it")


def agent_flags(aid: AgentID, terminateds: Mapping, truncateds: Mapping, all_term: bool,
                all_trunc: bool) -> tuple[bool, bool]:
    """An agent's (terminated, truncated) this step, the episode-wide flags included; terminated wins."""
    term = all_term or bool(terminateds.get(aid, False))
    return term, (all_trunc or bool(truncateds.get(aid, False))) and not term


def _is_number(value: Any) -> bool:
    try:
        float(value)
    except (TypeError, ValueError):
        return False
    return True
