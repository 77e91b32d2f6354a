"""Playing multi-agent episodes through the step checker, for the multi-agent env tests.

``play_episode`` drives any ``MultiAgentEnv`` the way a sampler will: actions only for
``checker.agents_to_act``, every reset/step result and action dict checked. ``Transitions`` applies
the sampler's reward rules (``actors.env.multi_agent_checks``, rules 2-4) to the results, so the
tests can see what each agent's transitions would be paid.
"""
from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any, Callable

import numpy as np

from actors.env.multi_agent_checks import ALL, MultiAgentStepChecker

Pick = Callable[[Any, Any, Any, np.random.Generator], Any]
"""(agent, its observation, env, rng) -> its action."""


def random_action(agent: Any, obs: Any, env: Any, rng: np.random.Generator) -> Any:
    """A uniformly random action; a legal one when the observation carries an action mask."""
    if isinstance(obs, dict) and "action_mask" in obs:
        return int(rng.choice(np.flatnonzero(obs["action_mask"])))
    space = env.get_action_space(agent)
    space.seed(int(rng.integers(2**31)))
    return space.sample()


class Transitions:
    """Per-agent transition rewards, by the sampler's rules: a transition opens when the agent acts and
    closes at its next observation, or when it finishes (with its last observation repeated when it
    has no final one); rewards accumulate to the open transition; rewards before the agent's first
    action belong to no transition (``loose``)."""

    def __init__(self) -> None:
        self.open: dict[Any, float] = {}
        self.closed: dict[Any, list[float]] = defaultdict(list)
        self.loose: dict[Any, float] = defaultdict(float)
        self.closed_without_obs: list[Any] = []

    def add(self, actions: dict, result: tuple) -> None:
        obs, rewards, terminateds, truncateds, _ = result
        for agent in actions:
            self.open[agent] = 0.0
        for agent, reward in rewards.items():
            if agent in self.open:
                self.open[agent] += reward
            else:
                self.loose[agent] += reward
        over = terminateds[ALL] or truncateds[ALL]
        for agent in list(self.open):
            finished = over or terminateds.get(agent, False) or truncateds.get(agent, False)
            if agent in obs or finished:
                self.closed[agent].append(self.open.pop(agent))
                if agent not in obs:
                    self.closed_without_obs.append(agent)


@dataclass
class Episode:
    returns: dict = field(default_factory=lambda: defaultdict(float))
    steps: int = 0
    moves: list = field(default_factory=list)
    """(agent, action) in the order they were sent."""
    log: list = field(default_factory=list)
    """(action dict, step result) of every step."""
    last: tuple = ()
    """The final step's result."""
    transitions: Transitions = field(default_factory=Transitions)
    first_obs: dict = field(default_factory=dict)


def play_episode(env: Any, rng: np.random.Generator, pick: Pick = random_action, seed: int | None = None,
                 checker: MultiAgentStepChecker | None = None, max_steps: int = 10_000) -> Episode:
    """One episode of ``env`` with actions from ``pick``, every result checked."""
    checker = checker or MultiAgentStepChecker.for_env(env)
    obs, _ = checker.check_reset(env.reset(seed=seed))
    episode = Episode(first_obs=dict(obs))
    while episode.steps < max_steps:
        actions = {agent: pick(agent, obs[agent], env, rng) for agent in checker.agents_to_act}
        episode.moves.extend(actions.items())
        result = checker.check_step(env.step(checker.check_actions(actions)))
        episode.steps += 1
        episode.log.append((actions, result))
        episode.transitions.add(actions, result)
        for agent, reward in result[1].items():
            episode.returns[agent] += reward
        obs = result[0]
        if checker.episode_over:
            episode.last = result
            return episode
    raise AssertionError(f"no episode end within {max_steps} steps")
