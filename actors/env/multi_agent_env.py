"""What a user's multi-agent environment is written against: ``MultiAgentEnv``, with RLlib's new-stack
names and meaning, and ``make_multi_agent``, which turns a single-agent env into one of n agents.

Plain dicts in, plain dicts out, so a sampler consumes them without adapters: ``reset()`` returns
``(observations, infos)`` and ``step(actions)`` ``(observations, rewards, terminateds, truncateds,
infos)``, each keyed by agent id (str or int), with ``"__all__"`` in ``terminateds``/``truncateds``.
Which agents may appear when, and how rewards and finished agents are treated, is written once, in
``actors.env.multi_agent_checks``, whose ``MultiAgentStepChecker`` enforces it.
"""
from __future__ import annotations

import copy
import math
from itertools import repeat
from operator import is_
from typing import Any, Callable, Union

import gymnasium as gym
import numpy as np

from actors.env.multi_agent_checks import ALL, MultiAgentEnvError, reward_value
from actors.env.space_values import problem_finder

AgentID = Union[str, int]
MultiAgentDict = dict


class MultiAgentEnv(gym.Env):
    """An environment hosting several agents, each with its own observation and action space.

    Set ``possible_agents`` (every agent id that may ever appear), ``agents`` (those in the current
    episode; it may change during it) and the dicts ``observation_spaces`` / ``action_spaces`` (agent id
    -> space) in ``__init__``, or override ``get_observation_space`` / ``get_action_space``, which are
    what runnel reads. An env written for RLlib's old stack, with one ``observation_space`` for all
    agents (or a ``gym.spaces.Dict`` keyed by agent id), is read the same way RLlib reads it.
    """

    observation_spaces: dict[AgentID, gym.Space] | None = None
    action_spaces: dict[AgentID, gym.Space] | None = None
    agents: list[AgentID] = []
    possible_agents: list[AgentID] = []
    observation_space: gym.Space | None = None
    action_space: gym.Space | None = None

    def __init__(self) -> None:
        super().__init__()
        # instance lists (the class attributes are shared), each inferred from the other when only one is set
        self.agents = list(self.agents or self.possible_agents or self.observation_spaces or ())
        self.possible_agents = list(self.possible_agents or self.agents)

    def reset(self, *, seed: int | None = None, options: dict | None = None) -> tuple[dict, dict] | None:  # type: ignore[override]
        """Start an episode and return (observations, infos) of the agents that act first.

        Here, as in gymnasium, it only seeds ``self.np_random``: subclasses call
        ``super().reset(seed=seed)`` first, then return their observations."""
        super().reset(seed=seed, options=options)
        return None

    def step(self, action_dict: dict) -> tuple[dict, dict, dict, dict, dict]:  # type: ignore[override]
        """Apply the actions of the agents that had an observation; return (observations, rewards,
        terminateds, truncateds, infos), with ``terminateds["__all__"]`` / ``truncateds["__all__"]``."""
        raise NotImplementedError(f"{type(self).__name__} must implement step(action_dict)")

    def render(self) -> Any:
        """Nothing by default."""
        return None

    def get_observation_space(self, agent_id: AgentID) -> gym.Space:
        """The observation space of ``agent_id``."""
        return self._space_of(agent_id, self.observation_spaces, self.observation_space, "observation")

    def get_action_space(self, agent_id: AgentID) -> gym.Space:
        """The action space of ``agent_id``."""
        return self._space_of(agent_id, self.action_spaces, self.action_space, "action")

    @property
    def num_agents(self) -> int:
        """How many agents are in the current episode (``len(agents)``)."""
        return len(self.agents)

    @property
    def max_num_agents(self) -> int:
        """How many agents may ever appear (``len(possible_agents)``)."""
        return len(self.possible_agents)

    def _space_of(self, agent_id: AgentID, spaces: dict | None, single: gym.Space | None, kind: str) -> gym.Space:
        if spaces is not None:
            if agent_id in spaces:
                return spaces[agent_id]
            raise MultiAgentEnvError(
                f"{type(self).__name__} has no {kind} space for agent {agent_id!r}: {kind}_spaces holds "
                f"{list(spaces)}; add {kind}_spaces[{agent_id!r}]", agent_id)
        if isinstance(single, gym.spaces.Dict) and agent_id in single.spaces:
            return single[agent_id]  # RLlib's old stack: a Dict keyed by agent id
        if single is None:
            raise MultiAgentEnvError(
                f"{type(self).__name__} defines no {kind} spaces: set self.{kind}_spaces = {{agent_id: space, ...}} "
                f"for every agent of possible_agents in __init__", agent_id)
        return single  # RLlib's old stack: one space for every agent


class SingleAgentCopies(MultiAgentEnv):
    """``num_agents`` copies of one single-agent env in one multi-agent env: agents 0..n-1, agent i
    playing copy i. An agent that is done stops appearing; ``"__all__"`` comes when every agent is done
    -- truncated when every agent was truncated (so their values are bootstrapped), terminated
    otherwise. Made by ``make_multi_agent``; subclasses implement ``make_single(config)``.

    It checks what its copies return as it builds the dicts (``checks_itself``): each reward one finite
    number (given back as a float), each flag a bool, each agent's final observation inside its space.
    The dicts' structure is this class's own, so env runners do not put the step checker around it;
    the observations agents act on are checked a batch at a time by the sampler, as for every env.
    """

    def __init__(self, config: dict | None = None) -> None:
        super().__init__()
        # a copy: the caller's dict (an EnvContext, with its worker_index...) keeps its num_agents
        config = copy.copy(config) if config is not None else {}
        num = config.pop("num_agents", 1)
        if isinstance(num, bool) or not isinstance(num, (int, np.integer)) or num < 1:
            raise MultiAgentEnvError(f"num_agents = {num!r}: the number of agents is a whole number of 1 or more, "
                                     f"e.g. env_config={{'num_agents': 2}}")
        self.envs = [self.make_single(config) for _ in range(int(num))]
        self.possible_agents = list(range(int(num)))
        self.agents = list(self.possible_agents)
        self.observation_spaces = {i: env.observation_space for i, env in enumerate(self.envs)}
        self.action_spaces = {i: env.action_space for i, env in enumerate(self.envs)}
        self.ended: dict[int, str] = {}
        """Agent -> "terminated" or "truncated", for the agents done in this episode."""
        self._finders: dict[int, Any] | None = None  # built at the first final observation; not pickled

    def make_single(self, config: dict) -> gym.Env:
        """One copy of the single-agent env, from the env config without ``num_agents``."""
        raise NotImplementedError(f"{type(self).__name__} must implement make_single(config)")

    def reset(self, *, seed: int | None = None, options: dict | None = None) -> tuple[dict, dict]:
        """Reset every copy. With a seed, copy i gets ``seed + i``: RLlib gives all copies the same seed,
        which starts every agent in the same state."""
        super().reset(seed=seed, options=options)
        self.ended = {}
        self.agents = list(self.possible_agents)
        obs, infos = {}, {}
        for i, env in enumerate(self.envs):
            obs[i], infos[i] = env.reset(seed=None if seed is None else seed + i, options=options)
        return obs, infos

    def step(self, action_dict: dict) -> tuple[dict, dict, dict, dict, dict]:
        if not action_dict:
            raise MultiAgentEnvError(f"step() got no actions; the agents not done, {self.agents}, act every step")
        spaces, done = self.observation_spaces, self.ended  # once, not once per agent
        for agent in action_dict:
            if agent not in spaces:
                raise MultiAgentEnvError(f"an action for agent {agent!r}; this env's agents are "
                                         f"{self.possible_agents}", agent)
            if agent in done:
                raise MultiAgentEnvError(f"an action for agent {agent!r}, which is {done[agent]}: a done agent "
                                         f"does not act (the agents still playing: {self.agents})", agent)
        agents = list(action_dict)
        obs, rewards, terms, truncs, infos = [], [], [], [], []
        envs = self.envs
        for agent, action in action_dict.items():
            o, reward, term, trunc, info = envs[agent].step(action)
            if type(term) is not bool or type(trunc) is not bool:
                term, trunc = _flag(agent, "terminated", term), _flag(agent, "truncated", trunc)
            obs.append(o)
            rewards.append(reward if type(reward) is float and reward - reward == 0.0 else reward_value(agent, reward))
            terms.append(term)
            truncs.append(trunc)
            infos.append(info)
            if term or trunc:
                self.end_agent(agent, o, trunc and not term)
        terminateds, truncateds = dict(zip(agents, terms)), dict(zip(agents, truncs))
        if self.agents and len(self.agents) == len(self.possible_agents):  # nobody finished: the episode goes on
            terminateds[ALL] = truncateds[ALL] = False
        else:
            over = not self.agents
            all_truncated = over and all(how == "truncated" for how in self.ended.values())
            terminateds[ALL] = over and not all_truncated
            truncateds[ALL] = all_truncated
        return dict(zip(agents, obs)), dict(zip(agents, rewards)), terminateds, truncateds, dict(zip(agents, infos))

    def end_agent(self, agent: int, obs: Any, truncated: bool) -> None:
        """Agent ``agent``'s copy ended (truncated, or else terminated) on ``obs``: checked against its space,
        and the agent stops playing (``step`` calls it; so does ``CopiesStepper``)."""
        if self._finders is None:
            self._finders = {i: problem_finder(space) for i, space in self.observation_spaces.items()}
        why = self._finders[agent](obs)  # a final observation: no action is taken on it
        if why is not None:
            raise MultiAgentEnvError(f"the final observation of agent {agent} {why}; it must lie in the "
                                     f"observation space of its copy, {self.observation_spaces[agent]}", agent)
        self.ended[agent] = "truncated" if truncated else "terminated"
        self.agents = [a for a in self.possible_agents if a not in self.ended]

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "_finders": None}  # closures: rebuilt where they are needed

    def render(self) -> Any:
        """The copies' frames side by side (along the shorter side), or a list when they are not images."""
        frames = [env.render() for env in self.envs]
        if frames and all(isinstance(f, np.ndarray) and f.ndim == 3 for f in frames):
            return np.concatenate(frames, axis=0 if frames[0].shape[1] > frames[0].shape[0] else 1)
        return frames

    def close(self) -> None:
        for env in self.envs:
            env.close()


def checks_itself(env: Any) -> bool:
    """Whether ``env`` is a ``SingleAgentCopies`` whose ``reset`` and ``step`` are that class's own (which check
    what they return); a subclass that overrides either is checked like any env."""
    cls = type(env)
    return (isinstance(env, SingleAgentCopies) and cls.step is SingleAgentCopies.step
            and cls.reset is SingleAgentCopies.reset)


class CopiesStepper:
    """Steps the playing agents of many ``SingleAgentCopies`` envs at once, lists in and lists out: what a
    sampler stepping them in lockstep calls once a round instead of each env's ``step`` (no dicts; the
    values checked a round at a time as ``step`` checks them one by one).

    ``playing`` lists the (env index, agent) pairs that play, env by env, agents in order: ``step`` takes
    their actions in that order. Call ``refresh`` after resetting an env."""

    def __init__(self, envs: list[SingleAgentCopies]) -> None:
        self.envs = envs
        self.playing: list[tuple[int, int]] = []
        self._copies: list[gym.Env] = []
        self.refresh()

    def refresh(self) -> None:
        self.playing = [(i, k) for i, env in enumerate(self.envs) for k in env.agents]
        self._copies = [self.envs[i].envs[k] for i, k in self.playing]

    def step(self, actions: list[Any]) -> tuple[tuple, list[float], list[int]]:
        """One step of every playing agent: their observations and rewards (floats), in ``playing``'s order,
        and the positions (in that order) of the agents that ended on this step. The envs whose every agent
        ended are over (``agents`` empty); ``playing`` leaves out the ended agents from here on."""
        results = [env.step(action) for env, action in zip(self._copies, actions)]
        obs, rewards, terms, truncs, _ = zip(*results)
        if not (all(map(is_, map(type, rewards), repeat(float))) and math.isfinite(sum(rewards))):
            rewards = tuple(reward_value(agent, r) for (_, agent), r in zip(self.playing, rewards))
        if not (all(map(is_, map(type, terms), repeat(bool))) and all(map(is_, map(type, truncs), repeat(bool)))):
            terms = tuple(_flag(agent, "terminated", f) for (_, agent), f in zip(self.playing, terms))
            truncs = tuple(_flag(agent, "truncated", f) for (_, agent), f in zip(self.playing, truncs))
        ended: list[int] = []
        if True in terms or True in truncs:
            for n, (term, trunc) in enumerate(zip(terms, truncs)):
                if term or trunc:
                    i, agent = self.playing[n]
                    self.envs[i].end_agent(agent, obs[n], trunc and not term)
                    ended.append(n)
            self.refresh()
        return obs, list(rewards), ended


def _flag(agent: int, name: str, flag: Any) -> bool:
    if type(flag) is bool or type(flag) is np.bool_:
        return bool(flag)
    raise MultiAgentEnvError(f"the copy of agent {agent} returned {name}={flag!r} ({type(flag).__name__}); "
                             f"a flag is True or False", agent)


_MADE: dict[str, type] = {}
_PREFIX = "MultiAgent["


def make_multi_agent(env_name_or_creator: str | Callable[[dict], gym.Env]) -> type[SingleAgentCopies]:
    """A MultiAgentEnv class whose constructor takes a config dict: ``num_agents`` (default 1) copies of
    the env, agents 0..n-1; the rest of the config goes to each copy (``gym.make(name, **rest)`` for a
    gymnasium id, ``creator(rest)`` for a creator).

    The class made for a gymnasium id is importable as ``actors.env.multi_agent_env:MultiAgent[<id>]``
    (the same class every time), so it pickles by reference and survives ``config.to_dict()``; one made
    for a creator function lives only in this process: register it with ``register_env`` to name it.
    """
    if isinstance(env_name_or_creator, str):
        name = f"{_PREFIX}{env_name_or_creator}]"
        if name not in _MADE:
            env_id = env_name_or_creator

            def make_from_id(self: SingleAgentCopies, config: dict) -> gym.Env:
                return gym.make(env_id, **config)

            cls = type(name, (SingleAgentCopies,), {"make_single": make_from_id, "__module__": __name__})
            # a dotted id cannot be looked up by attribute: say so in the name, as for a local class
            cls.__qualname__ = name if "." not in env_id else f"make_multi_agent.<locals>.{name}"
            _MADE[name] = cls
        return _MADE[name]
    if not callable(env_name_or_creator):
        raise TypeError(f"make_multi_agent({env_name_or_creator!r}): give a gymnasium env id (str) or a creator "
                        f"function config -> gym.Env")
    creator = env_name_or_creator

    def make_from_creator(self: SingleAgentCopies, config: dict) -> gym.Env:
        return creator(config)

    label = getattr(creator, "__qualname__", type(creator).__name__)
    cls = type(f"{_PREFIX}{label}]", (SingleAgentCopies,), {"make_single": make_from_creator, "__module__": __name__})
    cls.__qualname__ = f"make_multi_agent.<locals>.{cls.__name__}"
    return cls


def __getattr__(name: str) -> Any:
    """``MultiAgent[<gymnasium id>]``: the class ``make_multi_agent`` makes, rebuilt in a process that has
    not made it yet (unpickling, or resolving the import path of a saved config)."""
    if name.startswith(_PREFIX) and name.endswith("]"):
        return make_multi_agent(name[len(_PREFIX):-1])
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
