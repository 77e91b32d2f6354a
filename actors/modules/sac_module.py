"""SACModule: SAC's networks (Haarnoja et al., 2018) -- a tanh-squashed Gaussian actor, twin critics
Q(s, a) on an encoder of their own, and the learnable log-temperature ``log_alpha``.

Box actions live in the normalized range [-1, 1] (runners rescale them to the Box bounds). For a
``Discrete(n)`` action space (discrete SAC, Christodoulou 2019) the actor gives ``n`` logits of a
categorical policy and each critic gives Q(s, .) for all ``n`` actions at once, so the losses take
expectations over the policy's probabilities instead of reparameterized samples. The
inference-only copy that runners carry is the actor alone; the learner keeps a full target copy
whose critics follow by Polyak averaging.
"""
from __future__ import annotations

from typing import Any

import gymnasium as gym
import torch
from torch import nn

from actors.modules.distributions import ActionDistSpec
from actors.modules.encoders import ModelConfig, build_encoder, head, mlp
from actors.modules.rl_module import RLModule


class SACModule(RLModule):
    """SAC's networks: a squashed-Gaussian actor, twin critics Q(s, a) on their own encoder, and the
    learnable log-temperature ``log_alpha``. The inference-only copy runners carry is the actor alone."""

    train_only_prefixes = ("q_encoder.", "qf1.", "qf2.", "log_alpha")

    def __init__(self, observation_space: gym.Space, action_space: gym.Space,
                 model_config: dict[str, Any] | ModelConfig | None = None, inference_only: bool = False, *,
                 initial_alpha: float = 1.0) -> None:
        super().__init__(observation_space, action_space, model_config, inference_only)
        self.dist_spec = ActionDistSpec(action_space, squashed=True)
        if self.dist_spec.kind not in ("squashed_gaussian", "categorical"):
            raise ValueError(f"SAC needs a 1-d Box or a Discrete action space, got {action_space}; flatten "
                             f"the action space in a wrapper, or use PPO or DQN for it")
        self.discrete = self.dist_spec.kind == "categorical"
        """Discrete(n) actions: a categorical actor and critics that give Q(s, .) for every action."""
        cfg = self.config
        act_dim = self.dist_spec.input_dim if self.discrete else self.dist_spec.input_dim // 2
        self.encoder = build_encoder(observation_space, cfg)
        self.pi_trunk, dim = mlp(self.encoder.out_dim, cfg.trunk_hiddens(self.encoder), cfg.fcnet_activation)
        self.pi_head = head(dim, self.dist_spec.input_dim, gain=0.01)
        if not inference_only:
            self.q_encoder = build_encoder(observation_space, cfg)
            q_in, q_out = (self.q_encoder.out_dim, act_dim) if self.discrete else (self.q_encoder.out_dim + act_dim, 1)
            self.qf1, self.qf2 = (self._critic(q_in, q_out) for _ in range(2))
            self.log_alpha = nn.Parameter(torch.tensor(float(initial_alpha)).log())

    def _critic(self, in_dim: int, out_dim: int) -> nn.Sequential:
        # Box actions: features and action side by side, with hidden layers even after a CNN, or Q would be
        # linear in the action; Discrete: the features alone, one output per action
        trunk, dim = mlp(in_dim, self.config.trunk_hiddens(None), self.config.fcnet_activation)
        return nn.Sequential(trunk, head(dim, out_dim, gain=1.0))

    def forward_inference(self, obs: Any) -> dict[str, torch.Tensor]:
        return {"action_dist_inputs": self.pi_head(self.pi_trunk(self.encoder(obs)))}

    def forward_train(self, obs: Any) -> dict[str, torch.Tensor]:
        return self.forward_inference(obs)

    def q_values(self, obs: Any, actions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Both critics' Q(s, a): for Box actions in the normalized range [-1, 1], for Discrete ones the
        taken actions' entries of ``all_q_values``."""
        if self.discrete:
            index = actions.long().unsqueeze(-1)
            q1, q2 = self.all_q_values(obs)
            return q1.gather(-1, index).squeeze(-1), q2.gather(-1, index).squeeze(-1)
        x = torch.cat([self.q_encoder(obs), actions], dim=-1)
        return self.qf1(x).squeeze(-1), self.qf2(x).squeeze(-1)

    def all_q_values(self, obs: Any) -> tuple[torch.Tensor, torch.Tensor]:
        """Discrete actions: both critics' Q(s, .), ``[batch, n]`` each."""
        if not self.discrete:
            raise ValueError(f"all_q_values is for Discrete action spaces; this module's is {self.dist_spec.space}")
        x = self.q_encoder(obs)
        return self.qf1(x), self.qf2(x)

    def actor_parameters(self) -> list[nn.Parameter]:
        return [p for n, p in self.named_parameters() if n.startswith(("encoder.", "pi_trunk.", "pi_head."))]

    def critic_parameters(self) -> list[nn.Parameter]:
        return [p for n, p in self.named_parameters() if n.startswith(("q_encoder.", "qf1.", "qf2."))]
