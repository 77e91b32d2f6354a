"""The ``evaluation`` group: how often and how long evaluators run, and off-policy estimates.

``evaluation_config`` (the settings evaluators run with) is checked by ``AlgorithmConfig`` itself,
since it is checked as a whole config; the estimates read the recording of ``offline_data(input_=...)``.
"""
from __future__ import annotations

from typing import Any

from pipeline.config.checks import is_int, is_number


def evaluation_problems(config: Any) -> list[str]:
    problems = []
    interval = config.evaluation_interval
    if interval is not None and (not is_int(interval) or interval < 0):
        problems.append(f"evaluation_interval must be None or an int >= 0, got {interval!r}")
    duration = config.evaluation_duration
    if duration == "auto":
        if not config.evaluation_parallel_to_training:
            problems.append("evaluation_duration='auto' needs evaluation_parallel_to_training=True (it ends "
                            "evaluation when the parallel training step ends); give a number of episodes or "
                            "timesteps instead")
    elif not is_int(duration) or duration < 1:
        problems.append(f"evaluation_duration must be an int >= 1 or 'auto', got {duration!r}")
    if not is_int(config.evaluation_num_env_runners) or config.evaluation_num_env_runners < 0:
        problems.append(f"evaluation_num_env_runners must be an int >= 0, got {config.evaluation_num_env_runners!r}")
    if not is_number(config.evaluation_sample_timeout_s) or config.evaluation_sample_timeout_s <= 0:
        problems.append(f"evaluation_sample_timeout_s must be a number > 0, got {config.evaluation_sample_timeout_s!r}")
    return problems


def estimation_problems(config: Any) -> list[str]:
    """``off_policy_estimation_methods``: known estimators, and a recording to estimate from."""
    from pipeline.offline.ope import estimator_kinds

    problems = list(estimator_kinds(config.off_policy_estimation_methods)[1])
    if config.off_policy_estimation_methods and not (config.offline_data_config or {}).get("input_"):
        problems.append("off_policy_estimation_methods estimate from recorded episodes: add "
                        ".offline_data(input_='DIR') (a recording whose episodes carry action_logp)")
    if not isinstance(config.off_policy_estimation_episodes, int) or config.off_policy_estimation_episodes < 1:
        problems.append(f"off_policy_estimation_episodes must be an int >= 1, got {config.off_policy_estimation_episodes!r}")
    return problems
