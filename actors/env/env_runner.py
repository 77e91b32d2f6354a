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
import math
import threading
from dataclasses import dataclass, field
from typing import Any, Callable

import gymnasium as gym
import numpy as np
import torch

from actors.core import EnvRunnerRole
from actors.env.actions import EnvActions
from actors.env.exploration import make_exploration
from actors.env.vector_env import EnvContext, make_vector_env
from actors.metrics import MetricsLogger
from actors.modules import ActorCriticModule, RLModule
from protocols import nested
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


@dataclass
class _Slot:
    """The episode currently running in one sub-env."""

    episode_id: str
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
        self.env = make_vector_env(
            settings.vectorize_mode, creator=settings.env_creator, env_config=settings.env_config,
            num_envs=settings.num_envs, worker_index=worker_index, num_workers=settings.num_env_runners,
            seed=settings.seed, restart_failed=settings.restart_failed_sub_environments, recreated=recreated,
        )
        self.observation_space = settings.observation_space or self.env.single_observation_space
        self.action_space = settings.action_space or self.env.single_action_space
        self.module = settings.module_class(self.observation_space, self.action_space, settings.model_config,
                                            inference_only=True, **settings.module_kwargs)
        self.module.eval()
        self.exploration = make_exploration(settings.exploration_config, self.module.dist_spec)
        self.env_actions = EnvActions(self.action_space, settings.normalize_actions, settings.clip_actions)
        self.metrics = MetricsLogger()
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

    # --- sampling ---------------------------------------------------------------------------
    def sample(self, num_timesteps: int | None = None, num_episodes: int | None = None,
               explore: bool | None = None) -> list[EpisodeChunk]:
        """Step all sub-envs and return the episode chunks collected.

        ``num_timesteps`` (default ``rollout_fragment_length * num_envs``) continues running
        episodes across calls (``truncate_episodes``) or returns only whole episodes
        (``complete_episodes``). ``num_episodes`` starts fresh episodes and returns exactly that
        many whole ones.
        """
        explore = self.s.explore if explore is None else explore
        if num_episodes is not None:
            return self._sample_episodes(num_episodes, explore)
        if num_timesteps is None:
            num_timesteps = self.s.rollout_fragment_length * self.s.num_envs
        if self._obs is None:
            self._reset_all()
        complete = self.s.batch_mode == "complete_episodes"
        out: list[EpisodeChunk] = []
        collected = 0
        while collected < num_timesteps:
            steps = max(1, math.ceil((num_timesteps - collected) / self.s.num_envs))
            chunks = self._run(steps, explore, hold_back=complete)
            out.extend(chunks)
            collected += sum(len(c) for c in chunks) if complete else steps * self.s.num_envs
        return out

    def sample_encoded(self, num_timesteps: int | None = None, explore: bool | None = None,
                       compress: bool = False) -> tuple[bytes, dict[str, Any]]:
        """``sample()`` as one codec frame, plus ``get_metrics()``: what a stage group asks for, so
        chunks cross every process boundary as codec frames (and do so in-process too)."""
        frame = encode(self.sample(num_timesteps=num_timesteps, explore=explore), compress=compress)
        return frame, self.get_metrics()

    def _sample_episodes(self, num_episodes: int, explore: bool) -> list[EpisodeChunk]:
        self._reset_all()
        done: list[EpisodeChunk] = []
        while len(done) < num_episodes:
            done.extend(self._run(self.s.rollout_fragment_length, explore, hold_back=True))
        self._obs = None  # unfinished episodes are dropped; the next sample() starts fresh ones
        return done[:num_episodes]

    def _new_episode_id(self) -> str:
        return self._ids.bytes(16).hex()

    def _reset_all(self) -> None:
        self._obs = self.env.reset()
        self._slots = [_Slot(self._new_episode_id()) for _ in range(self.s.num_envs)]

    @torch.inference_mode()
    def _run(self, steps: int, explore: bool, hold_back: bool) -> list[EpisodeChunk]:
        n = self.s.num_envs
        obs_rows, act_rows, logp_rows, dist_rows = [], [], [], []
        rewards = np.zeros((steps, n), np.float32)
        terminated = np.zeros((steps, n), bool)
        truncated = np.zeros((steps, n), bool)
        final_obs: dict[tuple[int, int], Any] = {}
        obs = self._obs
        module, spec, exploration = self.module, self.module.dist_spec, self.exploration
        forward = module.forward_exploration if explore else module.forward_inference
        t0 = self.num_env_steps_sampled_lifetime + self._timestep_offset
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
            obs = res.obs
        self._obs = obs
        obs_rows.append(obs)
        self.num_env_steps_sampled_lifetime += steps * n
        self._log_steps(steps * n)
        return self._cut(obs_rows, act_rows, logp_rows, dist_rows, rewards, terminated, truncated, final_obs, hold_back)

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
             hold_back: bool) -> list[EpisodeChunk]:
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
                )
                slot.ret += float(raw_rewards[j, start : t + 1].sum())
                slot.length += t + 1 - start
                slot.chunk_index += 1
                slot.t_started += t + 1 - start
                if hold_back:
                    slot.pending.append(chunk)
                    if ended:
                        out.append(EpisodeChunk.concat(slot.pending))
                else:
                    out.append(chunk)
                if ended:
                    ended_returns.append(slot.ret)
                    ended_lengths.append(slot.length)
                    slot = self._slots[j] = _Slot(self._new_episode_id())
                start = t + 1
        if ended_returns:  # logged before the chunks leave, so whoever receives them finds them counted
            self._log_episodes(ended_returns, ended_lengths)
        return out

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

    def get_metrics(self) -> dict[str, Any]:
        """What was logged since the last call, as plain data for ``MetricsLogger.merge``. While
        streaming, raises if the sampling thread failed or hangs, so the driver's stage group treats
        this runner as failed and recreates it."""
        if self._stream is not None:
            self._stream.check_health()
            self._stream.log_counters()
        return self.metrics.export()

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
                "slots": slots, "env": self.env.get_state() if episodes else None}

    def set_state(self, state: dict[str, Any]) -> None:
        self.set_weights(state["weights"], state.get("weights_version", 0))
        self.num_env_steps_sampled_lifetime = state.get("num_env_steps_sampled_lifetime", 0)
        self._timestep_offset = state.get("timestep_offset", 0)
        self.exploration.set_state(state.get("exploration", {}))
        if state.get("torch_rng") is not None:
            torch.set_rng_state(torch.as_tensor(np.asarray(state["torch_rng"], np.uint8)))
        if state.get("episode_ids"):
            self._ids.bit_generator.state = json.loads(state["episode_ids"])
        if state.get("env") is not None:
            self._obs = self.env.set_state(state["env"])
            self._slots = [_Slot(s["episode_id"], s["chunk_index"], s["t_started"], s["ret"], s["length"],
                                 [decode(f) for f in s["pending"]]) for s in state["slots"]]

    def ping(self) -> str:
        return "ok"

    def apply(self, fn: Callable[["EnvRunner"], Any]) -> Any:
        """Run ``fn(self)`` here (``Algorithm.foreach_env_runner``)."""
        return fn(self)

    def stop(self) -> None:
        self.stop_streaming()
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
