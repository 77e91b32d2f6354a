"""EnvRunner: steps a vector of environments with an inference-only module and emits episode chunks.

The per-step path (``sampling.FragmentSampler``) does one call of the acting piece
(``actors.env.acting``: one batched forward pass and one exploration call here, or -- central
inference -- one round trip to an inference server) and one vector-env step; nothing per sub-env
except the env's own ``step``. Steps go into
time-major buffers (``[T, num_envs]``) that are cut into one chunk per episode segment at the end
of each run (``episode_slots.EpisodeSlots``). This class is the stage around those pieces: what it
is asked to do (sample, weights, state, streaming, curriculum) and what it reports.

The same class runs in the driver process (``num_env_runners=0``) or as a Ray actor; a stage
group talks to it through the same methods either way (``sample_encoded``, ``set_weights``,
``get_metrics``, ``start_streaming``...). What it observes goes to ``self.metrics`` (a
``MetricsLogger``) and leaves through ``get_metrics()`` as plain data the driver merges: episode
statistics under their RLlib names, step and episode counters, the weights version it acts with,
and ``fault_tolerance/...`` and ``stream/...`` keys for the result sections of those names.
"""
from __future__ import annotations

import logging
import math
from typing import Any, Callable

import gymnasium as gym
import numpy as np

from actors.callbacks import build_callbacks, call_hook, overrides
from actors.connectors.base import build_pipeline
from actors.connectors.module_to_env import build_module_to_env
from actors.core import EnvRunnerRole, call_user_fn
from actors.env.acting import make_acting
from actors.env.actions import EnvActions
from actors.env.episode_hooks import EpisodeHooks
from actors.env.episode_slots import EpisodeSlots
from actors.env.process import prepare_process
from actors.env.sampling import FragmentSampler
from actors.env.settings import EnvRunnerSettings, check_sample_count
from actors.env.streaming import StreamingRunner
from actors.env.task_settable import SubEnvTasks
from actors.env.vector_env import EnvContext
from actors.env.vector_modes import make_vector_env
from actors.metrics import MetricsLogger
from actors.sys_usage import SysUsage
from protocols import nested
from actors.offline.recorder import Recorder
from protocols.codec import encode
from protocols.episode import EpisodeChunk


EPISODE_HOOKS = ("on_episode_created", "on_episode_start", "on_episode_step", "on_episode_end")
SUB_ENV_HOOKS = ("on_sub_environment_created", *EPISODE_HOOKS)
"""Callbacks that see each sub-env or each episode step by step: they need separate sub-env objects."""


class EnvRunner(StreamingRunner, EnvRunnerRole):
    def __init__(self, settings: EnvRunnerSettings, worker_index: int = 0, recreated: bool = False) -> None:
        self.s = settings
        self.worker_index = worker_index
        prepare_process(settings, worker_index, uses_torch=settings.inference is None and settings.numpy_policy is None)
        self.where = f"{'evaluation ' if settings.in_evaluation else ''}env runner {worker_index}"
        self.metrics = MetricsLogger()
        self.callback_metrics = MetricsLogger()
        """What callbacks log (``metrics_logger`` of the runner hooks); reported under ``env_runners/``."""
        self.callbacks = build_callbacks(settings.callbacks)
        self.tasks = SubEnvTasks(settings.num_envs)  # curriculum task per sub-env, once a task function set them
        mode = settings.vectorize_mode
        if mode == "auto" and any(overrides(self.callbacks, h) for h in SUB_ENV_HOOKS):
            mode = "sync"  # those hooks reach into each sub-env: no env's own vector implementation
        self.env = make_vector_env(
            mode, creator=settings.env_creator, env_config=settings.env_config,
            num_envs=settings.num_envs, worker_index=worker_index, num_workers=settings.num_env_runners,
            seed=settings.seed, restart_failed=settings.restart_failed_sub_environments, recreated=recreated,
            in_evaluation=settings.in_evaluation, on_created=self._sub_env_created, threads=settings.env_threads,
        )
        self.action_space = settings.action_space or self.env.single_action_space
        self.connector = build_pipeline(settings.env_to_module,
                                        settings.env_observation_space or self.env.single_observation_space,
                                        self.action_space)
        """The env-to-module pipeline (``actors.connectors``); None without ``env_to_module_connector``."""
        self.observation_space = (self.connector.observation_space if self.connector is not None else
                                  settings.observation_space or self.env.single_observation_space)
        self.acting = make_acting(settings, self.observation_space, self.action_space, worker_index)
        self.module = self.acting.module
        """The inference-only module this runner acts with (None under central inference: the server holds it)."""
        self.exploration = self.acting.exploration
        self.env_actions = EnvActions(self.action_space, settings.normalize_actions, settings.clip_actions)
        self.module_to_env = build_module_to_env(settings.module_to_env, self.observation_space, self.action_space)
        """The module-to-env pipeline; None without ``module_to_env_connector``."""
        self.weights_version = 0
        self.num_env_steps_sampled_lifetime = 0
        self._timestep_offset = 0  # the run's env steps minus this runner's, as of the last weights
        self._restarts_seen = 0
        self.init_streaming()  # streaming (IMPALA, APPO): actors.env.streaming
        self._sys = SysUsage() if settings.log_sys_usage else None
        cb = self.callbacks
        self.hooks: EpisodeHooks | None = None
        if any(overrides(cb, h) for h in EPISODE_HOOKS):
            if self.env.next_step:
                raise ValueError(f"{self.where}: episode callbacks (on_episode_*) need the episode's steps as they "
                                 f"happen, and {settings.env_creator!r}'s vector implementation resets its sub-envs "
                                 f"a step late; use gym_env_vectorize_mode='auto' or 'sync'")
            self.hooks = EpisodeHooks(self, cb, self.where, self.callback_metrics, settings.metrics_window)
            self.env.keep_infos = True
        recurrent = getattr(self.acting, "recurrent", False)
        self.slots = EpisodeSlots(settings.num_envs, worker_index, settings.clip_rewards, self.metrics,
                                  settings.metrics_window, self.hooks, self._postprocessed,
                                  max_seq_len=self.acting.max_seq_len if recurrent else None)
        if self.env.supports_hooks:
            self.env.before_reset = self.slots.begin
        with_infos = settings.recording is not None and settings.recording.output_write_infos
        if with_infos:
            self.env.keep_infos = True
        self.sampler = FragmentSampler(self.env, self.acting, self.env_actions, self.slots, self.hooks, with_infos,
                                       self.connector, update_connector=not settings.in_evaluation,
                                       module_to_env=self.module_to_env)
        self.recorder = (Recorder(settings.recording, f"{'eval' if settings.in_evaluation else 'runner'}{worker_index:03d}")
                         if settings.recording is not None else None)
        self._postprocess = overrides(cb, "on_postprocess_trajectory")
        self._sample_end = overrides(cb, "on_sample_end")
        if overrides(cb, "on_environment_created"):
            self._hook("on_environment_created", env_runner=self, env=self.env,
                       env_context=EnvContext(settings.env_config, worker_index, 0, settings.num_env_runners,
                                              recreated, settings.in_evaluation),
                       metrics_logger=self.callback_metrics)

    @property
    def config(self) -> EnvRunnerSettings:
        """This runner's settings (``env_runner.config.in_evaluation``, as RLlib's callbacks check it)."""
        return self.s

    def _hook(self, hook: str, **kwargs: Any) -> None:
        call_hook(self.callbacks, hook, self.where, self.metrics, **kwargs)

    def _sub_env_created(self, index: int, env: gym.Env, ctx: EnvContext) -> None:
        """Every sub-env, first or recreated after a crash: the user's hook, and the current task back."""
        self.tasks.restore(index, env)
        if overrides(self.callbacks, "on_sub_environment_created"):
            self._hook("on_sub_environment_created", worker=self, env_runner=self, sub_environment=env,
                       env_context=ctx, env_index=index)

    # --- sampling ---------------------------------------------------------------------------
    def sample(self, num_timesteps: int | None = None, num_episodes: int | None = None,
               explore: bool | None = None, force_reset: bool = False) -> list[EpisodeChunk]:
        """Step all sub-envs and return the episode chunks collected.

        ``num_timesteps`` (default ``rollout_fragment_length * num_envs``) continues running
        episodes across calls (``truncate_episodes``) or returns only whole episodes
        (``complete_episodes``). ``num_episodes`` starts fresh episodes and returns exactly that
        many whole ones: the first ``num_episodes`` to start, whatever their length (episodes that
        start later are dropped, so short episodes are not favoured). ``force_reset`` drops running
        episodes and starts fresh ones first.
        """
        explore = self.s.explore if explore is None else explore
        if num_episodes is not None:
            check_sample_count("num_episodes", num_episodes)
            return self._sample_end_hook(self._sample_episodes(num_episodes, explore))
        complete = self.s.batch_mode == "complete_episodes"
        # no count asked (a streaming runner's loop): one fragment, reset-only steps and all
        one_fragment = num_timesteps is None and not complete
        if num_timesteps is None:
            num_timesteps = self.s.rollout_fragment_length * self.s.num_envs
        check_sample_count("num_timesteps", num_timesteps)
        if self.sampler.obs is None or force_reset:
            self.sampler.reset()
        out: list[EpisodeChunk] = []
        collected = 0
        while collected < num_timesteps:
            steps = max(1, math.ceil((num_timesteps - collected) / self.s.num_envs))
            chunks, env_steps = self._run(steps, explore, hold_back=complete)
            out.extend(chunks)
            collected += sum(len(c) for c in chunks) if complete else env_steps
            if one_fragment:
                break
        return self._sample_end_hook(out)

    def _sample_end_hook(self, samples: list[EpisodeChunk]) -> list[EpisodeChunk]:
        if self._sample_end:
            self._hook("on_sample_end", env_runner=self, worker=self, samples=samples,
                       metrics_logger=self.callback_metrics)
        if self.recorder is not None:
            self.recorder.record(samples)
        return samples

    def sample_metrics(self, num_timesteps: int | None = None, num_episodes: int | None = None,
                       explore: bool | None = None, force_reset: bool = False) -> dict[str, Any]:
        """Sample like ``sample`` but return only what evaluation needs: the metrics
        (``get_metrics()``), the returns and lengths of the episodes that ended, and the step count."""
        self.slots.ended_log = []
        try:
            chunks = self.sample(num_timesteps=num_timesteps, num_episodes=num_episodes, explore=explore,
                                 force_reset=force_reset)
            ended = self.slots.ended_log
        finally:
            self.slots.ended_log = None
        return {"metrics": self.get_metrics(), "episode_returns": [r for r, _ in ended],
                "episode_lengths": [n for _, n in ended], "num_env_steps": sum(len(c) for c in chunks)}

    def sample_encoded(self, num_timesteps: int | None = None, explore: bool | None = None,
                       compress: bool = False) -> tuple[bytes, dict[str, Any]]:
        """``sample()`` as one codec frame, plus ``get_metrics()``: what a stage group asks for, so
        chunks cross every process boundary as codec frames (and do so in-process too)."""
        frame = encode(self.sample(num_timesteps=num_timesteps, explore=explore), compress=compress)
        self.flush_recording()
        return frame, self.get_metrics()

    def flush_recording(self) -> None:
        """Returns once the recorder wrote every chunk sampled so far: called before chunks leave
        this runner, so a runner killed afterwards has lost nothing the learner got from the recording."""
        if self.recorder is not None:
            self.recorder.flush()

    def _sample_episodes(self, num_episodes: int, explore: bool) -> list[EpisodeChunk]:
        self.slots.quota, self.slots.started = num_episodes, 0
        try:
            self.sampler.reset()
            done: list[EpisodeChunk] = []
            while len(done) < num_episodes:
                done.extend(self._run(self.s.rollout_fragment_length, explore, hold_back=True)[0])
        finally:
            self.slots.quota = None
            self.sampler.obs = None  # unfinished episodes are dropped; the next sample() starts fresh ones
        return done

    def _run(self, steps: int, explore: bool, hold_back: bool) -> tuple[list[EpisodeChunk], int]:
        """``steps`` steps of every sub-env -> (the chunks cut, the env steps taken: reset-only ones left out)."""
        with self.acting.session():  # over the loop and the cut: postprocessing hooks run in it too
            fragment = self.sampler.run(steps, explore, self.timestep)
            env_steps = fragment.num_env_steps
            self.num_env_steps_sampled_lifetime += env_steps
            self._log_steps(env_steps, fragment.rewards.size - env_steps)
            return self.slots.cut(fragment, hold_back, self.sampler.oldest_version), env_steps

    def _log_steps(self, steps: int, reset_only: int) -> None:
        m = self.metrics
        m.log_value("num_env_steps_sampled", steps, reduce="sum")
        m.log_value("num_env_steps_sampled_lifetime", steps, reduce="lifetime_sum")
        if self.env.next_step:  # acted on, but no env step (``native_vector_env``)
            m.log_value("num_env_steps_reset_only_lifetime", reset_only, reduce="lifetime_sum")
        restarts = self.env.num_restarts - self._restarts_seen
        if restarts:
            self._restarts_seen = self.env.num_restarts
            m.log_value("fault_tolerance/num_sub_env_restarts", restarts, reduce="lifetime_sum")

    def _postprocessed(self, chunk: EpisodeChunk) -> EpisodeChunk:
        """``on_postprocess_trajectory`` may rewrite the chunk (its rewards...) before it leaves."""
        if self._postprocess:
            episode = self.hooks.find(chunk.episode_id) if self.hooks is not None else None
            self._hook("on_postprocess_trajectory", worker=self, env_runner=self, episode=episode, agent_id=None,
                       policy_id="default_policy", policies={"default_policy": self.module},
                       postprocessed_batch=chunk, original_batches={None: (self.module, chunk)})
        return chunk

    # --- weights, metrics, state ------------------------------------------------------------
    # set_weights (held back while streaming) comes from StreamingRunner
    def _apply_weights(self, weights: dict[str, np.ndarray] | None, weights_version: int, timestep: int | None) -> None:
        """``weights`` None: only the version and timestep (central inference: the servers get the weights)."""
        if weights is not None:
            self.acting.set_weights(weights, weights_version)
        self.weights_version = weights_version
        if timestep is not None:
            self._timestep_offset = max(0, timestep - self.num_env_steps_sampled_lifetime)
        self.metrics.log_value("weights_version", weights_version, reduce="max")

    def get_weights(self) -> dict[str, np.ndarray]:
        return self.acting.get_weights()

    @property
    def timestep(self) -> int:
        """The run's env steps as this runner knows them: what exploration schedules follow."""
        return self.num_env_steps_sampled_lifetime + self._timestep_offset

    def get_metrics(self) -> dict[str, Any]:
        """What was logged since the last call, as plain data for ``MetricsLogger.merge``. While
        streaming, raises if the sampling thread failed or hangs, so the driver's stage group treats
        this runner as failed and recreates it."""
        self.check_stream()
        if self._sys is not None:
            for key, value in self._sys.sample().items():
                self.metrics.log_value(f"perf/env_runner_{self.worker_index}/{key}", value)
        if self.recorder is not None:
            self.recorder.log_metrics(self.metrics)
        self.acting.log_metrics(self.metrics)
        out = self.metrics.export()
        out.update({f"env_runners/{k}": v for k, v in self.callback_metrics.export().items()})
        return out

    def get_state(self) -> dict[str, Any]:
        """Weights, counters, exploration, this process's torch RNG, and the running episodes
        (slots, and the vector env's record of them) -- what a checkpoint needs for the runner to
        continue exactly where it was. Plain data, arrays, tensors and codec frames only."""
        # a streaming runner's episodes move in its sampling thread: it resumes with fresh ones; so does one
        # whose vector env cannot carry its episodes (one vector object, or sub-envs in other processes)
        episodes = self.sampler.obs is not None and not self.is_streaming() and self.env.carries_episodes
        env_state = self.env.get_state() if episodes else None
        return {"weights": self.get_weights() if self.acting.holds_weights else None, "weights_version": self.weights_version,
                "num_env_steps_sampled_lifetime": self.num_env_steps_sampled_lifetime,
                "timestep_offset": self._timestep_offset, **self.acting.get_state(),
                "episode_ids": self.slots.get_ids_state(),
                "slots": self.slots.get_state() if episodes else None,
                "env": env_state, "env_tasks": self.tasks.tasks,
                "connectors": None if self.connector is None else self.connector.get_state(),
                "module_to_env": None if self.module_to_env is None else self.module_to_env.get_state()}

    def set_state(self, state: dict[str, Any]) -> None:
        self.set_weights(state["weights"], state.get("weights_version", 0))
        self.num_env_steps_sampled_lifetime = state.get("num_env_steps_sampled_lifetime", 0)
        self._timestep_offset = state.get("timestep_offset", 0)
        self.acting.set_state(state)
        if state.get("episode_ids"):
            self.slots.set_ids_state(state["episode_ids"])
        if state.get("env_tasks") is not None:
            self.set_env_tasks(state["env_tasks"])
        if state.get("connectors") is not None and self.connector is not None:
            self.connector.set_state(state["connectors"])
        if state.get("module_to_env") is not None and self.module_to_env is not None:
            self.module_to_env.set_state(state["module_to_env"])
        slots = state.get("slots")
        if state.get("env") is not None and slots is not None and len(slots) != self.s.num_envs:
            # restored with another num_envs_per_env_runner: the saved episodes have no sub-envs to go on in
            logging.getLogger("runnel").info("env runner %d: the checkpoint ran %d sub-envs, this runner %d; starting fresh episodes",
                     self.worker_index, len(slots), self.s.num_envs)
        elif state.get("env") is not None and self.env.carries_episodes:  # else: fresh episodes at the next sample
            self.sampler.resume(self.env.set_state(state["env"]))
            self.slots.set_state(state["slots"])
            if self.hooks is not None:
                self.hooks.upcoming.clear()
                for j, slot in enumerate(self.slots.running):
                    self.hooks.resume(j, slot.episode_id, nested.map_structure(lambda a: a[j], self.sampler.obs))

    # --- connectors ---------------------------------------------------------------------------
    def pop_connector_deltas(self) -> list[Any] | None:
        """What this runner's connectors learned since the last call (running statistics), as plain data;
        None without connectors. The driver merges every runner's and sends the result back (``sync_connectors``)."""
        return None if self.connector is None else self.connector.pop_deltas()

    def sync_connectors(self, state: list[dict[str, Any]]) -> None:
        """The driver's merged connector state; what was gathered since ``pop_connector_deltas`` is kept."""
        if self.connector is not None and state is not None:
            self.connector.sync(state)

    def ping(self) -> str:
        return "ok"

    def apply(self, fn: Callable[["EnvRunner"], Any]) -> Any:
        """Run ``fn(self)`` here (``Algorithm.foreach_env_runner``). An error ``fn`` raises is the
        caller's: the group raises it in the driver, naming this runner, and does not restart it."""
        return call_user_fn(fn, self)

    def __repr__(self) -> str:  # how Ray names this actor in errors and logs
        return f"EnvRunner({getattr(self, 'where', 'env runner')})"

    def foreach_env(self, fn: Callable[[gym.Env], Any]) -> list[Any]:
        """``fn(sub_env)`` for each sub-environment of this runner."""
        return [fn(env) for env in self.env.sub_envs]

    def foreach_env_with_context(self, fn: Callable[[gym.Env, EnvContext], Any]) -> list[Any]:
        """``fn(sub_env, env_context)`` for each sub-environment of this runner."""
        return [fn(env, self._context(i)) for i, env in enumerate(self.env.sub_envs)]

    def _context(self, index: int) -> EnvContext:
        return EnvContext(self.s.env_config, self.worker_index, index, self.s.num_env_runners,
                          in_evaluation=self.s.in_evaluation)

    # --- curriculum -------------------------------------------------------------------------
    def apply_env_task_fn(self, env_task_fn: Callable, train_results: dict) -> list[Any]:
        """Curriculum: ``env_task_fn(train_results, sub_env, env_context)`` picks each sub-env's next
        task, set where it changed. Returns the tasks (what a recreated runner gets back)."""
        return self.tasks.apply(env_task_fn, train_results, self.env.sub_envs, self._context)

    def set_env_tasks(self, tasks: list[Any]) -> None:
        """Give each sub-env its task (a recreated runner, a restored checkpoint)."""
        self.tasks.set(tasks, self.env.sub_envs)

    def stop(self) -> None:
        self.stop_streaming()
        if self.recorder is not None:
            self.recorder.close()
        self.env.close()
        self.acting.close()
