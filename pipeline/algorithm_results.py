"""An algorithm's training results: the metrics logger reduced into RLlib's result keys.

Separate from ``Algorithm`` because what a result holds (its defaults, lifetime counters, rates) is
one contract that the CLI, Tune and the checkpoint keeper read through ``lookup``; with it, when an
iteration's training steps end (``training_steps``). Writing results to files is ``pipeline/results.py``.
"""
from __future__ import annotations

import dataclasses
import json
import time
from typing import Any

from actors.metrics import MetricsLogger
from pipeline.config.base import AlgorithmConfig, ConfigError

COUNTERS = {"num_env_steps_sampled_lifetime": "env_runners/num_env_steps_sampled_lifetime",
            "num_env_steps_trained_lifetime": "learners/__all_modules__/num_env_steps_trained_lifetime",
            "num_episodes_lifetime": "env_runners/num_episodes_lifetime"}
"""The lifetime counters of a run (``algo.counters``), and where the metrics logger keeps them."""


@dataclasses.dataclass(frozen=True)
class IterationInfo:
    """What the driver knows of the iteration that just ended, beside what was logged into the metrics."""

    training_iteration: int
    time_this_iter_s: float
    time_total_s: float
    num_training_step_calls: int
    weights_version: int


def lookup(result: dict, path: str) -> Any:
    """``"env_runners/episode_return_mean"`` -> ``result["env_runners"]["episode_return_mean"]`` (or None)."""
    node: Any = result
    for part in path.split("/"):
        if not isinstance(node, dict) or part not in node:
            return None
        node = node[part]
    return node


def lifetime_counters(metrics: MetricsLogger) -> dict[str, int]:
    """The run's lifetime counters (``COUNTERS``) as the metrics logger holds them now."""
    return {name: metrics.peek(key, 0) for name, key in COUNTERS.items()}


def iteration_result(metrics: MetricsLogger, info: IterationInfo) -> dict[str, Any]:
    """Reduce the metrics into one ``train()`` result, with every key RLlib's results always have
    (NaN or 0 until something reports it), the lifetime counters at the top level, and rates."""
    result = metrics.reduce()
    nan = float("nan")
    env = result.setdefault("env_runners", {})
    for key in ("episode_return_mean", "episode_return_min", "episode_return_max", "episode_len_mean"):
        env.setdefault(key, nan)
    for key in ("num_episodes", "num_env_steps_sampled", "num_env_steps_sampled_lifetime", "num_episodes_lifetime"):
        env.setdefault(key, 0)
    learners = result.setdefault("learners", {})
    if not any(k != "__all_modules__" for k in learners):  # a multi-agent run's modules are its own keys
        learners["default_policy"] = {}
    all_modules = learners.setdefault("__all_modules__", {})
    all_modules.setdefault("num_env_steps_trained", 0)
    all_modules.setdefault("num_env_steps_trained_lifetime", 0)
    all_modules.setdefault("num_updates", 0)
    all_modules["weights_version"] = info.weights_version
    dt = info.time_this_iter_s
    if "num_agent_steps_sampled_lifetime" in env:  # multi-agent runs count agent steps too (RLlib's keys)
        result["num_agent_steps_sampled_lifetime"] = env["num_agent_steps_sampled_lifetime"]
        result["num_agent_steps_trained_lifetime"] = all_modules.get("num_agent_steps_trained_lifetime", 0)
    return result | {
        "num_env_steps_sampled_lifetime": env["num_env_steps_sampled_lifetime"],
        "num_env_steps_trained_lifetime": all_modules["num_env_steps_trained_lifetime"],
        "num_episodes_lifetime": env["num_episodes_lifetime"],
        "num_env_steps_sampled_per_s": env["num_env_steps_sampled"] / dt if dt > 0 else 0.0,
        "num_env_steps_trained_per_s": all_modules["num_env_steps_trained"] / dt if dt > 0 else 0.0,
        "num_learner_updates": all_modules["num_updates"],
        "num_training_step_calls_per_iteration": info.num_training_step_calls,
        "training_iteration": info.training_iteration,
        "time_this_iter_s": dt,
        "time_total_s": info.time_total_s,
        "timestamp": int(time.time()),
    }


def result_params(config: AlgorithmConfig) -> dict[str, Any]:
    """The config as a run's ``params.json`` holds it."""
    try:
        return config.to_dict()
    except ConfigError:  # a setting with no import path (a local class): logged as its repr
        return {f.name: json_safe(getattr(config, f.name)) for f in dataclasses.fields(config)
                if f.name != "_unknown"}


def json_safe(value: Any) -> Any:
    """``value`` with whatever JSON cannot hold (classes, functions) written as its repr."""
    return json.loads(json.dumps(value, default=repr))


def training_steps(algo: Any, t0: float, sampled0: int, trained0: int) -> int:
    """``algo.training_step()`` until the iteration's minimum time (since ``t0``) and its minimum env steps
    sampled and trained (counted from ``sampled0``/``trained0``) are met; how many steps ran."""
    c = algo.config
    steps = 0
    while True:
        with algo.metrics.log_time("timers/training_step"):
            algo.training_step()
        steps += 1
        elapsed = time.perf_counter() - t0
        counters = algo.counters
        if ((c.min_time_s_per_iteration is None or elapsed >= c.min_time_s_per_iteration)
                and counters["num_env_steps_sampled_lifetime"] - sampled0 >= c.min_sample_timesteps_per_iteration
                and counters["num_env_steps_trained_lifetime"] - trained0 >= c.min_train_timesteps_per_iteration):
            return steps
