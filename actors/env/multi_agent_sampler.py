"""MultiAgentSampler: an env runner's per-step loop for multi-agent envs, one module per policy.

The multi-agent counterpart of ``sampling.FragmentSampler``. A multi-agent env (RLlib's new-stack
``MultiAgentEnv`` API, duck-typed: ``reset(seed=)`` -> ``(obs, infos)``, ``step(actions)`` -> ``(obs,
rewards, terminateds, truncateds, infos)`` with ``"__all__"``, all dicts keyed by agent id) has
agents that act together, in turns, join late or finish early. Each env's episode is recorded by a
``protocols.multi_agent_episode.MultiAgentEpisode``, which knows which agents hold an observation
to act on and which module each is mapped to.

Each step gathers the waiting observations of every env, grouped by module, and acts on them with
``multi_agent_acting.ModuleActing`` (shared with ``lockstep_sampler.LockstepSampler``, which samples
``make_multi_agent`` copies time-major): **one batched forward pass per module** over all agents of all
envs mapped to it, one exploration call on that batch, and one action conversion (``EnvActions``) for
it; then every env steps once. What an action carries into its chunk is what the single-agent loop
records, so the learners read both alike: the module's action (before the env conversion),
``action_logp``, ``action_dist_inputs``, and ``vf_preds`` when the module's acting forward pass gives
them. The per-agent Python that is left is what the dict API forces: scattering each batch's rows back
to agents and envs.

A finished episode is replaced by a fresh one (the env is reset) and reported in the sample; the
running ones are cut at the end of each ``run`` and continue there in the next (their chunk
indices go on). Env errors propagate: recreating a failed env is the env runner's business.
"""
from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np
import torch

from actors.connectors.module_to_env import ModuleToEnvPipeline
from actors.env.actions import EnvActions
from actors.env.exploration import Exploration
from actors.env.multi_agent_acting import ModuleActing
from actors.env.multi_agent_connectors import AgentObservations
from actors.env.numpy_acting import acting_rng
from actors.env.sampling import plain_info
from actors.metrics import MetricsLogger
from actors.modules import RLModule
from protocols import nested
from protocols.episode import EpisodeChunk
from protocols.multi_agent_episode import AgentID, MultiAgentEpisode, add_action_batch

PolicyMappingFn = Callable[[AgentID, MultiAgentEpisode], str]


class EpisodeListener(Protocol):
    """What the env runner hears of each episode (its ``on_episode_*`` callbacks): called when the episode
    object is made (before the env resets), after the reset, after every step of a running episode, and
    once when it ended."""

    def episode_created(self, env_index: int, episode: MultiAgentEpisode) -> None: ...

    def episode_started(self, env_index: int, episode: MultiAgentEpisode) -> None: ...

    def episode_stepped(self, env_index: int, episode: MultiAgentEpisode) -> None: ...

    def episode_ended(self, env_index: int, episode: MultiAgentEpisode) -> None: ...

    hears_steps: bool
    """Whether ``episode_stepped`` does anything (False: the sampler skips calling it; absent: True)."""

@dataclass
class MultiAgentSample:
    """One ``run``: the chunks cut, grouped by module, what was counted, and the episodes that ended."""

    chunks: dict[str, list[EpisodeChunk]]
    """Per module id, the per-agent chunks (tagged with ``agent_id`` and ``module_id``)."""
    env_steps: int
    """``step()`` calls, over all envs."""
    agent_steps: int
    """Actions taken, by all agents of all envs."""
    module_steps: dict[str, int] = field(default_factory=dict)
    """Actions taken per module (modules that did not act are absent)."""
    episodes: list[MultiAgentEpisode] = field(default_factory=list)
    """The episodes that ended during this run, in the order they did."""

    @property
    def episode_returns(self) -> list[float]:
        """Each ended episode's return: every agent's rewards summed."""
        return [ep.get_return() for ep in self.episodes]

    @property
    def episode_lens(self) -> list[int]:
        """Each ended episode's length in env steps."""
        return [ep.env_steps() for ep in self.episodes]

    def log_episodes(self, metrics: MetricsLogger, window: int | None = None) -> None:
        """The ended episodes' statistics under RLlib's keys (less ``env_runners/``): the usual
        return/length statistics with returns summed over agents, and the per-agent and per-module
        returns (``agent_episode_returns_mean/<agent>``, ``module_episode_returns_mean/<module>``)."""
        metrics.log_episodes(self.episode_returns, self.episode_lens, window)
        for ep in self.episodes:
            for key, value in ep.return_metrics().items():
                metrics.log_value(key, value, window=window)


class MultiAgentSampler:
    """Steps every env, each with its running ``MultiAgentEpisode``; ``run`` returns a ``MultiAgentSample``.

    ``modules``, ``explorations`` and ``env_actions`` are keyed by module id (the same ids);
    ``policy_mapping_fn(agent_id, episode)`` picks an agent's module, once per agent per episode.
    Env ``i`` is reset at once, with ``seed + i`` when ``seed`` is given (later resets continue
    each env's own generator, as gymnasium's vector envs do). ``listener`` (optional) hears of every
    episode's start, steps and end, where the runner's ``on_episode_*`` callbacks hook in.
    """

    def __init__(self, envs: Sequence[Any], modules: Mapping[str, RLModule], explorations: Mapping[str, Exploration],
                 env_actions: Mapping[str, EnvActions], policy_mapping_fn: PolicyMappingFn, *,
                 env_runner_index: int = 0, seed: int | None = None, record_infos: bool = False,
                 weights_version: int = 0, listener: EpisodeListener | None = None,
                 check_observations: bool = False, rng: np.random.Generator | None = None,
                 observations: AgentObservations | None = None,
                 module_to_env: Mapping[str, ModuleToEnvPipeline] | None = None) -> None:
        if not envs:
            raise ValueError("MultiAgentSampler needs at least one env, got none")
        self.acting = ModuleActing(modules, explorations, env_actions,
                                   rng if rng is not None else acting_rng(seed, env_runner_index), self.policy_of,
                                   check_observations)
        """The modules and how they act; its ``rng`` (seeded from ``seed`` unless given) draws the actions of
        modules that act in numpy."""
        self.envs = list(envs)
        self.policy_mapping_fn = checked_mapping_fn(policy_mapping_fn)
        self.env_runner_index = env_runner_index
        self.record_infos = record_infos
        """Keep each agent's infos in its chunks (a recording that writes them)."""
        self._weights_version = weights_version
        self.listener = listener
        self.observations = observations
        """The env-to-module pipelines every observation passes before its episode records it (None: none)."""
        self.module_to_env = module_to_env
        """Each module's module-to-env pipeline, applied to its rows' actions before they are recorded and sent
        (None: none)."""
        self._fast_path = True
        self.episodes: list[MultiAgentEpisode] = []
        """The episode running in each env."""
        self.reset(seed)

    @property
    def weights_version(self) -> int:
        """The version of the weights acting now; stamped on every chunk cut from here on."""
        return self._weights_version

    @weights_version.setter
    def weights_version(self, version: int) -> None:
        self._weights_version = version
        for ep in self.episodes:
            ep.weights_version = version

    def use_fast_path(self, on: bool) -> None:
        """Take the shortcuts for the commonest steps (the episodes' one-pass recording, the fused pass's rows
        padded as a list), the default; False: the general path throughout, which gives the same chunks."""
        self._fast_path = self.acting.fast_path = on
        for ep in self.episodes:
            ep.plain_steps = on

    def reset(self, seed: int | None = None) -> None:
        """Reset every env (env ``i`` with ``seed + i`` when a seed is given); each starts a fresh
        episode, and the running ones are dropped with whatever they had not handed out."""
        self.episodes = [self._start(i, None if seed is None else seed + i) for i in range(len(self.envs))]

    def _start(self, index: int, seed: int | None) -> MultiAgentEpisode:
        ep = MultiAgentEpisode(self.policy_mapping_fn, module_ids=self.acting.modules,
                               env_runner_index=self.env_runner_index, env_index=index,
                               weights_version=self._weights_version, record_infos=self.record_infos,
                               look_back=None if self.observations is None else self.observations.look_back,
                               seq_lens=seq_lens(self.acting.modules))
        self.acting.forget_states(index)
        ep.plain_steps = self._fast_path
        if self.listener is not None:  # RLlib's order: the episode object exists before the env resets
            self.listener.episode_created(index, ep)
        result = self.envs[index].reset(seed=seed)
        if not isinstance(result, tuple) or len(result) != 2:  # a bare obs dict would unpack into two agent ids
            raise ValueError(f"env {index}'s reset() returned {_short(result)}; a multi-agent env's reset returns "
                             "(observations, infos), two dicts keyed by agent id")
        obs, infos = result
        if self.observations is not None:
            self.observations.new_episode(index)
            obs = self.observations.transform([(index, ep, obs)])[0]
        ep.add_reset(obs, self._infos(infos))
        if self.listener is not None:
            self.listener.episode_started(index, ep)
        return ep

    def _infos(self, infos: Any) -> Any:
        if not self.record_infos or not isinstance(infos, Mapping):
            return infos
        return {aid: plain_info(info) for aid, info in infos.items()}

    @torch.inference_mode()
    def run(self, num_env_steps: int | None = None, num_agent_steps: int | None = None, *, explore: bool = True,
            t0: int = 0) -> MultiAgentSample:
        """Step every env until ``num_env_steps`` env steps or ``num_agent_steps`` actions are taken
        (give one). Every env steps once per round, so the count may overshoot by less than one
        round. ``t0`` is where exploration schedules stand, in the unit the run counts; each round's
        exploration call gets ``t0`` plus what this run counted before it."""
        target, by_agents = run_target(num_env_steps, num_agent_steps)
        acting = self.acting
        forwards = acting.forwards(explore)
        groups = acting.groups()
        listener = self.listener
        stepped = listener.episode_stepped if listener is not None and getattr(listener, "hears_steps", True) else None
        chunks: dict[str, list[EpisodeChunk]] = {}
        ended: list[MultiAgentEpisode] = []
        module_steps: dict[str, int] = {}
        env_steps = agent_steps = 0
        n = len(self.envs)
        keyed = self.observations is not None and self.observations.keyed
        views = self.observations is not None and bool(self.observations.look_back)
        while (agent_steps if by_agents else env_steps) < target:
            timestep = t0 + (agent_steps if by_agents else env_steps)
            # every waiting observation of every env, grouped by module: (env index, agent), observation
            waiting: dict[str, tuple[list[tuple[int, AgentID]], list[Any]]] = {}
            for i, ep in enumerate(self.episodes):
                for mid, aid, o in ep.waiting_rows():
                    part = waiting.get(mid)
                    if part is None:
                        part = waiting[mid] = ([], [])
                    part[0].append((i, aid))
                    part[1].append(o)
            if views:  # the episodes record one frame per step; the modules act on their stacks
                self.observations.view_waiting(waiting, self.episodes)
            to_env: list[dict[AgentID, Any]] = [{} for _ in range(n)]
            for group in groups:
                acted = acting.act_group(group, waiting, forwards, explore, timestep)
                if acted is None:
                    continue
                present, who, acts, env_acts, columns = acted
                if self.module_to_env is not None:
                    acts, env_acts, columns = through_module_to_env(self.module_to_env, self.acting.env_actions,
                                                                    present, waiting, acts, columns, explore)
                if keyed:
                    self.observations.note_actions(who, acts)
                keys = tuple(columns)
                rows = list(zip(*columns.values()))  # each agent's policy outputs, in keys' order
                if self._fast_path and add_action_batch(self.episodes, who, acts, keys, rows):
                    for (i, aid), env_action in zip(who, env_acts):
                        to_env[i][aid] = env_action
                else:
                    for i, (agents, acts_i, rows_i, env_acts_i) in _by_env(who, acts, rows, env_acts).items():
                        self.episodes[i].add_action_rows(agents, acts_i, keys, rows_i)
                        to_env[i].update(zip(agents, env_acts_i))
                for m in present:
                    module_steps[m] = module_steps.get(m, 0) + len(waiting[m][0])
                agent_steps += len(who)
            envs, plain_results = self.envs, not self.record_infos
            piped = None if self.observations is None else self._step_through_pipelines(to_env)
            for i, ep in enumerate(self.episodes):
                if piped is not None:
                    result = piped[i]
                else:
                    result = envs[i].step(to_env[i])
                    # a plain 5-tuple with infos not kept goes to the episode as it is
                    if type(result) is not tuple or len(result) != 5 or not plain_results:
                        result = self._step_result(i, result)
                ep.add_step(*result)
                if ep.is_terminated or ep.is_truncated:  # is_done, without a property call per env
                    _add(chunks, ep.take_chunks())
                    ended.append(ep)
                    if self.listener is not None:
                        self.listener.episode_ended(i, ep)
                    self.episodes[i] = self._start(i, None)
                elif stepped is not None:
                    stepped(i, ep)
            env_steps += n
        for ep in self.episodes:
            ep.cut()
            _add(chunks, ep.take_chunks())
        return MultiAgentSample(chunks, env_steps, agent_steps, module_steps, ended)

    def _step_through_pipelines(self, to_env: list[dict[AgentID, Any]]) -> list[tuple]:
        """Every env steps first, then their observations pass the pipelines: one call per module for them all."""
        results = [self._step_result(i, env.step(to_env[i])) for i, env in enumerate(self.envs)]
        self.observations.add_rewards([(i, r[1]) for i, r in enumerate(results)])
        new_obs = self.observations.transform([(i, ep, r[0]) for i, (ep, r) in enumerate(zip(self.episodes, results))])
        return [(o, *r[1:]) for o, r in zip(new_obs, results)]

    def policy_of(self, env_index: int, agent_id: AgentID) -> str:
        """The module ``agent_id`` of env ``env_index``'s running episode acts with."""
        return self.episodes[env_index].module_for(agent_id)

    def _step_result(self, index: int, result: Any) -> tuple:
        """Env ``index``'s step result as the episode takes it: a plain 5-tuple, infos kept as plain data."""
        if type(result) is not tuple or len(result) != 5:
            if not isinstance(result, tuple) or len(result) != 5:
                raise ValueError(f"env {index}'s step() returned {_short(result)}; a multi-agent env's step returns "
                                 "(observations, rewards, terminateds, truncateds, infos), dicts keyed by agent id "
                                 "with '__all__' in terminateds and truncateds")
            result = tuple(result)  # a tuple subclass (a named tuple): plain, as the episode takes it
        if not self.record_infos:
            return result
        obs, rewards, terminateds, truncateds, infos = result
        return obs, rewards, terminateds, truncateds, self._infos(infos)


def through_module_to_env(pipelines: Mapping[str, ModuleToEnvPipeline], env_actions: Mapping[str, Any],
                          present: list[str], waiting: dict, acts: Any, columns: dict[str, np.ndarray],
                          explore: bool) -> tuple[Any, list[Any], dict]:
    """A group's actions through each module's module-to-env pipeline, its rows (grouped by module in
    ``present``'s order; ``waiting[mid]`` starts with the module's rows and their observations) one batch per
    module: what the pieces leave in "actions" is recorded, their "actions_for_env" (else the actions converted
    by ``env_actions[mid]``) is what the env gets. Every module has a pipeline (``build_module_pipelines`` builds
    one per module, and ``add_module`` is refused). Both multi-agent samplers run it."""
    acts = np.asarray(acts)
    parts, env_parts, col_parts = [], [], {k: [] for k in columns}
    start = 0
    for mid in present:
        rows = slice(start, start + len(waiting[mid][0]))
        start = rows.stop
        batch = {k: v[rows] for k, v in columns.items()}
        batch["actions"] = acts[rows]
        batch = pipelines[mid](batch, nested.stack(waiting[mid][1]), explore)
        for_env = batch.pop("actions_for_env", None)
        env_part = np.asarray(env_actions[mid](np.asarray(batch["actions"])) if for_env is None else for_env)
        env_part = env_part.tolist() if env_part.ndim == 1 else list(env_part)
        parts.append(np.asarray(batch["actions"]))
        env_parts += env_part
        for k in columns:
            col_parts[k].append(np.asarray(batch[k]))
    return (np.concatenate(parts), env_parts,
            {k: np.concatenate(v) for k, v in col_parts.items()})


def seq_lens(modules: Mapping[str, RLModule]) -> dict[str, int]:
    """The recurrent modules' ``max_seq_len`` (their agents' chunks are sequences of at most that many steps)."""
    return {mid: int(m.config.max_seq_len) for mid, m in modules.items() if getattr(m, "is_recurrent", False)}


def checked_mapping_fn(policy_mapping_fn: Any) -> PolicyMappingFn:
    """``policy_mapping_fn`` when it can be called, or an error saying what it must be."""
    if not callable(policy_mapping_fn):
        raise ValueError(f"policy_mapping_fn must be callable (agent_id, episode) -> module id, "
                         f"got {policy_mapping_fn!r}")
    return policy_mapping_fn


def run_target(num_env_steps: int | None, num_agent_steps: int | None) -> tuple[int, bool]:
    """A run's step target and whether it counts agent steps, from ``run()``'s two arguments (one of them given)."""
    if (num_env_steps is None) == (num_agent_steps is None):
        raise ValueError(f"give run() one of num_env_steps and num_agent_steps, got num_env_steps={num_env_steps}, "
                         f"num_agent_steps={num_agent_steps}")
    target = num_agent_steps if num_env_steps is None else num_env_steps
    if isinstance(target, bool) or not isinstance(target, (int, np.integer)) or target < 1:
        raise ValueError(f"run() needs a number of steps >= 1, got {target!r}")
    return int(target), num_env_steps is None


def _by_env(who: list[tuple[int, AgentID]], acts: Any, rows: list[tuple], env_acts: list) -> dict[int, tuple]:
    """A batch's agents, actions, output rows and env actions regrouped per env index."""
    out: dict[int, tuple[list, list, list, list]] = {}
    for (i, aid), action, row, env_action in zip(who, acts, rows, env_acts):
        part = out.get(i)
        if part is None:
            part = out[i] = ([], [], [], [])
        part[0].append(aid)
        part[1].append(action)
        part[2].append(row)
        part[3].append(env_action)
    return out


def _add(into: dict[str, list[EpisodeChunk]], chunks: dict[str, list[EpisodeChunk]]) -> None:
    for mid, cs in chunks.items():
        into.setdefault(mid, []).extend(cs)


def _short(value: Any) -> str:
    text = " ".join(repr(value).split())  # one line: an array's repr wraps
    return f"{type(value).__name__} {text[:80]}{'...' if len(text) > 80 else ''}"
