"""The default module of the policy-gradient algorithms: an observation encoder, a policy head and
(unless inference-only) a value head, on one shared or two separate MLP trunks. Action masks in the
observations set the logits of illegal actions to the minimum (``actors.modules.action_mask``)."""
from __future__ import annotations

from typing import Any

import gymnasium as gym
import torch

from actors.modules.distributions import apply_log_std_init
from actors.modules.encoders import ModelConfig, build_encoder, head, mlp
from actors.modules.rl_module import RLModule


class ActorCriticModule(RLModule):
    """``forward_inference`` gives the action distribution inputs; ``forward_train`` adds the value
    predictions. The inference-only copy that env runners carry has no value trunk or head."""

    train_only_prefixes = ("vf_trunk.", "vf_head.")

    def __init__(self, observation_space: gym.Space, action_space: gym.Space,
                 model_config: dict[str, Any] | ModelConfig | None = None, inference_only: bool = False) -> None:
        super().__init__(observation_space, action_space, model_config, inference_only)
        cfg = self.config
        self.encoder = build_encoder(self.encoder_space, cfg)
        feat, hiddens = self.encoder.out_dim, cfg.trunk_hiddens(self.encoder)
        self.pi_trunk, pi_dim = mlp(feat, hiddens, cfg.fcnet_activation)
        self.pi_head = head(pi_dim, self.dist_spec.input_dim, gain=0.01)
        apply_log_std_init(self.pi_head.bias, self.dist_spec, cfg.log_std_init)
        if not inference_only:
            if cfg.vf_share_layers:
                self.vf_trunk, vf_dim = None, pi_dim
            else:
                self.vf_trunk, vf_dim = mlp(feat, hiddens, cfg.fcnet_activation)
            self.vf_head = head(vf_dim, 1, gain=1.0)

    def forward_inference(self, obs: Any) -> dict[str, torch.Tensor]:
        obs, mask = self.split_mask(obs)
        return {"action_dist_inputs": self.mask_outputs(self.pi_head(self.pi_trunk(self.encoder(obs))), mask, True)}

    def forward_train(self, obs: Any) -> dict[str, torch.Tensor]:
        if self.inference_only:
            raise RuntimeError("an inference-only module has no value head; build it with inference_only=False")
        obs, mask = self.split_mask(obs)
        feats = self.encoder(obs)
        pi_out = self.pi_trunk(feats)
        vf_in = pi_out if self.vf_trunk is None else self.vf_trunk(feats)
        return {"action_dist_inputs": self.mask_outputs(self.pi_head(pi_out), mask, False),
                "vf_preds": self.vf_head(vf_in).squeeze(-1)}

    def compute_values(self, obs: Any) -> torch.Tensor:
        return self.forward_train(obs)["vf_preds"]
