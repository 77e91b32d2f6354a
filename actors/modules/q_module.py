"""QModule: action values for DQN -- Discrete actions, or MultiDiscrete as one branch per component.

``forward_inference`` returns the (expected) Q-values as ``action_dist_inputs``, so the greedy
action is the distribution's ``deterministic()`` (argmax per branch) and an exploration piece
(epsilon-greedy) decides when to act at random instead. Options: a dueling head (a state value
shared by every branch plus mean-centred advantages, Wang et al. 2016) and distributional atoms
(C51, Bellemare et al. 2017: ``num_atoms`` logits per action over ``[v_min, v_max]``). MultiDiscrete
branches follow action-branching networks (Tavakoli et al. 2018): each branch has its own
advantages and is trained against its own target. The target network is a full copy kept by the
learner; runners carry the same network. Action masks in the observations: acting, illegal actions
get the lowest Q-value (never greedy); ``forward_train`` hands the mask on as ``action_mask`` for
the loss's bootstrap (``actors.modules.action_mask``).
"""
from __future__ import annotations

from typing import Any

import gymnasium as gym
import torch

from actors.modules.encoders import ModelConfig, build_encoder, head, mlp
from actors.modules.rl_module import RLModule


class QModule(RLModule):
    def __init__(self, observation_space: gym.Space, action_space: gym.Space,
                 model_config: dict[str, Any] | ModelConfig | None = None, inference_only: bool = False, *,
                 dueling: bool = True, num_atoms: int = 1, v_min: float = -10.0, v_max: float = 10.0) -> None:
        super().__init__(observation_space, action_space, model_config, inference_only)
        spec = self.dist_spec
        if spec.kind not in ("categorical", "multi_categorical"):
            raise ValueError(f"DQN needs Discrete or MultiDiscrete actions, got {action_space}; "
                             f"for Box actions use SAC")
        self.branches = [spec.input_dim] if spec.kind == "categorical" else list(spec.nvec)
        if num_atoms > 1 and len(self.branches) > 1:
            raise ValueError(f"distributional DQN (num_atoms={num_atoms}) supports Discrete actions only, "
                             f"got {action_space}; set num_atoms=1")
        self.dueling, self.num_atoms = dueling, num_atoms
        cfg = self.config
        self.encoder = build_encoder(self.encoder_space, cfg)
        self.trunk, dim = mlp(self.encoder.out_dim, cfg.trunk_hiddens(self.encoder), cfg.fcnet_activation)
        self.advantage = head(dim, sum(self.branches) * num_atoms, gain=1.0)
        if dueling:
            self.value = head(dim, num_atoms, gain=1.0)
        if num_atoms > 1:
            self.register_buffer("support", torch.linspace(v_min, v_max, num_atoms))

    def branch_logits(self, obs: Any) -> list[torch.Tensor]:
        """Per branch: Q-values ``[B, n]``, or atom logits ``[B, n, atoms]`` when distributional
        (unmasked; ``obs`` without the action mask)."""
        feats = self.trunk(self.encoder(obs))
        batch, atoms = feats.shape[0], self.num_atoms
        adv = self.advantage(feats).view(batch, -1, atoms)
        out = []
        for a in torch.split(adv, self.branches, dim=1):
            if self.dueling:
                a = self.value(feats).view(batch, 1, atoms) + a - a.mean(dim=1, keepdim=True)
            out.append(a if atoms > 1 else a.squeeze(-1))
        return out

    def q_values(self, branch_logits: list[torch.Tensor]) -> torch.Tensor:
        """Expected Q-values of every branch, concatenated ``[B, sum(n)]``."""
        if self.num_atoms == 1:
            return torch.cat(branch_logits, dim=-1)
        return torch.cat([(b.softmax(-1) * self.support).sum(-1) for b in branch_logits], dim=-1)

    def forward_inference(self, obs: Any) -> dict[str, torch.Tensor]:
        obs, mask = self.split_mask(obs)
        return {"action_dist_inputs": self.mask_outputs(self.q_values(self.branch_logits(obs)), mask, True)}

    def forward_train(self, obs: Any) -> dict[str, Any]:
        obs, mask = self.split_mask(obs)
        logits = self.branch_logits(obs)
        out = {"branch_logits": logits, "q_values": self.q_values(logits)}
        if mask is not None:
            out["action_mask"] = mask
        return out

