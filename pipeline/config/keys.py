"""Which builder sets which setting, and what becomes of a key that is not a setting.

``GROUPS`` names each builder's settings (an algorithm config's own settings belong to ``training``).
A key no builder knows goes through RLlib's table (``pipeline/config/compat.py``): read as the setting
it names, ignored, or reported at ``validate()`` with the builder to use or the closest valid names.
"""
from __future__ import annotations

import difflib
import logging
from dataclasses import fields
from typing import Any

from pipeline.config.checks import ConfigError
from pipeline.config.compat import ACCEPTED_KIND, IGNORED_KIND, NAMES, NO_VALUE, ignored_note, refusal

log = logging.getLogger("runnel")

GROUPS: dict[str, tuple[str, ...]] = {
    "environment": ("env", "env_config", "observation_space", "action_space", "clip_rewards",
                    "normalize_actions", "clip_actions", "env_task_fn"),
    "env_runners": ("num_env_runners", "num_envs_per_env_runner", "rollout_fragment_length", "batch_mode",
                    "num_cpus_per_env_runner", "explore", "gym_env_vectorize_mode", "env_to_module_connector",
                    "module_to_env_connector"),
    "learners": ("num_learners", "num_gpus_per_learner", "num_cpus_per_learner", "learner_placement_timeout_s",
                 "learner_precision"),
    "training": ("gamma", "lr", "grad_clip", "grad_clip_by", "adam_epsilon", "train_batch_size_per_learner",
                 "minibatch_size", "num_epochs", "learner_connector"),
    "rl_module": ("model_config", "rl_module_spec"),
    "multi_agent": ("policies", "policy_mapping_fn", "policies_to_train", "count_steps_by"),
    "resources": ("num_cpus_for_main_process", "ray_address"),
    "reporting": ("metrics_num_episodes_for_smoothing", "min_time_s_per_iteration",
                  "min_sample_timesteps_per_iteration", "min_train_timesteps_per_iteration",
                  "env_runner_metrics_interval_s"),
    "checkpointing": ("export_native_model_files",),
    "debugging": ("seed", "log_level", "log_sys_usage"),
    "fault_tolerance": ("restart_failed_env_runners", "ignore_env_runner_failures", "max_num_env_runner_restarts",
                        "delay_between_env_runner_restarts_s", "env_runner_health_probe_timeout_s",
                        "restart_failed_sub_environments", "max_num_learner_restarts", "learner_snapshot_interval_s",
                        "max_num_replay_restarts"),
    "callbacks": ("callbacks_class", "callbacks_functions"),
    "exploration": ("explore", "exploration_config"),
    "evaluation": ("evaluation_interval", "evaluation_duration", "evaluation_duration_unit", "evaluation_num_env_runners",
                   "evaluation_parallel_to_training", "evaluation_config", "evaluation_sample_timeout_s",
                   "evaluation_force_reset_envs_before_iteration", "custom_evaluation_function",
                   "always_attach_evaluation_results", "off_policy_estimation_methods",
                   "off_policy_estimation_episodes"),
}
OWN_BUILDERS = {"external_clients_config": "external_clients", "offline_data_config": "offline_data",
                "inference_config": "inference"}
"""Settings outside ``GROUPS`` that have a builder of their own."""


def dict_setting_problems(d: Any, keys: tuple[str, ...], group: str) -> list[str]:
    """A dict-valued setting group (``external_clients``, ``offline_data``, ``inference``): not a dict, or
    keys it does not know (each with the closest valid ones)."""
    if not isinstance(d, dict):
        return [f"{group} settings must be a dict, got {type(d).__name__}"]
    problems = []
    for key in d:
        if key not in keys:
            close = difflib.get_close_matches(key, keys, n=2, cutoff=0.5)
            hint = f"did you mean {' or '.join(map(repr, close))}?" if close else f"valid keys: {list(keys)}"
            problems.append(f"unknown {group} setting {key!r}; {hint}")
    return problems


def setting_names(config: Any) -> list[str]:
    """The settings of a config class or config (its dataclass fields but the unknown-key record)."""
    return [f.name for f in fields(config) if f.name != "_unknown"]


def group_keys(config: Any, group: str) -> set[str]:
    """The settings the builder ``group`` sets; ``training`` also takes the algorithm config's own."""
    keys = set(GROUPS[group])
    if group == "training":
        keys |= {f.name for f in fields(config)} - {k for g in GROUPS.values() for k in g} - {"_unknown"}
    return keys


def builder_of(name: str) -> str:
    """The builder method that sets a runnel setting (algorithm settings: ``training``)."""
    if name in OWN_BUILDERS:
        return OWN_BUILDERS[name]
    return next((group for group, keys in GROUPS.items() if name in keys), "training")


def ignore_setting(key: str, value: Any) -> None:
    """An RLlib setting with no meaning here (one framework, one API stack); a framework other than
    torch is refused at once."""
    problem = ignored_note(key, value)
    if problem:
        raise ConfigError(problem)
    log.debug("config setting %s=%r is RLlib's and means nothing in runnel (%s): ignored", key, value,
              NAMES[key].how)


def unknown_problem(config: Any, key: str, group: str, valid: list[str], value: Any = NO_VALUE) -> str:
    """What to say about a key nobody took: the table's refusal, the builder a runnel setting given
    to the wrong builder belongs to, or the closest valid names."""
    refused = refusal(key, value)
    if refused:
        return refused
    names = setting_names(config)
    entry = NAMES.get(key)
    target = entry.runnel if entry is not None and entry.kind == ACCEPTED_KIND else key
    what = f"{key!r} (RLlib's name of {target!r})" if target != key else repr(key)
    if target in names:
        return f"unknown {group} setting {what}: it is set with .{builder_of(target)}({target}=...)"
    if target != key:
        return f"unknown {group} setting {what}: {type(config).__name__} has no setting {target!r}"
    close = difflib.get_close_matches(key, valid, n=3, cutoff=0.5)
    hint = f"; did you mean {' or '.join(map(repr, close))}?" if close else f"; valid keys: {valid}"
    return f"unknown {group} setting {key!r}{hint}"


def read_setting(config: Any, key: str) -> Any:
    """``config[key]``: a setting, the setting an RLlib name stands for, or what an ignored RLlib
    setting reads as; KeyError naming the fix or the closest settings otherwise."""
    names = setting_names(config)
    if key in names:
        return getattr(config, key)
    entry = NAMES.get(key)
    if entry is not None and entry.kind == ACCEPTED_KIND and entry.runnel in names:
        return getattr(config, entry.runnel)
    if entry is not None and entry.kind == IGNORED_KIND:
        return entry.reads_as
    refused = refusal(key) if isinstance(key, str) else None
    if refused:
        raise KeyError(refused)
    close = difflib.get_close_matches(key, names, n=3) if isinstance(key, str) else []
    hint = f"; did you mean {' or '.join(map(repr, close))}?" if close else ""
    raise KeyError(f"{type(config).__name__} has no setting {key!r}{hint}")
