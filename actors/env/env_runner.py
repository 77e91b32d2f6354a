"""EnvRunner: steps a vector of environments with an inference-only module and emits episode chunks.

The per-step path does one batched forward pass, one exploration call and one vector-env step;
nothing per sub-env except the env's own ``step``. Steps go into time-major buffers
(``[T, num_envs]``) that are cut into one chunk per episode segment at the end of each run.

The same class runs in the driver process (``num_env_runners=0``) or as a Ray actor; a stage
group talks to it through the same methods either way (``sample_encoded``, ``set_weights``,
``get_metrics``, ``start_streaming``...). What it observes goes to ``self.metrics`` (a
``MetricsLogger``) and leaves through ``get_metrics()`` as plain data the driver merges: episode
statistics under their RLlib names, step and episode counters, the weights version it acts with,
and ``fault_tolerance/...`` and ``stream/...`` keys for the result sections of those names.
"""
from __future__ import annotations

import json
import logging
import math
import os
import sys
import threading
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Callable

import gymnasium as gym
import numpy as np
import torch

from actors.callbacks import CallbacksSpec, build_callbacks, call_hook, overrides
from actors.core import EnvRunnerRole
from actors.env.actions import EnvActions
from actors.env.episode_hooks import EpisodeHooks
from actors.env.exploration import make_exploration
from actors.env.vector_env import EnvContext, make_vector_env
from actors.metrics import MetricsLogger
from actors.modules import ActorCriticModule, RLModule
from actors.sys_usage import SysUsage
from protocols import nested
from actors.offline.recorder import Recorder, RecordingSettings
from protocols.codec import decode, encode
from protocols.episode import EpisodeChunk


@dataclass
class EnvRunnerSettings:
    """What an env runner needs to know; filled in by the driver from the algorithm config."""

    env_creator: Callable[[EnvContext], gym.Env]
    env_config: dict = field(default_factory=dict)
    num_envs: int = 1
    vectorize_mode: str = "sync"
    rollout_fragment_length: int = 200
    batch_mode: str = "truncate_episodes"
    explore: bool = True
    module_class: type[RLModule] = ActorCriticModule
    model_config: dict = field(default_factory=dict)
    module_kwargs: dict = field(default_factory=dict)
    observation_space: gym.Space | None = None
    action_space: gym.Space | None = None
    exploration_config: dict = field(default_factory=dict)
    clip_rewards: bool | float | None = None
    normalize_actions: bool = True
    clip_actions: bool = False
    seed: int | None = None
    num_env_runners: int = 0
    restart_failed_sub_environments: bool = False
    torch_threads: int = 1
    metrics_window: int = 100
    """Episodes the runner's own episode statistics are averaged over."""
    callbacks: CallbacksSpec | None = None
    """The user's callbacks; this runner builds its own instance and runs the runner hooks."""
    in_evaluation: bool = False
    """An evaluator (its envs see ``EnvContext.in_evaluation``; callbacks see ``env_runner.config.in_evaluation``)."""
    log_level: str = "WARN"
    """Level of runnel's loggers in this runner's process."""
    log_sys_usage: bool = False
    """Report this process's CPU and resident memory under ``perf/env_runner_<index>/``."""
    recording: RecordingSettings | None = None
    """Record every chunk this runner returns (``config.offline_data(output=...)``); None: off."""
    niceness: int = 0
    """Raise this runner's OS niceness by this much (a remote runner only): evaluators running beside
    training take the CPU time training leaves idle instead of slowing it down."""


@dataclass
class _Slot:
    """The episode currently running in one sub-env."""

    episode_id: str
    counted: bool = True
    """False for an episode started after ``sample(num_episodes=n)`` had started its n (it is dropped)."""
    chunk_index: int = 0
    t_started: int = 0
    ret: float = 0.0
    length: int = 0
    pending: list = field(default_factory=list)  # held-back chunks (complete_episodes mode)


class EnvRunner(EnvRunnerRole):
    def __init__(self, settings: EnvRunnerSettings, worker_index: int = 0, recreated: bool = False) -> None:
        self.s = settings
        self.worker_index = worker_index
        if settings.seed is not None:
            torch.manual_seed(settings.seed + 7919 * worker_index)
        if worker_index > 0:  # a remote actor owns its core; intra-op threads only add contention
            torch.set_num_threads(settings.torch_threads)
            set_log_level(settings.log_level)
            if settings.niceness:
                lower_priority(settings.niceness)
        self.where = f"{'evaluation ' if settings.in_evaluation else ''}env runner {worker_index}"
        self.metrics = MetricsLogger()
        self.callback_metrics = MetricsLogger()
        """What callbacks log (``metrics_logger`` of the runner hooks); reported under ``env_runners/``."""
        self.callbacks = build_callbacks(settings.callbacks)
        self._tasks: list[Any] | None = None  # curriculum task per sub-env, once a task function set them
        self.env = make_vector_env(
            settings.vectorize_mode, creator=settings.env_creator, env_config=settings.env_config,
            num_envs=settings.num_envs, worker_index=worker_index, num_workers=settings.num_env_runners,
            seed=settings.seed, restart_failed=settings.restart_failed_sub_environments, recreated=recreated,
            in_evaluation=settings.in_evaluation, on_created=self._sub_env_created,
        )
        self.observation_space = settings.observation_space or self.env.single_observation_space
        self.action_space = settings.action_space or self.env.single_action_space
        self.module = settings.module_class(self.observation_space, self.action_space, settings.model_config,
                                            inference_only=True, **settings.module_kwargs)
        self.module.eval()
        self.exploration = make_exploration(settings.exploration_config, self.module.dist_spec)
        self.env_actions = EnvActions(self.action_space, settings.normalize_actions, settings.clip_actions)
        self.weights_version = 0
        self.num_env_steps_sampled_lifetime = 0
        self._timestep_offset = 0  # the run's env steps minus this runner's, as of the last weights
        self._obs: Any = None
        self._slots: list[_Slot] = []
        self._restarts_seen = 0
        # episode ids: unique across runs (OS entropy), yet the same after a resume (state is saved)
        self._ids = np.random.default_rng()
        # weights that arrive while a stream samples in another thread wait here for its next fragment
        self._weights_lock = threading.Lock()
        self._pending_weights: tuple[Any, int] | None = None
        self._stream: Any = None
        self._next: list[deque] = [deque() for _ in range(settings.num_envs)]  # (id, counted) of started episodes
        self._quota: int | None = None  # sample(num_episodes=n): episodes that count, in the order they start
        self._started = 0
        self._ended_log: list[tuple[float, int]] | None = None  # (return, length) of counted episodes, when asked
        self._sys = SysUsage() if settings.log_sys_usage else None
        cb = self.callbacks
        self.hooks: EpisodeHooks | None = None
        if any(overrides(cb, h) for h in ("on_episode_created", "on_episode_start", "on_episode_step",
                                          "on_episode_end")):
            self.hooks = EpisodeHooks(self, cb, self.where, self.callback_metrics, settings.metrics_window)
            self.env.keep_infos = True
        if self.env.supports_hooks:
            self.env.before_reset = self._episode_begins
        self._with_infos = settings.recording is not None and settings.recording.output_write_infos
        if self._with_infos:
            self.env.keep_infos = True
        self._obs_infos: list[dict] | None = None  # the info of each sub-env's current observation
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
        if self._tasks is not None:
            task_env(env).set_task(self._tasks[index])
        if overrides(self.callbacks, "on_sub_environment_created"):
            self._hook("on_sub_environment_created", worker=self, env_runner=self, sub_environment=env,
                       env_context=ctx, env_index=index)

    def _episode_begins(self, index: int) -> None:
        """Sub-env ``index`` is about to start an episode: draw its id (and whether it counts)."""
        counted = True
        if self._quota is not None:
            counted = self._started < self._quota
            self._started += 1
        episode_id = self._new_episode_id()
        self._next[index].append((episode_id, counted))
        if self.hooks is not None:
            self.hooks.created(index, episode_id)

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
            return self._sample_end_hook(self._sample_episodes(num_episodes, explore))
        if num_timesteps is None:
            num_timesteps = self.s.rollout_fragment_length * self.s.num_envs
        if self._obs is None or force_reset:
            self._reset_all()
        complete = self.s.batch_mode == "complete_episodes"
        out: list[EpisodeChunk] = []
        collected = 0
        while collected < num_timesteps:
            steps = max(1, math.ceil((num_timesteps - collected) / self.s.num_envs))
            chunks = self._run(steps, explore, hold_back=complete)
            out.extend(chunks)
            collected += sum(len(c) for c in chunks) if complete else steps * self.s.num_envs
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
        self._ended_log = []
        try:
            chunks = self.sample(num_timesteps=num_timesteps, num_episodes=num_episodes, explore=explore,
                                 force_reset=force_reset)
            ended = self._ended_log
        finally:
            self._ended_log = None
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
        self._quota, self._started = num_episodes, 0
        try:
            self._reset_all()
            done: list[EpisodeChunk] = []
            while len(done) < num_episodes:
                done.extend(self._run(self.s.rollout_fragment_length, explore, hold_back=True))
        finally:
            self._quota = None
            self._obs = None  # unfinished episodes are dropped; the next sample() starts fresh ones
        return done

    def _new_episode_id(self) -> str:
        return self._ids.bytes(16).hex()

    def _reset_all(self) -> None:
        self._next = [deque() for _ in range(self.s.num_envs)]
        self._obs = self.env.reset()
        if not self.env.supports_hooks:
            for j in range(self.s.num_envs):
                self._episode_begins(j)
        self._slots = [_Slot(*self._next[j].popleft()) for j in range(self.s.num_envs)]
        if self._with_infos:
            reset_infos = getattr(self.env, "reset_infos", None) or [{}] * self.s.num_envs
            self._obs_infos = [_plain(i) for i in reset_infos]
        if self.hooks is not None:
            infos = getattr(self.env, "reset_infos", None) or [{}] * self.s.num_envs
            for j in range(self.s.num_envs):
                self.hooks.started(j, nested.map_structure(lambda a: a[j], self._obs), infos[j])

    @torch.inference_mode()
    def _run(self, steps: int, explore: bool, hold_back: bool) -> list[EpisodeChunk]:
        n = self.s.num_envs
        obs_rows, act_rows, logp_rows, dist_rows = [], [], [], []
        rewards = np.zeros((steps, n), np.float32)
        terminated = np.zeros((steps, n), bool)
        truncated = np.zeros((steps, n), bool)
        final_obs: dict[tuple[int, int], Any] = {}
        info_rows: list[list[dict]] | None = [self._obs_infos or [{}] * n] if self._with_infos else None
        final_infos: dict[tuple[int, int], dict] = {}
        obs = self._obs
        module, spec, exploration = self.module, self.module.dist_spec, self.exploration
        forward = module.forward_exploration if explore else module.forward_inference
        t0 = self.timestep
        for t in range(steps):
            obs_rows.append(obs)
            dist_inputs = forward(nested.map_structure(torch.from_numpy, obs))["action_dist_inputs"]
            dist = spec.build(dist_inputs)
            actions = exploration.actions(dist, explore, t0 + t * n)
            act_np = actions.numpy()
            act_rows.append(act_np)
            logp_rows.append(dist.logp(actions).numpy())
            dist_rows.append(dist_inputs.numpy())
            res = self.env.step(self.env_actions(act_np))
            rewards[t], terminated[t], truncated[t] = res.rewards, res.terminated, res.truncated
            for i, o in res.final_obs.items():
                final_obs[(t, i)] = o
                if not self.env.supports_hooks:
                    self._episode_begins(i)
            if self.hooks is not None:
                self.hooks.step_all(act_np, res.rewards, res.obs, res)
            if info_rows is not None:
                step_infos = [_plain(i) for i in (res.infos or [{}] * n)]
                reset_infos = res.reset_infos or {}
                for i in res.final_obs:
                    final_infos[(t, i)] = step_infos[i]
                info_rows.append([_plain(reset_infos.get(i, {})) if i in res.final_obs else step_infos[i]
                                  for i in range(n)])
            obs = res.obs
        self._obs = obs
        obs_rows.append(obs)
        if info_rows is not None:
            self._obs_infos = info_rows[-1]
        self.num_env_steps_sampled_lifetime += steps * n
        self._log_steps(steps * n)
        return self._cut(obs_rows, act_rows, logp_rows, dist_rows, rewards, terminated, truncated, final_obs, hold_back,
                         info_rows, final_infos)

    def _log_steps(self, steps: int) -> None:
        m = self.metrics
        m.log_value("num_env_steps_sampled", steps, reduce="sum")
        m.log_value("num_env_steps_sampled_lifetime", steps, reduce="lifetime_sum")
        restarts = self.env.num_restarts - self._restarts_seen
        if restarts:
            self._restarts_seen = self.env.num_restarts
            m.log_value("fault_tolerance/num_sub_env_restarts", restarts, reduce="lifetime_sum")

    def _log_episodes(self, returns: list[float], lengths: list[int]) -> None:
        m, w = self.metrics, self.s.metrics_window
        m.log_values("episode_return_mean", returns, window=w)
        m.log_values("episode_return_min", returns, reduce="min", window=w)
        m.log_values("episode_return_max", returns, reduce="max", window=w)
        m.log_values("episode_len_mean", lengths, window=w)
        m.log_value("num_episodes", len(returns), reduce="sum")
        m.log_value("num_episodes_lifetime", len(returns), reduce="lifetime_sum")

    def _clip(self, rewards: np.ndarray) -> np.ndarray:
        c = self.s.clip_rewards
        if c is None or c is False:
            return rewards
        if c is True:
            return np.sign(rewards)
        return np.clip(rewards, -c, c)

    def _cut(self, obs_rows, act_rows, logp_rows, dist_rows, rewards, terminated, truncated, final_obs,
             hold_back: bool, info_rows: list | None = None, final_infos: dict | None = None) -> list[EpisodeChunk]:
        """Time-major buffers -> one chunk per (sub-env, episode segment)."""
        env_major = lambda rows: nested.map_structure(lambda a: np.ascontiguousarray(np.swapaxes(a, 0, 1)), nested.stack(rows))  # noqa: E731
        obs = env_major(obs_rows)  # [n, T+1, ...]
        acts = env_major(act_rows)
        logp = np.ascontiguousarray(np.stack(logp_rows).T)
        dists = env_major(dist_rows)
        raw_rewards = np.ascontiguousarray(rewards.T)
        clipped = self._clip(raw_rewards)
        dones = (terminated | truncated).T
        col = lambda struct, j, a, b: nested.map_structure(lambda x: x[j, a:b], struct)  # noqa: E731
        out: list[EpisodeChunk] = []
        ended_returns: list[float] = []
        ended_lengths: list[int] = []
        steps = rewards.shape[0]
        for j, slot in enumerate(self._slots):
            start = 0
            for t in [*np.flatnonzero(dones[j]), steps - 1]:
                t = int(t)
                if t < start:
                    continue
                ended = bool(dones[j, t])
                seg_obs = col(obs, j, start, t + 1 + (not ended))
                if ended:
                    last = nested.map_structure(lambda a: np.asarray(a)[None], final_obs[(t, j)])
                    seg_obs = nested.concat([seg_obs, last])
                chunk = EpisodeChunk(
                    episode_id=slot.episode_id, chunk_index=slot.chunk_index, obs=seg_obs,
                    actions=col(acts, j, start, t + 1), rewards=clipped[j, start : t + 1],
                    # gymnasium allows both flags at once (CartPole at its time limit): terminal wins,
                    # since nothing should be bootstrapped past a terminal state
                    terminated=bool(terminated[t, j]), truncated=bool(truncated[t, j] and not terminated[t, j]),
                    extra={"action_logp": logp[j, start : t + 1], "action_dist_inputs": col(dists, j, start, t + 1)},
                    t_started=slot.t_started, weights_version=self.weights_version,
                    env_runner_index=self.worker_index, env_index=j,
                    infos=([row[j] for row in info_rows[start : t + 1 + (not ended)]]
                           + ([final_infos[(t, j)]] if ended else [])) if info_rows is not None else [],
                )
                slot.ret += float(raw_rewards[j, start : t + 1].sum())
                slot.length += t + 1 - start
                slot.chunk_index += 1
                slot.t_started += t + 1 - start
                if hold_back:
                    slot.pending.append(chunk)
                    if ended and slot.counted:
                        out.append(self._postprocessed(EpisodeChunk.concat(slot.pending)))
                elif slot.counted:
                    out.append(self._postprocessed(chunk))
                if ended:
                    if slot.counted:
                        ended_returns.append(slot.ret)
                        ended_lengths.append(slot.length)
                    slot = self._slots[j] = _Slot(*self._next[j].popleft())
                start = t + 1
        if ended_returns:  # logged before the chunks leave, so whoever receives them finds them counted
            self._log_episodes(ended_returns, ended_lengths)
            if self._ended_log is not None:
                self._ended_log.extend(zip(ended_returns, ended_lengths))
        if self.hooks is not None:
            self.hooks.forget_ended()
        return out

    def _postprocessed(self, chunk: EpisodeChunk) -> EpisodeChunk:
        """``on_postprocess_trajectory`` may rewrite the chunk (its rewards...) before it leaves."""
        if self._postprocess:
            episode = self.hooks.find(chunk.episode_id) if self.hooks is not None else None
            self._hook("on_postprocess_trajectory", worker=self, env_runner=self, episode=episode, agent_id=None,
                       policy_id="default_policy", policies={"default_policy": self.module},
                       postprocessed_batch=chunk, original_batches={None: (self.module, chunk)})
        return chunk

    # --- weights, metrics, state ------------------------------------------------------------
    def set_weights(self, weights: dict[str, np.ndarray], weights_version: int = 0,
                    timestep: int | None = None) -> None:
        """Apply now, or -- while a stream samples in its own thread -- before its next fragment
        (never in the middle of one). ``timestep``: the run's env steps sampled so far, which
        drives exploration schedules (a runner alone sees only its share of them)."""
        with self._weights_lock:
            if self.is_streaming():
                self._pending_weights = (weights, weights_version, timestep)
                return
        self._apply_weights(weights, weights_version, timestep)

    def apply_pending_weights(self) -> bool:
        """Apply weights that arrived while streaming; the stream calls this between fragments."""
        with self._weights_lock:
            pending, self._pending_weights = self._pending_weights, None
        if pending is None:
            return False
        self._apply_weights(*pending)
        self.metrics.log_value("num_weight_updates_applied", 1, reduce="lifetime_sum")
        return True

    def _apply_weights(self, weights: dict[str, np.ndarray], weights_version: int, timestep: int | None) -> None:
        self.module.set_state(weights)
        self.weights_version = weights_version
        if timestep is not None:
            self._timestep_offset = max(0, timestep - self.num_env_steps_sampled_lifetime)
        self.metrics.log_value("weights_version", weights_version, reduce="max")

    def get_weights(self) -> dict[str, np.ndarray]:
        return self.module.get_state()

    @property
    def timestep(self) -> int:
        """The run's env steps as this runner knows them: what exploration schedules follow."""
        return self.num_env_steps_sampled_lifetime + self._timestep_offset

    def get_metrics(self) -> dict[str, Any]:
        """What was logged since the last call, as plain data for ``MetricsLogger.merge``. While
        streaming, raises if the sampling thread failed or hangs, so the driver's stage group treats
        this runner as failed and recreates it."""
        if self._stream is not None:
            self._stream.check_health()
            self._stream.log_counters()
        if self._sys is not None:
            for key, value in self._sys.sample().items():
                self.metrics.log_value(f"perf/env_runner_{self.worker_index}/{key}", value)
        if self.recorder is not None:
            self.recorder.log_metrics(self.metrics)
        out = self.metrics.export()
        out.update({f"env_runners/{k}": v for k, v in self.callback_metrics.export().items()})
        return out

    def get_state(self) -> dict[str, Any]:
        """Weights, counters, exploration, this process's torch RNG, and the running episodes
        (slots, and the vector env's record of them) -- what a checkpoint needs for the runner to
        continue exactly where it was. Plain data, arrays, tensors and codec frames only."""
        # a streaming runner's episodes move in its sampling thread: it resumes with fresh ones
        episodes = self._obs is not None and not self.is_streaming()
        slots = [{"episode_id": s.episode_id, "chunk_index": s.chunk_index, "t_started": s.t_started,
                  "ret": s.ret, "length": s.length, "pending": [encode(c, compress=False) for c in s.pending]}
                 for s in self._slots] if episodes else None
        return {"weights": self.get_weights(), "weights_version": self.weights_version,
                "num_env_steps_sampled_lifetime": self.num_env_steps_sampled_lifetime,
                "timestep_offset": self._timestep_offset, "exploration": self.exploration.get_state(),
                "torch_rng": torch.get_rng_state().numpy(), "episode_ids": json.dumps(self._ids.bit_generator.state),
                "slots": slots, "env": self.env.get_state() if episodes else None, "env_tasks": self._tasks}

    def set_state(self, state: dict[str, Any]) -> None:
        self.set_weights(state["weights"], state.get("weights_version", 0))
        self.num_env_steps_sampled_lifetime = state.get("num_env_steps_sampled_lifetime", 0)
        self._timestep_offset = state.get("timestep_offset", 0)
        self.exploration.set_state(state.get("exploration", {}))
        if state.get("torch_rng") is not None:
            torch.set_rng_state(torch.as_tensor(np.array(state["torch_rng"], np.uint8)))  # a writable copy
        if state.get("episode_ids"):
            self._ids.bit_generator.state = json.loads(state["episode_ids"])
        if state.get("env_tasks") is not None:
            self.set_env_tasks(state["env_tasks"])
        slots = state.get("slots")
        if state.get("env") is not None and slots is not None and len(slots) != self.s.num_envs:
            # restored with another num_envs_per_env_runner: the saved episodes have no sub-envs to go on in
            logging.getLogger("runnel").info("env runner %d: the checkpoint ran %d sub-envs, this runner %d; starting fresh episodes",
                     self.worker_index, len(slots), self.s.num_envs)
        elif state.get("env") is not None:
            self._obs = self.env.set_state(state["env"])
            self._next = [deque() for _ in range(self.s.num_envs)]  # the replayed resets drew ids the slots replace
            self._slots = [_Slot(s["episode_id"], True, s["chunk_index"], s["t_started"], s["ret"], s["length"],
                                 [decode(f) for f in s["pending"]]) for s in state["slots"]]
            if self.hooks is not None:
                self.hooks.upcoming.clear()
                for j, slot in enumerate(self._slots):
                    self.hooks.resume(j, slot.episode_id, nested.map_structure(lambda a: a[j], self._obs))

    def ping(self) -> str:
        return "ok"

    def apply(self, fn: Callable[["EnvRunner"], Any]) -> Any:
        """Run ``fn(self)`` here (``Algorithm.foreach_env_runner``). An error ``fn`` raises is the
        caller's: the group raises it in the driver, naming this runner, and does not restart it."""
        try:
            return fn(self)
        except Exception as err:
            try:
                err.runnel_user_code = True
            except AttributeError:  # an exception class that takes no attributes: the method says it all
                pass
            raise

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
        tasks = []
        for i, env in enumerate(self.env.sub_envs):
            target = task_env(env)
            task = env_task_fn(train_results, target, self._context(i))
            if self._tasks is None or task != self._tasks[i]:
                target.set_task(task)
            tasks.append(task)
        self._tasks = tasks
        return tasks

    def set_env_tasks(self, tasks: list[Any]) -> None:
        """Give each sub-env its task (a recreated runner, a restored checkpoint)."""
        if len(tasks) != self.s.num_envs:
            raise ValueError(f"{len(tasks)} env tasks for {self.s.num_envs} sub-environments")
        for env, task in zip(self.env.sub_envs, tasks):
            task_env(env).set_task(task)
        self._tasks = list(tasks)

    def stop(self) -> None:
        self.stop_streaming()
        if self.recorder is not None:
            self.recorder.close()
        self.env.close()

    # --- streaming (asynchronous algorithms: IMPALA, APPO) ----------------------------------
    def start_streaming(self, address: str, hwm: int = 4, compress: bool = True, sndbuf: int = 0,
                        stall_timeout_s: float = 60.0) -> None:
        """Start (or keep) a thread that samples fragment after fragment and pushes each one's
        chunks to the receiver at ``address`` (``actors.env.streaming``); this object's other
        methods stay callable meanwhile."""
        from actors.env.streaming import RunnerStream

        stream = self._stream
        if stream is not None and stream.alive():
            if stream.address == address:
                return
            stream.stop()
        self._stream = RunnerStream(self, address, hwm=hwm, compress=compress, sndbuf=sndbuf,
                                    stall_timeout_s=stall_timeout_s)
        self._stream.start()

    def stop_streaming(self, timeout_s: float = 10.0) -> bool:
        """Stop the sampling thread (a send blocked by back-pressure gives up). True if it ended."""
        stream = self._stream
        if stream is None:
            return True
        stopped = stream.stop(timeout_s)
        if stopped:
            self._stream = None
            self.apply_pending_weights()  # what arrived for a fragment that never came
        return stopped

    def is_streaming(self) -> bool:
        stream = self._stream
        return stream is not None and stream.alive()


def task_env(env: gym.Env) -> Any:
    """The object that holds ``set_task``: the env itself, or the env inside gymnasium's wrappers."""
    if hasattr(env, "set_task"):
        return env
    inner = getattr(env, "unwrapped", env)
    if not hasattr(inner, "set_task"):
        raise TypeError(f"env {type(inner).__name__} has no set_task/get_task: a curriculum (env_task_fn) needs "
                        f"a TaskSettableEnv (pipeline.TaskSettableEnv)")
    return inner


def set_log_level(level: str) -> None:
    """runnel's loggers in this process at ``level``, printing to stderr (Ray forwards it to the driver)."""
    level = "WARNING" if level == "WARN" else level
    for name in ("runnel", "actors", "pipeline"):
        logger = logging.getLogger(name)
        logger.setLevel(level)
        if not logger.handlers:
            handler = logging.StreamHandler(sys.stderr)
            handler.setFormatter(logging.Formatter("%(levelname)s %(name)s: %(message)s"))
            logger.addHandler(handler)


def lower_priority(niceness: int) -> None:
    """Raise the niceness of every thread of this process (Linux sets it per thread, and Ray's
    threads already run), or of the process where threads cannot be listed."""
    try:
        tids = [int(t) for t in os.listdir("/proc/self/task")]
    except OSError:
        os.nice(niceness)
        return
    for tid in tids:
        try:
            os.setpriority(os.PRIO_PROCESS, tid, min(19, os.getpriority(os.PRIO_PROCESS, tid) + niceness))
        except OSError:  # a thread that ended meanwhile
            pass


def _plain(info: Any) -> dict:
    """An env info as plain data the codec carries (numpy scalars to Python numbers, arrays kept)."""
    if not isinstance(info, dict):
        return {}
    out = {}
    for k, v in info.items():
        if isinstance(v, np.generic):
            v = v.item()
        elif isinstance(v, dict):
            v = _plain(v)
        out[str(k)] = v
    return out
