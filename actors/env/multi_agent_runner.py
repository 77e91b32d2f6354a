"""MultiAgentEnvRunner: the env-runner stage for multi-agent envs, one inference-only module per policy.

The multi-agent counterpart of ``env_runner.EnvRunner``, implementing the same ``EnvRunnerRole`` so a
stage group hosts it in-process or as a Ray actor alike. The stepping is a sampler's (one batched forward pass
per module per step): ``LockstepSampler`` for envs of ``make_multi_agent`` copies when no ``on_episode_*``
callback needs ``MultiAgentEpisode`` objects, no module-to-env pipeline is set and no env-to-module pipeline has
a view (frame stacking; time-major rows, cut by slicing: the same chunks at a fraction of the Python),
``MultiAgentSampler`` for every other env; this class is the stage around it: building the envs (each behind a
``MultiAgentStepChecker`` unless ``check_env`` is off, RLlib's ``disable_env_checking``) and the modules, what it
is asked to do (sample by steps or by episodes, weights, state, modules added and removed, a new mapping), what
it reports and records (each module's chunks into its own recording, ``actors.offline.module_recorders``).

It takes the plan's pieces (``module_specs``, ``policy_mapping_fn``, ``count_steps_by``), not the
plan: actors never import ``pipeline``. Weights are the flat ``{"<module_id>/<param>": array}`` dict
of ``MultiRLModule`` and ``MultiLearner.get_weights(inference_only=True)``; modules absent from a
weights dict keep theirs (frozen opponents). ``sample()`` returns one flat list of per-agent chunks,
each tagged with ``agent_id`` and ``module_id``; ``multi_agent_runner_parts.chunks_by_module`` groups
them for a learner.

Streaming (IMPALA, APPO) is ``EnvRunner``'s (``actors.env.streaming.StreamingRunner``): a thread samples
fragment after fragment with ``sample()`` and pushes each fragment's per-agent chunks as one frame;
weights that arrive meanwhile wait for the next fragment.

Steps are counted in ``count_steps_by`` units ("env_steps": ``step()`` calls of all envs;
"agent_steps": actions taken) for ``num_timesteps``, for ``timestep`` in ``set_weights`` and for the
exploration schedules; both counters are kept and reported whatever the unit.
"""
from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import numpy as np
import torch

from actors.callbacks import build_callbacks, call_hook, overrides
from actors.connectors.module_to_env import build_module_pipelines
from actors.connectors.multi_agent import ModuleConnectors
from actors.core import EnvRunnerRole, call_user_fn
from actors.env.actions import EnvActions
from actors.env.exploration import Exploration, make_exploration
from actors.env.lockstep_sampler import LockstepSampler, lockstep_fits
from actors.env.multi_agent_connectors import AgentObservations
from actors.env.multi_agent_env import checks_itself
from actors.env.multi_agent_runner_parts import CheckedMultiAgentEnv, HeldChunks, RunnerListener
from actors.env.multi_agent_sampler import MultiAgentSample, MultiAgentSampler, PolicyMappingFn
from actors.env.numpy_acting import acting_rng, rng_state, set_rng_state
from actors.env.process import prepare_process
from actors.env.settings import EnvRunnerSettings, check_sample_count
from actors.env.streaming import StreamingRunner
from actors.env.vector_env import EnvContext
from actors.metrics import MetricsLogger
from actors.offline.module_recorders import ModuleRecorders
from actors.modules import ModuleSpec, RLModule
from actors.modules.multi import SEP, MultiRLModule
from actors.modules.rl_module import set_autocast
from actors.sys_usage import SysUsage
from protocols.codec import encode
from protocols.episode import EpisodeChunk

COUNT_UNITS = ("env_steps", "agent_steps")
NAMED_KEYS = ("perf/", "callbacks/", "fault_tolerance/", "stream/", "offline_data/")
"""Metrics keys that are result keys as they stand; the others belong under ``env_runners/``."""


class MultiAgentEnvRunner(StreamingRunner, EnvRunnerRole):
    def __init__(self, settings: EnvRunnerSettings, module_specs: dict[str, ModuleSpec],
                 policy_mapping_fn: PolicyMappingFn, worker_index: int = 0, recreated: bool = False,
                 count_steps_by: str = "env_steps", check_env: bool = True, lockstep: bool = True,
                 connector_spaces: dict[str, tuple[Any, Any]] | None = None) -> None:
        """``lockstep``: sample envs of ``make_multi_agent`` copies with the ``LockstepSampler`` when nothing
        needs ``MultiAgentEpisode`` objects (no ``on_episode_*`` callbacks, no view such as frame stacking);
        False: always the general ``MultiAgentSampler`` (the two give the same chunks). ``connector_spaces``: each
        module's (observation, action) spaces as the env gives them, the input of its env-to-module pipeline (``settings.env_to_module``
        builds them; ``module_specs`` then hold the pipelines' output spaces)."""
        if count_steps_by not in COUNT_UNITS:
            raise ValueError(f"count_steps_by={count_steps_by!r}; use one of {COUNT_UNITS}")
        if not module_specs:
            raise ValueError("MultiAgentEnvRunner needs at least one module spec, got none")
        self.s = settings
        self.worker_index = worker_index
        self.count_steps_by = count_steps_by
        prepare_process(settings, worker_index)
        self.where = f"{'evaluation ' if settings.in_evaluation else ''}multi-agent env runner {worker_index}"
        self.metrics = MetricsLogger()
        name = f"{'eval' if settings.in_evaluation else 'runner'}{worker_index:03d}"
        self.recorder = ModuleRecorders(settings.recording, name) if settings.recording is not None else None
        self.callback_metrics = MetricsLogger()
        """What callbacks log (``metrics_logger`` of the runner hooks); reported under ``env_runners/``."""
        self.callbacks = build_callbacks(settings.callbacks)
        self.user_envs = [self._make_env(i, recreated) for i in range(settings.num_envs)]
        """The user's envs, as their creator made them."""
        # the checker leaves the observations agents act on to the sampler, which checks them a batch at a time;
        # make_multi_agent's copies check their copies' values themselves and build the dicts right
        self.envs = [CheckedMultiAgentEnv(env, plain_step_values=False) if check_env and not checks_itself(env)
                     else env for env in self.user_envs]
        """What the sampler steps: each user env behind a step checker, unless ``check_env`` is off."""
        self.module_specs: dict[str, ModuleSpec] = {}
        self.module = MultiRLModule({})
        self.explorations: dict[str, Exploration] = {}
        self.env_actions: dict[str, EnvActions] = {}
        if settings.env_to_module is not None and connector_spaces is None:
            raise ValueError("a multi-agent runner with env_to_module_connector needs connector_spaces, each "
                             "module's spaces as the env gives them")
        self.connectors = ModuleConnectors.build(settings.env_to_module, connector_spaces or {})
        """Each module's env-to-module pipeline (``actors.connectors.multi_agent``); None without them."""
        for mid, spec in module_specs.items():
            self._build_module(mid, spec)
        self.module_to_env = build_module_pipelines(
            settings.module_to_env, {mid: (spec.observation_space, spec.action_space) for mid, spec in module_specs.items()})
        """Each module's module-to-env pipeline, for the spaces the module acts in; None without them."""
        self.weights_version = 0
        self.init_streaming()
        self.num_env_steps_sampled_lifetime = 0
        self.num_agent_steps_sampled_lifetime = 0
        self._timestep_offset = 0  # the run's steps minus this runner's, as of the last weights
        self.held = HeldChunks()
        self.listener = RunnerListener(self, self.callbacks, self.where, self.metrics, self.callback_metrics,
                                       self.user_envs)
        self._fresh_episodes = False  # after num_episodes sampling: the next sample() starts new episodes
        self._sys = SysUsage() if settings.log_sys_usage else None
        self._sample_end = overrides(self.callbacks, "on_sample_end")
        if settings.seed is not None:
            # each env's generator seeded apart (the sampler's seed + i would give env 0's agent 1 and env 1's
            # agent 0 of make_multi_agent copies one seed); the sampler's first reset continues from there
            for i, env in enumerate(self.envs):
                env.reset(seed=int(np.random.SeedSequence([settings.seed, worker_index, i]).generate_state(1)[0]))
        pieces = dict(env_runner_index=worker_index, listener=self.listener, check_observations=check_env,
                      rng=acting_rng(settings.seed, worker_index))
        self.sampler: MultiAgentSampler | LockstepSampler
        if self.connectors is not None:
            pieces["observations"] = AgentObservations(self.connectors, update=not settings.in_evaluation,
                                                       check_observations=check_env)
        if self.module_to_env is not None:
            pieces["module_to_env"] = self.module_to_env
        views = self.connectors is not None and bool(self.connectors.look_back)  # built from per-agent episodes
        recurrent = any(getattr(m, "is_recurrent", False) for m in self.module.members.values())
        if (lockstep and not views and not recurrent and not self.listener.runs_callbacks
                and all(map(lockstep_fits, self.envs))):
            self.sampler = LockstepSampler(self.envs, self.module.members, self.explorations, self.env_actions,
                                           policy_mapping_fn, **pieces)
        else:
            self.sampler = MultiAgentSampler(self.envs, self.module.members, self.explorations, self.env_actions,
                                             policy_mapping_fn, **pieces)
        self._ended: list[tuple[float, int]] | None = None  # (return, env steps) of ended episodes, for evaluation

    def _make_env(self, index: int, recreated: bool) -> Any:
        s = self.s
        ctx = EnvContext(s.env_config, self.worker_index, index, s.num_env_runners, recreated, s.in_evaluation)
        env = s.env_creator(ctx)
        if not (hasattr(env, "possible_agents") and hasattr(env, "get_observation_space")):
            raise TypeError(f"the env creator made a {type(env).__name__}, which is not a multi-agent env (it lacks "
                            f"possible_agents or get_observation_space): give a MultiAgentEnv, e.g. "
                            f"make_multi_agent(...), or use the single-agent EnvRunner")
        if overrides(self.callbacks, "on_environment_created"):  # once per env: this runner steps several
            call_hook(self.callbacks, "on_environment_created", self.where, self.metrics, env_runner=self, env=env,
                      env_context=ctx, metrics_logger=self.callback_metrics)
        return env

    def _build_module(self, module_id: str, spec: ModuleSpec) -> RLModule:
        if not isinstance(module_id, str) or not module_id or SEP in module_id or "." in module_id:
            raise ValueError(f"module id {module_id!r}: give a non-empty str without '{SEP}' or '.'")
        if not isinstance(spec, ModuleSpec):
            raise TypeError(f"module {module_id!r}: got {type(spec).__name__} for its spec; give a ModuleSpec "
                            f"(observation_space, action_space, model_config, module_class, module_kwargs)")
        module = spec.build(inference_only=True)
        module.eval()
        if self.s.precision != "float32":  # its forward methods run under autocast and hand back float32
            set_autocast(module, self.s.precision, "cpu")
        self.module.members[module_id] = module  # the id was checked above, as MultiRLModule checks its own
        self.module_specs[module_id] = spec
        self.explorations[module_id] = make_exploration(self.s.exploration_config, module.dist_spec)
        self.env_actions[module_id] = EnvActions(spec.action_space, self.s.normalize_actions, self.s.clip_actions)
        return module

    @property
    def config(self) -> EnvRunnerSettings:
        """This runner's settings (``env_runner.config.in_evaluation``, as RLlib's callbacks check it)."""
        return self.s

    @property
    def module_ids(self) -> list[str]:
        return list(self.module_specs)

    # --- sampling ---------------------------------------------------------------------------
    def sample(self, num_timesteps: int | None = None, num_episodes: int | None = None,
               explore: bool | None = None, force_reset: bool = False) -> list[EpisodeChunk]:
        """Step every env and return the per-agent chunks collected, one flat list.

        ``num_timesteps`` (default ``rollout_fragment_length * num_envs``, in ``count_steps_by`` units)
        continues running episodes across calls (``truncate_episodes``) or returns only whole episodes
        (``complete_episodes``: the chunks of episodes still running wait here for their end).
        ``num_episodes`` starts fresh episodes and returns exactly that many whole ones: the first to
        start, whatever their length. ``force_reset`` drops running episodes and starts fresh ones.
        """
        explore = self.s.explore if explore is None else explore
        if num_episodes is not None:
            out = self._sample_episodes(num_episodes, explore)
        else:
            out = self._sample_steps(num_timesteps, explore, force_reset)
        if self._sample_end:
            call_hook(self.callbacks, "on_sample_end", self.where, self.metrics, env_runner=self, worker=self,
                      samples=out, metrics_logger=self.callback_metrics)
        if self.recorder is not None:
            self.recorder.record(out)
        return out

    def _sample_steps(self, num_timesteps: int | None, explore: bool, force_reset: bool) -> list[EpisodeChunk]:
        if num_timesteps is None:
            num_timesteps = self.s.rollout_fragment_length * self.s.num_envs
        check_sample_count("num_timesteps", num_timesteps)
        if force_reset or self._fresh_episodes:
            self._reset()
        complete = self.s.batch_mode == "complete_episodes"
        by_agents = self.count_steps_by == "agent_steps"
        out: list[EpisodeChunk] = []
        collected = 0
        while collected < num_timesteps:
            sample = self._run(num_timesteps - collected, explore)
            chunks = _flat(sample)
            if complete:
                self.held.add(chunks)
                chunks = [c for ep in sample.episodes for c in self.held.take(ep)]
                collected += sum(ep.agent_steps() if by_agents else ep.env_steps() for ep in sample.episodes)
            else:
                collected += sample.agent_steps if by_agents else sample.env_steps
            out.extend(chunks)
            self._log_episodes(sample.episodes)
        return out

    def _sample_episodes(self, num_episodes: int, explore: bool) -> list[EpisodeChunk]:
        check_sample_count("num_episodes", num_episodes)
        self.listener.order = {}
        done: list = []
        out: list[EpisodeChunk] = []
        try:
            self._reset()
            order = self.listener.order
            while len(done) < num_episodes:
                sample = self._run(self.s.rollout_fragment_length * len(self.envs), explore, unit="env_steps")
                self.held.add(_flat(sample))
                for ep in sample.episodes:
                    chunks = self.held.take(ep)
                    if order[ep.id_] < num_episodes:  # later starters are dropped: short episodes are not favoured
                        done.append(ep)
                        out.extend(chunks)
        finally:
            self.listener.order = None
            self.held.clear()
            self._fresh_episodes = True  # unfinished episodes are dropped; the next sample() starts fresh ones
        self._log_episodes(done)
        return out

    def _log_episodes(self, episodes: list) -> None:
        MultiAgentSample({}, 0, 0, episodes=episodes).log_episodes(self.metrics, self.s.metrics_window)
        if self._ended is not None:
            self._ended.extend((ep.get_return(), ep.env_steps()) for ep in episodes)

    def _reset(self) -> None:
        self.held.clear()
        self.sampler.reset()
        self._fresh_episodes = False

    def _run(self, steps: int, explore: bool, unit: str | None = None) -> MultiAgentSample:
        unit = unit or self.count_steps_by
        counts = {"num_env_steps" if unit == "env_steps" else "num_agent_steps": int(steps)}
        sample = self.sampler.run(**counts, explore=explore, t0=self.timestep)
        self.num_env_steps_sampled_lifetime += sample.env_steps
        self.num_agent_steps_sampled_lifetime += sample.agent_steps
        m = self.metrics
        m.log_value("num_env_steps_sampled", sample.env_steps, reduce="sum")
        m.log_value("num_env_steps_sampled_lifetime", sample.env_steps, reduce="lifetime_sum")
        m.log_value("num_agent_steps_sampled", sample.agent_steps, reduce="sum")
        m.log_value("num_agent_steps_sampled_lifetime", sample.agent_steps, reduce="lifetime_sum")
        for mid, n in sample.module_steps.items():
            m.log_value(f"num_module_steps_sampled/{mid}", n, reduce="sum")
            m.log_value(f"num_module_steps_sampled_lifetime/{mid}", n, reduce="lifetime_sum")
        return sample

    def sample_encoded(self, num_timesteps: int | None = None, explore: bool | None = None,
                       compress: bool = False) -> tuple[bytes, dict[str, Any]]:
        """``sample()`` as one codec frame, plus ``get_metrics()``: chunks cross every process boundary
        as codec frames (``protocols.codec.decode_chunks`` reads them back, module ids included)."""
        frame = encode(self.sample(num_timesteps=num_timesteps, explore=explore), compress=compress)
        self.flush_recording()  # recorded before the chunks leave: a runner killed later lost none of them
        return frame, self.get_metrics()

    def flush_recording(self) -> None:
        if self.recorder is not None:
            self.recorder.flush()

    def sample_metrics(self, num_timesteps: int | None = None, num_episodes: int | None = None,
                       explore: bool | None = None, force_reset: bool = False) -> dict[str, Any]:
        """Sample like ``sample`` but return only what evaluation needs: the metrics (``get_metrics()``),
        the returns (summed over agents) and lengths of the episodes that ended, and the env steps taken."""
        self._ended, env_steps = [], self.num_env_steps_sampled_lifetime
        try:
            self.sample(num_timesteps=num_timesteps, num_episodes=num_episodes, explore=explore,
                        force_reset=force_reset)
            ended = self._ended
        finally:
            self._ended = None
        return {"metrics": self.get_metrics(), "episode_returns": [r for r, _ in ended],
                "episode_lengths": [n for _, n in ended],
                "num_env_steps": self.num_env_steps_sampled_lifetime - env_steps}

    @property
    def _own_steps(self) -> int:
        by_agents = self.count_steps_by == "agent_steps"
        return self.num_agent_steps_sampled_lifetime if by_agents else self.num_env_steps_sampled_lifetime

    @property
    def timestep(self) -> int:
        """The run's steps (``count_steps_by`` units) as this runner knows them: what exploration follows."""
        return self._own_steps + self._timestep_offset

    # --- weights, modules, mapping ----------------------------------------------------------
    # set_weights (StreamingRunner's: held back while streaming) loads ``{"<module_id>/<param>": array}`` into the
    # modules it names, the others keep theirs; its ``timestep`` (``count_steps_by`` units) drives exploration.
    def _checked_weights(self, weights: dict[str, Any]) -> dict[str, dict[str, Any]]:
        """The weights per module, checked in the caller's thread (not later in a streaming one)."""
        by_module: dict[str, dict[str, Any]] = {}
        for key, value in weights.items():
            mid, sep, param = key.partition(SEP)
            if not sep or not param:
                raise ValueError(f"weights key {key!r} names no module: a multi-agent runner takes "
                                 f"'<module_id>{SEP}<param>' keys (MultiLearner.get_weights(inference_only=True))")
            by_module.setdefault(mid, {})[param] = value
        unknown = sorted(set(by_module) - set(self.module_specs))
        if unknown:
            raise ValueError(f"weights for modules {unknown}, which this runner does not hold; it holds "
                             f"{self.module_ids}: add_module() them first")
        return by_module

    def _apply_weights(self, by_module: dict[str, dict[str, Any]], weights_version: int,
                       timestep: int | None) -> None:
        for mid, state in by_module.items():
            try:
                self.module[mid].set_state(state)
            except ValueError as err:
                raise ValueError(f"weights for module {mid!r}: {err}") from None
        self.weights_version = weights_version
        self.sampler.weights_version = weights_version
        if timestep is not None:
            self._timestep_offset = max(0, timestep - self._own_steps)
        self.metrics.log_value("weights_version", weights_version, reduce="max")

    def get_weights(self, module_ids: Iterable[str] | None = None) -> dict[str, np.ndarray]:
        """The flat weights of every module (or of ``module_ids``)."""
        ids = self.module_ids if module_ids is None else list(module_ids)
        unknown = sorted(set(ids) - set(self.module_specs))
        if unknown:
            raise KeyError(f"no modules {unknown}; this runner holds {self.module_ids}")
        return {f"{mid}{SEP}{k}": v for mid in ids for k, v in self.module[mid].get_state().items()}

    def add_module(self, module_id: str, spec: ModuleSpec, weights: dict[str, Any] | None = None) -> None:
        """A new module (self-play: a snapshot of the learning policy); ``weights`` are its own, without
        the module prefix. Episodes that start from now on may be mapped to it."""
        if module_id in self.module_specs:
            raise ValueError(f"module {module_id!r} exists already (modules: {self.module_ids}); remove_module() "
                             f"it first or pick another id")
        if self.is_streaming():  # the sampling thread iterates the module tables this changes
            raise RuntimeError(f"add_module({module_id!r}) while this runner streams: stop_streaming() first, "
                               f"then start_streaming() again")
        if self.connectors is not None or self.module_to_env is not None:
            raise NotImplementedError(f"add_module({module_id!r}) in a run with env_to_module_connector or "
                                      f"module_to_env_connector: a pipeline for a module added while training is "
                                      f"not built yet")
        module = self._build_module(module_id, spec)
        if getattr(module, "is_recurrent", False) and isinstance(self.sampler, LockstepSampler):
            for table in (self.module_specs, self.module.members, self.explorations, self.env_actions):
                table.pop(module_id, None)
            raise NotImplementedError(f"add_module({module_id!r}): a recurrent module joining a run sampled in lockstep "
                                      f"(make_multi_agent copies): start the run with a recurrent module instead")
        if weights is not None:
            module.set_state(weights)
        self._share_with_sampler()

    def remove_module(self, module_id: str, policy_mapping_fn: PolicyMappingFn | None = None) -> None:
        """Drop a module (and, given, switch to a mapping that no longer names it). Running episodes
        with an agent mapped to it are dropped and their envs reset, since nothing could act for it."""
        if module_id not in self.module_specs:
            raise KeyError(f"no module {module_id!r} to remove; this runner holds {self.module_ids}")
        if len(self.module_specs) == 1:
            raise ValueError(f"module {module_id!r} is this runner's last module; add_module() another first")
        if self.is_streaming():  # its episodes may need a reset, which must not race the sampling thread
            raise RuntimeError(f"remove_module({module_id!r}) while this runner streams: stop_streaming() first, "
                               f"then start_streaming() again")
        if policy_mapping_fn is not None:
            self.set_policy_mapping_fn(policy_mapping_fn)
        uses_it = any(module_id in ep.module_returns for ep in self.sampler.episodes)
        for pieces in (self.module_specs, self.explorations, self.env_actions):
            del pieces[module_id]
        del self.module.members[module_id]
        self._share_with_sampler()
        if uses_it:
            self._reset()

    def _share_with_sampler(self) -> None:
        # the sampler keeps its own dicts of the pieces; new episodes check their mapping against its modules
        self.sampler.acting.share(self.module.members, self.explorations, self.env_actions)

    def set_policy_mapping_fn(self, policy_mapping_fn: PolicyMappingFn) -> None:
        """``fn(agent_id, episode) -> module_id`` for the episodes that start from now on (running
        episodes keep the mapping they started with)."""
        if not callable(policy_mapping_fn):
            raise ValueError(f"policy_mapping_fn must be callable (agent_id, episode) -> module id, "
                             f"got {policy_mapping_fn!r}")
        self.sampler.policy_mapping_fn = policy_mapping_fn

    # --- metrics and state ------------------------------------------------------------------
    def get_metrics(self) -> dict[str, Any]:
        """What was logged since the last call, as plain data for ``MetricsLogger.merge``."""
        self.check_stream()
        if self._sys is not None:
            for key, value in self._sys.sample().items():
                self.metrics.log_value(f"perf/env_runner_{self.worker_index}/{key}", value)
        if self.recorder is not None:
            self.recorder.log_metrics(self.metrics)
        # a stage group files keys with a '/' as named and bare ones under env_runners/ (EnvRunner's contract):
        # the per-agent and per-module statistics are env_runners/ keys with a '/' of their own
        out = {k if "/" not in k or k.startswith(NAMED_KEYS) else f"env_runners/{k}": v
               for k, v in self.metrics.export().items()}
        out.update({f"env_runners/{k}": v for k, v in self.callback_metrics.export().items()})
        return out

    def get_state(self) -> dict[str, Any]:
        """Weights, weights version, counters, each module's exploration state and this process's torch
        RNG: plain data and arrays. Running episodes are not part of it (a restored runner starts fresh
        ones)."""
        return {"module_ids": self.module_ids, "weights": self.get_weights(), "weights_version": self.weights_version,
                "num_env_steps_sampled_lifetime": self.num_env_steps_sampled_lifetime,
                "num_agent_steps_sampled_lifetime": self.num_agent_steps_sampled_lifetime,
                "timestep_offset": self._timestep_offset,
                "exploration": {mid: e.get_state() for mid, e in self.explorations.items()},
                "torch_rng": torch.get_rng_state().numpy(), "numpy_rng": rng_state(self.sampler.acting.rng),
                "connectors": None if self.connectors is None else self.connectors.get_state(),
                "module_to_env": None if self.module_to_env is None else {
                    mid: p.get_state() for mid, p in self.module_to_env.items()}}

    def set_state(self, state: dict[str, Any]) -> None:
        missing = sorted(set(state.get("module_ids", [])) - set(self.module_specs))
        if missing:
            raise ValueError(f"the state holds modules {missing}, which this runner does not (it holds "
                             f"{self.module_ids}): add_module() them first")
        self.set_weights(state["weights"], state.get("weights_version", 0))
        self.num_env_steps_sampled_lifetime = state.get("num_env_steps_sampled_lifetime", 0)
        self.num_agent_steps_sampled_lifetime = state.get("num_agent_steps_sampled_lifetime", 0)
        self._timestep_offset = state.get("timestep_offset", 0)
        for mid, exploration_state in state.get("exploration", {}).items():
            self.explorations[mid].set_state(exploration_state)
        if state.get("torch_rng") is not None:
            torch.set_rng_state(torch.as_tensor(np.array(state["torch_rng"], np.uint8)))  # a writable copy
        if state.get("numpy_rng") is not None:
            set_rng_state(self.sampler.acting.rng, state["numpy_rng"])
        if state.get("connectors") is not None and self.connectors is not None:
            self.connectors.set_state(state["connectors"])
        if state.get("module_to_env") is not None and self.module_to_env is not None:
            for mid, pipeline_state in state["module_to_env"].items():
                if mid in self.module_to_env:
                    self.module_to_env[mid].set_state(pipeline_state)

    # --- connectors -------------------------------------------------------------------------
    def pop_connector_deltas(self) -> dict[str, list[Any]] | None:
        """What each module's pipeline learned since the last call (running statistics); None without them."""
        return None if self.connectors is None else self.connectors.pop_deltas()

    def sync_connectors(self, state: dict[str, Any]) -> None:
        """The driver's merged state of every module's pipeline; what was gathered since is kept."""
        if self.connectors is not None and state is not None:
            self.connectors.sync(state)

    # --- the stage --------------------------------------------------------------------------
    def ping(self) -> str:
        return "ok"

    def apply(self, fn: Callable[["MultiAgentEnvRunner"], Any]) -> Any:
        """Run ``fn(self)`` here (``Algorithm.foreach_env_runner``); its error is the caller's."""
        return call_user_fn(fn, self)

    def foreach_env(self, fn: Callable[[Any], Any]) -> list[Any]:
        """``fn(env)`` for each multi-agent env of this runner (the user's env, not the checker around it)."""
        return [fn(env) for env in self.user_envs]

    def __repr__(self) -> str:  # how Ray names this actor in errors and logs
        return f"MultiAgentEnvRunner({getattr(self, 'where', 'multi-agent env runner')})"

    def stop(self) -> None:
        self.stop_streaming()
        for env in self.user_envs:
            if getattr(env, "close", None) is not None:
                env.close()
        if self.recorder is not None:
            self.recorder.close()


def _flat(sample: MultiAgentSample) -> list[EpisodeChunk]:
    return [c for chunks in sample.chunks.values() for c in chunks]
