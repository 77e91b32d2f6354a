"""The ``environment`` and ``env_runners`` groups: what the runners step, and in what fragments.

Their plain ranges and choices are in the range table (``pipeline.config.checks``); here are the
checks that need more than a range, and the fragment length an ``"auto"`` setting works out to.
"""
from __future__ import annotations

from typing import Any

from pipeline.config.checks import is_int


def environment_problems(config: Any) -> list[str]:
    """A config needs something to learn from: an env, external clients or a recording."""
    if config.env is None and config.external_clients_config is None and not (config.offline_data_config or {}).get("input_"):
        return ["no environment: call .environment('CartPole-v1') (a gymnasium id, a registered name, "
                "an env class or 'pkg.module:Class')"]
    return []


def env_runner_problems(config: Any) -> list[str]:
    rfl = config.rollout_fragment_length
    if rfl != "auto" and (not is_int(rfl) or rfl < 1):
        return [f"rollout_fragment_length must be 'auto' or an int >= 1, got {rfl!r}"]
    return []


def rollout_fragment_length(config: Any) -> int:
    """Steps per sub-env per sample request; "auto" divides the train batch among all sub-envs."""
    if config.rollout_fragment_length != "auto":
        return int(config.rollout_fragment_length)
    envs = max(1, config.num_env_runners) * config.num_envs_per_env_runner
    learners = max(1, config.num_learners)
    return max(1, -(-config.train_batch_size_per_learner * learners // envs))
