"""EnvRunnerSettings: everything an env runner is built from, as one plain dataclass.

Apart from the runner itself so the driver (and the policy server, which shares these settings)
can fill it in without reading the sampling code.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable

import gymnasium as gym
import numpy as np

from actors.callbacks import CallbacksSpec
from actors.env.vector_env import EnvContext
from actors.offline.recorder import RecordingSettings

if TYPE_CHECKING:  # torch-free at run time: a runner under central inference unpickles these settings
    from actors.inference.settings import InferenceClientSettings
    from actors.modules import RLModule


@dataclass
class EnvRunnerSettings:
    """What an env runner needs to know; filled in by the driver from the algorithm config."""

    env_creator: Callable[[EnvContext], gym.Env]
    env_config: dict = field(default_factory=dict)
    num_envs: int = 1
    vectorize_mode: str = "auto"
    """How the sub-envs are stepped (``gym_env_vectorize_mode``: ``actors.env.vector_modes.make_vector_env``)."""
    rollout_fragment_length: int = 200
    batch_mode: str = "truncate_episodes"
    explore: bool = True
    module_class: type[RLModule] | None = None
    """The module runners act with; None: ``ActorCriticModule`` (``module_class_of``)."""
    model_config: dict = field(default_factory=dict)
    module_kwargs: dict = field(default_factory=dict)
    observation_space: gym.Space | None = None
    action_space: gym.Space | None = None
    env_to_module: Callable[..., Any] | None = None
    """The user's ``env_to_module_connector`` factory: each runner builds its own pipeline from it
    (``actors.connectors``); None: observations go to the module as the env gives them."""
    module_to_env: Callable[..., Any] | None = None
    """The user's ``module_to_env_connector`` factory (``actors.connectors.module_to_env``): what each runner
    does to its module's actions before the env gets them; None: nothing beyond ``normalize_actions`` and
    ``clip_actions``."""
    env_observation_space: gym.Space | None = None
    """The env's own observation space, what the pipeline starts from (``observation_space`` is what
    comes out of it); None: the env's."""
    exploration_config: dict = field(default_factory=dict)
    clip_rewards: bool | float | None = None
    normalize_actions: bool = True
    clip_actions: bool = False
    seed: int | None = None
    num_env_runners: int = 0
    restart_failed_sub_environments: bool = False
    torch_threads: int = 1
    env_threads: int = 1
    """Threads a vector env with threads of its own may use (EnvPool's ``num_threads``): the runner's CPUs."""
    metrics_window: int = 100
    """Episodes the runner's own episode statistics are averaged over."""
    callbacks: CallbacksSpec | None = None
    """The user's callbacks; this runner builds its own instance and runs the runner hooks."""
    in_evaluation: bool = False
    """An evaluator (its envs see ``EnvContext.in_evaluation``; callbacks see ``env_runner.config.in_evaluation``)."""
    log_level: str = "WARN"
    """Level of runnel's loggers in this runner's process."""
    log_sys_usage: bool = False
    """Report this process's CPU and resident memory under ``perf/env_runner_<index>/``."""
    recording: RecordingSettings | None = None
    """Record every chunk this runner returns (``config.offline_data(output=...)``); None: off."""
    inference: InferenceClientSettings | None = None
    """Central inference: ask an inference server for actions instead of acting with a module of one's own
    (such a runner imports no torch); None acts locally."""
    numpy_policy: dict | None = None
    """Act with numpy alone: the driver's ``actors.modules.export.acting_plan`` of the module and exploration
    (then ``module_class``, ``module_kwargs`` and ``exploration_config`` are left out of the runners' copy,
    so no torch is imported to read them); None: the torch module acts."""
    precision: str = "float32"
    """The dtype the runner's own torch forward pass computes in (``InferenceSettings.precision``)."""
    niceness: int = 0
    """Raise this runner's OS niceness by this much (a remote runner only): evaluators running beside
    training take the CPU time training leaves idle instead of slowing it down."""


def module_class_of(settings: Any) -> type:
    """The module class ``settings`` name, ``ActorCriticModule`` when they name none."""
    if settings.module_class is not None:
        return settings.module_class
    from actors.modules import ActorCriticModule

    return ActorCriticModule


def check_sample_count(name: str, value: Any) -> None:
    """A count ``sample()`` is asked for (``num_timesteps``, ``num_episodes``): a whole number >= 1, else an error
    naming it, instead of an empty sample or a loop that never ends."""
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 1:
        raise ValueError(f"{name}={value!r}: give a whole number >= 1")
