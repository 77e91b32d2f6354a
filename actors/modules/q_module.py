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

Recurrent (``model_config`` ``use_lstm``, R2D2: Kapturowski et al. 2019): an LSTM between the trunk and
the heads; ``forward_inference`` then takes and returns the states ``[B, 2, cell]`` as the actor-critic
module's do, and ``forward_sequences`` unrolls ``B`` stored sequences from their start states.
"""
from __future__ import annotations

from typing import Any

import gymnasium as gym
import numpy as np
import torch
from torch import nn

from actors.modules.encoders import ModelConfig, build_encoder, head, mlp
from actors.modules.recurrent import unroll, zero_states
from actors.modules.rl_module import RLModule
from protocols import nested


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
        self.lstm: nn.LSTM | None = None
        if cfg.use_lstm:
            if num_atoms > 1:
                raise ValueError(f"a recurrent DQN module (use_lstm=True) has one Q-value per action; "
                                 f"num_atoms={num_atoms} is not supported with it: set num_atoms=1")
            self.lstm = nn.LSTM(dim, cfg.lstm_cell_size, batch_first=True)
            dim = cfg.lstm_cell_size
        self.advantage = head(dim, sum(self.branches) * num_atoms, gain=1.0)
        if dueling:
            self.value = head(dim, num_atoms, gain=1.0)
        if num_atoms > 1:
            self.register_buffer("support", torch.linspace(v_min, v_max, num_atoms))

    def branch_logits(self, obs: Any) -> list[torch.Tensor]:
        """Per branch: Q-values ``[B, n]``, or atom logits ``[B, n, atoms]`` when distributional
        (unmasked; ``obs`` without the action mask)."""
        if self.lstm is not None:
            raise RuntimeError("a recurrent module needs its states: forward_inference(obs, state) or "
                               "forward_sequences(obs, state_in)")
        return self.heads(self.trunk(self.encoder(obs)))

    def heads(self, feats: torch.Tensor) -> list[torch.Tensor]:
        """``branch_logits`` from the trunk's (or the LSTM's) features ``[B, dim]``."""
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

    def forward_inference(self, obs: Any, state: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
        """Q-values as ``action_dist_inputs``; a recurrent module also takes the states ``[B, 2, cell]``
        (None: fresh ones) and returns the next ones as ``state_out``."""
        obs, mask = self.split_mask(obs)
        if self.lstm is None:
            return {"action_dist_inputs": self.mask_outputs(self.q_values(self.branch_logits(obs)), mask, True)}
        out, state_out = unroll(self.lstm, self.trunk(self.encoder(obs)).unsqueeze(1), state)
        return {"action_dist_inputs": self.mask_outputs(self.q_values(self.heads(out[:, 0])), mask, True),
                "state_out": state_out}

    def forward_exploration(self, obs: Any, state: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
        return self.forward_inference(obs, state)

    # --- recurrent (model_config use_lstm) -----------------------------------------------------
    @property
    def is_recurrent(self) -> bool:
        return self.lstm is not None

    def initial_state(self, n: int) -> np.ndarray:
        """``n`` fresh recurrent states ``[n, 2, cell]`` (hidden and cell state, zeros), float32."""
        return zero_states(n, self.config.lstm_cell_size)

    def forward_sequences(self, obs: Any, state_in: torch.Tensor, lengths: torch.Tensor | None = None
                          ) -> dict[str, Any]:
        """``B`` sequences of ``T`` steps, ``obs`` ``[B, T, ...]``, unrolled from ``state_in`` ``[B, 2, cell]``:
        ``branch_logits`` (per branch ``[B, T, n]``), ``q_values`` ``[B, T, sum(n)]``, ``state_out`` (after
        step T, or with ``lengths`` after each sequence's last real step) and, with action masks,
        ``action_mask`` ``[B, T, n]``."""
        if self.lstm is None:
            raise RuntimeError("forward_sequences is for recurrent modules (model_config use_lstm=True)")
        first = nested.first_leaf(obs)
        b, t = first.shape[0], first.shape[1]
        flat, mask = self.split_mask(nested.map_structure(lambda a: a.reshape(b * t, *a.shape[2:]), obs))
        feats = self.trunk(self.encoder(flat)).reshape(b, t, -1)
        out, state_out = unroll(self.lstm, feats, state_in, lengths)
        logits = self.heads(out.reshape(b * t, -1))
        result = {"branch_logits": [q.reshape(b, t, *q.shape[1:]) for q in logits],
                  "q_values": self.q_values(logits).reshape(b, t, -1), "state_out": state_out}
        if mask is not None:
            result["action_mask"] = mask.reshape(b, t, *mask.shape[1:])
        return result

    def forward_train(self, obs: Any) -> dict[str, Any]:
        obs, mask = self.split_mask(obs)
        logits = self.branch_logits(obs)
        out = {"branch_logits": logits, "q_values": self.q_values(logits)}
        if mask is not None:
            out["action_mask"] = mask
        return out

