"""runnel's driver side and user API: configs, algorithms, checkpoints, the CLI."""
from pipeline.algorithm import Algorithm
from pipeline.algorithms.appo import APPO, APPOConfig
from pipeline.algorithms.bc import BC, BCConfig
from pipeline.algorithms.cql import CQL, CQLConfig
from pipeline.algorithms.dqn import DQN, DQNConfig
from pipeline.algorithms.impala import IMPALA, IMPALAConfig
from pipeline.algorithms.marwil import MARWIL, MARWILConfig
from pipeline.algorithms.ppo import PPO, PPOConfig
from pipeline.algorithms.sac import SAC, SACConfig
from actors.env.atari import make_atari
from actors.env.multi_agent_env import MultiAgentEnv, make_multi_agent
from actors.env.pettingzoo_env import ParallelPettingZooEnv, PettingZooEnv
from actors.env.task_settable import TaskSettableEnv
from actors.env.vector_env import EnvContext
from pipeline.callbacks import (CallbackError, Callbacks, DefaultCallbacks, MemoryTrackingCallbacks, RLlibCallback,
                                make_multi_callbacks)
from pipeline.checkpoints.directory import CheckpointError
from pipeline.config.base import AlgorithmConfig, ConfigError
from pipeline.config.multi_agent import PolicySpec
from pipeline.config.multi_agent_plan import MultiAgentPlan, multi_agent_plan
from actors.modules.rl_module_spec import MultiRLModuleSpec, RLModuleSpec
from actors.modules import ModelConfig as DefaultModelConfig
from pipeline.groups.env_runners import SingleAgentEnvRunner
from pipeline.envs import register_env
from pipeline.groups.evaluation import collect_episodes, summarize_episodes
from pipeline.registry import get_algorithm, register_algorithm

__all__ = ["APPO", "APPOConfig", "Algorithm", "AlgorithmConfig", "BC", "BCConfig", "CQL", "CQLConfig", "MARWIL", "MARWILConfig", "CallbackError", "Callbacks", "CheckpointError",
           "ConfigError", "DQN", "DefaultModelConfig", "DQNConfig", "DefaultCallbacks", "EnvContext", "IMPALA", "IMPALAConfig", "MemoryTrackingCallbacks", "MultiAgentEnv",
           "MultiAgentPlan", "MultiRLModuleSpec", "ParallelPettingZooEnv", "PettingZooEnv", "PPO", "PolicySpec", "RLModuleSpec", "multi_agent_plan",
           "PPOConfig", "RLlibCallback", "SAC", "SingleAgentEnvRunner", "SACConfig", "TaskSettableEnv", "collect_episodes", "get_algorithm",
           "make_atari", "make_multi_agent", "make_multi_callbacks", "register_algorithm", "register_env", "summarize_episodes"]
