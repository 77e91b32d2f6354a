"""runnel's driver side and user API: configs, algorithms, checkpoints, the CLI.

The names below load on first use (PEP 562). A learner actor unpickles its config and learner classes
from ``pipeline.algorithms.<name>.config`` and ``.learner`` and so imports this package: an eager
import here would pull every algorithm, Ray Tune and pandas into each actor (about 2 CPU-s of its
start on a 2-core VM). The first use of an algorithm or config name registers every built-in
algorithm (with Ray Tune too, so ``tune.Tuner("PPO")`` finds it), as importing ``pipeline`` did before.
"""
from __future__ import annotations

import importlib

from pipeline.lazy import lazy_exports

_HOMES = {
    "pipeline.algorithm": ["Algorithm"],
    "pipeline.algorithms.appo": ["APPO", "APPOConfig"],
    "pipeline.algorithms.bc": ["BC", "BCConfig"],
    "pipeline.algorithms.cql": ["CQL", "CQLConfig"],
    "pipeline.algorithms.dqn": ["DQN", "DQNConfig"],
    "pipeline.algorithms.impala": ["IMPALA", "IMPALAConfig"],
    "pipeline.algorithms.marwil": ["MARWIL", "MARWILConfig"],
    "pipeline.algorithms.ppo": ["PPO", "PPOConfig"],
    "pipeline.algorithms.sac": ["SAC", "SACConfig"],
    "actors.env.atari": ["make_atari"],
    "actors.env.multi_agent_env": ["MultiAgentEnv", "make_multi_agent"],
    "actors.env.pettingzoo_env": ["ParallelPettingZooEnv", "PettingZooEnv"],
    "actors.env.task_settable": ["TaskSettableEnv"],
    "actors.env.vector_env": ["EnvContext"],
    "pipeline.callbacks": ["CallbackError", "Callbacks", "DefaultCallbacks", "MemoryTrackingCallbacks",
                           "RLlibCallback", "make_multi_callbacks"],
    "pipeline.checkpoints.errors": ["CheckpointError"],
    "pipeline.config.base": ["AlgorithmConfig", "ConfigError"],
    "pipeline.config.multi_agent": ["PolicySpec"],
    "pipeline.config.multi_agent_plan": ["MultiAgentPlan", "multi_agent_plan"],
    "protocols.multi_agent_episode_checks": ["MappingError"],
    "actors.modules.rl_module_spec": ["MultiRLModuleSpec", "RLModuleSpec"],
    "pipeline.groups.env_runners": ["SingleAgentEnvRunner"],
    "pipeline.envs": ["register_env"],
    "pipeline.groups.evaluation": ["collect_episodes", "summarize_episodes"],
    "pipeline.registry": ["get_algorithm", "register_algorithm"],
}


def _register_builtins(name: str) -> None:
    if name in _REGISTERING:
        importlib.import_module("pipeline.registry").register_builtins()


_REGISTERING = {"Algorithm", "get_algorithm", "register_algorithm"} | {
    name for module, names in _HOMES.items() if module.startswith("pipeline.algorithms.") for name in names}

__getattr__, __dir__, __all__ = lazy_exports(
    __name__, _HOMES, renamed={"DefaultModelConfig": ("actors.modules", "ModelConfig")}, before=_register_builtins)
