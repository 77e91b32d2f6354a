"""Algorithm: wires env runners and learners, runs training iterations, saves and restores.

An algorithm file subclasses it and implements ``training_step()`` (how the stages are driven in
one step) and ``update_fn`` (what a learner does with a batch). Everything else — building the
stages, metrics, stop criteria, checkpoints, computing actions — is shared here.
"""
from __future__ import annotations

import logging
import os
import time
from collections import deque
from datetime import datetime
from typing import Any, Callable

import numpy as np
import ray
import torch

from actors.env_runner import EnvRunnerSettings
from actors.manager import FaultToleranceSettings
from actors.module import RLModule, to_torch
from pipeline.callbacks import Callbacks
from pipeline.checkpoint import CheckpointError, read_checkpoint, read_manifest, write_checkpoint
from pipeline.config import AlgorithmConfig, ConfigError, resolve_import_path
from pipeline.env_runner_group import EnvRunnerGroup
from pipeline.envs import env_creator, probe_spaces
from pipeline.learner_group import LearnerGroup
from protocols import nested

log = logging.getLogger("runnel")

_ALGORITHMS: dict[str, tuple[type[AlgorithmConfig], type["Algorithm"]]] = {}


def register_algorithm(name: str, config_cls: type[AlgorithmConfig], algo_cls: type["Algorithm"]) -> None:
    _ALGORITHMS[name] = (config_cls, algo_cls)


def algorithm_class_for(config_cls: type[AlgorithmConfig]) -> type["Algorithm"]:
    for c, a in _ALGORITHMS.values():
        if c is config_cls:
            return a
    raise ConfigError(f"{config_cls.__name__} belongs to no registered algorithm; known: {sorted(_ALGORITHMS)}")


def get_algorithm(name: str) -> tuple[type[AlgorithmConfig], type["Algorithm"]]:
    key = {k.upper(): k for k in _ALGORITHMS}.get(name.upper())
    if key is None:
        raise ConfigError(f"unknown algorithm {name!r}; available: {sorted(_ALGORITHMS)}")
    return _ALGORITHMS[key]


def init_ray_if_needed(config: AlgorithmConfig) -> None:
    """Join the cluster named by ``RAY_ADDRESS`` (as ``ray job submit`` sets it), or else start an
    embedded local Ray with room for every actor the config asks for."""
    if ray.is_initialized():
        return
    if os.environ.get("RAY_ADDRESS"):
        ray.init(logging_level=logging.WARNING)
        return
    needed = config.num_env_runners * config.num_cpus_per_env_runner + config.num_learners * config.num_cpus_per_learner
    ray.init(num_cpus=max(os.cpu_count() or 1, int(np.ceil(needed))), include_dashboard=False,
             logging_level=logging.WARNING, log_to_driver=True)


def lookup(result: dict, path: str) -> Any:
    """``"env_runners/episode_return_mean"`` -> ``result["env_runners"]["episode_return_mean"]`` (or None)."""
    node: Any = result
    for part in path.split("/"):
        if not isinstance(node, dict) or part not in node:
            return None
        node = node[part]
    return node


class Algorithm:
    config_class: type[AlgorithmConfig] = AlgorithmConfig
    update_fn: Callable = None  # set by each algorithm file

    def __init__(self, config: AlgorithmConfig, logdir: str | None = None) -> None:
        config.validate()
        self.config = config
        logging.getLogger("runnel").setLevel("WARNING" if config.log_level == "WARN" else config.log_level)
        if config.seed is not None:
            np.random.seed(config.seed)
            torch.manual_seed(config.seed)
        self.name = type(self).__name__
        self.logdir = logdir
        creator = env_creator(config.env)
        obs_space, act_space = config.observation_space, config.action_space
        if obs_space is None or act_space is None:
            probed = probe_spaces(creator, config.env_config)
            obs_space, act_space = obs_space or probed[0], act_space or probed[1]
        self.observation_space, self.action_space = obs_space, act_space
        try:  # fail here, in the driver, with the space named, not later inside an actor
            self.module = RLModule(obs_space, act_space, config.model_config)
        except ValueError as err:
            raise ConfigError(str(err)) from err
        self.callbacks = self._make_callbacks()
        if config.num_env_runners > 0 or config.num_learners > 0:
            init_ray_if_needed(config)
        self.ft_settings = FaultToleranceSettings(
            restart_failed=config.restart_failed_env_runners, ignore_failures=config.ignore_env_runner_failures,
            max_restarts=config.max_num_env_runner_restarts, restart_delay_s=config.delay_between_env_runner_restarts_s,
            probe_timeout_s=config.env_runner_health_probe_timeout_s,
            max_requests_in_flight=getattr(config, "max_requests_in_flight_per_env_runner", 2),
        )
        self.runner_settings = EnvRunnerSettings(
            env_creator=creator, env_config=config.env_config, num_envs=config.num_envs_per_env_runner,
            vectorize_mode=config.gym_env_vectorize_mode, rollout_fragment_length=config.get_rollout_fragment_length(),
            batch_mode=config.batch_mode, explore=config.explore, model_config=config.model_config,
            observation_space=obs_space, action_space=act_space, clip_rewards=config.clip_rewards,
            normalize_actions=config.normalize_actions, clip_actions=config.clip_actions, seed=config.seed,
            num_env_runners=config.num_env_runners,
            restart_failed_sub_environments=config.restart_failed_sub_environments,
        )
        self.learner_group = LearnerGroup(config, obs_space, act_space, type(self).update_fn)
        self.env_runner_group = EnvRunnerGroup(
            self.runner_settings, config.num_env_runners, config.num_cpus_per_env_runner, self.ft_settings,
            on_recreated=lambda ids: self._on_recreated(self.env_runner_group, ids, False),
        )
        self.weights_version = 0
        self.iteration = 0
        self.time_total_s = 0.0
        self.counters = {"num_env_steps_sampled_lifetime": 0, "num_env_steps_trained_lifetime": 0,
                         "num_episodes_lifetime": 0}
        self._returns: deque = deque(maxlen=config.metrics_num_episodes_for_smoothing)
        self._lengths: deque = deque(maxlen=config.metrics_num_episodes_for_smoothing)
        self.setup()
        self.sync_weights()
        self.callbacks.on_algorithm_init(algorithm=self)

    def _make_callbacks(self) -> Callbacks:
        cls = self.config.callbacks_class
        if cls is None:
            return Callbacks()
        if isinstance(cls, str):
            cls = resolve_import_path(cls, "callbacks_class")
        return cls()

    def _on_recreated(self, group: EnvRunnerGroup, ids: list[int], is_evaluation: bool) -> None:
        self.callbacks.on_env_runners_recreated(algorithm=self, env_runner_group=group, env_runner_indices=ids,
                                                is_evaluation=is_evaluation)

    # --- to be provided by an algorithm -------------------------------------------------------
    def setup(self) -> None:
        """Build extra stages (streams, replay...). Runs before the first weight sync."""

    def training_step(self) -> dict[str, Any]:
        """One round of sampling and learning; returns learner stats. Must update ``self.counters``."""
        raise NotImplementedError

    # --- shared machinery ---------------------------------------------------------------------
    def sync_weights(self) -> None:
        weights = self.learner_group.get_weights(inference_only=True)
        self.env_runner_group.sync_weights(weights, self.weights_version)
        if self.learner_group.local is None:
            self.module.set_state(self.learner_group.get_weights())

    def record_runner_metrics(self, metrics: list[dict]) -> int:
        """Fold runner metrics into the smoothing window; returns the number of new episodes."""
        new = 0
        for m in metrics:
            self._returns.extend(m["episode_returns"])
            self._lengths.extend(m["episode_lengths"])
            new += len(m["episode_returns"])
        self.counters["num_episodes_lifetime"] += new
        return new

    def train(self) -> dict[str, Any]:
        """Run training steps until the iteration's minimum time/steps are reached; return results."""
        t0 = time.perf_counter()
        c = self.config
        sampled0 = self.counters["num_env_steps_sampled_lifetime"]
        trained0 = self.counters["num_env_steps_trained_lifetime"]
        stats: dict[str, Any] = {}
        timers = {"training_step": 0.0}
        steps = new_episodes = 0
        while True:
            ts = time.perf_counter()
            stats = self.training_step()
            timers["training_step"] += time.perf_counter() - ts
            steps += 1
            new_episodes += stats.get("_new_episodes", 0)
            elapsed = time.perf_counter() - t0
            if ((c.min_time_s_per_iteration is None or elapsed >= c.min_time_s_per_iteration)
                    and self.counters["num_env_steps_sampled_lifetime"] - sampled0 >= c.min_sample_timesteps_per_iteration
                    and self.counters["num_env_steps_trained_lifetime"] - trained0 >= c.min_train_timesteps_per_iteration):
                break
        self.iteration += 1
        dt = time.perf_counter() - t0
        self.time_total_s += dt
        stats["_new_episodes"] = new_episodes
        result = self._result(stats, timers, dt, self.counters["num_env_steps_sampled_lifetime"] - sampled0,
                              self.counters["num_env_steps_trained_lifetime"] - trained0, steps)
        self.callbacks.on_train_result(algorithm=self, result=result)
        return result

    def _result(self, stats: dict, timers: dict, dt: float, sampled: int, trained: int, steps: int) -> dict:
        returns = np.asarray(self._returns, np.float64)
        lengths = np.asarray(self._lengths, np.float64)
        nan = float("nan")
        learner_stats = {k: v for k, v in stats.items() if not k.startswith("_")}
        group = self.env_runner_group
        result = {
            "env_runners": {
                "episode_return_mean": float(returns.mean()) if len(returns) else nan,
                "episode_return_min": float(returns.min()) if len(returns) else nan,
                "episode_return_max": float(returns.max()) if len(returns) else nan,
                "episode_len_mean": float(lengths.mean()) if len(lengths) else nan,
                "num_episodes": int(stats.get("_new_episodes", 0)),
                "num_env_steps_sampled": sampled,
                "num_env_steps_sampled_lifetime": self.counters["num_env_steps_sampled_lifetime"],
                "num_episodes_lifetime": self.counters["num_episodes_lifetime"],
            },
            "learners": {"default_policy": learner_stats,
                         "__all_modules__": {"num_env_steps_trained": trained,
                                             "num_env_steps_trained_lifetime": self.counters["num_env_steps_trained_lifetime"],
                                             "weights_version": self.weights_version}},
            "fault_tolerance": {
                "num_healthy_workers": group.num_healthy() if group.num_runners else 0,
                "num_remote_worker_restarts": group.manager.num_restarts if group.manager else 0,
                "num_remote_worker_failures": group.manager.num_failures if group.manager else 0,
                "num_dropped_requests": group.manager.num_dropped_results if group.manager else 0,
                "num_sub_env_restarts": int(sum(group.sub_env_restarts.values())),
            },
            "timers": {k: v / steps for k, v in timers.items()} | {k[7:]: v for k, v in stats.items() if k.startswith("_timer_")},
            "num_env_steps_sampled_lifetime": self.counters["num_env_steps_sampled_lifetime"],
            "num_env_steps_trained_lifetime": self.counters["num_env_steps_trained_lifetime"],
            "num_episodes_lifetime": self.counters["num_episodes_lifetime"],
            "num_env_steps_sampled_per_s": sampled / dt if dt > 0 else 0.0,
            "num_training_step_calls_per_iteration": steps,
            "training_iteration": self.iteration,
            "time_this_iter_s": dt,
            "time_total_s": self.time_total_s,
            "timestamp": int(time.time()),
        }
        for k, v in stats.items():
            if k.startswith("_result_"):  # algorithm-specific top-level sections
                result[k[8:]] = v
        return result

    # --- weights and actions ------------------------------------------------------------------
    def get_weights(self) -> dict[str, np.ndarray]:
        return self.learner_group.get_weights()

    def set_weights(self, weights: dict[str, np.ndarray]) -> None:
        self.learner_group.set_weights(weights)
        self.weights_version += 1
        self.sync_weights()

    def _inference_module(self) -> RLModule:
        if self.learner_group.local is not None:
            return self.learner_group.local.module
        return self.module

    def compute_actions(self, obs: Any, explore: bool = False) -> np.ndarray:
        """A batch of observations (leading batch dim, nested like the space) -> a batch of env actions."""
        module = self._inference_module()
        device = next(module.parameters()).device
        with torch.inference_mode():
            t_obs = to_torch(nested.map_structure(np.asarray, obs), device)
            dist = module.action_dist(module.forward_inference(t_obs)["action_dist_inputs"])
            actions = (dist.sample() if explore else dist.deterministic()).cpu().numpy()
        if module.dist_spec.kind == "gaussian" and self.config.normalize_actions:
            low, high = self.action_space.low, self.action_space.high
            actions = low + (np.clip(actions, -1.0, 1.0) + 1.0) * 0.5 * (high - low)
        elif module.dist_spec.kind == "gaussian" and self.config.clip_actions:
            actions = np.clip(actions, self.action_space.low, self.action_space.high)
        return module.dist_spec.to_env(actions)

    def compute_single_action(self, obs: Any, explore: bool = False) -> Any:
        """One observation (no batch dim) -> one action the env accepts."""
        batched = nested.map_structure(lambda a: np.asarray(a)[None], obs)
        action = self.compute_actions(batched, explore=explore)[0]
        return action.item() if np.ndim(action) == 0 else action

    def foreach_env_runner(self, fn: Callable[[Any], Any], local_env_runner: bool = True) -> list[Any]:
        return self.env_runner_group.foreach_env_runner(fn, local=local_env_runner)

    # --- checkpoints --------------------------------------------------------------------------
    def default_checkpoint_dir(self) -> str:
        root = self.logdir or os.path.join(os.path.expanduser("~/runnel_results"),
                                           f"{self.name}_{datetime.now():%Y-%m-%d_%H-%M-%S}")
        self.logdir = root
        return os.path.join(root, f"checkpoint_{self.iteration:06d}")

    def get_state(self) -> dict[str, Any]:
        return {"iteration": self.iteration, "time_total_s": self.time_total_s, "counters": dict(self.counters),
                "weights_version": self.weights_version, "episode_returns": list(self._returns),
                "episode_lengths": list(self._lengths), "numpy_rng": _np_rng_state()}

    def save(self, checkpoint_dir: str | None = None) -> str:
        """Write a checkpoint directory (atomically) and return its path."""
        path = checkpoint_dir or self.default_checkpoint_dir()
        native = self._inference_module() if self.config.export_native_model_files else None
        return write_checkpoint(path, self.name, self.config.to_dict(), self.learner_group.get_state(),
                                self.get_state(), native_module=native)

    save_to_path = save

    def restore(self, checkpoint_dir: str) -> None:
        """Load a checkpoint of this algorithm into this instance; training continues from its state."""
        manifest, _, learner_state, state = read_checkpoint(checkpoint_dir)
        if manifest["algorithm"] != self.name:
            raise CheckpointError(f"checkpoint {checkpoint_dir!r} is of {manifest['algorithm']}, not {self.name}")
        self.learner_group.set_state(learner_state)
        self.iteration = int(state["iteration"])
        self.time_total_s = float(state["time_total_s"])
        self.counters.update(state["counters"])
        self.weights_version = int(state["weights_version"])
        self._returns.clear(), self._returns.extend(state["episode_returns"])
        self._lengths.clear(), self._lengths.extend(state["episode_lengths"])
        if state.get("numpy_rng"):
            name, keys, pos, has_gauss, cached = state["numpy_rng"]
            np.random.set_state((name, np.asarray(keys, np.uint32), pos, has_gauss, cached))
        self.sync_weights()
        self.callbacks.on_checkpoint_loaded(algorithm=self)

    restore_from_path = restore

    @classmethod
    def from_checkpoint(cls, checkpoint_dir: str, **kwargs: Any) -> "Algorithm":
        """Rebuild the algorithm a checkpoint was written by, with its config and state."""
        manifest = read_manifest(checkpoint_dir)
        config_cls, algo_cls = get_algorithm(manifest["algorithm"])
        _, config_dict, _, _ = read_checkpoint(checkpoint_dir)
        config = config_cls.from_dict(config_dict)
        config.update_from_dict(kwargs)  # e.g. num_env_runners=0 to evaluate locally; typos fail in validate
        algo = algo_cls(config)
        algo.restore(checkpoint_dir)
        return algo

    def evaluate_episodes(self, num_episodes: int, explore: bool = False, render: bool = False) -> dict[str, Any]:
        """Play ``num_episodes`` whole episodes in the driver with the current policy."""
        from pipeline.evaluate import run_episodes

        return run_episodes(self, num_episodes, explore=explore, render=render)

    def stop(self) -> None:
        """Stop every actor this algorithm started (Ray itself stays up)."""
        self.env_runner_group.stop()
        self.learner_group.stop()

    def __enter__(self) -> "Algorithm":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.stop()


def _np_rng_state() -> list:
    name, keys, pos, has_gauss, cached = np.random.get_state()
    return [name, keys.tolist(), int(pos), int(has_gauss), float(cached)]

