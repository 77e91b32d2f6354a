"""The default module of the policy-gradient algorithms: an observation encoder, a policy head and
(unless inference-only) a value head, on one shared or two separate MLP trunks. Action masks in the
observations set the logits of illegal actions to the minimum (``actors.modules.action_mask``)."""
from __future__ import annotations

from typing import Any

import gymnasium as gym
import numpy as np
import torch
from torch import nn

from actors.modules.distributions import apply_log_std_init
from actors.modules.encoders import ModelConfig, build_encoder, head, mlp
from actors.modules.normalizers import ReturnNormalizer
from actors.modules.recurrent import unroll, zero_states
from actors.modules.rl_module import RLModule
from protocols import nested


class ActorCriticModule(RLModule):
    """``forward_inference`` gives the action distribution inputs; ``forward_train`` adds the value
    predictions. The inference-only copy that env runners carry has no value trunk or head."""

    train_only_prefixes = ("vf_trunk.", "vf_head.", "return_normalizer.")

    def __init__(self, observation_space: gym.Space, action_space: gym.Space,
                 model_config: dict[str, Any] | ModelConfig | None = None, inference_only: bool = False) -> None:
        super().__init__(observation_space, action_space, model_config, inference_only)
        cfg = self.config
        self.encoder = build_encoder(self.encoder_space, cfg)
        feat, hiddens = self.encoder.out_dim, cfg.trunk_hiddens(self.encoder)
        self.pi_trunk, pi_dim = mlp(feat, hiddens, cfg.fcnet_activation)
        self.lstm: nn.LSTM | None = None
        if cfg.use_lstm:  # trunk -> LSTM -> both heads
            self.lstm = nn.LSTM(pi_dim, cfg.lstm_cell_size, batch_first=True)
            pi_dim = cfg.lstm_cell_size
        self.pi_head = head(pi_dim, self.dist_spec.input_dim, gain=0.01)
        apply_log_std_init(self.pi_head.bias, self.dist_spec, cfg.log_std_init)
        self.return_normalizer: ReturnNormalizer | None = None
        if not inference_only:
            if cfg.vf_share_layers:
                self.vf_trunk, vf_dim = None, pi_dim
            else:  # with an LSTM: its own trunk on the features and the LSTM's (detached) output
                self.vf_trunk, vf_dim = mlp(feat + (cfg.lstm_cell_size if cfg.use_lstm else 0), hiddens,
                                            cfg.fcnet_activation)
            self.vf_head = head(vf_dim, 1, gain=1.0)
            # normalize_returns: the head learns standardised targets; vf_preds are turned back into returns
            self.return_normalizer = ReturnNormalizer() if cfg.normalize_returns else None

    # --- recurrent (model_config use_lstm) -----------------------------------------------------
    @property
    def is_recurrent(self) -> bool:
        return self.lstm is not None

    def initial_state(self, n: int) -> np.ndarray:
        """``n`` fresh recurrent states ``[n, 2, cell]`` (hidden and cell state, zeros), float32."""
        return zero_states(n, self.config.lstm_cell_size)

    def _step_features(self, obs: Any) -> tuple[torch.Tensor, torch.Tensor | None]:
        obs, mask = self.split_mask(obs)
        return self.pi_trunk(self.encoder(obs)), mask

    def forward_inference(self, obs: Any, state: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
        """``action_dist_inputs`` for a batch of observations; a recurrent module also takes the batch's
        states ``[B, 2, cell]`` (None: fresh ones) and returns the next ones as ``state_out``."""
        feats, mask = self._step_features(obs)
        if self.lstm is None:
            return {"action_dist_inputs": self.mask_outputs(self.pi_head(feats), mask, True)}
        out, state_out = unroll(self.lstm, feats.unsqueeze(1), state)
        return {"action_dist_inputs": self.mask_outputs(self.pi_head(out[:, 0]), mask, True), "state_out": state_out}

    def forward_exploration(self, obs: Any, state: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
        return self.forward_inference(obs, state)

    def forward_sequences(self, obs: Any, state_in: torch.Tensor) -> dict[str, torch.Tensor]:
        """A recurrent module over ``B`` sequences of ``T`` steps: ``obs`` ``[B, T, ...]``, ``state_in``
        ``[B, 2, cell]`` at each sequence's start -> ``action_dist_inputs`` ``[B, T, ...]`` and (the full
        module) ``vf_preds`` ``[B, T]``."""
        if self.lstm is None:
            raise RuntimeError("forward_sequences is for recurrent modules (model_config use_lstm=True)")
        first = nested.first_leaf(obs)
        b, t = first.shape[0], first.shape[1]
        flat = nested.map_structure(lambda a: a.reshape(b * t, *a.shape[2:]), obs)
        obs_part, mask = self.split_mask(flat)
        feats = self.encoder(obs_part)
        out, _ = unroll(self.lstm, self.pi_trunk(feats).reshape(b, t, -1), state_in)
        out = out.reshape(b * t, -1)
        dist_inputs = self.mask_outputs(self.pi_head(out), mask, False)
        result = {"action_dist_inputs": dist_inputs.reshape(b, t, *dist_inputs.shape[1:])}
        if not self.inference_only:
            # vf_share_layers: the value head sits on the LSTM, whose training the value loss shares. Else the
            # value has a trunk of its own that reads the LSTM's memory without training it: value errors,
            # large where returns are, would otherwise swamp what the policy needs the memory for
            vf_in = out if self.vf_trunk is None else self.vf_trunk(torch.cat([feats, out.detach()], -1))
            result["vf_preds"] = self._values(self.vf_head(vf_in)).reshape(b, t)
        return result

    def forward_train(self, obs: Any) -> dict[str, torch.Tensor]:
        if self.lstm is not None:
            raise RuntimeError("a recurrent module trains on sequences: forward_sequences(obs, state_in)")
        if self.inference_only:
            raise RuntimeError("an inference-only module has no value head; build it with inference_only=False")
        obs, mask = self.split_mask(obs)
        feats = self.encoder(obs)
        pi_out = self.pi_trunk(feats)
        vf_in = pi_out if self.vf_trunk is None else self.vf_trunk(feats)
        return {"action_dist_inputs": self.mask_outputs(self.pi_head(pi_out), mask, False),
                "vf_preds": self._values(self.vf_head(vf_in)).squeeze(-1)}

    def _values(self, head_out: torch.Tensor) -> torch.Tensor:
        return head_out if self.return_normalizer is None else self.return_normalizer.denormalize(head_out)

    def compute_values(self, obs: Any) -> torch.Tensor:
        return self.forward_train(obs)["vf_preds"]
