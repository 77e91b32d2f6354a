"""RLModule: what every policy network offers the stages that carry it.

Env runners call ``forward_exploration``/``forward_inference`` on an inference-only copy;
learners call ``forward_train`` on the full module. Weights travel as ``{name: numpy array}``
(``get_state``/``set_state``), which Ray broadcasts with one ``ray.put`` and a checkpoint stores.
A subclass lists in ``train_only_prefixes`` the parameters an inference-only copy leaves out
(value heads, critics, target networks' sources), so runners hold and receive only what they use.
Observations with an ``"action_mask"`` key are split here (``split_mask``/``mask_outputs``, see
``actors.modules.action_mask``): a subclass builds its encoder on ``encoder_space``.
"""
from __future__ import annotations

from typing import Any, ClassVar

import gymnasium as gym
import numpy as np
import torch
from torch import nn

from actors.modules.action_mask import masking_for
from actors.modules.distributions import ActionDistSpec
from actors.modules.encoders import ModelConfig
from protocols import nested


class RLModule(nn.Module):
    train_only_prefixes: ClassVar[tuple[str, ...]] = ()
    """State-dict prefixes that exist only in the full (learner) module."""

    def __init__(self, observation_space: gym.Space, action_space: gym.Space,
                 model_config: dict[str, Any] | ModelConfig | None = None, inference_only: bool = False) -> None:
        super().__init__()
        self.config = model_config if isinstance(model_config, ModelConfig) else ModelConfig.from_dict(model_config)
        self.observation_space = observation_space
        self.action_space = action_space
        self.inference_only = inference_only
        self.dist_spec = ActionDistSpec(action_space)
        self.masking = masking_for(observation_space, self.dist_spec)
        self.encoder_space = observation_space if self.masking is None else self.masking.features_space
        """The observation space without the action mask: what the encoder sees."""

    # --- forward passes: a subclass implements these ----------------------------------------
    def forward_inference(self, obs: Any) -> dict[str, torch.Tensor]:
        """Greedy acting: at least ``action_dist_inputs``."""
        raise NotImplementedError

    def forward_exploration(self, obs: Any) -> dict[str, torch.Tensor]:
        """Acting while training: at least ``action_dist_inputs`` (default: as inference)."""
        return self.forward_inference(obs)

    def forward_train(self, obs: Any) -> dict[str, torch.Tensor]:
        """What the loss needs (action_dist_inputs, values...); not available inference-only."""
        raise NotImplementedError

    def split_mask(self, obs: Any) -> tuple[Any, torch.Tensor | None]:
        """(the encoder's part of ``obs``, its action mask as bools ``[B, n]`` or None)."""
        return (obs, None) if self.masking is None else self.masking.split(obs)

    def mask_outputs(self, inputs: torch.Tensor, mask: torch.Tensor | None, acting: bool) -> torch.Tensor:
        """Logits or Q-values ``[B, n]`` with illegal actions at the dtype's minimum (``acting``: a row
        with no legal action raises; else it stays unmasked)."""
        return inputs if mask is None else self.masking.apply(inputs, mask, acting)

    def action_dist(self, dist_inputs: torch.Tensor):
        return self.dist_spec.build(dist_inputs)

    # --- state ----------------------------------------------------------------------------
    def get_state(self, inference_only: bool = False) -> dict[str, np.ndarray]:
        """Weights as numpy arrays (codec- and ``ray.put``-friendly)."""
        # copies: a snapshot must not change as training goes on (.numpy() aliases CPU parameters)
        state = {k: v.detach().cpu().numpy().copy() for k, v in self.state_dict().items()}
        if inference_only:
            state = {k: v for k, v in state.items() if not k.startswith(self.train_only_prefixes)}
        return state

    def set_state(self, state: dict[str, Any]) -> None:
        own = self.state_dict()
        missing = [k for k in own if k not in state]
        if missing:
            raise ValueError(f"module state lacks {missing[:5]}{'...' if len(missing) > 5 else ''}: "
                             f"was it saved from another model config?")
        with torch.no_grad():
            for k, t in own.items():
                v = state[k]
                t.copy_(v if isinstance(v, torch.Tensor) else torch.from_numpy(np.array(v, copy=True)))


def to_torch(obs: Any, device: torch.device | str = "cpu") -> Any:
    """Nested numpy -> nested torch tensors (no copy on CPU where the dtype allows)."""
    return nested.map_structure(lambda a: torch.as_tensor(a, device=device), obs)
