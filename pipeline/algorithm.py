"""Algorithm: builds the stages a config asks for, runs training iterations, saves and restores.

An algorithm contributes only its pieces (see ``pipeline/algorithms/ppo.py``):

* ``config_class`` -- its settings; ``learner_class`` -- what a learner does with a batch (and,
  through its ``module_class``, the network every stage carries);
* ``training_step()`` -- its plan: which groups are asked for what, how often (PPO's is a few
  lines; IMPALA and APPO hand it to the reusable ``AsyncPlan``, built in ``build_plan()``).

Everything else is shared here: the env runner and learner groups (``setup``), the metrics logger
that every stage reports into and every result is reduced from, stop conditions of an iteration,
checkpoints, and computing actions.
"""
from __future__ import annotations

import logging
import os
import time
from datetime import datetime
from typing import Any, Callable, ClassVar

import numpy as np
import ray
import torch

from actors.env import EnvRunnerSettings
from actors.learner import Learner
from actors.manager import FaultToleranceSettings
from actors.metrics import MetricsLogger
from actors.modules import ModuleSpec, RLModule, to_torch
from actors.env.actions import EnvActions
from actors.env.exploration import make_exploration
from pipeline.callbacks import Callbacks
from pipeline.checkpoint import CheckpointError, read_checkpoint, read_extras, read_manifest, write_checkpoint
from pipeline.config import AlgorithmConfig, ConfigError, resolve_import_path
from pipeline.env_runner_group import EnvRunnerGroup
from pipeline.envs import env_creator, probe_spaces
from pipeline.learner_group import LearnerGroup
from pipeline.registry import get_algorithm
from protocols import nested
from protocols.spaces import space_to_dict
from protocols.transport import compress_by_default

log = logging.getLogger("runnel")

COUNTERS = {"num_env_steps_sampled_lifetime": "env_runners/num_env_steps_sampled_lifetime",
            "num_env_steps_trained_lifetime": "learners/__all_modules__/num_env_steps_trained_lifetime",
            "num_episodes_lifetime": "env_runners/num_episodes_lifetime"}
"""The lifetime counters of a run (``algo.counters``), and where the metrics logger keeps them."""


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
    config_class: ClassVar[type[AlgorithmConfig]] = AlgorithmConfig
    learner_class: ClassVar[type[Learner]] = Learner

    def __init__(self, config: AlgorithmConfig, logdir: str | None = None) -> None:
        self.logdir = logdir
        self.setup(config)

    # --- building -------------------------------------------------------------------------------
    def setup(self, config: AlgorithmConfig) -> None:
        """Build every stage ``config`` asks for (the name and signature of Tune's ``Trainable.setup``)."""
        config.validate()
        self.config = config
        logging.getLogger("runnel").setLevel("WARNING" if config.log_level == "WARN" else config.log_level)
        if config.seed is not None:
            np.random.seed(config.seed)
            torch.manual_seed(config.seed)
        self.name = type(self).__name__
        self.env_creator = env_creator(config.env)
        obs_space, act_space = config.observation_space, config.action_space
        if obs_space is None or act_space is None:
            probed = probe_spaces(self.env_creator, config.env_config)
            obs_space, act_space = obs_space or probed[0], act_space or probed[1]
        self.observation_space, self.action_space = obs_space, act_space
        self.module_spec = ModuleSpec(obs_space, act_space, config.model_config, self.learner_class.module_class,
                                      config.module_kwargs())
        try:  # fail here, in the driver, with the space named, not later inside an actor
            self.module = self.module_spec.build()
        except ValueError as err:
            raise ConfigError(str(err)) from err
        self._module_version = -1  # weights version self.module holds (refreshed by compute_actions)
        self.env_actions = EnvActions(act_space, config.normalize_actions, config.clip_actions)
        self.exploration = make_exploration(config.exploration_settings(), self.module.dist_spec)
        self.callbacks = self._make_callbacks()
        if config.num_env_runners > 0 or config.num_learners > 0:
            init_ray_if_needed(config)
        self.metrics = MetricsLogger()
        self.iteration = 0
        self.time_total_s = 0.0
        self.learner_group: LearnerGroup | None = None
        self.env_runner_group: EnvRunnerGroup | None = None
        self.plan: Any = None
        try:
            self.learner_group = LearnerGroup(self.learner_class, config, obs_space, act_space)
            self.env_runner_group = EnvRunnerGroup(
                self.env_runner_settings(), config.num_env_runners, config.num_cpus_per_env_runner,
                self.fault_tolerance_settings(), compress_frames=self.compress_frames(),
                on_recreated=lambda ids: self.callbacks.on_env_runners_recreated(
                    algorithm=self, env_runner_group=self.env_runner_group, env_runner_indices=ids,
                    is_evaluation=False))
            self.plan = self.build_plan()
        except BaseException:
            self.stop()
            raise
        self.sync_weights()
        self.callbacks.on_algorithm_init(algorithm=self)

    def env_runner_settings(self) -> EnvRunnerSettings:
        c = self.config
        return EnvRunnerSettings(
            env_creator=self.env_creator, env_config=c.env_config, num_envs=c.num_envs_per_env_runner,
            vectorize_mode=c.gym_env_vectorize_mode, rollout_fragment_length=c.get_rollout_fragment_length(),
            batch_mode=c.batch_mode, explore=c.explore, module_class=self.learner_class.module_class,
            model_config=c.model_config, module_kwargs=c.module_kwargs(), exploration_config=c.exploration_settings(),
            observation_space=self.observation_space, action_space=self.action_space, clip_rewards=c.clip_rewards,
            normalize_actions=c.normalize_actions, clip_actions=c.clip_actions, seed=c.seed,
            num_env_runners=c.num_env_runners, restart_failed_sub_environments=c.restart_failed_sub_environments,
            metrics_window=c.metrics_num_episodes_for_smoothing,
        )

    def fault_tolerance_settings(self) -> FaultToleranceSettings:
        c = self.config
        return FaultToleranceSettings(
            restart_failed=c.restart_failed_env_runners, ignore_failures=c.ignore_env_runner_failures,
            max_restarts=c.max_num_env_runner_restarts, restart_delay_s=c.delay_between_env_runner_restarts_s,
            probe_timeout_s=c.env_runner_health_probe_timeout_s,
            max_requests_in_flight=getattr(c, "max_requests_in_flight_per_env_runner", 2))

    def compress_frames(self) -> bool:
        """LZ4 for chunk frames: as configured (``stream_compress`` where an algorithm has it), or
        by the observations' dtype ("auto")."""
        setting = getattr(self.config, "stream_compress", "auto")
        if setting != "auto":
            return bool(setting)
        return compress_by_default(space_to_dict(self.observation_space))

    def _make_callbacks(self) -> Callbacks:
        cls = self.config.callbacks_class
        if cls is None:
            return Callbacks()
        if isinstance(cls, str):
            cls = resolve_import_path(cls, "callbacks_class")
        return cls()

    # --- what an algorithm provides -----------------------------------------------------------
    def build_plan(self) -> Any:
        """Stages beyond the env runner and learner groups that ``training_step`` drives (streams,
        a circular buffer...); None when it needs none."""
        return None

    def training_step(self) -> None:
        """One round of sampling and learning; reports what happened into ``self.metrics``."""
        raise NotImplementedError

    # --- weights ------------------------------------------------------------------------------
    @property
    def weights_version(self) -> int:
        return self.learner_group.weights_version

    @weights_version.setter
    def weights_version(self, version: int) -> None:
        self.learner_group.weights_version = version

    def sync_weights(self) -> None:
        """Send the learner's current weights to every env runner and wait until they have them."""
        weights = self.learner_group.get_weights(inference_only=True)
        self.env_runner_group.sync_weights(weights, self.weights_version, self.counters["num_env_steps_sampled_lifetime"])

    def get_weights(self) -> dict[str, np.ndarray]:
        return self.learner_group.get_weights()

    def set_weights(self, weights: dict[str, np.ndarray]) -> None:
        self.learner_group.set_weights(weights)
        self.weights_version += 1
        self.sync_weights()

    # --- training -----------------------------------------------------------------------------
    @property
    def counters(self) -> dict[str, int]:
        return {name: self.metrics.peek(key, 0) for name, key in COUNTERS.items()}

    def train(self) -> dict[str, Any]:
        """Run training steps until the iteration's minimum time/steps are reached; return results."""
        t0 = time.perf_counter()
        c = self.config
        sampled0, trained0 = (self.counters[k] for k in ("num_env_steps_sampled_lifetime",
                                                          "num_env_steps_trained_lifetime"))
        steps = 0
        while True:
            with self.metrics.log_time("timers/training_step"):
                self.training_step()
            steps += 1
            elapsed = time.perf_counter() - t0
            counters = self.counters
            if ((c.min_time_s_per_iteration is None or elapsed >= c.min_time_s_per_iteration)
                    and counters["num_env_steps_sampled_lifetime"] - sampled0 >= c.min_sample_timesteps_per_iteration
                    and counters["num_env_steps_trained_lifetime"] - trained0 >= c.min_train_timesteps_per_iteration):
                break
        self.iteration += 1
        dt = time.perf_counter() - t0
        self.time_total_s += dt
        result = self._result(dt, steps)
        self.callbacks.on_train_result(algorithm=self, result=result)
        return result

    def _result(self, dt: float, steps: int) -> dict[str, Any]:
        self.env_runner_group.log_fault_tolerance(self.metrics)
        result = self.metrics.reduce()
        nan = float("nan")
        env = result.setdefault("env_runners", {})
        for key in ("episode_return_mean", "episode_return_min", "episode_return_max", "episode_len_mean"):
            env.setdefault(key, nan)
        for key in ("num_episodes", "num_env_steps_sampled", "num_env_steps_sampled_lifetime", "num_episodes_lifetime"):
            env.setdefault(key, 0)
        learners = result.setdefault("learners", {})
        learners.setdefault("default_policy", {})
        all_modules = learners.setdefault("__all_modules__", {})
        all_modules.setdefault("num_env_steps_trained", 0)
        all_modules.setdefault("num_env_steps_trained_lifetime", 0)
        all_modules.setdefault("num_updates", 0)
        all_modules["weights_version"] = self.weights_version
        return result | {
            "num_env_steps_sampled_lifetime": env["num_env_steps_sampled_lifetime"],
            "num_env_steps_trained_lifetime": all_modules["num_env_steps_trained_lifetime"],
            "num_episodes_lifetime": env["num_episodes_lifetime"],
            "num_env_steps_sampled_per_s": env["num_env_steps_sampled"] / dt if dt > 0 else 0.0,
            "num_env_steps_trained_per_s": all_modules["num_env_steps_trained"] / dt if dt > 0 else 0.0,
            "num_learner_updates": all_modules["num_updates"],
            "num_training_step_calls_per_iteration": steps,
            "training_iteration": self.iteration,
            "time_this_iter_s": dt,
            "time_total_s": self.time_total_s,
            "timestamp": int(time.time()),
        }

    # --- actions ------------------------------------------------------------------------------
    def _inference_module(self) -> RLModule:
        if self._module_version != self.weights_version:
            self.module.set_state(self.learner_group.get_weights())
            self._module_version = self.weights_version
        return self.module

    def compute_actions(self, obs: Any, explore: bool = False) -> np.ndarray:
        """A batch of observations (leading batch dim, nested like the space) -> a batch of env actions."""
        module = self._inference_module()
        with torch.inference_mode():
            t_obs = to_torch(nested.map_structure(np.asarray, obs))
            dist = module.action_dist(module.forward_inference(t_obs)["action_dist_inputs"])
            actions = self.exploration.actions(dist, explore, self.counters["num_env_steps_sampled_lifetime"])
        return self.env_actions(actions.numpy())

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
        """The driver's own state (plain data): iteration, time, weights version, metrics, numpy RNG."""
        return {"iteration": self.iteration, "time_total_s": self.time_total_s,
                "weights_version": self.weights_version, "metrics": self.metrics.get_state(),
                "numpy_rng": _np_rng_state()}

    def set_state(self, state: dict[str, Any]) -> None:
        self.iteration = int(state["iteration"])
        self.time_total_s = float(state["time_total_s"])
        self.weights_version = int(state["weights_version"])
        self.metrics.set_state(state["metrics"])
        if state.get("numpy_rng"):
            name, keys, pos, has_gauss, cached = state["numpy_rng"]
            np.random.set_state((name, np.asarray(keys, np.uint32), pos, has_gauss, cached))

    def save(self, checkpoint_dir: str | None = None) -> str:
        """Write a checkpoint directory (atomically) and return its path."""
        path = checkpoint_dir or self.default_checkpoint_dir()
        native = self._inference_module() if self.config.export_native_model_files else None
        plan_state = self.plan.get_state() if self.plan is not None else None
        return write_checkpoint(path, self.name, self.config.to_dict(), self.learner_group.get_state(),
                                self.get_state(), native_module=native, runner_states=self.env_runner_group.get_state(),
                                replay_state=plan_state)

    save_to_path = save

    def restore(self, checkpoint_dir: str) -> None:
        """Load a checkpoint of this algorithm into this instance; training continues from its state."""
        manifest, _, learner_state, state = read_checkpoint(checkpoint_dir)
        if manifest["algorithm"] != self.name:
            raise CheckpointError(f"checkpoint {checkpoint_dir!r} is of {manifest['algorithm']}, not {self.name}")
        runner_states, plan_state = read_extras(checkpoint_dir)
        self.learner_group.set_state(learner_state)
        self.set_state(state)
        self.sync_weights()
        if runner_states:
            self.env_runner_group.set_state(runner_states)
        if plan_state and self.plan is not None:
            self.plan.set_state(plan_state)
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
        try:
            algo.restore(checkpoint_dir)
        except BaseException:
            algo.stop()
            raise
        return algo

    def evaluate_episodes(self, num_episodes: int, explore: bool = False, render: bool = False) -> dict[str, Any]:
        """Play ``num_episodes`` whole episodes in the driver with the current policy."""
        from pipeline.evaluate import run_episodes

        return run_episodes(self, num_episodes, explore=explore, render=render)

    def stop(self) -> None:
        """Stop every actor and thread this algorithm started (Ray itself stays up)."""
        for stage in (self.plan, self.env_runner_group, self.learner_group):
            if stage is not None:
                stage.stop()

    def __enter__(self) -> "Algorithm":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.stop()


def _np_rng_state() -> list:
    name, keys, pos, has_gauss, cached = np.random.get_state()
    return [name, keys.tolist(), int(pos), int(has_gauss), float(cached)]
