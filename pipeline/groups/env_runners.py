"""Env runner settings from a config, and ``SingleAgentEnvRunner``: RLlib's name for an env runner
built straight from a config (what ``Algorithm`` does for its own runners)."""
from __future__ import annotations

from typing import Any, Callable

from actors.env import EnvRunnerSettings
from actors.env.env_runner import EnvRunner
from pipeline.config.base import ALGORITHM_OF, AlgorithmConfig, ConfigError
from pipeline.config.plain import resolve_import_path
from pipeline.envs import env_creator, probe_spaces


def runner_settings(c: AlgorithmConfig, creator: Callable | None, module_class: type, observation_space: Any,
                    action_space: Any, in_evaluation: bool = False, recording: Any = None,
                    env_observation_space: Any = None) -> EnvRunnerSettings:
    """What one env runner needs of ``c``: its env, vector, fragment, module, exploration and reporting settings."""
    return EnvRunnerSettings(
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
        env_observation_space=env_observation_space,
    )


def vectorize_mode(c: AlgorithmConfig) -> str:
    """The config's mode, with "auto" kept to separate sub-envs when a curriculum sets each one's task."""
    mode = getattr(c.gym_env_vectorize_mode, "value", c.gym_env_vectorize_mode)  # gymnasium's VectorizeMode too
    return "sync" if mode == "auto" and c.env_task_fn is not None else mode


class SingleAgentEnvRunner(EnvRunner):
    """``SingleAgentEnvRunner(config=PPOConfig().environment("CartPole-v1"))``: an env runner with the
    algorithm's module (random initial weights until ``set_weights``), usable in-process or as
    ``ray.remote(SingleAgentEnvRunner).remote(config=config)``. ``sample(num_episodes=n)`` returns
    whole episodes (``EpisodeChunk``; ``get_return()``, ``len()``)."""

    def __init__(self, config: AlgorithmConfig, worker_index: int = 0, **kwargs: Any) -> None:
        if kwargs:
            raise TypeError(f"SingleAgentEnvRunner() got unexpected arguments {sorted(kwargs)}")
        algo_cls = ALGORITHM_OF.get(type(config))
        if algo_cls is None:
            raise ConfigError(f"{type(config).__name__} belongs to no algorithm; use an algorithm's config (PPOConfig...)")
        config.validate()
        creator = env_creator(config.env)
        obs_space, act_space = config.observation_space, config.action_space
        if obs_space is None or act_space is None:
            probed = probe_spaces(creator, config.env_config)
            obs_space, act_space = obs_space or probed[0], act_space or probed[1]
        super().__init__(runner_settings(config, creator, algo_cls.learner_class.module_class, obs_space, act_space),
                         worker_index=worker_index)
