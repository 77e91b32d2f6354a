"""An algorithm's evaluation: its evaluators, one evaluation, and evaluations run beside training.

Separate from ``Algorithm`` because evaluation has stages of its own (a second env runner group),
a thread of its own (``evaluation_parallel_to_training``) and a reader of its own (off-policy
estimates); the algorithm only decides when to evaluate and where the results go.
"""
from __future__ import annotations

import concurrent.futures
import dataclasses
import threading
from typing import Any, Callable

import numpy as np
import ray
import torch

from actors.modules import to_torch
from actors.offline import OfflineReader
from pipeline.ray_cluster import init_ray_if_needed
from pipeline.envs import env_creator
from pipeline.groups.evaluation import EVALUATOR_REQUEST_SLOTS, Evaluators

EVALUATOR_NICENESS = 19
"""Parallel evaluators run at the lowest OS priority: on shared cores they use what training leaves."""
AUTO_FRAGMENT = 200
"""Evaluators' steps per sub-env per request when ``rollout_fragment_length`` is "auto" (sized for training)."""


class AlgorithmEvaluation:
    """Builds and drives ``algo``'s evaluators, reading the algorithm through its public attributes;
    ``hook(name, **kwargs)`` calls the algorithm's callbacks."""

    def __init__(self, algo: Any, hook: Callable[..., None]) -> None:
        self.algo = algo
        self.hook = hook
        self.evaluators: Evaluators | None = None
        self.thread: concurrent.futures.ThreadPoolExecutor | None = None
        self.ope_reader: OfflineReader | None = None

    def build_evaluators(self, check_started: bool = True) -> Evaluators:
        """The evaluators (built at set-up with ``evaluation_interval``, else at the first ``evaluate()``);
        ``check_started=False``: their actors asked for, not waited for (``Evaluators.check_started``)."""
        algo = self.algo
        if self.evaluators is None:
            c = algo.config.evaluation_settings()
            c.validate()
            settings = algo.env_runner_settings(c, in_evaluation=True)
            if c.env != algo.config.env:
                settings.env_creator = env_creator(c.env)
            if c.observation_space is None or c.action_space is None:  # the policy's spaces, whatever the env
                settings.observation_space, settings.action_space = algo.observation_space, algo.action_space
            if c.seed is not None:  # not the training runners' episode seeds
                settings.seed = c.seed + 100_000
            if c.evaluation_parallel_to_training:
                settings.niceness = EVALUATOR_NICENESS
            settings.rollout_fragment_length = (int(c.rollout_fragment_length) if c.rollout_fragment_length != "auto"
                                                else AUTO_FRAGMENT)
            if c.evaluation_num_env_runners > 0 and not ray.is_initialized():
                init_ray_if_needed(c)
            fault_tolerance = dataclasses.replace(algo.fault_tolerance_settings(c),
                                                  max_requests_in_flight=EVALUATOR_REQUEST_SLOTS)
            # a multi-agent run's evaluators are MultiAgentEnvRunners holding the run's current modules
            runner_args = algo.multi_agent.runner_group_args(evaluation=True) if algo.multi_agent is not None else None
            self.evaluators = Evaluators(c, settings, fault_tolerance, on_recreated=lambda ids: self.hook(
                "on_env_runners_recreated", algorithm=algo, env_runner_group=self.evaluators.group,
                env_runner_indices=ids, is_evaluation=True), runner_args=runner_args, check_started=check_started)
        return self.evaluators

    def sync_weights(self, wait: bool = True) -> None:
        """Send the learner's current weights to the evaluators (built now if need be)."""
        algo = self.algo
        if algo.env_creator is None:  # no env to evaluate in (off-policy estimates read the learner's weights)
            return
        evaluators = self.build_evaluators()
        evaluators.sync_weights(algo.learner_group.get_weights(inference_only=True), algo.weights_version,
                                algo.counters["num_env_steps_sampled_lifetime"], wait=wait)  # evaluators count env steps
        if algo.connector is not None and algo.connector.stateful:  # normalise as the training runners do
            evaluators.group.sync_connectors(algo.connector.get_state(), wait=wait)

    def beside(self, evaluating: bool, train: Callable[[], Any]) -> Any:
        """``train()``, with an evaluation beside it in the evaluation thread when ``evaluating`` and
        ``evaluation_parallel_to_training`` (its results become ``algo.evaluation_results``); returns what
        ``train()`` returned."""
        if not (evaluating and self.algo.config.evaluation_parallel_to_training):
            return train()
        stop = threading.Event()
        parallel = self.start_parallel(stop)
        try:
            out = train()
        finally:
            stop.set()
        self.algo.evaluation_results = parallel.result()
        return out

    def start_parallel(self, stop: threading.Event) -> concurrent.futures.Future:
        """Start an evaluation in the evaluation thread, with the weights from before this training
        step (so its results are one iteration behind); it ends early once ``stop`` is set."""
        self.sync_weights(wait=False)
        if self.thread is None:
            # torch's thread setting is per thread: local evaluators act with the driver's, not one per core
            self.thread = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="runnel-evaluation",
                                                                initializer=torch.set_num_threads,
                                                                initargs=(torch.get_num_threads(),))
        return self.thread.submit(self.run, stop)

    def run(self, stop: threading.Event | None) -> dict[str, Any]:
        """One evaluation with the weights the evaluators hold (in the evaluation thread when parallel)."""
        algo = self.algo
        self.hook("on_evaluate_start", algorithm=algo, metrics_logger=algo.metrics)
        if algo.env_creator is None:  # training from a recording with no env: off-policy estimates only
            metrics: dict[str, Any] = {}
        elif algo.custom_evaluation_function is not None:
            evaluators = self.build_evaluators()
            metrics = algo.custom_evaluation_function(algo, evaluators.group)
            if isinstance(metrics, tuple):  # RLlib's newer (metrics, env_steps, agent_steps)
                metrics = metrics[0]
            if not isinstance(metrics, dict):
                raise TypeError(f"custom_evaluation_function must return a dict of metrics, got {type(metrics).__name__}")
        else:
            metrics = self.build_evaluators().run(stop)
        if algo.config.off_policy_estimation_methods:
            metrics["off_policy_estimator"] = self.off_policy_estimates()
        self.hook("on_evaluate_end", algorithm=algo, evaluation_metrics=metrics, metrics_logger=algo.metrics)
        return metrics

    def off_policy_estimates(self) -> dict[str, dict[str, float]]:
        """IS/WIS estimates of the current policy's return over recorded whole episodes."""
        from pipeline.offline.ope import estimate_all, estimator_kinds

        algo = self.algo
        if self.ope_reader is None:
            settings = dataclasses.replace(algo.offline_input, input_read_episodes=True, shuffle_buffer_size=0)
            self.ope_reader = OfflineReader(algo.env_runner_settings(), worker_index=0, offline=settings)
        chunks = self.ope_reader.sample(num_episodes=algo.config.off_policy_estimation_episodes)
        module = algo.get_module()

        def target_logp(obs: Any, actions: Any) -> np.ndarray:
            with torch.inference_mode():
                out = module.forward_inference(to_torch(obs))["action_dist_inputs"]
                return module.action_dist(out).logp(to_torch(actions)).numpy()

        kinds = estimator_kinds(algo.config.off_policy_estimation_methods)[0]
        return estimate_all(chunks, target_logp, float(getattr(algo.config, "gamma", 0.99)), kinds)

    def close_thread(self) -> None:
        """Wait for an evaluation still running in the evaluation thread, and end the thread."""
        if self.thread is not None:
            self.thread.shutdown(wait=True)
            self.thread = None
