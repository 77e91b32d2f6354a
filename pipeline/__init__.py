"""runnel's driver side and user API: configs, algorithms, checkpoints, the CLI.

The names below load on first use (PEP 562). A learner actor unpickles its config and learner classes
from ``pipeline.algorithms.<name>.config`` and ``.learner`` and so imports this package: an eager
import here would pull every algorithm, Ray Tune and pandas into each actor (about 2 CPU-s of its
start on a 2-core VM). The first use of an algorithm or config name registers every built-in
algorithm (with Ray Tune too, so ``tune.Tuner("PPO")`` finds it), as importing ``pipeline`` did before.
"""
from __future__ import annotations

import importlib
from typing import Any

_HOMES = {
    "pipeline.algorithm": ["Algorithm"],
    "pipeline.algorithms.appo.algorithm": ["APPO"],
    "pipeline.algorithms.appo.config": ["APPOConfig"],
    "pipeline.algorithms.bc.algorithm": ["BC"],
    "pipeline.algorithms.bc.config": ["BCConfig"],
    "pipeline.algorithms.cql.algorithm": ["CQL"],
    "pipeline.algorithms.cql.config": ["CQLConfig"],
    "pipeline.algorithms.dqn.algorithm": ["DQN"],
    "pipeline.algorithms.dqn.config": ["DQNConfig"],
    "pipeline.algorithms.impala.algorithm": ["IMPALA"],
    "pipeline.algorithms.impala.config": ["IMPALAConfig"],
    "pipeline.algorithms.marwil.algorithm": ["MARWIL"],
    "pipeline.algorithms.marwil.config": ["MARWILConfig"],
    "pipeline.algorithms.ppo.algorithm": ["PPO"],
    "pipeline.algorithms.ppo.config": ["PPOConfig"],
    "pipeline.algorithms.sac.algorithm": ["SAC"],
    "pipeline.algorithms.sac.config": ["SACConfig"],
    "actors.env.atari": ["make_atari"],
    "actors.env.multi_agent_env": ["MultiAgentEnv", "make_multi_agent"],
    "actors.env.pettingzoo_env": ["ParallelPettingZooEnv", "PettingZooEnv"],
    "actors.env.task_settable": ["TaskSettableEnv"],
    "actors.env.vector_env": ["EnvContext"],
    "pipeline.callbacks": ["CallbackError", "Callbacks", "DefaultCallbacks", "MemoryTrackingCallbacks",
                           "RLlibCallback", "make_multi_callbacks"],
    "pipeline.checkpoints.directory": ["CheckpointError"],
    "pipeline.config.base": ["AlgorithmConfig", "ConfigError"],
    "pipeline.config.multi_agent": ["PolicySpec"],
    "pipeline.config.multi_agent_plan": ["MultiAgentPlan", "multi_agent_plan"],
    "actors.modules.rl_module_spec": ["MultiRLModuleSpec", "RLModuleSpec"],
    "pipeline.groups.env_runners": ["SingleAgentEnvRunner"],
    "pipeline.envs": ["register_env"],
    "pipeline.groups.evaluation": ["collect_episodes", "summarize_episodes"],
    "pipeline.registry": ["get_algorithm", "register_algorithm"],
}
_RENAMED = {"DefaultModelConfig": ("actors.modules", "ModelConfig")}
_HOME_OF = {name: (module, name) for module, names in _HOMES.items() for name in names} | _RENAMED

__all__ = sorted(_HOME_OF)


_REGISTERING = {"Algorithm", "get_algorithm", "register_algorithm"} | {
    name for module, names in _HOMES.items() if module.startswith("pipeline.algorithms.") for name in names}


def __getattr__(name: str) -> Any:
    if name not in _HOME_OF:
        raise AttributeError(f"module 'pipeline' has no attribute {name!r}")
    module, attr = _HOME_OF[name]
    if name in _REGISTERING:
        importlib.import_module("pipeline.registry").register_builtins()
    value = getattr(importlib.import_module(module), attr)
    globals()[name] = value  # later lookups skip this function
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
