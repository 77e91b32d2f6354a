"""The module catalogue: RLModule (the interface), ActorCriticModule (PPO, IMPALA, APPO), QModule
(DQN), SACModule (SAC), MultiRLModule (modules keyed by module id), ModuleSpec (how a stage builds
its copy), RLModuleSpec/MultiRLModuleSpec (RLlib's names for what a user chooses per module)."""
from actors.modules.actor_critic import ActorCriticModule
from actors.modules.encoders import ModelConfig
from actors.modules.multi import MultiRLModule
from actors.modules.q_module import QModule
from actors.modules.rl_module import RLModule, to_torch
from actors.modules.sac_module import SACModule
from actors.modules.rl_module_spec import MultiRLModuleSpec, RLModuleSpec
from actors.modules.spec import ModuleSpec

__all__ = ["ActorCriticModule", "ModelConfig", "ModuleSpec", "MultiRLModule", "MultiRLModuleSpec", "QModule", "RLModule", "RLModuleSpec", "SACModule",
           "to_torch"]
