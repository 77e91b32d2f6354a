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

import concurrent.futures
import dataclasses
import json
import logging
import os
import threading
import time
from typing import Any, Callable, ClassVar

import gymnasium as gym
import numpy as np
import ray
import torch
from ray.tune import Trainable

from actors.callbacks import build_callbacks, call_hook
from actors.env import EnvRunnerSettings
from actors.env.process import set_log_level
from actors.learner import Learner
from actors.manager import FaultToleranceSettings
from actors.metrics import MetricsLogger
from actors.modules import ModuleSpec, RLModule, to_torch
from actors.env.actions import EnvActions
from actors.env.exploration import make_exploration
from actors.sys_usage import SysUsage
from pipeline.checkpoints.directory import CheckpointError, read_checkpoint, read_extras, read_manifest, write_checkpoint
from pipeline.config.base import AlgorithmConfig, ConfigError, resolve_import_path
from pipeline.groups.env_runner_group import EnvRunnerGroup
from pipeline.groups.env_runners import runner_settings
from pipeline.envs import env_creator, probe_spaces
from pipeline.groups.evaluation import EVALUATOR_REQUEST_SLOTS, Evaluators
from pipeline.config.external import external_settings
from pipeline.config.offline import mixes_sampler, reader_settings, recorded_spaces, recording_settings
from actors.offline import OfflineReader, write_manifest
from pipeline.groups.learner_group import LearnerGroup
from pipeline.registry import get_algorithm
from pipeline.resources import actor_cpus, check_room, held, released
from pipeline.results import ResultLogger
from pipeline.run_dirs import make_run_dir, results_root, run_dir_name
from pipeline.tune.support import resource_request
from pipeline.version import runnel_version
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
    needed = ((config.num_env_runners + config.evaluation_num_env_runners) * config.num_cpus_per_env_runner
              + config.num_learners * config.num_cpus_per_learner)
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


class Algorithm(Trainable):
    """Also a ``ray.tune.Trainable``: Tune hosts it as a trial (``tune.Tuner(PPO, param_space=config)``),
    calling ``train``/``save``/``restore``/``stop`` with its own bookkeeping around them; used directly,
    those methods are runnel's own (``save()`` returns the checkpoint's path)."""

    config_class: ClassVar[type[AlgorithmConfig]] = AlgorithmConfig
    learner_class: ClassVar[type[Learner]] = Learner

    def __init__(self, config: AlgorithmConfig | dict | None = None, env: Any = None, logdir: str | None = "auto",
                 storage: Any = None, **kwargs: Any) -> None:
        """``PPO(config)``, or RLlib's spellings ``PPO(config={...})`` and ``PPO(config=c, env="CartPole-v1")``.

        ``logdir``: where ``train()`` writes results (``params.json``, ``result.json``, ``progress.csv``,
        TensorBoard events) and ``save()`` puts checkpoints; "auto" makes a new directory under
        ``$RUNNEL_RESULTS_DIR`` (default ``~/runnel_results``) at the first result; None writes no results.
        ``storage`` is Ray Tune's, when it hosts the algorithm as a trial (results are then Tune's to log)."""
        if kwargs:
            hint = " (runnel writes results itself: pass logdir=DIR, or logdir=None for none)" \
                if "logger_creator" in kwargs else ""
            raise TypeError(f"{type(self).__name__}() got unexpected arguments {sorted(kwargs)}{hint}")
        self._hosted_by_tune = storage is not None
        self._num_iterations = 0
        self._results: ResultLogger | None = None
        self._logdir_setting = None if self._hosted_by_tune else logdir
        self._run_dir = logdir if logdir not in ("auto", None) and not self._hosted_by_tune else None
        if self._hosted_by_tune:  # Tune's trial bookkeeping (trial dir, output files), which calls setup()
            Trainable.__init__(self, config, storage)
        else:
            self.setup(self._as_config(config, env))

    @classmethod
    def _as_config(cls, config: AlgorithmConfig | dict | None, env: Any = None) -> AlgorithmConfig:
        if config is None:
            config = cls.config_class()
        elif isinstance(config, dict):  # RLlib's dict configs, and Tune's trial configs
            config = cls.config_class.from_dict(config)
        elif not isinstance(config, AlgorithmConfig):
            raise ConfigError(f"{cls.__name__}(config=...) takes a {cls.config_class.__name__} or a dict of its "
                              f"settings, got {type(config).__name__}")
        elif not isinstance(config, cls.config_class):
            raise ConfigError(f"{cls.__name__} was given a {type(config).__name__}; build it from a "
                              f"{cls.config_class.__name__} (or call config.build())")
        else:
            config = config.copy()
        if env is not None:
            config.environment(env)
        return config

    @classmethod
    def default_resource_request(cls, config: AlgorithmConfig | dict) -> Any:
        """What Tune reserves for one trial: the driver, then every runner, learner and evaluator actor."""
        return resource_request(cls._as_config(config))

    # --- building -------------------------------------------------------------------------------
    def setup(self, config: AlgorithmConfig | dict) -> None:
        """Build every stage ``config`` asks for (Tune calls it with a dict, its trial's settings)."""
        config = self._as_config(config)
        config.validate()
        self.config = config
        set_log_level(config.log_level)
        if config.seed is not None:
            np.random.seed(config.seed)
            torch.manual_seed(config.seed)
        self.name = type(self).__name__
        self.external = external_settings(config)
        self.offline_input = reader_settings(config)
        # {"sampler": p, "DIR": q}: env runners stay; the off-policy plan mixes the recordings in
        readers_in_slots = self.offline_input is not None and not mixes_sampler(config)
        self.recording = recording_settings(config)
        self.env_creator = env_creator(config.env) if config.env is not None else None
        obs_space, act_space = config.observation_space, config.action_space
        if (obs_space is None or act_space is None) and readers_in_slots:
            recorded = recorded_spaces(config)
            obs_space, act_space = obs_space or recorded[0], act_space or recorded[1]
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
        try:
            self.exploration = make_exploration(config.exploration_settings(), self.module.dist_spec)
            self.callbacks = build_callbacks(config.callbacks_spec())
        except ValueError as err:
            raise ConfigError(str(err)) from err
        self.env_task_fn = _function(config.env_task_fn, "env_task_fn")
        self.custom_evaluation_function = _function(config.custom_evaluation_function, "custom_evaluation_function")
        ray_data = self.offline_input is not None and self.offline_input.input_reader == "ray_data"
        if config.num_env_runners > 0 or config.num_learners > 0 or config.evaluation_num_env_runners > 0 or ray_data:
            init_ray_if_needed(config)
            if not self._hosted_by_tune:  # a trial's actors go into its own placement group
                check_room(self.name, config)
        self.metrics = MetricsLogger()
        self.evaluators: Evaluators | None = None
        self.evaluation_results: dict[str, Any] | None = None
        """The latest evaluation's results (``always_attach_evaluation_results`` repeats them)."""
        self._eval_thread: concurrent.futures.ThreadPoolExecutor | None = None
        self._sys = SysUsage() if config.log_sys_usage else None
        self.time_total_s = 0.0
        self.learner_group: LearnerGroup | None = None
        self.env_runner_group: EnvRunnerGroup | None = None
        self.plan: Any = None
        self._ope_reader: OfflineReader | None = None
        if self.recording is not None:
            write_manifest(self.recording.output, obs_space, act_space, self.name, _json_safe(config.to_dict()),
                           runnel_version(), actions_normalized=bool(config.normalize_actions))
        try:
            self.learner_group = LearnerGroup(self.learner_class, config, obs_space, act_space)
            self.env_runner_group = EnvRunnerGroup(
                self.env_runner_settings(), config.num_env_runners, config.num_cpus_per_env_runner,
                self.fault_tolerance_settings(), compress_frames=self.compress_frames(), external=self.external,
                offline=self.offline_input if readers_in_slots else None,
                on_recreated=lambda ids: self._hook(
                    "on_env_runners_recreated", algorithm=self, env_runner_group=self.env_runner_group,
                    env_runner_indices=ids, is_evaluation=False))
            if config.evaluation_interval and self.env_creator is not None:
                self.build_evaluators()
            self.plan = self.build_plan()
        except BaseException:
            self.cleanup()
            raise
        self.sync_weights()
        held(self, actor_cpus(config))
        self._hook("on_algorithm_init", algorithm=self, metrics_logger=self.metrics)

    def _hook(self, hook: str, **kwargs: Any) -> None:
        call_hook(self.callbacks, hook, "the driver", self.metrics, **kwargs)

    def env_runner_settings(self, config: AlgorithmConfig | None = None, in_evaluation: bool = False
                            ) -> EnvRunnerSettings:
        c = config or self.config
        recording = (self.recording if self.recording is not None
                     and (not in_evaluation or self.recording.output_include_evaluation) else None)
        return runner_settings(c, self.env_creator, self.learner_class.module_class, self.observation_space,
                               self.action_space, in_evaluation=in_evaluation, recording=recording)

    def fault_tolerance_settings(self, config: AlgorithmConfig | None = None) -> FaultToleranceSettings:
        c = config or self.config
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

    def build_evaluators(self) -> Evaluators:
        """The evaluators (built at set-up with ``evaluation_interval``, else at the first ``evaluate()``)."""
        if self.evaluators is None:
            c = self.config.evaluation_settings()
            c.validate()
            settings = self.env_runner_settings(c, in_evaluation=True)
            if c.env != self.config.env:
                settings.env_creator = env_creator(c.env)
            if c.observation_space is None or c.action_space is None:  # the policy's spaces, whatever the env
                settings.observation_space, settings.action_space = self.observation_space, self.action_space
            if c.seed is not None:  # not the training runners' episode seeds
                settings.seed = c.seed + 100_000
            if c.evaluation_parallel_to_training:
                settings.niceness = EVALUATOR_NICENESS
            settings.rollout_fragment_length = (int(c.rollout_fragment_length) if c.rollout_fragment_length != "auto"
                                                else AUTO_FRAGMENT)
            if c.evaluation_num_env_runners > 0 and not ray.is_initialized():
                init_ray_if_needed(c)
            fault_tolerance = dataclasses.replace(self.fault_tolerance_settings(c),
                                                  max_requests_in_flight=EVALUATOR_REQUEST_SLOTS)
            self.evaluators = Evaluators(c, settings, fault_tolerance, on_recreated=lambda ids: self._hook(
                "on_env_runners_recreated", algorithm=self, env_runner_group=self.evaluators.group,
                env_runner_indices=ids, is_evaluation=True))
        return self.evaluators

    @property
    def eval_env_runner_group(self) -> EnvRunnerGroup | None:
        return self.evaluators.group if self.evaluators is not None else None

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

    @property
    def iteration(self) -> int:
        """Training iterations (``train()`` calls) so far, restored with a checkpoint."""
        return self._num_iterations

    @iteration.setter
    def iteration(self, value: int) -> None:
        self._num_iterations = int(value)

    training_iteration = iteration

    @property
    def logdir(self) -> str | None:
        """This run's results directory (None until the first result with ``logdir="auto"``, or when off)."""
        return self._run_dir

    @logdir.setter
    def logdir(self, path: str | None) -> None:
        self._run_dir = path

    def train(self) -> dict[str, Any]:
        """One training iteration (``step()``); its result is also written to ``logdir``."""
        if self._hosted_by_tune:
            return super().train()  # Tune's bookkeeping around step()
        result = self.step()
        self._log_result(result)
        return result

    def get_auto_filled_metrics(self, *args: Any, **kwargs: Any) -> dict[str, Any]:
        """Tune's per-result fields, with the config as the plain dict Tune expects."""
        return super().get_auto_filled_metrics(*args, **kwargs) | {"config": self.config.to_dict()}

    def _log_result(self, result: dict[str, Any]) -> None:
        if self._logdir_setting is None:
            return
        if self._results is None:
            if self._run_dir is None:
                self._run_dir = make_run_dir(os.path.join(results_root(), run_dir_name(self.name, self.config.env)))
            try:
                params = self.config.to_dict()
            except ConfigError:  # a setting with no import path (a local class): logged as its repr
                params = {f.name: _json_safe(getattr(self.config, f.name)) for f in dataclasses.fields(self.config)
                          if f.name != "_unknown"}
            self._results = ResultLogger(self._run_dir, params=params)
        self._results.log(result)

    def step(self) -> dict[str, Any]:
        """Run training steps until the iteration's minimum time/steps are reached; return results."""
        t0 = time.perf_counter()
        c = self.config
        sampled0, trained0 = (self.counters[k] for k in ("num_env_steps_sampled_lifetime",
                                                          "num_env_steps_trained_lifetime"))
        evaluating = bool(c.evaluation_interval) and (self.iteration + 1) % c.evaluation_interval == 0
        parallel: concurrent.futures.Future | None = None
        stop_eval = threading.Event()
        if evaluating and c.evaluation_parallel_to_training:
            # the weights from before this training step: evaluation results are one iteration behind
            self._sync_evaluators(wait=False)
            if self._eval_thread is None:
                self._eval_thread = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="runnel-evaluation")
            parallel = self._eval_thread.submit(self._evaluate, stop_eval)
        try:
            steps = self._train_steps(t0, sampled0, trained0)
        finally:
            stop_eval.set()
        if parallel is not None:
            self.evaluation_results = parallel.result()
        elif evaluating:
            self.evaluate()
        self.iteration += 1
        dt = time.perf_counter() - t0
        self.time_total_s += dt
        result = self._result(dt, steps)
        if self.evaluation_results is not None and (evaluating or c.always_attach_evaluation_results):
            result["evaluation"] = self.evaluation_results
        self._hook("on_train_result", algorithm=self, result=result, metrics_logger=self.metrics)
        if self.env_task_fn is not None:
            self.env_runner_group.apply_env_task_fn(self.env_task_fn, result)
        return result

    def _train_steps(self, t0: float, sampled0: int, trained0: int) -> int:
        """Training steps until the iteration's minimum time and step counts are met; how many ran."""
        c = self.config
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
        return steps

    # --- evaluation ---------------------------------------------------------------------------
    def evaluate(self) -> dict[str, Any]:
        """Evaluate the current weights with the evaluators (built on first use); returns
        ``{"evaluation": results}`` and keeps them for the next ``train()`` result."""
        self._sync_evaluators()
        self.evaluation_results = self._evaluate(None)
        return {"evaluation": self.evaluation_results}

    def _sync_evaluators(self, wait: bool = True) -> None:
        if self.env_creator is None:  # no env to evaluate in (off-policy estimates read the learner's weights)
            return
        evaluators = self.build_evaluators()
        evaluators.sync_weights(self.learner_group.get_weights(inference_only=True), self.weights_version,
                                self.counters["num_env_steps_sampled_lifetime"], wait=wait)

    def _evaluate(self, stop: threading.Event | None) -> dict[str, Any]:
        """One evaluation with the weights the evaluators hold (in the evaluation thread when parallel)."""
        self._hook("on_evaluate_start", algorithm=self, metrics_logger=self.metrics)
        if self.env_creator is None:  # training from a recording with no env: off-policy estimates only
            metrics: dict[str, Any] = {}
        elif self.custom_evaluation_function is not None:
            evaluators = self.build_evaluators()
            metrics = self.custom_evaluation_function(self, evaluators.group)
            if isinstance(metrics, tuple):  # RLlib's newer (metrics, env_steps, agent_steps)
                metrics = metrics[0]
            if not isinstance(metrics, dict):
                raise TypeError(f"custom_evaluation_function must return a dict of metrics, got {type(metrics).__name__}")
        else:
            metrics = self.build_evaluators().run(stop)
        if self.config.off_policy_estimation_methods:
            metrics["off_policy_estimator"] = self._off_policy_estimates()
        self._hook("on_evaluate_end", algorithm=self, evaluation_metrics=metrics, metrics_logger=self.metrics)
        return metrics

    def _off_policy_estimates(self) -> dict[str, dict[str, float]]:
        """IS/WIS estimates of the current policy's return over recorded whole episodes."""
        from pipeline.offline.ope import estimate_all, estimator_kinds

        if self._ope_reader is None:
            settings = dataclasses.replace(self.offline_input, input_read_episodes=True, shuffle_buffer_size=0)
            self._ope_reader = OfflineReader(self.env_runner_settings(), worker_index=0, offline=settings)
        chunks = self._ope_reader.sample(num_episodes=self.config.off_policy_estimation_episodes)
        module = self._inference_module()

        def target_logp(obs: Any, actions: Any) -> np.ndarray:
            with torch.inference_mode():
                out = module.forward_inference(to_torch(obs))["action_dist_inputs"]
                return module.action_dist(out).logp(to_torch(actions)).numpy()

        kinds = estimator_kinds(self.config.off_policy_estimation_methods)[0]
        return estimate_all(chunks, target_logp, float(getattr(self.config, "gamma", 0.99)), kinds)

    def _result(self, dt: float, steps: int) -> dict[str, Any]:
        self.env_runner_group.log_fault_tolerance(self.metrics)
        if self._sys is not None:
            for key, value in self._sys.sample().items():
                self.metrics.log_value(f"perf/driver/{key}", value)
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

    def compute_actions(self, obs: Any, explore: bool | None = None) -> np.ndarray:
        """A batch of observations (leading batch dim, nested like the space) -> a batch of env actions.
        ``explore=None`` follows ``config.explore``; True/False override it for this call."""
        explore = self.config.explore if explore is None else explore
        module = self._inference_module()
        with torch.inference_mode():
            t_obs = to_torch(_as_arrays(obs, self.observation_space))
            dist = module.action_dist(module.forward_inference(t_obs)["action_dist_inputs"])
            actions = self.exploration.actions(dist, explore, self.counters["num_env_steps_sampled_lifetime"])
        return self.env_actions(actions.numpy())

    def compute_single_action(self, obs: Any, explore: bool | None = None) -> Any:
        """One observation (no batch dim) -> one action the env accepts."""
        batched = nested.map_structure(lambda a: a[None], _as_arrays(obs, self.observation_space))
        action = self.compute_actions(batched, explore=explore)[0]
        return action.item() if np.ndim(action) == 0 else action

    def foreach_env_runner(self, fn: Callable[[Any], Any], local_env_runner: bool = True) -> list[Any]:
        return self.env_runner_group.foreach_env_runner(fn, local=local_env_runner)

    @property
    def env_runners(self) -> EnvRunnerGroup:
        return self.env_runner_group

    @property
    def workers(self) -> Any:
        # RLlib's old WorkerSet held RolloutWorkers with policy maps; runnel's runners are not those
        raise AttributeError(
            "algo.workers is RLlib's old WorkerSet of RolloutWorkers: use algo.env_runner_group, e.g. "
            "algo.env_runner_group.foreach_env_runner(lambda runner: runner.get_weights()), or algo.get_weights()")

    def get_module(self, module_id: str = "default_policy") -> RLModule:
        """The current policy as a torch module (the learner's latest weights), RLlib's new-stack name."""
        if module_id != "default_policy":
            raise KeyError(f"module {module_id!r}: runnel trains one module, 'default_policy' (multi-agent "
                           f"modules are not built yet)")
        return self._inference_module()

    def get_policy(self, policy_id: str = "default_policy") -> Any:
        raise AttributeError(
            "algo.get_policy() is RLlib's old API stack: runnel has no Policy objects. Use "
            "algo.get_module() for the torch module, algo.compute_single_action(obs) for actions, and "
            "algo.get_weights()/set_weights() for the weights")

    # --- checkpoints --------------------------------------------------------------------------
    def default_checkpoint_dir(self) -> str:
        """``<logdir>/checkpoint_<iteration>`` (the run directory is made now if there is none yet:
        unique per process, so two runs saving at the same moment never collide)."""
        if self._run_dir is None:
            self._run_dir = make_run_dir(os.path.join(results_root(), run_dir_name(self.name, self.config.env)))
        return os.path.join(self._run_dir, f"checkpoint_{self.iteration:06d}")

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

    def save(self, checkpoint_dir: str | None = None) -> Any:
        """Write a checkpoint directory (atomically) and return its path (under Tune: Tune's result)."""
        if self._hosted_by_tune:
            return super().save(checkpoint_dir)  # calls save_checkpoint(), then reports it to Tune
        return self.save_to_path(checkpoint_dir)

    def save_checkpoint(self, checkpoint_dir: str) -> str:
        return self.save_to_path(checkpoint_dir)

    def save_to_path(self, checkpoint_dir: str | None = None) -> str:
        """Write a checkpoint directory (atomically) and return its path."""
        path = checkpoint_dir or self.default_checkpoint_dir()
        native = self._inference_module() if self.config.export_native_model_files else None
        plan_state = self.plan.get_state() if self.plan is not None else None
        written = write_checkpoint(path, self.name, self.config.to_dict(), self.learner_group.get_state(),
                                   self.get_state(), native_module=native,
                                   runner_states=self.env_runner_group.get_state(), replay_state=plan_state)
        return SavedCheckpoint(written, self.counters)

    def restore(self, checkpoint_dir: Any) -> None:
        """Load a checkpoint of this algorithm into this instance; training continues from its state.
        (Tune passes its own checkpoint result, which comes back here through ``load_checkpoint``.)"""
        if not isinstance(checkpoint_dir, (str, os.PathLike)):
            return super().restore(checkpoint_dir)
        checkpoint_dir = os.fspath(checkpoint_dir)
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
        self._hook("on_checkpoint_loaded", algorithm=self)

    def load_checkpoint(self, checkpoint: Any) -> None:
        self.restore(os.fspath(checkpoint))

    restore_from_path = restore

    @classmethod
    def from_checkpoint(cls, checkpoint_dir: str, logdir: str | None = "auto", **kwargs: Any) -> "Algorithm":
        """Rebuild the algorithm a checkpoint was written by, with its config and state; ``kwargs``
        override config settings (e.g. ``num_env_runners=0``), ``logdir`` as in the constructor."""
        manifest = read_manifest(checkpoint_dir)
        config_cls, algo_cls = get_algorithm(manifest["algorithm"])
        _, config_dict, _, _ = read_checkpoint(checkpoint_dir)
        config = config_cls.from_dict(config_dict)
        config.update_from_dict(kwargs)  # e.g. num_env_runners=0 to evaluate locally; typos fail in validate
        algo = algo_cls(config, logdir=logdir)
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
        if self._hosted_by_tune:
            super().stop()  # Tune's own clean-up, which calls cleanup()
        else:
            self.cleanup()

    def cleanup(self) -> None:
        released(self)
        if self._results is not None:
            self._results.close()
            self._results = None
        if getattr(self, "_eval_thread", None) is not None:
            self._eval_thread.shutdown(wait=True)
            self._eval_thread = None
        for stage in (self.plan, getattr(self, "evaluators", None), self.env_runner_group, self.learner_group):
            if stage is not None:
                stage.stop()

    def __enter__(self) -> "Algorithm":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.stop()


class SavedCheckpoint(str):
    """What ``save()`` returns: the checkpoint's path (a str), which also answers RLlib's spelling
    ``algo.save().checkpoint.path``; ``metrics`` holds the run's counters at the save."""

    def __new__(cls, path: str, metrics: dict[str, Any] | None = None) -> "SavedCheckpoint":
        out = super().__new__(cls, path)
        out.metrics = dict(metrics or {})
        return out

    @property
    def checkpoint(self) -> Any:
        return _CheckpointRef(str(self))

    @property
    def path(self) -> str:
        return str(self)


@dataclasses.dataclass(frozen=True)
class _CheckpointRef:
    path: str


EVALUATOR_NICENESS = 19
"""Parallel evaluators run at the lowest OS priority: on shared cores they use what training leaves."""
AUTO_FRAGMENT = 200
"""Evaluators' steps per sub-env per request when ``rollout_fragment_length`` is "auto" (sized for training)."""


def _as_arrays(obs: Any, space: Any) -> Any:
    """``obs`` as numpy arrays nested like ``space`` (Dict/Tuple); anything else, lists included
    (``[0.0, 0.1, ...]`` for a Box), becomes one array."""
    if isinstance(space, gym.spaces.Dict) and isinstance(obs, dict):
        return {k: _as_arrays(obs[k], space[k]) if k in space.spaces else np.asarray(obs[k]) for k in obs}
    if isinstance(space, gym.spaces.Tuple) and isinstance(obs, (list, tuple)):
        return tuple(_as_arrays(o, s) for o, s in zip(obs, space.spaces))
    return np.asarray(obs)


def _json_safe(value: Any) -> Any:
    """``value`` with whatever JSON cannot hold (classes, functions) written as its repr."""
    return json.loads(json.dumps(value, default=repr))


def _function(value: Any, name: str) -> Callable | None:
    """A setting that holds a function, or its import path (configs read back from a checkpoint)."""
    if isinstance(value, str):
        return resolve_import_path(value, name)
    return value


def _np_rng_state() -> list:
    name, keys, pos, has_gauss, cached = np.random.get_state()
    return [name, keys.tolist(), int(pos), int(has_gauss), float(cached)]
