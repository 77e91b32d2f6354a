"""The rules of a multi-agent episode, checked step by step: what a ``MultiAgentEnv``'s ``reset()`` and
``step()`` may return, and which agents a sampler may send actions for.

``MultiAgentStepChecker`` holds one episode's state (which agents have had an observation, which are
done) and raises ``MultiAgentEnvError`` -- a ``ValueError`` naming the agent, the bad value and the fix
-- at the first broken rule, instead of letting a malformed step turn into a wrong batch or a hang
later. It costs a few dict look-ups per agent and one space check per observation, so env runners can
run it on every step (a switch to turn it off, like RLlib's ``disable_env_checking``, is for the part
that wires it into env runners).

What an env may return (all dicts keyed by agent id; ids are str or int, ``"__all__"`` is reserved):

- ``reset()`` -> ``(observations, infos)``. ``step(actions)`` -> ``(observations, rewards, terminateds,
  truncateds, infos)``, where ``terminateds`` and ``truncateds`` always hold ``"__all__"``.
- Observations only for agents in ``possible_agents``, each in that agent's observation space.
- Agents act in turns or together: only the agents with an observation in the last result act next.
- Agents join late: an agent's first observation may come at any step.
- A reward, or a terminated/truncated flag, only for an agent that has had an observation this
  episode (earlier, or in the same step).
- Rewards for agents that did not act this step are fine (a turn-based game pays both players when
  one of them moves); they are numbers, finite.
- Agents finish early: an agent whose own terminated or truncated flag is True is done; it gets no
  observation or reward after that step (a repeated True flag is tolerated). The episode ends when
  ``"__all__"`` is True in either dict; an agent may be done without a final observation.
- ``infos`` keys are agents of ``possible_agents`` or ``"__common__"``.

How a sampler turns this into per-agent trajectories (the rules the env runner must apply):

1. **Who acts.** After ``reset()``/``step()`` the agents to act are those with an observation in that
   result whose own flags are not True, unless ``"__all__"`` ended the episode (``agents_to_act``).
   The sampler sends an action for each of them and for no other agent (``check_actions``).
2. **Rewards accumulate to the agent's next step.** An agent's transition runs from an observation at
   which it acted to its next observation, however many env steps later that comes. Its reward is
   the sum of every reward the env gave that agent after it acted, up to and including the step that
   brings its next observation (rewards paid while it waited for its turn are kept, not dropped).
3. **Rewards before an agent's first action** (a reward that arrives with its first observation) belong
   to no transition: they count in the agent's and the episode's return only.
4. **An agent that finishes** (its own terminated/truncated True, or ``"__all__"`` with no flag of its
   own -- it then takes the ``"__all__"`` flags) closes its last transition with the rewards since it
   last acted. With a final observation in that step, the transition ends there. **Without one**
   (mobile-env PR#68, which RLlib refuses for truncation) the transition ends at the agent's last
   observation, repeated: terminated -> no bootstrap; truncated -> bootstrap from that repeated
   observation, the best estimate there is. Terminated wins when both flags are True.
5. **Observations in the step that ends the episode** are final observations: no action follows.
6. The episode's return is the sum over agents of every reward they got.
"""
from __future__ import annotations

from collections.abc import Iterable, Mapping
from itertools import repeat
from math import isfinite
from operator import is_
from typing import Any

import gymnasium as gym
import numpy as np

from actors.env.space_values import ProblemFinder, problem_finder, short_repr

ALL = "__all__"
"""The key of ``terminateds``/``truncateds`` that ends the episode for every agent."""
COMMON_INFO = "__common__"
"""The ``infos`` key for information about no agent in particular."""
_FALSES, _FLOATS = repeat(False), repeat(float)  # endless: map() stops at the values' end


class MultiAgentEnvError(ValueError):
    """A multi-agent env, or a sampler driving one, broke a rule. ``agent_id``: the agent (None: none)."""

    def __init__(self, message: str, agent_id: Any = None) -> None:
        super().__init__(message)
        self.agent_id = agent_id


def check_agent_ids(agent_ids: Iterable[Any], where: str) -> list[Any]:
    """``agent_ids`` as a list, after checking each is a str or an int (chunks carry them over the wire)."""
    ids = list(agent_ids)
    for agent in ids:
        if agent == ALL:
            raise MultiAgentEnvError(f"{where} holds the agent id '__all__', which is reserved for the "
                                     f"terminateds/truncateds key that ends the episode: rename that agent", agent)
        if isinstance(agent, bool) or not isinstance(agent, (str, int, np.integer)):
            raise MultiAgentEnvError(
                f"{where} holds the agent id {agent!r} ({type(agent).__name__}): agent ids are str or int "
                f"(they travel in episode chunks); use e.g. str({agent!r})", agent)
    return ids


class MultiAgentStepChecker:
    """Checks one env's reset/step results and a sampler's actions against the rules above."""

    def __init__(self, observation_spaces: Mapping[Any, gym.Space], plain_step_values: bool = True) -> None:
        """``observation_spaces``: every agent that may appear (``possible_agents``) -> its observation space.
        ``plain_step_values=False`` leaves the observation values of plain steps (no agent joins or finishes:
        every observation is one an agent acts on next) to the sampler, which checks each module's batch
        of them at once (``MultiAgentSampler(check_observations=True)``); resets and the other steps are
        checked here value by value."""
        self.plain_step_values = plain_step_values
        self.fast = True
        """Take ``_lockstep``'s one pass for the commonest step (False: every step through every rule, the
        general path that ``_lockstep`` must agree with; tests compare the two)."""
        self.possible_agents = check_agent_ids(observation_spaces, "possible_agents")
        if not self.possible_agents:
            raise MultiAgentEnvError("the env has no possible agents: set possible_agents (every agent id that may "
                                     "appear) and give each an observation space")
        self._finders: dict[Any, ProblemFinder] = {a: problem_finder(s) for a, s in observation_spaces.items()}
        self.step_index = -1
        """Steps since the last reset (0 right after it; -1 before the first)."""
        self.last_seen: dict[Any, int] = {}
        """Agent -> the step of its latest observation, for the agents seen this episode."""
        self.done: dict[Any, tuple[int, str]] = {}
        """Agent -> (step, "terminated" or "truncated") for the agents that finished this episode."""
        self.agents_to_act: list[Any] = []
        """The agents the next ``step()`` needs actions for (rule 1 of the module docstring)."""
        self.episode_over = True
        self._playing: set[Any] = set()  # seen this episode and not done
        self._flag_keys: set[Any] = {ALL}  # the agents playing, and "__all__"
        self._info_keys = set(self._finders) | {COMMON_INFO}

    @classmethod
    def for_env(cls, env: Any, plain_step_values: bool = True) -> "MultiAgentStepChecker":
        """The checker of a ``MultiAgentEnv`` (anything with ``possible_agents`` and ``get_observation_space``)."""
        agents = list(getattr(env, "possible_agents", None) or [])
        if not agents:
            raise MultiAgentEnvError(f"{type(env).__name__}.possible_agents is empty: list every agent id that may "
                                     f"appear in an episode (self.possible_agents = [...] in __init__)")
        spaces = {}
        for agent in agents:
            try:
                space = env.get_observation_space(agent)
            except KeyError:
                space = None
            if not isinstance(space, gym.Space):
                raise MultiAgentEnvError(
                    f"{type(env).__name__} has no observation space for agent {agent!r} of possible_agents: set "
                    f"observation_spaces[{agent!r}] (or override get_observation_space)", agent)
            spaces[agent] = space
        return cls(spaces, plain_step_values)

    # --- what the env returns ------------------------------------------------------------------

    def check_reset(self, result: Any) -> Any:
        """Check what ``env.reset()`` returned and start a new episode; returns ``result``."""
        if not isinstance(result, tuple) or len(result) != 2:
            raise MultiAgentEnvError(
                f"reset() returned {short_repr(result)}; a MultiAgentEnv's reset() returns (observations, infos), "
                f"two dicts keyed by agent id")
        obs, infos = result
        _need_dict("reset()", "observations", obs)
        _need_dict("reset()", "infos", infos)
        self.done, self.episode_over = {}, True  # a refused reset leaves no episode to step
        for agent, value in obs.items():
            self._check_observation("reset()", agent, value)
        self._check_infos("reset()", infos)
        self.step_index, self.last_seen, self.episode_over = 0, dict.fromkeys(obs, 0), False
        self._playing = set(obs)
        self._flag_keys = self._playing | {ALL}
        self.agents_to_act = list(obs)
        return result

    def check_step(self, result: Any) -> Any:
        """Check what ``env.step(actions)`` returned and advance the episode; returns ``result``."""
        if self.fast and self._lockstep(result):
            return result
        if self.episode_over:
            raise MultiAgentEnvError("step() result after the episode ended (or before the first reset()): "
                                     "reset() the env first")
        if not isinstance(result, tuple) or len(result) != 5:
            old = " (the old gym API's obs, rewards, dones, infos)" if isinstance(result, tuple) and len(result) == 4 else ""
            raise MultiAgentEnvError(
                f"step() returned {short_repr(result)}{old}; a MultiAgentEnv's step() returns (observations, "
                f"rewards, terminateds, truncateds, infos), five dicts keyed by agent id")
        obs, rewards, terminateds, truncateds, infos = result
        if not (type(obs) is dict and type(rewards) is dict and type(terminateds) is dict and  # the common case
                type(truncateds) is dict and type(infos) is dict):
            for name, value in zip(("observations", "rewards", "terminateds", "truncateds", "infos"), result):
                _need_dict("step()", name, value)
        for name, flags in (("terminateds", terminateds), ("truncateds", truncateds)):
            if ALL not in flags:
                raise MultiAgentEnvError(
                    f"step() returned {name} without the key '__all__': {short_repr(flags)}; add "
                    f"{name}['__all__'] = True when the episode ends for every agent, False otherwise")
            _check_flag(name, ALL, flags[ALL])
        step = self.step_index + 1
        if not self._plain_step(obs, rewards, terminateds, truncateds, infos):
            self._check_step_fully(step, obs, rewards, terminateds, truncateds, infos)

        self.step_index = step
        for agent in obs:
            self.last_seen[agent] = step
        playing = self._playing
        joined = not obs.keys() <= playing
        if joined:
            playing.update(obs)
        flagged = any(terminateds.values()) or any(truncateds.values())
        if flagged:
            for name, flags in (("terminateds", terminateds), ("truncateds", truncateds)):
                for agent, flag in flags.items():
                    if flag and agent != ALL and agent not in self.done:
                        self.done[agent] = (step, name[:-1])
                        playing.discard(agent)
        if joined or flagged:
            self._flag_keys = playing | {ALL}
        self.episode_over = bool(terminateds[ALL]) or bool(truncateds[ALL])
        # an agent with an observation is not done (checked above) unless a flag of this step ended it
        self.agents_to_act = ([] if self.episode_over else
                              [a for a in obs if a not in self.done] if flagged else list(obs))
        if not self.episode_over and not self.agents_to_act and self.last_seen and all(
                a in self.done for a in self.last_seen):
            raise MultiAgentEnvError(
                f"step {step}: every agent of the episode is done ({sorted(map(str, self.done))}) but "
                f"terminateds['__all__'] and truncateds['__all__'] are False, so no agent can act again: set "
                f"'__all__' True in the step where the last agent finishes")
        return result

    def _lockstep(self, result: Any) -> bool:
        """The commonest step checked and recorded in one pass, or False having changed nothing: a tuple of
        five dicts, observations for playing agents only (at least one), every flag ``False`` (the bool) with
        ``"__all__"`` in both flag dicts, rewards finite floats of playing agents, infos of known keys, and
        the observation values left to the sampler (``plain_step_values`` off). What ``check_step``'s rules
        would pass and record the same way; anything else goes through them."""
        if type(result) is not tuple or len(result) != 5 or self.plain_step_values or self.episode_over:
            return False
        obs, rewards, terminateds, truncateds, infos = result
        if not (type(obs) is dict and type(rewards) is dict and type(terminateds) is dict
                and type(truncateds) is dict and type(infos) is dict and obs and ALL in terminateds
                and ALL in truncateds):
            return False
        playing, flag_keys = self._playing, self._flag_keys
        # map(is_, ..., repeat(False)): every flag is the bool False itself, with no Python frame per flag
        if not (obs.keys() <= playing and rewards.keys() <= playing and terminateds.keys() <= flag_keys
                and truncateds.keys() <= flag_keys and infos.keys() <= self._info_keys
                and all(map(is_, terminateds.values(), _FALSES)) and all(map(is_, truncateds.values(), _FALSES))
                and all(map(is_, map(type, rewards.values()), _FLOATS)) and isfinite(sum(rewards.values()))):
            return False
        step = self.step_index = self.step_index + 1
        last_seen = self.last_seen
        for agent in obs:
            last_seen[agent] = step
        self.agents_to_act = list(obs)
        return True

    def _plain_step(self, obs: dict, rewards: dict, terminateds: dict, truncateds: dict, infos: dict) -> bool:
        """Whether this is the common step that needs no rule looked at one by one: only agents already
        playing (seen, not done) appear, flags are bools, rewards finite floats, observations in their
        spaces (left to the sampler when ``plain_step_values`` is off and no flag is set). False sends the
        step through every rule, which names what is wrong (or passes it)."""
        playing, flag_keys = self._playing, self._flag_keys
        if not (obs.keys() <= playing and rewards.keys() <= playing and terminateds.keys() <= flag_keys
                and truncateds.keys() <= flag_keys and infos.keys() <= self._info_keys):
            return False
        if not (all(type(f) is bool for f in terminateds.values()) and all(type(f) is bool for f in truncateds.values())
                and all(type(r) is float for r in rewards.values()) and isfinite(sum(rewards.values()))):
            return False
        if not self.plain_step_values and not any(terminateds.values()) and not any(truncateds.values()):
            return True  # every observation is acted on next: the sampler checks them, a batch at a time
        finders = self._finders
        return all(finders[agent](value) is None for agent, value in obs.items())

    def _check_step_fully(self, step: int, obs: dict, rewards: dict, terminateds: dict, truncateds: dict,
                          infos: dict) -> None:
        finders, done, last_seen = self._finders, self.done, self.last_seen
        for agent, value in obs.items():
            # the common case inline (a known, running agent and a value in its space); the named errors below
            finder = finders.get(agent)
            if finder is None or agent in done or finder(value) is not None:
                self._check_observation("step()", agent, value)
        for agent, reward in rewards.items():
            if agent not in finders or (agent not in last_seen and agent not in obs):
                self._check_has_data(agent, obs, "a reward", reward)
            if agent in done:
                self._check_not_done("a reward", agent)
            if type(reward) is not float or not isfinite(reward):
                _check_reward(agent, reward)
        for name, flags in (("terminateds", terminateds), ("truncateds", truncateds)):
            for agent, flag in flags.items():
                if agent != ALL and (agent in done or agent not in last_seen or
                                     (type(flag) is not bool and type(flag) is not np.bool_)):
                    self._check_flag_of(name, agent, flag, obs)
        if infos:
            self._check_infos("step()", infos)

    # --- what the sampler sends ----------------------------------------------------------------

    def check_actions(self, actions: Any) -> Any:
        """Check a sampler's action dict for the next ``step()``: one action for each agent in
        ``agents_to_act``, none for any other agent; returns ``actions``."""
        if not isinstance(actions, dict):
            raise MultiAgentEnvError(f"the actions for step() are {short_repr(actions)}; a MultiAgentEnv takes "
                                     f"a dict of agent id -> action")
        if self.episode_over:
            raise MultiAgentEnvError("actions sent after the episode ended (or before the first reset()): reset() "
                                     "the env first")
        to_act = self.agents_to_act
        if len(actions) == len(to_act) and not actions.keys() ^ to_act:  # exactly the agents to act
            return actions
        for agent in actions:
            if agent not in to_act:
                raise MultiAgentEnvError(f"an action for agent {agent!r}, which {self._why_not_acting(agent)}; only "
                                         f"the agents with an observation in the last result act: {to_act}", agent)
        for agent in to_act:
            if agent not in actions:
                raise MultiAgentEnvError(
                    f"no action for agent {agent!r}, which got an observation at step {self.step_index} and is not "
                    f"done: send an action for every agent in {to_act}", agent)
        return actions

    # --- the single rules ----------------------------------------------------------------------

    def _why_not_acting(self, agent: Any) -> str:
        if agent not in self._finders:
            return f"is not in possible_agents {self.possible_agents}"
        if agent in self.done:
            step, how = self.done[agent]
            return f"was {how} at step {step} (a done agent does not act)"
        if agent not in self.last_seen:
            return "has had no observation yet this episode"
        return (f"got its latest observation at step {self.last_seen[agent]}, none at step {self.step_index} "
                f"(not its turn)")

    def _check_known(self, where: str, what: str, agent: Any) -> None:
        if agent not in self._finders:
            hint = " ('__all__' belongs in terminateds and truncateds only)" if agent == ALL else ""
            raise MultiAgentEnvError(
                f"{where} returned {what} for agent {agent!r}, which is not in possible_agents "
                f"{self.possible_agents}{hint}: add it to possible_agents with its spaces, or leave it out", agent)

    def _check_not_done(self, what: str, agent: Any) -> None:
        if agent in self.done:
            step, how = self.done[agent]
            raise MultiAgentEnvError(
                f"step {self.step_index + 1}: step() returned {what} for agent {agent!r}, which was {how} at step "
                f"{step}: a done agent gets no more observations or rewards (leave it out of the dicts)", agent)

    def _check_observation(self, where: str, agent: Any, value: Any) -> None:
        self._check_known(where, "an observation", agent)
        self._check_not_done("an observation", agent)
        why = self._finders[agent](value)
        if why is not None:
            raise MultiAgentEnvError(
                f"{where}: the observation of agent {agent!r} {why}; it must lie in the agent's observation space "
                f"(fix the env's observation, or the space it declares for {agent!r})", agent)

    def _check_has_data(self, agent: Any, obs: dict, what: str, value: Any) -> None:
        self._check_known("step()", what, agent)
        if agent not in self.last_seen and agent not in obs:
            raise MultiAgentEnvError(
                f"step {self.step_index + 1}: step() returned {what} ({short_repr(value)}) for agent {agent!r}, "
                f"which has had no observation this episode: give an agent its first observation before (or with) "
                f"its first reward or flag, or keep them until it has one", agent)

    def _check_flag_of(self, name: str, agent: Any, flag: Any, obs: dict) -> None:
        if agent in self.done:
            _check_flag(name, agent, flag)
            if not flag:
                step, how = self.done[agent]
                raise MultiAgentEnvError(f"step() returned {name}[{agent!r}] = False for agent {agent!r}, which was "
                                         f"{how} at step {step}: a done agent stays done", agent)
            return
        self._check_has_data(agent, obs, f"{name}[{agent!r}]", flag)
        _check_flag(name, agent, flag)

    def _check_infos(self, where: str, infos: dict) -> None:
        for agent in infos:
            if agent != COMMON_INFO:
                self._check_known(where, "an info", agent)


def _need_dict(where: str, name: str, value: Any) -> None:
    if not isinstance(value, dict):
        raise MultiAgentEnvError(f"{where} returned {name} = {short_repr(value)}; a MultiAgentEnv returns a dict "
                                 f"keyed by agent id for each")


def _check_flag(name: str, agent: Any, flag: Any) -> None:
    if type(flag) is not bool and type(flag) is not np.bool_:
        raise MultiAgentEnvError(f"step() returned {name}[{agent!r}] = {short_repr(flag)} "
                                 f"({type(flag).__name__}); a flag is True or False",
                                 None if agent == ALL else agent)


def reward_value(agent: Any, reward: Any) -> float:
    """``reward`` as a float, after checking it is one finite number (an int, a numpy scalar); else an error
    naming ``agent``."""
    _check_reward(agent, reward)
    return float(reward)


def _check_reward(agent: Any, reward: Any) -> None:
    if type(reward) is float or type(reward) is int:
        number = reward
    elif isinstance(reward, (np.floating, np.integer)) or (
            isinstance(reward, np.ndarray) and reward.shape == () and reward.dtype.kind in "iuf"):
        number = float(reward)
    else:
        raise MultiAgentEnvError(f"step() returned the reward {short_repr(reward)} ({type(reward).__name__}) for "
                                 f"agent {agent!r}; a reward is one number", agent)
    if not isfinite(number):
        raise MultiAgentEnvError(f"step() returned the reward {number!r} for agent {agent!r}; rewards are finite "
                                 f"numbers (one NaN turns every weight into NaN)", agent)
