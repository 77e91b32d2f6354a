"""PettingZoo environments as ``MultiAgentEnv``s: ``PettingZooEnv`` wraps an AEC (turn-based) env,
``ParallelPettingZooEnv`` a parallel one. RLlib's names, and RLlib's ``.env`` to reach the wrapped env.

Both expose every agent's own spaces (``observation_spaces`` / ``action_spaces`` of
``possible_agents``), so agents with different spaces need no padding and the step checker accepts
them (RLlib's wrappers offered one shared space, which its own env check refused: ray#39453).
Observations pass through unchanged, action masks (``observation["action_mask"]``) included.
PettingZoo itself is not imported here: the wrappers use its API (``last``, ``agent_selection``,
``rewards``...) on whatever env they are given; ``pip install runnel-rl[pettingzoo]`` brings it.

The AEC wrapper, one ``step()``: the agent whose turn it is acts; then PettingZoo's clean-up turns of
finished agents (``step(None)``) run until a live agent's turn comes or no agent is left. The result
holds an observation for that next agent and final observations of the agents that finished, and
the rewards of **all** agents earned meanwhile -- read from ``env.rewards`` (each agent's reward of
the last PettingZoo step) after every PettingZoo step and summed -- so a player's loss is reported
in the step where the opponent wins, not only at its next turn. An agent that earns a reward before
its first observation of the episode has it kept and reported with that observation (rule 3 of
``actors.env.multi_agent_checks``); one that never gets an observation is not part of the episode.
"""
from __future__ import annotations

from typing import Any

from actors.env.multi_agent_checks import ALL, MultiAgentEnvError
from actors.env.multi_agent_env import MultiAgentEnv


class PettingZooWrapper(MultiAgentEnv):
    """What both wrappers share: the wrapped env as ``.env``, each agent's own spaces, how the episode's
    end is flagged, ``render`` and ``close``."""

    def __init__(self, env: Any) -> None:
        super().__init__()
        self.env = env
        self.possible_agents = list(env.possible_agents)
        self.observation_spaces = {a: env.observation_space(a) for a in self.possible_agents}
        self.action_spaces = {a: env.action_space(a) for a in self.possible_agents}
        self.agents = list(self.possible_agents)
        self.ended: dict[Any, str] = {}
        """Agent -> "terminated" or "truncated", for the agents that finished this episode."""

    def mark_ended(self, agent: Any, terminated: bool) -> None:
        """Note that ``agent`` finished (terminated wins when PettingZoo sets both flags)."""
        self.ended.setdefault(agent, "terminated" if terminated else "truncated")

    def end_flags(self) -> tuple[bool, bool]:
        """``"__all__"`` of (terminateds, truncateds): (False, False) while an agent plays on; at the end
        truncated when every agent was truncated (their values are then bootstrapped), else terminated."""
        if self.agents:
            return False, False
        all_truncated = bool(self.ended) and all(how == "truncated" for how in self.ended.values())
        return not all_truncated, all_truncated

    def render(self) -> Any:
        return self.env.render()

    def close(self) -> None:
        self.env.close()


class PettingZooEnv(PettingZooWrapper):
    """A PettingZoo AEC env (``pettingzoo.AECEnv``): one agent acts per step (module docstring)."""

    def __init__(self, env: Any) -> None:
        if not (hasattr(env, "last") and hasattr(env, "possible_agents")):
            raise TypeError(f"PettingZooEnv wraps a PettingZoo AEC env (with last() and agent_selection); "
                            f"{type(env).__name__} is not one -- for a parallel env use ParallelPettingZooEnv")
        super().__init__(env)
        self._observed: set = set()
        self._held: dict[Any, float] = {}

    def reset(self, *, seed: int | None = None, options: dict | None = None) -> tuple[dict, dict]:
        self.env.reset(seed=seed, options=options)
        self._observed, self._held, self.ended = set(), {}, {}
        obs, rewards, terminateds, truncateds, infos = {}, {}, {}, {}, {}
        self._advance(obs, rewards, terminateds, truncateds, infos)
        self.agents = list(self.env.agents)
        return obs, infos

    def step(self, action_dict: dict) -> tuple[dict, dict, dict, dict, dict]:
        if not self.env.agents:
            raise MultiAgentEnvError("step() after the episode ended: reset() first")
        agent = self.env.agent_selection
        if agent not in action_dict:
            raise MultiAgentEnvError(f"it is agent {agent!r}'s turn, but the actions are for {list(action_dict)}: "
                                     f"an AEC env takes the action of the agent that got the observation", agent)
        other = next((a for a in action_dict if a != agent), None)
        if other is not None:
            raise MultiAgentEnvError(f"an action for agent {other!r}, but it is agent {agent!r}'s turn: an AEC env "
                                     f"takes one action per step, from the agent that got the observation", other)
        obs, rewards, terminateds, truncateds, infos = {}, {}, {}, {}, {}
        self.env.step(action_dict[agent])
        self._collect_rewards(rewards)
        self._advance(obs, rewards, terminateds, truncateds, infos)
        self.agents = list(self.env.agents)
        terminateds[ALL], truncateds[ALL] = self.end_flags()
        return obs, rewards, terminateds, truncateds, infos

    def _advance(self, obs: dict, rewards: dict, terminateds: dict, truncateds: dict, infos: dict) -> None:
        """Run finished agents' clean-up turns until a live agent's turn (it gets the observation) or the end."""
        env = self.env
        while env.agents:
            agent = env.agent_selection
            observation, _, terminated, truncated, info = env.last()
            obs[agent], infos[agent] = observation, info
            terminateds[agent], truncateds[agent] = bool(terminated), bool(truncated)
            if agent not in self._observed:
                self._observed.add(agent)
                if agent in self._held:
                    rewards[agent] = rewards.get(agent, 0.0) + self._held.pop(agent)
            if not (terminated or truncated):
                return
            self.mark_ended(agent, bool(terminated))
            env.step(None)  # PettingZoo removes a finished agent on its turn
            self._collect_rewards(rewards)

    def _collect_rewards(self, rewards: dict) -> None:
        """Add every agent's reward of the PettingZoo step just taken (kept for agents not yet observed;
        a finished agent has left ``env.rewards`` with its clean-up turn)."""
        for agent, reward in self.env.rewards.items():
            if agent in self._observed:
                rewards[agent] = rewards.get(agent, 0.0) + float(reward)
            elif reward:
                self._held[agent] = self._held.get(agent, 0.0) + float(reward)


class ParallelPettingZooEnv(PettingZooWrapper):
    """A PettingZoo parallel env (``pettingzoo.ParallelEnv``): every live agent acts every step."""

    def __init__(self, env: Any) -> None:
        if hasattr(env, "last") or not hasattr(env, "possible_agents"):
            raise TypeError(f"ParallelPettingZooEnv wraps a PettingZoo parallel env; {type(env).__name__} is "
                            f"not one -- for an AEC env use PettingZooEnv (or pettingzoo.utils.aec_to_parallel)")
        super().__init__(env)

    @property
    def par_env(self) -> Any:
        """RLlib's name for the wrapped parallel env (``.env`` here)."""
        return self.env

    def reset(self, *, seed: int | None = None, options: dict | None = None) -> tuple[dict, dict]:
        obs, infos = self.env.reset(seed=seed, options=options)
        self.ended = {}
        self.agents = list(self.env.agents)
        return dict(obs), dict(infos or {})

    def step(self, action_dict: dict) -> tuple[dict, dict, dict, dict, dict]:
        obs, rewards, terminations, truncations, infos = self.env.step(action_dict)
        terminateds = {a: bool(f) for a, f in terminations.items()}
        truncateds = {a: bool(f) for a, f in truncations.items()}
        for agent in set(terminateds) | set(truncateds):
            if terminateds.get(agent) or truncateds.get(agent):
                self.mark_ended(agent, bool(terminateds.get(agent)))
        # PettingZoo drops finished agents from env.agents; an env that keeps them has them in ``ended``
        self.agents = [a for a in self.env.agents if a not in self.ended]
        terminateds[ALL], truncateds[ALL] = self.end_flags()
        return dict(obs), {a: float(r) for a, r in rewards.items()}, terminateds, truncateds, dict(infos)
