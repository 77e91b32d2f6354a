"""Building blocks every module shares: the model settings, observation encoders, MLP trunks, heads.

Observations of any supported gymnasium space are turned into one float vector: Box leaves are
flattened, Discrete/MultiDiscrete leaves one-hot encoded, MultiBinary leaves cast to float, and
nested Dict/Tuple spaces concatenated in sorted-key order. A single image-shaped Box
(``(H, W, C)``) goes through a CNN instead: by default the Nature CNN of DQN (Mnih et al. 2015) --
convolutions 32x8x8 stride 4, 64x4x4 stride 2, 64x3x3 stride 1, then one fully connected layer of
512, all ReLU -- with uint8 pixels scaled by 1/255 inside the module, so observations stay uint8 in
runners, chunks and batches (a quarter of float32's bytes). On images the MLP trunk after the
encoder is empty by default (``fcnet_hiddens=None``): the heads sit on the 512 features, as in the
paper. A new module (a Q network, SAC's actor and critics) is these pieces put together differently.
"""
from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Any

import gymnasium as gym
import numpy as np
import torch
from torch import nn

from actors.modules.normalizers import InputNormalizer
from protocols import nested

ACTIVATIONS = {"tanh": nn.Tanh, "relu": nn.ReLU, "elu": nn.ELU, "silu": nn.SiLU, "swish": nn.SiLU, "linear": nn.Identity}


@dataclass
class ModelConfig:
    """Settings of the default modules (``config.rl_module(model_config={...})``)."""

    fcnet_hiddens: list[int] | None = None
    """Sizes of the hidden layers of the MLP (policy and value trunks) after the encoder; None: [64, 64]
    on flat observations, none on images (the CNN ends in its own fully connected layers)."""
    fcnet_activation: str = "tanh"
    """Activation of the MLP: tanh, relu, elu, silu/swish or linear."""
    vf_share_layers: bool = False
    """Share the encoder between policy and value head (one trunk) instead of two trunks."""
    conv_filters: list[list[int]] | None = None
    """CNN layers as ``[out_channels, kernel, stride]`` for image observations; None = Nature-DQN layout."""
    conv_activation: str = "relu"
    """Activation of the CNN layers (and of its fully connected layers)."""
    conv_fc_hiddens: list[int] = field(default_factory=lambda: [512])
    """Fully connected layers that end the CNN, after its flatten (Nature CNN: one of 512)."""
    normalize_input: bool = False
    """Image observations only (runnel's, as Sample Factory's ``--normalize_input``): each pixel of the CNN's
    input is standardised by its own running mean and variance (clipped to +-5) instead of scaled by 1/255.
    Static background goes to zero and what moves stands out, which speeds early learning where little of the
    screen matters (APPO and PPO on Pong). The statistics are module buffers: learners update them after each
    train batch (``InputNormalizer``), so they travel with the weights to runners and into checkpoints. Vector
    observations take the ``MeanStdFilter`` connector instead."""
    normalize_returns: bool = False
    """runnel's, as Sample Factory's ``--normalize_returns`` (PPO, IMPALA, APPO): the value head learns the value
    targets standardised by their running mean and variance, which the learner updates from each train batch
    before its update (``ReturnNormalizer``). The module still reports values in the env's units, and the value
    loss is the squared error of standardised values, so ``vf_loss_coeff`` means the same whatever the scale of
    the rewards. The statistics are buffers of the value side, saved in checkpoints."""
    log_std_init: float = 0.0
    """Initial log standard deviation of Gaussian (Box) action distributions."""
    use_lstm: bool = False
    """An LSTM between the MLP trunk and the heads (policy and value share it): the policy remembers
    across steps. PPO, IMPALA, APPO, and DQN (R2D2: replayed sequences, ``pipeline.algorithms.dqn.recurrent``)."""
    lstm_cell_size: int = 256
    """Units of the LSTM's hidden and cell state."""
    max_seq_len: int = 20
    """Runners cut episodes into chunks of at most this many steps, each carrying the recurrent state at
    its start; learners unroll each chunk from that state."""
    lstm_use_prev_action: bool = False
    """Not supported yet (an error if True): feed the previous action to the LSTM."""
    lstm_use_prev_reward: bool = False
    """Not supported yet (an error if True): feed the previous reward to the LSTM."""

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
        for key in ("lstm_use_prev_action", "lstm_use_prev_reward"):
            if d.get(key):
                raise ValueError(f"model_config[{key!r}]=True is RLlib's old way; the module sees the previous "
                                 f"actions and rewards through a connector: .env_runners(env_to_module_connector="
                                 f"lambda env: [PrevActionsPrevRewards(), FlattenObservations()]) "
                                 f"(pipeline.connectors), and {key} left False")
        for key in ("lstm_cell_size", "max_seq_len"):
            if key in d and (not isinstance(d[key], int) or isinstance(d[key], bool) or d[key] < 1):
                raise ValueError(f"model_config[{key!r}] must be an int >= 1, got {d[key]!r}")
        return cls(**d)

    def trunk_hiddens(self, after: nn.Module | None) -> list[int]:
        """The MLP trunk's layer sizes after the encoder ``after`` (None: on flat inputs): ``fcnet_hiddens``,
        or by default [64, 64], and none after a CNN."""
        if self.fcnet_hiddens is not None:
            return list(self.fcnet_hiddens)
        return [] if isinstance(after, CNNEncoder) else [64, 64]


def is_image(space: gym.Space) -> bool:
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
    """``(B, H, W, C)`` images -> ``(B, out_dim)`` features: convolutions, flatten, fully connected layers;
    weights orthogonal with gain sqrt(2) (ReLU's), biases zero."""

    def __init__(self, space: gym.spaces.Box, cfg: ModelConfig) -> None:
        super().__init__()
        h, w, c = space.shape
        filters = cfg.conv_filters or [[32, 8, 4], [64, 4, 2], [64, 3, 1]]
        act = ACTIVATIONS[cfg.conv_activation]
        layers: list[nn.Module] = []
        for out, kernel, stride in filters:
            layers += [_orthogonal(nn.Conv2d(c, out, kernel, stride)), act()]
            c = out
        layers.append(nn.Flatten())
        with torch.no_grad():
            width = int(nn.Sequential(*layers)(torch.zeros(1, space.shape[2], h, w)).shape[-1])
        for size in cfg.conv_fc_hiddens:
            layers += [_orthogonal(nn.Linear(width, size)), act()]
            width = size
        self.net = nn.Sequential(*layers)
        self.out_dim = width
        self.scale = 1.0 / 255.0 if space.dtype == np.uint8 else 1.0
        self.normalizer = InputNormalizer(space.shape, self.scale) if cfg.normalize_input else None

    def forward(self, obs: torch.Tensor) -> torch.Tensor:
        if self.normalizer is not None:
            return self.net(self.normalizer(obs).permute(0, 3, 1, 2))
        x = obs.permute(0, 3, 1, 2)
        if x.is_floating_point():
            return self.net(x.float() * self.scale)
        # uint8 frames: .float() makes a new tensor, so scaling it in place spares a second frame-sized buffer
        return self.net(x.float().mul_(self.scale))


def build_encoder(space: gym.Space, cfg: ModelConfig) -> nn.Module:
    """A CNN for a single image observation, else the flattening encoder; ``.out_dim`` is its width."""
    if cfg.normalize_input and not is_image(space):
        raise ValueError(f"model_config normalize_input=True standardises image observations (H, W, C) inside the "
                         f"CNN; these observations are {space}: normalise vectors with the MeanStdFilter connector "
                         f"(.env_runners(env_to_module_connector=lambda env: [MeanStdFilter()])) and leave "
                         f"normalize_input False")
    return CNNEncoder(space, cfg) if is_image(space) else ObsEncoder(space)


def _orthogonal(layer: nn.Conv2d | nn.Linear) -> nn.Conv2d | nn.Linear:
    nn.init.orthogonal_(layer.weight, gain=np.sqrt(2))
    nn.init.zeros_(layer.bias)
    return layer


def mlp(in_dim: int, hiddens: list[int], activation: str) -> tuple[nn.Sequential, int]:
    """Orthogonally initialised hidden layers; returns the trunk and its output width."""
    layers: list[nn.Module] = []
    for h in hiddens:
        layer = nn.Linear(in_dim, h)
        nn.init.orthogonal_(layer.weight, gain=np.sqrt(2))
        nn.init.zeros_(layer.bias)
        layers += [layer, ACTIVATIONS[activation]()]
        in_dim = h
    return nn.Sequential(*layers), in_dim


def head(in_dim: int, out_dim: int, gain: float) -> nn.Linear:
    layer = nn.Linear(in_dim, out_dim)
    nn.init.orthogonal_(layer.weight, gain=gain)
    nn.init.zeros_(layer.bias)
    return layer
