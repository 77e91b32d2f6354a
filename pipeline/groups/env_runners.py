"""Env runner settings from a config, and ``SingleAgentEnvRunner``: RLlib's name for an env runner
built straight from a config (what ``Algorithm`` does for its own runners)."""
from __future__ import annotations

import dataclasses
from typing import Any, Callable

from actors.callbacks import build_callbacks, overrides
from actors.env import EnvRunnerSettings
from actors.env.env_runner import EPISODE_HOOKS, EnvRunner
from pipeline.config.base import AlgorithmConfig, ConfigError
from pipeline.config.multi_agent import settings_used
from pipeline.config.plain import resolve_import_path
from pipeline.envs import env_creator, probe_spaces


def runner_settings(c: AlgorithmConfig, creator: Callable | None, module_class: type, observation_space: Any,
                    action_space: Any, in_evaluation: bool = False, recording: Any = None,
                    env_observation_space: Any = None) -> EnvRunnerSettings:
    """What one env runner needs of ``c``: its env, vector, fragment, module, exploration and reporting settings."""
    settings = EnvRunnerSettings(
        env_creator=creator, env_config=c.env_config, num_envs=c.num_envs_per_env_runner,
        vectorize_mode=vectorize_mode(c), rollout_fragment_length=c.get_rollout_fragment_length(),
        batch_mode=c.batch_mode, explore=c.explore, module_class=module_class,
        model_config=c.model_config, module_kwargs=c.module_kwargs(), exploration_config=c.exploration_settings(),
        observation_space=observation_space, action_space=action_space, clip_rewards=c.clip_rewards,
        normalize_actions=c.normalize_actions, clip_actions=c.clip_actions, seed=c.seed,
        num_env_runners=c.num_env_runners, restart_failed_sub_environments=c.restart_failed_sub_environments,
        metrics_window=c.metrics_num_episodes_for_smoothing, callbacks=c.callbacks_spec(),
        in_evaluation=in_evaluation, log_level=c.log_level, log_sys_usage=c.log_sys_usage, recording=recording,
        env_to_module=(resolve_import_path(c.env_to_module_connector, "env_to_module_connector")
                       if isinstance(c.env_to_module_connector, str) else c.env_to_module_connector),
        module_to_env=(resolve_import_path(c.module_to_env_connector, "module_to_env_connector")
                       if isinstance(c.module_to_env_connector, str) else c.module_to_env_connector),
        env_observation_space=env_observation_space,
        env_threads=max(1, int(c.num_cpus_per_env_runner if c.num_env_runners else c.num_cpus_for_main_process)),
    )
    settings.precision = (c.inference_config or {}).get("precision", "float32")
    if c.external_clients_config is None and not settings_used(c):  # single-agent env runners act
        settings.numpy_policy = numpy_plan(settings, runner_backend(c))
    return settings


MODULE_HOOKS = (*EPISODE_HOOKS, "on_postprocess_trajectory")
"""Callbacks handed the runner's torch module (``rl_module``, ``policies``): its runners act with torch."""


def runner_backend(c: AlgorithmConfig) -> str:
    return (c.inference_config or {}).get("runner_backend", "auto")


def numpy_plan(settings: EnvRunnerSettings, backend: str) -> dict | None:
    """The numpy export runners act with (``actors.env.numpy_acting``), or None: they act with torch.
    ``backend`` "auto" exports when the module, its exploration and the callbacks allow and the module has no
    convolutions (numpy runs those several times slower than torch), "numpy" insists
    (a ``ConfigError`` says why it cannot), "torch" never exports."""
    if backend == "torch" or settings.precision != "float32":  # numpy computes in float32 only
        return None
    try:
        plan = _export_plan(settings)
    except ValueError as err:
        if backend == "numpy":
            raise ConfigError(f"inference runner_backend='numpy': {err}; use runner_backend='auto' (numpy where it "
                              f"can, torch elsewhere) or 'torch'") from None
        return None
    if backend == "auto" and any(op.get("op") == "conv2d" for op in plan["policy"]["layers"]):
        return None  # numpy's convolutions cost ~4x torch's (Atari's CNN, 8 frames: 9.3 ms against 2.4 ms of CPU)
    return plan


def _export_plan(settings: EnvRunnerSettings) -> dict:
    import torch

    from actors.env.exploration import make_exploration
    from actors.env.settings import module_class_of
    from actors.modules.export import acting_plan

    hooks = [h for h in MODULE_HOOKS if overrides(build_callbacks(settings.callbacks), h)] if settings.callbacks else []
    if hooks:
        raise ValueError(f"callbacks {hooks} are handed the runner's torch module")
    if settings.observation_space is None or settings.action_space is None:
        raise ValueError("the module's spaces are not known before the runners start")
    with torch.random.fork_rng(devices=[]):  # a throwaway module: its initial draws must not shift the run's
        module = module_class_of(settings)(settings.observation_space, settings.action_space, settings.model_config,
                                           inference_only=True, **settings.module_kwargs)
    return acting_plan(module, make_exploration(settings.exploration_config, module.dist_spec))


def thin(settings: EnvRunnerSettings) -> EnvRunnerSettings:
    """The runners' copy of settings with a numpy plan: without the module class, its arguments and the
    exploration config, whose unpickling could import torch into the runner (the plan carries what they say)."""
    return dataclasses.replace(settings, module_class=None, module_kwargs={}, exploration_config={})


def vectorize_mode(c: AlgorithmConfig) -> str:
    """The config's mode, with "auto" kept to separate sub-envs when a curriculum sets each one's task."""
    mode = getattr(c.gym_env_vectorize_mode, "value", c.gym_env_vectorize_mode)  # gymnasium's VectorizeMode too
    return "sync" if mode == "auto" and c.env_task_fn is not None else mode


class SingleAgentEnvRunner(EnvRunner):
    """``SingleAgentEnvRunner(config=PPOConfig().environment("CartPole-v1"))``: an env runner with the
    algorithm's torch module (``runner.module``; random initial weights until ``set_weights``; numpy acting only
    with ``runner_backend="numpy"``), usable in-process or as
    ``ray.remote(SingleAgentEnvRunner).remote(config=config)``. ``sample(num_episodes=n)`` returns
    whole episodes (``EpisodeChunk``; ``get_return()``, ``len()``)."""

    def __init__(self, config: AlgorithmConfig, worker_index: int = 0, **kwargs: Any) -> None:
        if kwargs:
            raise TypeError(f"SingleAgentEnvRunner() got unexpected arguments {sorted(kwargs)}")
        module_class = config.get_default_learner_class().module_class  # a ConfigError names the fix
        config.validate()
        creator = env_creator(config.env)
        obs_space, act_space = config.observation_space, config.action_space
        if obs_space is None or act_space is None:
            probed = probe_spaces(creator, config.env_config)
            obs_space, act_space = obs_space or probed[0], act_space or probed[1]
        settings = runner_settings(config, creator, module_class, obs_space, act_space)
        if runner_backend(config) == "auto":  # RLlib's env runner holds its RLModule (``runner.module``): torch
            settings.numpy_policy = None
        super().__init__(settings, worker_index=worker_index)
