"""MultiAgentEpisodes: a ``PolicyClient``'s multi-agent episodes (EXTERNAL.md section 10).

A multi-agent client reports what its env does and the server records the episode, so this side
keeps only what waits for the next request: the rewards ``log_returns`` added up per agent and the
agents it marked done. ``act`` sends them with the observations of the agents that observe now
(``ma_act``; only agents not done act) and returns their actions; ``end`` sends the last step with
``"__all__"`` (``ma_end``). Agent ids are checked here as the server would (``protocols.external_agents``),
so a caller's mistake raises at the call; observations are checked by the server against each
agent's module space (its error comes back as ``ServerError`` naming the agent).

A server that restarted forgets its episodes: the next call raises ``ServerError`` with
``unknown_episode``; start a new episode (the old one's steps since its last chunk are lost).
"""
from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Callable

from protocols import external as wire
from protocols.client_connection import Connection
from protocols.client_inference import plain_value
from protocols.external_agents import ALL, agent_ids, reward_pairs


@dataclass
class _Pending:
    """What waits for an episode's next request, and which agents may be given rewards and flags."""

    rewards: dict = field(default_factory=dict)
    terminated: list = field(default_factory=list)
    truncated: list = field(default_factory=list)
    acted: set = field(default_factory=set)
    """Agents that acted and are not done (as the server counts them)."""


class MultiAgentEpisodes:
    def __init__(self, conn: Connection, max_agents: Callable[[], int]) -> None:
        """``max_agents``: the server's ``limits.max_agents`` (from its latest welcome)."""
        self._conn = conn
        self._max_agents = max_agents
        self._running: dict[str, _Pending] = {}

    def __contains__(self, episode_id: object) -> bool:
        return episode_id in self._running

    def start(self, episode_id: str) -> None:
        if episode_id in self._running:
            raise ValueError(f"episode {episode_id!r} is already running; end it first or pick another id")
        self._conn.request({"op": wire.MA_START, "episode_id": episode_id})
        self._running[episode_id] = _Pending()

    def act(self, episode_id: str, observations: Mapping[Any, Any]) -> dict[Any, Any]:
        """``{agent_id: observation}`` of the agents that observe now -> ``{agent_id: action}`` for those
        that act (the agents marked done since the last call observe their final step and do not)."""
        if not isinstance(observations, Mapping) or not observations:
            raise ValueError(f"episode {episode_id!r} is multi-agent: give the observations as a non-empty dict "
                             f"{{agent_id: observation}}, got {type(observations).__name__}")
        header = {"op": wire.MA_ACT, "episode_id": episode_id, **self._step_fields(episode_id, observations)}
        reply, _ = self._conn.request(header)
        old = self._running[episode_id]
        # sent and recorded: a fresh step begins
        acted = (old.acted - set(old.terminated) - set(old.truncated)) | set(reply["agents"])
        self._running[episode_id] = _Pending(acted=acted)
        return dict(zip(reply["agents"], reply["actions"]))

    def log_returns(self, episode_id: str, rewards: Mapping[Any, float],
                    terminateds: Mapping[Any, bool] | None = None,
                    truncateds: Mapping[Any, bool] | None = None) -> None:
        """Rewards per agent for the actions they took (several calls add up), and the agents whose part
        of the episode ends with this step; all go with the next ``act`` or ``end``."""
        pending = self._pending(episode_id)
        if not isinstance(rewards, Mapping):
            raise ValueError(f"episode {episode_id!r} is multi-agent: give rewards as a dict {{agent_id: reward}}, "
                             f"got {type(rewards).__name__}")
        limit = self._max_agents()
        flagged = [aid for flags in (terminateds, truncateds) for aid, flag in (flags or {}).items()
                   if flag and aid != ALL]
        for what, aid in [("reward", aid) for aid in rewards] + [("done flag", aid) for aid in flagged]:
            if aid not in pending.acted:  # the server would refuse the next request (unknown_agent)
                raise ValueError(f"episode {episode_id!r}: {what} for agent {aid!r}, which has not acted in this "
                                 f"episode or is done; agents that acted: {sorted(map(str, pending.acted))}")
        added = reward_pairs([[aid, _number(aid, r)] for aid, r in rewards.items()], limit)
        for aid, r in added.items():
            pending.rewards[aid] = pending.rewards.get(aid, 0.0) + r
        for flags, into in ((terminateds, pending.terminated), (truncateds, pending.truncated)):
            for aid, flag in (flags or {}).items():
                if aid == ALL:
                    continue  # the episode's own end: end_episode() says it
                if flag and aid not in into:
                    into.append(aid)
        agent_ids(pending.terminated, limit, "terminated")
        agent_ids(pending.truncated, limit, "truncated")

    def end(self, episode_id: str, observations: Mapping[Any, Any] | None, truncated: bool) -> None:
        """The episode's last step: the final observations (of any agents that have one), the rewards and
        flags logged since the last ``act``, and ``"__all__"`` terminated (or truncated)."""
        fields = self._step_fields(episode_id, observations or {})
        fields["truncated" if truncated else "terminated"] = fields.get(
            "truncated" if truncated else "terminated", []) + [ALL]
        self._conn.request({"op": wire.MA_END, "episode_id": episode_id, **fields})
        del self._running[episode_id]

    def forget(self) -> None:
        """The server forgot every episode (a new server): so does this side."""
        self._running.clear()

    def _pending(self, episode_id: str) -> _Pending:
        pending = self._running.get(episode_id)
        if pending is None:
            raise ValueError(f"unknown multi-agent episode {episode_id!r}: call start_episode() first")
        return pending

    def _step_fields(self, episode_id: str, observations: Mapping[Any, Any]) -> dict[str, Any]:
        pending = self._pending(episode_id)
        agents = agent_ids(list(observations), self._max_agents())
        fields: dict[str, Any] = {"agents": agents, "obs": [plain_value(observations[a]) for a in agents]}
        if pending.rewards:
            fields["rewards"] = [[aid, r] for aid, r in pending.rewards.items()]
        if pending.terminated:
            fields["terminated"] = list(pending.terminated)
        if pending.truncated:
            fields["truncated"] = list(pending.truncated)
        return fields


def _number(agent_id: Any, reward: Any) -> float:
    try:
        return float(reward)
    except (TypeError, ValueError):
        raise ValueError(f"the reward {reward!r:.40} of agent {agent_id!r} is not a number") from None


def run_multi_agent_env(client: Any, env: Any, num_episodes: int, seed: int | None = None) -> list[float]:
    """Drive a multi-agent env (``reset()``/``step()`` with dicts keyed by agent id, ``"__all__"`` in the
    flag dicts) through ``client`` (a ``PolicyClient`` of a multi-agent server) for ``num_episodes``
    episodes; returns each episode's return, summed over its agents."""
    returns: list[float] = []
    while len(returns) < num_episodes:
        obs, _ = env.reset(seed=None if seed is None else seed + len(returns))
        eid = client.start_episode()
        total = 0.0
        while True:
            actions = client.get_action(eid, obs)
            obs, rewards, terminateds, truncateds, _ = env.step(actions)
            total += float(sum(rewards.values()))
            client.log_returns(eid, rewards, terminateds=terminateds, truncateds=truncateds)
            if terminateds.get(ALL) or truncateds.get(ALL):
                client.end_episode(eid, obs, truncated=not terminateds.get(ALL))
                break
        returns.append(total)
    return returns
