"""runnel's driver side and user API: configs, algorithms, checkpoints, the CLI."""
from pipeline.algorithm import Algorithm
from pipeline.algorithms.appo import APPO, APPOConfig
from pipeline.algorithms.dqn import DQN, DQNConfig
from pipeline.algorithms.impala import IMPALA, IMPALAConfig
from pipeline.algorithms.ppo import PPO, PPOConfig
from pipeline.algorithms.sac import SAC, SACConfig
from pipeline.callbacks import Callbacks
from pipeline.checkpoint import CheckpointError
from pipeline.config import AlgorithmConfig, ConfigError
from pipeline.envs import register_env
from pipeline.registry import get_algorithm, register_algorithm

__all__ = ["APPO", "APPOConfig", "Algorithm", "AlgorithmConfig", "Callbacks", "CheckpointError", "ConfigError",
           "DQN", "DQNConfig", "IMPALA", "IMPALAConfig", "PPO", "PPOConfig", "SAC", "SACConfig",
           "get_algorithm", "register_algorithm", "register_env"]
