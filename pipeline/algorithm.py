"""Algorithm: builds the stages a config asks for, runs training iterations, saves and restores.

An algorithm contributes only its pieces (see ``pipeline/algorithms/ppo/``):

* ``config_class`` -- its settings; ``learner_class`` -- what a learner does with a batch (and,
  through its ``module_class``, the network every stage carries);
* ``training_step()`` -- its plan: which groups are asked for what, how often (PPO's is a few
  lines; IMPALA and APPO hand it to the reusable ``AsyncPlan``, built in ``build_plan()``).

Everything else is shared here: the env runner and learner groups (``setup``), the metrics logger
that every stage reports into and every result is reduced from, stop conditions of an iteration,
checkpoints, and computing actions. The class keeps the public methods; the work behind them is in
``algorithm_setup`` (what set-up derives from the config), ``algorithm_stages`` (the order stages are built
in), ``algorithm_evaluation``, ``algorithm_results``, ``algorithm_actions`` and ``checkpoints/save_restore``.
"""
from __future__ import annotations

import os
import time
from typing import Any, Callable, ClassVar

import numpy as np
import torch
from ray.tune import Trainable

from actors.callbacks import build_callbacks, call_hook
from actors.env import EnvRunnerSettings
from actors.env.process import set_log_level
from actors.learner import Learner
from actors.manager import FaultToleranceSettings
from actors.metrics import MetricsLogger
from actors.modules import RLModule
from actors.env.actions import EnvActions
from actors.sys_usage import SysUsage
from pipeline.algorithm_actions import compute_actions, compute_single_action
from pipeline.algorithm_evaluation import AlgorithmEvaluation
from pipeline.algorithm_modules import add_module, load_module, remove_module, set_rllib_state
from pipeline.algorithm_multi_agent import MultiAgentSetup
from pipeline.algorithm_results import IterationInfo, iteration_result, training_steps, lifetime_counters, result_params
from pipeline.algorithm_stages import build_stages
from pipeline.algorithm_setup import (algorithm_config, frame_compression, function_setting, policy_setup,
                                      runner_fault_tolerance)
from pipeline.checkpoints.save_restore import (build_from_checkpoint, driver_state, load_into, save_algorithm,
                                               set_driver_state)
from pipeline.config.base import AlgorithmConfig, ConfigError
from pipeline.groups.env_runner_group import EnvRunnerGroup
from pipeline.groups.env_runners import runner_settings
from pipeline.envs import env_creator
from pipeline.evaluate import run_episodes
from pipeline.groups.evaluation import Evaluators
from pipeline.config.external import external_settings
from pipeline.config.offline import mixes_sampler, reader_settings, recording_settings
from pipeline.offline.record import write_run_manifest
from pipeline.groups.learner_group import LearnerGroup
from pipeline.ray_cluster import init_ray_if_needed
from pipeline.resources import actor_cpus, check_room, held, released
from pipeline.results import ResultLogger
from pipeline.run_dirs import make_run_dir, results_root, run_dir_name
from pipeline.tune.support import resource_request

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
            self.setup(algorithm_config(type(self), config, env))

    @classmethod
    def default_resource_request(cls, config: AlgorithmConfig | dict) -> Any:
        """What Tune reserves for one trial: the driver, then every runner, learner and evaluator actor."""
        return resource_request(algorithm_config(cls, config))

    # --- building -------------------------------------------------------------------------------
    def setup(self, config: AlgorithmConfig | dict) -> None:
        """Build every stage ``config`` asks for (Tune calls it with a dict, its trial's settings)."""
        config = algorithm_config(type(self), config)
        config.validate()
        self.config = config
        set_log_level(config.log_level)
        if config.seed is not None:
            np.random.seed(config.seed)
            torch.manual_seed(config.seed)
        # The driver's learner and local runners use the CPUs the driver is counted for: torch's default (an
        # intra-op thread per core) spins against the runner actors and whatever else shares the node -- a
        # two-thread DQN learner beside one busy process took 2.8x the wall time of a one-thread one.
        # cleanup() restores the previous setting.
        self._torch_threads_before = torch.get_num_threads()
        torch.set_num_threads(max(1, int(config.num_cpus_for_main_process)))
        self.name = type(self).__name__
        self.external = external_settings(config)
        self.offline_input = reader_settings(config)
        # {"sampler": p, "DIR": q}: env runners stay; the off-policy plan mixes the recordings in
        readers_in_slots = self.offline_input is not None and not mixes_sampler(config)
        self.recording = recording_settings(config)
        self.env_creator = env_creator(config.env) if config.env is not None else None
        policy = policy_setup(config, self.env_creator, self.learner_class, readers_in_slots)
        # each described where it is derived (pipeline.algorithm_setup.PolicySetup); subclasses and stages read
        # them here
        self.multi_agent: MultiAgentSetup | None = policy.multi_agent
        self.env_observation_space = policy.env_observation_space
        self.chunk_observation_space = policy.chunk_observation_space
        self.observation_space, self.action_space = policy.observation_space, policy.action_space
        self.connector: Any = policy.connector
        self.learner_connector, self.replay_intake = policy.learner_connector, policy.replay_intake
        self.module_spec, self.driver_policy = policy.module_spec, policy.driver_policy
        try:
            self.callbacks = build_callbacks(config.callbacks_spec())
        except ValueError as err:
            raise ConfigError(str(err)) from err
        self.env_task_fn = function_setting(config.env_task_fn, "env_task_fn")
        self.custom_evaluation_function = function_setting(config.custom_evaluation_function,
                                                           "custom_evaluation_function")
        ray_data = self.offline_input is not None and self.offline_input.input_reader == "ray_data"
        if config.num_env_runners > 0 or config.num_learners > 0 or config.evaluation_num_env_runners > 0 or ray_data:
            init_ray_if_needed(config)
            if not self._hosted_by_tune:  # a trial's actors go into its own placement group
                check_room(self.name, config)
        self.metrics = MetricsLogger()
        self.evaluation = AlgorithmEvaluation(self, hook=self.run_hook)
        self.evaluation_results: dict[str, Any] | None = None
        """The latest evaluation's results (``always_attach_evaluation_results`` repeats them)."""
        self._sys = SysUsage() if config.log_sys_usage else None
        self.time_total_s = 0.0
        self.learner_group: LearnerGroup | None = None
        self.env_runner_group: EnvRunnerGroup | None = None
        self.plan: Any = None
        if self.recording is not None:
            write_run_manifest(self)
        try:
            build_stages(self, readers_in_slots)
        except BaseException:
            self.cleanup()
            raise
        self.sync_weights()
        held(self, actor_cpus(config))
        self.run_hook("on_algorithm_init", algorithm=self, metrics_logger=self.metrics)

    @property
    def module(self) -> RLModule:
        """The driver's copy of the policy module (``compute_actions`` brings its weights up to date)."""
        return self.driver_policy.module

    @property
    def exploration(self) -> Any:
        """How ``compute_actions`` explores (``config.exploration_config``)."""
        return self.driver_policy.exploration

    @property
    def env_actions(self) -> EnvActions:
        """Module actions -> what the env accepts (``normalize_actions``, ``clip_actions``)."""
        return self.driver_policy.env_actions

    def run_hook(self, hook: str, **kwargs: Any) -> None:
        """Run callback ``hook`` in the driver (a failing callback raises ``CallbackError`` naming it)."""
        call_hook(self.callbacks, hook, "the driver", self.metrics, **kwargs)

    def env_runner_settings(self, config: AlgorithmConfig | None = None, in_evaluation: bool = False
                            ) -> EnvRunnerSettings:
        c = config or self.config
        recording = (self.recording if self.recording is not None
                     and (not in_evaluation or self.recording.output_include_evaluation) else None)
        return runner_settings(c, self.env_creator, self.learner_class.module_class, self.observation_space,
                               self.action_space, in_evaluation=in_evaluation, recording=recording,
                               env_observation_space=self.env_observation_space)

    def fault_tolerance_settings(self, config: AlgorithmConfig | None = None) -> FaultToleranceSettings:
        return runner_fault_tolerance(config or self.config)

    def observation_view(self) -> Any:
        """A single-agent run's env-to-module view (``actors.connectors.ObservationView``: what rebuilds the
        module's observations, e.g. frame stacks, from recorded rows where they are trained on), or None; a
        multi-agent run's are per module (``MultiAgentSetup.connectors``)."""
        if self.connector is None or self.multi_agent is not None:
            return None
        return self.connector.observation_view()

    def compress_frames(self) -> bool:
        """LZ4 for chunk frames: as configured (``stream_compress`` where an algorithm has it), or
        by the observations' dtype ("auto")."""
        return frame_compression(self.config, self.chunk_observation_space)

    def build_evaluators(self) -> Evaluators:
        """The evaluators (built at set-up with ``evaluation_interval``, else at the first ``evaluate()``)."""
        return self.evaluation.build_evaluators()

    @property
    def evaluators(self) -> Evaluators | None:
        """The evaluators, once built (None before)."""
        return self.evaluation.evaluators

    @property
    def eval_env_runner_group(self) -> EnvRunnerGroup | None:
        return self.evaluators.group if self.evaluators is not None else None

    # --- what an algorithm provides -----------------------------------------------------------
    def check_spaces(self) -> None:
        """Raise ConfigError for spaces this algorithm cannot train on that its module would accept; called
        before any stage is built (the spaces are known by then)."""

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
        timestep = self.counters["num_env_steps_sampled_lifetime"]
        if self.multi_agent is not None:  # multi-agent runners follow their schedules in count_steps_by units
            timestep = self.multi_agent.runner_timestep(self.metrics, timestep)
        self.env_runner_group.sync_weights(weights, self.weights_version, timestep)

    def sync_connectors(self) -> None:
        """Merge what every training runner's connectors learned (running statistics) into the driver's
        copy and send the merged state to all runners and evaluators (after each iteration)."""
        if self.connector is None or not self.connector.stateful:
            return
        self.connector.absorb(self.env_runner_group.pop_connector_deltas())
        self.env_runner_group.sync_connectors(self.connector.get_state())

    def get_weights(self) -> dict[str, np.ndarray]:
        return self.learner_group.get_weights()

    def set_weights(self, weights: dict[str, np.ndarray]) -> None:
        self.learner_group.set_weights(weights)
        self.weights_version += 1
        self.sync_weights()

    # --- training -----------------------------------------------------------------------------
    @property
    def counters(self) -> dict[str, int]:
        return lifetime_counters(self.metrics)

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
            self._results = ResultLogger(self._make_run_dir(), params=result_params(self.config))
        self._results.log(result)

    def _make_run_dir(self) -> str:
        """This run's directory, made now if there is none yet (unique per process)."""
        if self._run_dir is None:
            self._run_dir = make_run_dir(os.path.join(results_root(), run_dir_name(self.name, self.config.env)))
        return self._run_dir

    def step(self) -> dict[str, Any]:
        """Run training steps until the iteration's minimum time/steps are reached; return results."""
        t0 = time.perf_counter()
        c = self.config
        sampled0, trained0 = (self.counters[k] for k in ("num_env_steps_sampled_lifetime",
                                                          "num_env_steps_trained_lifetime"))
        evaluating = bool(c.evaluation_interval) and (self.iteration + 1) % c.evaluation_interval == 0
        steps = self.evaluation.beside(evaluating, lambda: training_steps(self, t0, sampled0, trained0))
        self.sync_connectors()
        if evaluating and not c.evaluation_parallel_to_training:
            self.evaluate()
        self.iteration += 1
        dt = time.perf_counter() - t0
        self.time_total_s += dt
        result = self._result(dt, steps)
        if self.evaluation_results is not None and (evaluating or c.always_attach_evaluation_results):
            result["evaluation"] = self.evaluation_results
        self.run_hook("on_train_result", algorithm=self, result=result, metrics_logger=self.metrics)
        if self.env_task_fn is not None:
            self.env_runner_group.apply_env_task_fn(self.env_task_fn, result)
        return result

    # --- evaluation ---------------------------------------------------------------------------
    def evaluate(self) -> dict[str, Any]:
        """Evaluate the current weights with the evaluators (built on first use); returns
        ``{"evaluation": results}`` and keeps them for the next ``train()`` result."""
        self.evaluation.sync_weights()
        self.evaluation_results = self.evaluation.run(None)
        return {"evaluation": self.evaluation_results}

    def _result(self, dt: float, steps: int) -> dict[str, Any]:
        self.env_runner_group.log_fault_tolerance(self.metrics)
        self.learner_group.log_fault_tolerance(self.metrics)
        if self._sys is not None:
            for key, value in self._sys.sample().items():
                self.metrics.log_value(f"perf/driver/{key}", value)
        info = IterationInfo(training_iteration=self.iteration, time_this_iter_s=dt, time_total_s=self.time_total_s,
                             num_training_step_calls=steps, weights_version=self.weights_version)
        return iteration_result(self.metrics, info)

    # --- actions ------------------------------------------------------------------------------
    def compute_actions(self, obs: Any, explore: bool | None = None, policy_id: str | None = None) -> np.ndarray:
        """A batch of observations (leading batch dim, nested like the space) -> a batch of env actions.
        ``explore=None`` follows ``config.explore``; True/False override it for this call. ``policy_id``:
        the module that acts (multi-agent runs)."""
        return compute_actions(self, obs, explore, policy_id)

    def compute_single_action(self, obs: Any, explore: bool | None = None, policy_id: str | None = None, *,
                              state: Any = None) -> Any:
        """One observation (no batch dim) -> one action the env accepts (``policy_id``: multi-agent runs).
        A recurrent module (``use_lstm``) returns ``(action, state_out, {})``: pass ``state_out`` back as
        ``state`` with the next observation of the episode (None starts one)."""
        return compute_single_action(self, obs, explore, policy_id, state)

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
        if self.multi_agent is not None:
            return self.multi_agent.module(self.learner_group, module_id)
        if module_id != "default_policy":
            raise KeyError(f"module {module_id!r}: this run trains one module, 'default_policy'")
        return self.driver_policy.current_module(self.learner_group)

    # --- a multi-agent run's modules (pipeline/algorithm_modules.py documents them) ------------
    def add_module(self, module_id: str, module_spec: Any = None, **kwargs: Any) -> None:
        """RLlib's ``add_module``: ``module_spec`` (None: the run's defaults), ``config_overrides``,
        ``new_agent_to_module_mapping_fn``, ``new_should_module_be_updated`` (ids or ``fn(module_id, batch)``)."""
        add_module(self, module_id, module_spec, **kwargs)

    def remove_module(self, module_id: str, **kwargs: Any) -> None:
        """RLlib's ``remove_module``: ``new_agent_to_module_mapping_fn``, ``new_should_module_be_updated``..."""
        remove_module(self, module_id, **kwargs)

    def load_module(self, module_id: str, checkpoint_dir: str, source_module_id: str | None = None, *,
                    weights_only: bool = True) -> None:
        """Module ``module_id``'s weights (or whole learner state) from module ``source_module_id`` of a checkpoint."""
        load_module(self, module_id, checkpoint_dir, source_module_id, weights_only=weights_only)

    def get_policy(self, policy_id: str = "default_policy") -> Any:
        raise AttributeError(
            "algo.get_policy() is RLlib's old API stack: runnel has no Policy objects. Use "
            "algo.get_module() for the torch module, algo.compute_single_action(obs) for actions, and "
            "algo.get_weights()/set_weights() for the weights")

    # --- checkpoints --------------------------------------------------------------------------
    def default_checkpoint_dir(self) -> str:
        """``<logdir>/checkpoint_<iteration>`` (the run directory is made now if there is none yet:
        unique per process, so two runs saving at the same moment never collide)."""
        return os.path.join(self._make_run_dir(), f"checkpoint_{self.iteration:06d}")

    def get_state(self) -> dict[str, Any]:
        """The driver's own state (plain data): iteration, time, weights version, metrics, numpy RNG."""
        return driver_state(self)

    def set_state(self, state: dict[str, Any]) -> None:
        """The driver's state (``get_state``); RLlib's ``{"learner_group": {"learner": {"rl_module":
        {module_id: weights}}}}`` sets those modules' weights (``algorithm_modules.set_rllib_state``)."""
        if not set_rllib_state(self, state):
            set_driver_state(self, state)

    def save(self, checkpoint_dir: str | None = None) -> Any:
        """Write a checkpoint directory (atomically) and return its path (under Tune: Tune's result)."""
        if self._hosted_by_tune:
            return super().save(checkpoint_dir)  # calls save_checkpoint(), then reports it to Tune
        return self.save_to_path(checkpoint_dir)

    def save_checkpoint(self, checkpoint_dir: str) -> str:
        return self.save_to_path(checkpoint_dir)

    def save_to_path(self, checkpoint_dir: str | None = None) -> str:
        """Write a checkpoint directory (atomically) and return its path."""
        return save_algorithm(self, checkpoint_dir)

    def restore(self, checkpoint_dir: Any) -> None:
        """Load a checkpoint of this algorithm into this instance; training continues from its state.
        (Tune passes its own checkpoint result, which comes back here through ``load_checkpoint``.)"""
        if not isinstance(checkpoint_dir, (str, os.PathLike)):
            return super().restore(checkpoint_dir)
        load_into(self, os.fspath(checkpoint_dir))
        self.run_hook("on_checkpoint_loaded", algorithm=self)

    def load_checkpoint(self, checkpoint: Any) -> None:
        self.restore(os.fspath(checkpoint))

    restore_from_path = restore

    @classmethod
    def from_checkpoint(cls, checkpoint_dir: str, logdir: str | None = "auto", **kwargs: Any) -> "Algorithm":
        """Rebuild the algorithm a checkpoint was written by, with its config and state; ``kwargs``
        override config settings (e.g. ``num_env_runners=0``), ``logdir`` as in the constructor."""
        return build_from_checkpoint(checkpoint_dir, logdir, kwargs)

    def evaluate_episodes(self, num_episodes: int, explore: bool = False, render: bool = False) -> dict[str, Any]:
        """Play ``num_episodes`` whole episodes in the driver with the current policy."""
        return run_episodes(self, num_episodes, explore=explore, render=render)

    def stop(self) -> None:
        """Stop every actor and thread this algorithm started (Ray itself stays up)."""
        if self._hosted_by_tune:
            super().stop()  # Tune's own clean-up, which calls cleanup()
        else:
            self.cleanup()

    def reset_config(self, new_config: dict) -> bool:
        """Tune's ``reuse_actors=True``: the next trial (or a PBT trial's new settings) in this process rather
        than a new one, sparing its start and imports: this trial's stages are stopped (their actors dead, their
        share of the trial's resources free), the new trial's built from ``new_config``, the iteration count
        back to 0. Tune restores a checkpoint after it where the trial continues from one."""
        self.cleanup()
        self._num_iterations = 0
        self.setup(new_config)
        return True

    def cleanup(self) -> None:
        released(self)
        if self._results is not None:
            self._results.close()
            self._results = None
        if getattr(self, "evaluation", None) is not None:
            self.evaluation.close_thread()
        for stage in (self.plan, getattr(self, "evaluators", None), self.env_runner_group, self.learner_group):
            if stage is not None:
                stage.stop()
        if getattr(self, "_torch_threads_before", None) is not None:
            torch.set_num_threads(self._torch_threads_before)
            self._torch_threads_before = None

    def __enter__(self) -> "Algorithm":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.stop()
