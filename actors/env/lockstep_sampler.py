"""LockstepSampler: the multi-agent sampler for ``make_multi_agent`` copies, recorded time-major.

In an env of ``make_multi_agent`` copies every agent acts every step until it is done, and the env resets
when the last one is. Such envs need none of ``MultiAgentEpisode``'s per-step bookkeeping (who observes,
who is paid, who joins): this sampler treats every (env, agent) as a slot, as ``EpisodeSlots`` treats the
sub-envs of a single-agent runner. Each step it acts for every playing slot with one batched pass per module
(``ModuleActing``, shared with ``MultiAgentSampler``), steps every playing copy of every env in one flat
pass (``multi_agent_env.CopiesStepper``: lists, no dicts), and writes observations, actions, policy outputs
and rewards into time-major rows; at the end of a run each slot's episode segments are cut out by slicing.

It gives exactly the chunks ``MultiAgentSampler`` gives for these envs -- the same rows acted on in the same
order, so the same draws, and the chunks in the same order (a test compares the two) -- at a fraction of the
Python per agent step. It does not keep infos and makes no ``MultiAgentEpisode``: the runner uses it only
when nothing asks for them (no ``on_episode_*`` callbacks, no recording). Its episodes are ``CopiesEpisode``
records, which answer what a runner asks of an ended episode under ``MultiAgentEpisode``'s names.
"""
from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import gymnasium as gym
import numpy as np
import torch

from actors.connectors.module_to_env import ModuleToEnvPipeline
from actors.env.actions import EnvActions
from actors.env.exploration import Exploration
from actors.env.multi_agent_acting import ModuleActing
from actors.env.multi_agent_connectors import AgentObservations
from actors.env.multi_agent_env import CopiesStepper, checks_itself
from actors.env.multi_agent_sampler import (EpisodeListener, MultiAgentSample, PolicyMappingFn, checked_mapping_fn,
                                           run_target, through_module_to_env)
from actors.env.numpy_acting import acting_rng
from actors.modules import RLModule
from protocols import nested
from protocols.episode import EpisodeChunk, new_episode_id
from protocols.multi_agent_episode_checks import mapped_module


PLAIN_ACTIONS = (gym.spaces.Box, gym.spaces.Discrete, gym.spaces.MultiDiscrete, gym.spaces.MultiBinary)
"""Action spaces whose actions are one array per batch: what the time-major rows hold."""


def lockstep_fits(env: Any) -> bool:
    """Whether ``LockstepSampler`` can step ``env``: ``make_multi_agent`` copies with that class's own step and
    reset (``checks_itself``) whose copies take plain array actions."""
    return checks_itself(env) and all(isinstance(env.get_action_space(a), PLAIN_ACTIONS) for a in env.possible_agents)


class CopiesEpisode:
    """One episode of one env of copies: its id, each agent's module, return and steps (agent ``k`` is
    copy ``k``). Read with ``MultiAgentEpisode``'s names; returns and agent steps are complete once the run
    that ended the episode returned."""

    def __init__(self, episode_id: str, env_index: int, num_agents: int) -> None:
        self.id_ = episode_id
        self.env_index = env_index
        self.modules: list[str] = []
        """Agent ``k``'s module, mapped when the episode starts."""
        self.returns = [0.0] * num_agents
        self.steps = 0
        self.agent_step_count = 0
        self.is_terminated = self.is_truncated = False
        self.custom_data: dict[str, Any] = {}
        """Free room for a policy mapping function (RLlib's ``episode.custom_data``)."""

    @property
    def is_done(self) -> bool:
        return self.is_terminated or self.is_truncated

    @property
    def agent_ids(self) -> list[int]:
        return list(range(len(self.returns)))

    @property
    def agent_episode_ids(self) -> dict[int, str]:
        """The episode id each agent's chunks carry (``"<episode id>.<agent>"``, as ``MultiAgentEpisode`` names
        the n-th agent to join)."""
        return {k: f"{self.id_}.{k}" for k in range(len(self.returns))}

    def module_for(self, agent_id: int) -> str:
        return self.modules[agent_id]

    def env_steps(self) -> int:
        return self.steps

    def agent_steps(self) -> int:
        return self.agent_step_count

    @property
    def agent_returns(self) -> dict[int, float]:
        return dict(enumerate(self.returns))

    @property
    def module_returns(self) -> dict[str, float]:
        out: dict[str, float] = {}
        for module_id, ret in zip(self.modules, self.returns):
            out[module_id] = out.get(module_id, 0.0) + ret
        return out

    def get_return(self) -> float:
        return sum(self.returns)

    def return_metrics(self) -> dict[str, float]:
        """As ``MultiAgentEpisode.return_metrics``: per-agent and per-module returns under RLlib's keys."""
        out = {f"agent_episode_returns_mean/{k}": r for k, r in enumerate(self.returns)}
        out.update({f"module_episode_returns_mean/{m}": r for m, r in self.module_returns.items()})
        return out


class LockstepSampler:
    """Steps every env of ``make_multi_agent`` copies (``checks_itself(env)`` for each) with its running
    episode; ``run`` returns a ``MultiAgentSample`` as ``MultiAgentSampler.run`` does, and the arguments are
    that class's (less ``record_infos``). ``listener`` hears episodes created, started and ended (never steps:
    the runner passes one only to number the episodes)."""

    def __init__(self, envs: Sequence[Any], modules: Mapping[str, RLModule], explorations: Mapping[str, Exploration],
                 env_actions: Mapping[str, EnvActions], policy_mapping_fn: PolicyMappingFn, *,
                 env_runner_index: int = 0, seed: int | None = None, weights_version: int = 0,
                 listener: EpisodeListener | None = None, check_observations: bool = False,
                 rng: np.random.Generator | None = None, observations: AgentObservations | None = None,
                 module_to_env: Mapping[str, ModuleToEnvPipeline] | None = None) -> None:
        if not envs:
            raise ValueError("LockstepSampler needs at least one env, got none")
        for i, env in enumerate(envs):
            if not lockstep_fits(env):
                raise ValueError(f"env {i} is a {type(env).__name__}, not make_multi_agent's copies with their own "
                                 "step and reset and array actions: sample it with MultiAgentSampler")
        recurrent = sorted(m for m, module in modules.items() if getattr(module, "is_recurrent", False))
        if recurrent:  # its time-major recording keeps no per-agent states: the per-agent sampler does
            raise ValueError(f"modules {recurrent} are recurrent (use_lstm): sample with MultiAgentSampler")
        self.acting = ModuleActing(modules, explorations, env_actions,
                                   rng if rng is not None else acting_rng(seed, env_runner_index), self.policy_of,
                                   check_observations)
        self.envs = list(envs)
        self.policy_mapping_fn = checked_mapping_fn(policy_mapping_fn)
        self.env_runner_index = env_runner_index
        self.weights_version = weights_version
        """Stamped on every chunk cut from now on."""
        self.listener = listener
        self.observations = observations
        """The env-to-module pipelines each new observation passes before it is recorded and acted on (None: none)."""
        self.module_to_env = module_to_env
        """Each module's module-to-env pipeline, applied to its rows' actions before they are recorded and sent
        (None: none)."""
        sizes = [len(env.possible_agents) for env in self.envs]
        self.bases = [int(b) for b in np.cumsum([0] + sizes[:-1])]
        """Env ``i``'s agent ``k`` is slot ``bases[i] + k``."""
        self.slots = [(i, k) for i, size in enumerate(sizes) for k in range(size)]
        n = len(self.slots)
        self.obs: list[Any] = [None] * n
        """Each slot's observation to act on (a done agent's: its final one, acted on by nobody)."""
        self._chunk_index = [0] * n
        self._t_started = [0] * n
        self._start_row = [0] * n  # where the slot's open segment starts in the running run (-1: none)
        self._plan: tuple | None = None  # who acts, by module and by group; rebuilt when an agent ends or starts
        self.stepper = CopiesStepper(self.envs)
        self.episodes: list[CopiesEpisode] = []
        """The episode running in each env."""
        self.reset(seed)

    def use_fast_path(self, on: bool) -> None:
        """As ``MultiAgentSampler.use_fast_path``: False pads a fused group's rows after stacking them."""
        self.acting.fast_path = on

    def policy_of(self, env_index: int, agent_id: int) -> str:
        """The module ``agent_id`` of env ``env_index``'s running episode acts with."""
        return self.episodes[env_index].module_for(agent_id)

    def reset(self, seed: int | None = None) -> None:
        """Reset every env (env ``i`` with ``seed + i`` when a seed is given); the running episodes are dropped."""
        self.episodes = [None] * len(self.envs)  # type: ignore[list-item]
        for i in range(len(self.envs)):
            self._start(i, None if seed is None else seed + i, 0)

    def _start(self, index: int, seed: int | None, row: int) -> None:
        env = self.envs[index]
        ep = CopiesEpisode(new_episode_id(), index, len(env.possible_agents))
        if self.listener is not None:  # RLlib's order: the episode object exists before the env resets
            self.listener.episode_created(index, ep)
        obs, _ = env.reset(seed=seed)
        known = self.acting.modules
        # every agent's module is picked and checked before any slot changes: a mapping error leaves no
        # half-started episode behind
        ep.modules.extend(mapped_module(self.policy_mapping_fn, k, ep, known) for k in range(len(env.possible_agents)))
        for k in range(len(env.possible_agents)):
            j = self.bases[index] + k
            self.obs[j] = obs[k]
            self._chunk_index[j] = self._t_started[j] = 0
            self._start_row[j] = row
        if self.observations is not None:
            self.observations.new_episode(index)
            self._transform([self.bases[index] + k for k in range(len(env.possible_agents))], ep)
        self.episodes[index] = ep
        self._plan = None
        self.stepper.refresh()
        if self.listener is not None:
            self.listener.episode_started(index, ep)

    def _transform(self, slots: list[int], episode: CopiesEpisode | None = None) -> None:
        """The observations of ``slots`` through their modules' pipelines, in place (``episode``: the one the
        slots' env starts, not yet in ``episodes``)."""
        rows = []
        for j in slots:
            i, k = self.slots[j]
            ep = episode if episode is not None else self.episodes[i]
            rows.append((i, k, ep.modules[k], self.obs[j]))
        for j, value in zip(slots, self.observations.transform_rows(rows)):
            self.obs[j] = value

    def _make_plan(self) -> tuple[dict[str, tuple[list, list[int]]], dict, dict, list[int]]:
        """The playing slots grouped by module (their (env, agent) rows and slot indices, in slot order), the
        slot indices of each group's present modules and each group's batch rows (both filled as groups act),
        and the playing slots in the order the stepper steps them."""
        by_module: dict[str, tuple[list, list[int]]] = {}
        for i, (env, ep) in enumerate(zip(self.envs, self.episodes)):
            base = self.bases[i]
            for k in env.agents:
                part = by_module.setdefault(ep.modules[k], ([], []))
                part[0].append((i, k))
                part[1].append(base + k)
        return by_module, {}, {}, [self.bases[i] + k for i, k in self.stepper.playing]

    @torch.inference_mode()
    def run(self, num_env_steps: int | None = None, num_agent_steps: int | None = None, *, explore: bool = True,
            t0: int = 0) -> MultiAgentSample:
        """As ``MultiAgentSampler.run``: every env steps once per round until ``num_env_steps`` env steps or
        ``num_agent_steps`` actions are taken (give one); ``t0`` is where exploration schedules stand."""
        target, by_agents = run_target(num_env_steps, num_agent_steps)
        acting = self.acting
        forwards = acting.forwards(explore)
        groups = acting.groups()
        envs, episodes, obs, stepper = self.envs, self.episodes, self.obs, self.stepper
        n_envs, n_slots = len(envs), len(self.slots)
        capacity = -(-int(target) // n_envs)  # every env takes at least one agent step a round
        obs_rows: list[Any] = []
        reward_rows: list[list[float]] = []
        outputs: list[dict[str, np.ndarray]] = [{} for _ in groups]  # per group: column -> [capacity, slots, ...]
        segments: list[tuple] = []  # each slot's finished episode segments: (j, start, end, final obs, flags, ...)
        ended: list[CopiesEpisode] = []
        ended_at: dict[int, int] = {}  # id(episode) -> the round it ended in
        module_steps: dict[str, int] = {}
        env_steps = agent_steps = t = 0
        keyed = self.observations is not None and self.observations.keyed
        while (agent_steps if by_agents else env_steps) < target:
            timestep = t0 + (agent_steps if by_agents else env_steps)
            if self._plan is None:
                self._plan = self._make_plan()
            by_module, slot_index, batch_rows, playing_slots = self._plan
            playing = len(playing_slots)
            cur = _stacked(obs)  # every slot's observation: recorded, and each module's batch gathered from it
            waiting = {m: (who, [obs[j] for j in slots], slots) for m, (who, slots) in by_module.items()}
            flat = type(cur) is np.ndarray
            to_env: list[Any] = [None] * n_slots
            for g, group in enumerate(groups):
                rows = None
                if flat:  # keyed by the group itself: the groups change when modules come and go
                    key = (group[0], group[1] is None)
                    rows = batch_rows.get(key, False)
                    if rows is False:
                        rows = batch_rows[key] = acting.batch_rows(group, waiting)
                acted = acting.act_group(group, waiting, forwards, explore, timestep, cur if flat else None, rows)
                if acted is None:
                    continue
                present, who, acts, env_acts, columns = acted
                if self.module_to_env is not None:
                    acts, env_acts, columns = through_module_to_env(self.module_to_env, acting.env_actions, present,
                                                                    waiting, acts, columns, explore)
                if keyed:
                    self.observations.note_actions(who, acts)
                index = slot_index.get(tuple(present))
                if index is None:
                    listed = [j for m in present for j in by_module[m][1]]
                    index = slot_index[tuple(present)] = (np.array(listed, np.intp), listed)
                slots, listed = index
                cols = outputs[g]
                if not cols:
                    cols["actions"] = _rows_like(acts, capacity, n_slots)
                    for key, value in columns.items():
                        cols[key] = _rows_like(value, capacity, n_slots)
                cols["actions"][t, slots] = acts
                for key, value in columns.items():
                    cols[key][t, slots] = value
                for j, action in zip(listed, env_acts):
                    to_env[j] = action
            obs_rows.append(cur if cur is not None else nested.stack(obs))
            for m, (_, slots) in by_module.items():
                module_steps[m] = module_steps.get(m, 0) + len(slots)
            agent_steps += playing
            everyone = playing == n_slots
            o_t, r_t, ended_now = stepper.step(to_env if everyone else [to_env[j] for j in playing_slots])
            if everyone:  # slices, no per-agent Python here
                obs[:] = o_t
                rewards = r_t
            else:
                rewards = [0.0] * n_slots
                for j, o, r in zip(playing_slots, o_t, r_t):
                    obs[j] = o
                    rewards[j] = r
            if self.observations is not None:  # the agents that stepped, final observations included
                if keyed:
                    self.observations.add_reward_rows([self.slots[j] for j in playing_slots], r_t)
                self._transform(playing_slots)
            for ep in episodes:
                ep.steps += 1
            if ended_now:
                self._plan = None
                over: list[int] = []
                for pos in ended_now:
                    j = playing_slots[pos]
                    i, k = self.slots[j]
                    truncated = envs[i].ended[k] == "truncated"
                    segments.append((j, self._start_row[j], t + 1, obs[j], not truncated, truncated, episodes[i], k,
                                     self._chunk_index[j], self._t_started[j]))
                    self._start_row[j] = -1
                    if not envs[i].agents and i not in over:
                        over.append(i)
                for i in over:  # every agent is done: the episode ends, the env starts the next
                    ep, env = episodes[i], envs[i]
                    ep.is_truncated = all(how == "truncated" for how in env.ended.values())
                    ep.is_terminated = not ep.is_truncated
                    ended.append(ep)
                    ended_at[id(ep)] = t
                    if self.listener is not None:
                        self.listener.episode_ended(i, ep)
                    self._start(i, None, t + 1)
            reward_rows.append(rewards)
            env_steps += n_envs
            t += 1
        obs_rows.append(nested.stack(obs))
        for j, start in enumerate(self._start_row):  # the open segments are cut where the run stops
            if start >= 0:
                i, k = self.slots[j]
                segments.append((j, start, t, None, False, False, self.episodes[i], k, self._chunk_index[j],
                                 self._t_started[j]))
        group_of = {m: g for g, (mids, _) in enumerate(groups) for m in mids}
        chunks = self._cut(segments, obs_rows, reward_rows, outputs, group_of, t, ended_at)
        return MultiAgentSample(chunks, env_steps, agent_steps, module_steps, ended)

    def _cut(self, segments: list[tuple], obs_rows: list[Any], reward_rows: list[list[float]],
             outputs: list[dict[str, np.ndarray]], group_of: dict[str, int], rounds: int,
             ended_at: dict[int, int]) -> dict[str, list[EpisodeChunk]]:
        """Each segment's chunk, grouped by module, in the order ``MultiAgentSampler`` hands them out: episodes as
        they end (by round, then env), then the running ones (by env); within an episode, agents as they finish
        (by round, then agent), the ones still playing last."""
        env_major = lambda a: np.ascontiguousarray(np.swapaxes(a, 0, 1))  # noqa: E731
        obs = nested.map_structure(env_major, nested.stack(obs_rows))  # [slots, rounds + 1, ...]
        rewards = np.asarray(reward_rows, dtype=np.float64).T if reward_rows else np.zeros((len(self.slots), 0))
        columns = [{key: env_major(value[:rounds]) for key, value in cols.items()} for cols in outputs]
        keyed = []
        for seg in segments:
            j, start, end, final, term, trunc, ep, k, chunk_index, t_started = seg
            taken = ended_at.get(id(ep), rounds)
            keyed.append(((taken, ep.env_index, end if final is not None else rounds + 1, k), seg))
        keyed.sort(key=lambda item: item[0])
        out: dict[str, list[EpisodeChunk]] = {}
        for _, (j, start, end, final, term, trunc, ep, k, chunk_index, t_started) in keyed:
            if end <= start:
                continue  # started at the run's last row: nothing to cut yet
            seg_obs = nested.map_structure(lambda a: a[j, start:end + (final is None)], obs)
            if final is not None:
                seg_obs = nested.concat([seg_obs, nested.map_structure(lambda a: np.asarray(a)[None], final)])
            module_id = ep.modules[k]
            cols = columns[group_of[module_id]]
            seg_rewards = rewards[j, start:end]
            chunk = EpisodeChunk(
                episode_id=f"{ep.id_}.{k}", chunk_index=chunk_index, obs=seg_obs,
                actions=cols["actions"][j, start:end], rewards=seg_rewards.astype(np.float32),
                terminated=term, truncated=trunc,
                extra={key: value[j, start:end] for key, value in cols.items() if key != "actions"},
                infos=[], t_started=t_started, weights_version=self.weights_version,
                env_runner_index=self.env_runner_index, env_index=ep.env_index)
            chunk.agent_id, chunk.module_id = str(k), module_id
            out.setdefault(module_id, []).append(chunk)
            ep.returns[k] += float(seg_rewards.sum())
            ep.agent_step_count += end - start
            if final is None:  # still playing: its next chunk continues from here
                self._chunk_index[j] += 1
                self._t_started[j] += end - start
        # the open segments go on from the next run's first row (one opened at this run's last row too)
        self._start_row = [0 if start >= 0 else -1 for start in self._start_row]
        return out


def _stacked(obs: list[Any]) -> Any:
    try:
        return nested.stack(obs)
    except ValueError:  # ragged: the acting's check names the agent whose observation is off
        return None


def _rows_like(value: np.ndarray, rounds: int, slots: int) -> np.ndarray:
    """Zeroed time-major rows for a batch output like ``value``: ``[rounds, slots, ...]``."""
    return np.zeros((rounds, slots) + value.shape[1:], value.dtype)
