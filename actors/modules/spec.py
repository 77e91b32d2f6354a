"""ModuleSpec: how to build a module, sent to every stage that carries one (runners build the
inference-only copy, learners the full module), so the class travels by reference, not by weights."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import gymnasium as gym

from actors.modules.actor_critic import ActorCriticModule
from actors.modules.rl_module import RLModule


@dataclass
class ModuleSpec:
    observation_space: gym.Space
    action_space: gym.Space
    model_config: dict[str, Any] = field(default_factory=dict)
    module_class: type[RLModule] = ActorCriticModule
    module_kwargs: dict[str, Any] = field(default_factory=dict)

    def build(self, inference_only: bool = False) -> RLModule:
        return self.module_class(self.observation_space, self.action_space, self.model_config,
                                 inference_only=inference_only, **self.module_kwargs)
