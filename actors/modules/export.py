"""Export a module's acting path for numpy (``protocols.numpy_policy`` documents the format).

Supported: the default MLP modules -- ``ActorCriticModule`` (encoder, policy trunk, policy head;
the value head stays behind) and ``QModule`` without distributional atoms (dueling or not,
Discrete or MultiDiscrete) -- on observations the flattening encoder reads, with the exploration
pieces that have a numpy counterpart. Anything else raises ``ValueError`` naming it; such a policy
serves clients in remote inference mode.
"""
from __future__ import annotations

from typing import Any

import numpy as np
from torch import nn

from actors.env.exploration import EpsilonGreedy, Exploration, SoftQ, StochasticSampling
from actors.modules.actor_critic import ActorCriticModule
from actors.modules.encoders import ObsEncoder
from actors.modules.q_module import QModule
from actors.modules.rl_module import RLModule
from protocols.numpy_policy import FORMAT, VERSION

_ACTIVATIONS = {nn.Tanh: "tanh", nn.ReLU: "relu", nn.ELU: "elu", nn.SiLU: "silu", nn.Identity: "identity"}
_USE_REMOTE = "use inference_mode='remote'"


def export_policy(module: RLModule, exploration: Exploration | None = None, timestep: int = 0) -> dict[str, Any]:
    """The module's acting path (and the exploration it uses at ``timestep``) as plain data."""
    if not isinstance(module.encoder, ObsEncoder):
        raise ValueError(f"numpy export covers MLP policies; {type(module.encoder).__name__} (image observations) "
                         f"is not exported yet -- {_USE_REMOTE}")
    if isinstance(module, ActorCriticModule):
        layers = _sequential(module.pi_trunk) + [_linear(module.pi_head)]
    elif isinstance(module, QModule):
        if module.num_atoms > 1:
            raise ValueError(f"distributional DQN (num_atoms={module.num_atoms}) is not exported -- {_USE_REMOTE}")
        head = ({"op": "dueling", "branches": list(module.branches), "advantage": [_linear(module.advantage)],
                 "value": [_linear(module.value)]} if module.dueling else _linear(module.advantage))
        layers = _sequential(module.trunk) + [head]
    else:
        raise ValueError(f"{type(module).__name__} has no numpy export -- {_USE_REMOTE}")
    spec = module.dist_spec
    if spec.kind == "squashed_gaussian":
        raise ValueError(f"squashed Gaussian policies are not exported -- {_USE_REMOTE}")
    return {"format": FORMAT, "version": VERSION, "encoder": _encoder(module.encoder), "layers": layers,
            "dist": {"kind": spec.kind, "nvec": list(getattr(spec, "nvec", [])), "dim": int(spec.input_dim)},
            "exploration": describe_exploration(exploration, timestep)}


def describe_exploration(exploration: Exploration | None, timestep: int) -> dict[str, Any]:
    if exploration is None:
        return {"type": "sample"}
    if type(exploration) is StochasticSampling:
        return {"type": "random" if timestep < exploration.random_timesteps else "sample"}
    if type(exploration) is EpsilonGreedy:
        return {"type": "epsilon_greedy", "epsilon": float(exploration.epsilon(timestep))}
    if type(exploration) is SoftQ:
        return {"type": "softmax", "temperature": exploration.temperature}
    raise ValueError(f"exploration {type(exploration).__name__} has no numpy counterpart -- {_USE_REMOTE}")


def _encoder(encoder: ObsEncoder) -> list[dict[str, Any]]:
    out = []
    for kind, dim in encoder.leaves:
        if kind == "box":
            out.append({"kind": "box", "size": int(dim)})
        else:
            _, nvec, start = kind
            out.append({"kind": "onehot", "nvec": [int(n) for n in nvec], "start": int(start)})
    return out


def _linear(layer: nn.Linear) -> dict[str, Any]:
    return {"op": "linear", "weight": layer.weight.detach().cpu().numpy().astype(np.float32),
            "bias": layer.bias.detach().cpu().numpy().astype(np.float32)}


def _sequential(seq: nn.Sequential) -> list[dict[str, Any]]:
    ops = []
    for layer in seq:
        if isinstance(layer, nn.Linear):
            ops.append(_linear(layer))
        elif type(layer) in _ACTIVATIONS:
            ops.append({"op": _ACTIVATIONS[type(layer)]})
        else:
            raise ValueError(f"layer {type(layer).__name__} has no numpy counterpart -- {_USE_REMOTE}")
    return ops
