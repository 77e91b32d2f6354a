"""The default RLModule: an observation encoder, a policy head and (unless inference-only) a value head.

Observations of any supported gymnasium space are turned into one float vector: Box leaves are
flattened, Discrete/MultiDiscrete leaves one-hot encoded, MultiBinary leaves cast to float, and
nested Dict/Tuple spaces concatenated in sorted-key order. A single image-shaped Box
(``(H, W, C)``) goes through a CNN instead.
"""
from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Any

import gymnasium as gym
import numpy as np
import torch
from torch import nn

from actors.distributions import ActionDistSpec, apply_log_std_init
from protocols import nested

ACTIVATIONS = {"tanh": nn.Tanh, "relu": nn.ReLU, "elu": nn.ELU, "silu": nn.SiLU, "swish": nn.SiLU, "linear": nn.Identity}


@dataclass
class ModelConfig:
    """Settings of the default module (``config.rl_module(model_config={...})``)."""

    fcnet_hiddens: list[int] = field(default_factory=lambda: [64, 64])
    """Sizes of the hidden layers of the MLP (policy and value trunks)."""
    fcnet_activation: str = "tanh"
    """Activation of the MLP: tanh, relu, elu, silu/swish or linear."""
    vf_share_layers: bool = False
    """Share the encoder between policy and value head (one trunk) instead of two trunks."""
    conv_filters: list[list[int]] | None = None
    """CNN layers as ``[out_channels, kernel, stride]`` for image observations; None = Nature-DQN layout."""
    conv_activation: str = "relu"
    """Activation of the CNN layers."""
    log_std_init: float = 0.0
    """Initial log standard deviation of Gaussian (Box) action distributions."""

    @classmethod
    def from_dict(cls, d: dict[str, Any] | None) -> "ModelConfig":
        d = dict(d or {})
        valid = [f.name for f in fields(cls)]
        unknown = sorted(set(d) - set(valid))
        if unknown:
            raise ValueError(f"unknown model_config key(s) {unknown}; valid keys: {valid}")
        for key in ("fcnet_activation", "conv_activation"):
            if key in d and d[key] not in ACTIVATIONS:
                raise ValueError(f"model_config[{key!r}]={d[key]!r} is not one of {sorted(ACTIVATIONS)}")
        return cls(**d)


def _is_image(space: gym.Space) -> bool:
    return isinstance(space, gym.spaces.Box) and len(space.shape) == 3 and min(space.shape[:2]) >= 16


class ObsEncoder(nn.Module):
    """Nested observation (torch tensors with a batch dim) -> one float feature vector per row."""

    SUPPORTED = "Box, Discrete, MultiDiscrete, MultiBinary, and Dict/Tuple of these"

    def __init__(self, space: gym.Space) -> None:
        super().__init__()
        self.leaves = self._leaf_specs(space)
        self.out_dim = sum(dim for _, dim in self.leaves)

    @classmethod
    def _leaf_specs(cls, space: gym.Space) -> list[tuple[Any, int]]:
        if isinstance(space, gym.spaces.Dict):
            return [leaf for k in sorted(space.spaces) for leaf in cls._leaf_specs(space.spaces[k])]
        if isinstance(space, gym.spaces.Tuple):
            return [leaf for s in space.spaces for leaf in cls._leaf_specs(s)]
        if isinstance(space, gym.spaces.Box):
            return [("box", int(np.prod(space.shape)))]
        if isinstance(space, gym.spaces.Discrete):
            return [(("onehot", [int(space.n)], int(space.start)), int(space.n))]
        if isinstance(space, gym.spaces.MultiDiscrete):
            nvec = [int(n) for n in np.asarray(space.nvec).ravel()]
            return [(("onehot", nvec, 0), sum(nvec))]
        if isinstance(space, gym.spaces.MultiBinary):
            return [("box", int(np.prod(space.shape)))]
        raise ValueError(f"runnel's default module cannot encode observations of {space}; supported: {cls.SUPPORTED}")

    def forward(self, obs: Any) -> torch.Tensor:
        parts = []
        for (kind, _), leaf in zip(self.leaves, nested.flatten(obs)):
            batch = leaf.shape[0]
            if kind == "box":
                parts.append(leaf.reshape(batch, -1).float())
            else:
                _, nvec, start = kind
                idx = (leaf.reshape(batch, -1).long() - start).clamp_(min=0)
                parts.extend(
                    nn.functional.one_hot(idx[:, i].clamp(max=n - 1), n).float() for i, n in enumerate(nvec)
                )
        return parts[0] if len(parts) == 1 else torch.cat(parts, -1)


class CNNEncoder(nn.Module):
    def __init__(self, space: gym.spaces.Box, cfg: ModelConfig) -> None:
        super().__init__()
        h, w, c = space.shape
        filters = cfg.conv_filters or [[32, 8, 4], [64, 4, 2], [64, 3, 1]]
        act = ACTIVATIONS[cfg.conv_activation]
        layers: list[nn.Module] = []
        for out, kernel, stride in filters:
            layers += [nn.Conv2d(c, out, kernel, stride), act()]
            c = out
        self.net = nn.Sequential(*layers, nn.Flatten())
        self.scale = 1.0 / 255.0 if space.dtype == np.uint8 else 1.0
        with torch.no_grad():
            self.out_dim = int(self.net(torch.zeros(1, space.shape[2], h, w)).shape[-1])

    def forward(self, obs: torch.Tensor) -> torch.Tensor:
        return self.net(obs.permute(0, 3, 1, 2).float() * self.scale)


def _mlp(in_dim: int, hiddens: list[int], activation: str) -> tuple[nn.Sequential, int]:
    layers: list[nn.Module] = []
    for h in hiddens:
        layer = nn.Linear(in_dim, h)
        nn.init.orthogonal_(layer.weight, gain=np.sqrt(2))
        nn.init.zeros_(layer.bias)
        layers += [layer, ACTIVATIONS[activation]()]
        in_dim = h
    return nn.Sequential(*layers), in_dim


def _head(in_dim: int, out_dim: int, gain: float) -> nn.Linear:
    layer = nn.Linear(in_dim, out_dim)
    nn.init.orthogonal_(layer.weight, gain=gain)
    nn.init.zeros_(layer.bias)
    return layer


class RLModule(nn.Module):
    """Policy (and value function) for one agent.

    ``forward_inference`` / ``forward_exploration`` return the action distribution inputs;
    ``forward_train`` adds the value predictions. ``inference_only=True`` builds the copy that env
    runners carry: no value trunk or head, and ``set_state`` ignores their weights.
    """

    def __init__(
        self,
        observation_space: gym.Space,
        action_space: gym.Space,
        model_config: dict[str, Any] | ModelConfig | None = None,
        inference_only: bool = False,
    ) -> None:
        super().__init__()
        cfg = model_config if isinstance(model_config, ModelConfig) else ModelConfig.from_dict(model_config)
        self.config = cfg
        self.observation_space = observation_space
        self.action_space = action_space
        self.inference_only = inference_only
        self.dist_spec = ActionDistSpec(action_space)
        self.encoder: nn.Module = CNNEncoder(observation_space, cfg) if _is_image(observation_space) else ObsEncoder(observation_space)
        feat = self.encoder.out_dim
        self.pi_trunk, pi_dim = _mlp(feat, cfg.fcnet_hiddens, cfg.fcnet_activation)
        self.pi_head = _head(pi_dim, self.dist_spec.input_dim, gain=0.01)
        apply_log_std_init(self.pi_head.bias, self.dist_spec, cfg.log_std_init)
        if not inference_only:
            if cfg.vf_share_layers:
                self.vf_trunk, vf_dim = None, pi_dim
            else:
                self.vf_trunk, vf_dim = _mlp(feat, cfg.fcnet_hiddens, cfg.fcnet_activation)
            self.vf_head = _head(vf_dim, 1, gain=1.0)

    # --- forward passes -------------------------------------------------------------------
    def forward_inference(self, obs: Any) -> dict[str, torch.Tensor]:
        return {"action_dist_inputs": self.pi_head(self.pi_trunk(self.encoder(obs)))}

    forward_exploration = forward_inference

    def forward_train(self, obs: Any) -> dict[str, torch.Tensor]:
        if self.inference_only:
            raise RuntimeError("an inference-only module has no value head; build it with inference_only=False")
        feats = self.encoder(obs)
        pi_out = self.pi_trunk(feats)
        vf_in = pi_out if self.vf_trunk is None else self.vf_trunk(feats)
        return {"action_dist_inputs": self.pi_head(pi_out), "vf_preds": self.vf_head(vf_in).squeeze(-1)}

    def compute_values(self, obs: Any) -> torch.Tensor:
        return self.forward_train(obs)["vf_preds"]

    def action_dist(self, dist_inputs: torch.Tensor):
        return self.dist_spec.build(dist_inputs)

    # --- state ----------------------------------------------------------------------------
    def get_state(self, inference_only: bool = False) -> dict[str, np.ndarray]:
        """Weights as numpy arrays (codec- and ``ray.put``-friendly)."""
        # copies: a snapshot must not change as training goes on (.numpy() aliases CPU parameters)
        state = {k: v.detach().cpu().numpy().copy() for k, v in self.state_dict().items()}
        if inference_only:
            state = {k: v for k, v in state.items() if not k.startswith(("vf_trunk.", "vf_head."))}
        return state

    def set_state(self, state: dict[str, Any]) -> None:
        own = self.state_dict()
        missing = [k for k in own if k not in state]
        if missing:
            raise ValueError(f"module state lacks {missing[:5]}{'...' if len(missing) > 5 else ''}: was it saved from another model config?")
        with torch.no_grad():
            for k, t in own.items():
                t.copy_(torch.from_numpy(np.array(state[k], copy=True)) if not isinstance(state[k], torch.Tensor) else state[k])


def to_torch(obs: Any, device: torch.device | str = "cpu") -> Any:
    """Nested numpy -> nested torch tensors (no copy on CPU where the dtype allows)."""
    return nested.map_structure(lambda a: torch.as_tensor(a, device=device), obs)
