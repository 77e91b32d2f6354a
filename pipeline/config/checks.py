"""ConfigError and the value checks that every config group and each algorithm's config share.

The range table (``CHOICES`` and the counts) covers plain settings of several groups at once; it runs
as one pass so that ``validate()`` lists its problems in the order the table gives them.
"""
from __future__ import annotations

from typing import Any

from actors.env.native_vector_env import ENVPOOL_OWN
from actors.env.vector_modes import VECTORIZE_MODES


class ConfigError(ValueError):
    """A config key or value is invalid; the message names it and what would be valid."""


CHOICES = {
    "batch_mode": ("truncate_episodes", "complete_episodes"),
    "grad_clip_by": ("value", "norm", "global_norm"),
    "gym_env_vectorize_mode": VECTORIZE_MODES,
    "log_level": ("DEBUG", "INFO", "WARN", "WARNING", "ERROR"),
    "evaluation_duration_unit": ("episodes", "timesteps"),
    "learner_precision": ("float32", "bfloat16"),
}
AT_LEAST_ZERO = ("num_env_runners", "num_learners", "min_sample_timesteps_per_iteration",
                 "min_train_timesteps_per_iteration", "max_num_env_runner_restarts", "max_num_learner_restarts",
                 "max_num_replay_restarts")
"""Settings that must be an int >= 0."""
AT_LEAST_ONE = ("num_envs_per_env_runner", "train_batch_size_per_learner", "minibatch_size", "num_epochs",
                "metrics_num_episodes_for_smoothing")
"""Settings that must be an int >= 1."""


def range_problems(config: Any) -> list[str]:
    """The settings of the range table that are out of range."""
    problems = []
    for key, choices in CHOICES.items():
        value = getattr(config, key)
        if getattr(value, "value", value) not in choices:  # an enum of those values too (gymnasium's VectorizeMode)
            problems.append(f"{key}={getattr(config, key)!r} is not one of {list(choices)}")
    for key in AT_LEAST_ZERO:
        if not is_int(getattr(config, key)) or getattr(config, key) < 0:
            problems.append(f"{key} must be an int >= 0, got {getattr(config, key)!r}")
    for key in AT_LEAST_ONE:
        if not is_int(getattr(config, key)) or getattr(config, key) < 1:
            problems.append(f"{key} must be an int >= 1, got {getattr(config, key)!r}")
    own = sorted(set(config.env_config or {}) & set(ENVPOOL_OWN)) if isinstance(config.env_config, dict) else []
    if getattr(config.gym_env_vectorize_mode, "value", config.gym_env_vectorize_mode) == "envpool" and own:
        problems.append(f"env_config sets EnvPool's {own}, which each env runner sets itself: EnvPool's threads follow "
                        f"num_cpus_per_env_runner (num_cpus_for_main_process for the driver's runner), a runner steps "
                        f"all its num_envs_per_env_runner envs at once, and its seed follows .debugging(seed=...); "
                        f"remove them from env_config")
    interval = config.learner_snapshot_interval_s
    if interval is not None and (not is_number(interval) or interval <= 0):
        problems.append(f"learner_snapshot_interval_s must be a number of seconds > 0, or None (snapshots only at "
                        f"checkpoints), got {interval!r}")
    if not is_number(config.env_runner_metrics_interval_s) or config.env_runner_metrics_interval_s <= 0:
        problems.append(f"env_runner_metrics_interval_s must be a number > 0, got {config.env_runner_metrics_interval_s!r}")
    return problems


def is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def is_number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def check_schedule(name: str, value: Any) -> list[str]:
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return [] if value >= 0 else [f"{name} must be >= 0, got {value!r}"]
    ok = isinstance(value, (list, tuple)) and value and all(
        isinstance(p, (list, tuple)) and len(p) == 2 and all(isinstance(x, (int, float)) for x in p) for p in value)
    return [] if ok else [f"{name} must be a number or a schedule [[timestep, value], ...], got {value!r}"]
