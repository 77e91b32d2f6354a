"""Export a module's acting path as plain data that numpy -- or a client in any language -- evaluates.

A policy server sends this description to clients in local inference mode (the ``policy`` body of
a ``weights`` reply); ``protocols.numpy_policy.NumpyPolicy`` evaluates it. It is plain data (maps
with str keys, lists, str, int, float, float32 arrays), sent with runnel's msgpack codec, never
pickled. The format -- keys, observation encoding, every op's math and weight layout, the
distributions, log-probabilities and exploration rules -- is specified in
``protocols/EXTERNAL.md`` section 9; a change to what this module writes changes that section
(and the format's version, if the math changes), and ``tests/test_external_policy_format.py``
checks an evaluator written from the section against what is exported here. In short::

    {"format": "runnel-numpy-policy", "version": 1,
     "encoder": [leaf, ...], "layers": [op, ...],
     "dist": {"kind": ..., "dim": D, "nvec": [...]}, "exploration": {"type": ..., ...}}

Exported: ``ActorCriticModule`` (encoder, policy trunk, its LSTM when recurrent -- format version 2 --, policy
head; the value head stays behind; an action mask in the observations -- version 2 -- as the ``mask`` key)
and ``QModule`` without distributional atoms (dueling or not, Discrete or MultiDiscrete; its LSTM when recurrent), on the
flattening or the CNN encoder, with StochasticSampling, EpsilonGreedy or SoftQ exploration.
Anything else raises ``ValueError`` naming it; such a policy serves clients in remote inference mode.
"""
from __future__ import annotations

from typing import Any

import gymnasium as gym
import numpy as np
from torch import nn

from actors.env.exploration import EpsilonGreedy, Exploration, SoftQ, StochasticSampling
from actors.modules.action_mask import MASK_KEY
from actors.modules.actor_critic import ActorCriticModule
from actors.modules.encoders import CNNEncoder, ObsEncoder
from actors.modules.q_module import QModule
from actors.modules.rl_module import RLModule
from actors.modules.sac_module import SACModule
from protocols.numpy_policy import FORMAT, VERSION

_ELEMENTWISE = {nn.Tanh: "tanh", nn.ReLU: "relu", nn.ELU: "elu", nn.SiLU: "silu", nn.Identity: "identity"}
_USE_REMOTE = "use inference_mode='remote'"


def export_policy(module: RLModule, exploration: Exploration | None = None, timestep: int = 0,
                  keyed: bool = False) -> dict[str, Any]:
    """The module's acting path and the exploration it uses at ``timestep``, as plain data. ``keyed``: every
    op with arrays also names the state-dict entries they come from (``"keys": {"weight": "pi_head.weight",
    ...}``), so a runner can refill them from the weights it is sent (``actors.env.numpy_acting``); what is
    sent to clients is not keyed."""
    names = {id(p): n for n, p in module.named_parameters()} if keyed else None
    # exact classes: a subclass may compute its actions differently from the layers exported here
    lstm = getattr(module, "lstm", None)  # both exported classes put it between their trunk and their head
    cell = [] if lstm is None else [_lstm(lstm, names)]
    # a discrete SAC module acts with its actor alone, laid out as ActorCriticModule's policy (the critics stay home)
    if type(module) is ActorCriticModule or (type(module) is SACModule and module.discrete):
        head = _sequential(module.pi_trunk, names) + cell + [_linear(module.pi_head, names)]
    elif type(module) is QModule:
        if module.num_atoms > 1:
            raise ValueError(f"distributional QModule (num_atoms={module.num_atoms}) has no numpy export -- "
                             f"{_USE_REMOTE}")
        q = ({"op": "dueling", "branches": [int(n) for n in module.branches],
              "advantage": [_linear(module.advantage, names)], "value": [_linear(module.value, names)]}
             if module.dueling else _linear(module.advantage, names))
        head = _sequential(module.trunk, names) + cell + [q]
    else:
        raise ValueError(f"{type(module).__name__} has no numpy export (supported: ActorCriticModule, QModule "
                         f"with num_atoms=1, SACModule with Discrete actions) -- {_USE_REMOTE}")
    spec = module.dist_spec
    if spec.kind not in ("categorical", "multi_categorical", "gaussian"):
        raise ValueError(f"{spec.kind} action distributions have no numpy export -- {_USE_REMOTE}")
    leaves, encoder_ops = _encoder(module.encoder, module.encoder_space, names)  # the observations less a mask
    masking = module.masking
    mask = {} if masking is None else {"mask": {"key": MASK_KEY, "width": int(spec.input_dim),
                                                **({} if masking.single_key is None else
                                                   {"features": masking.single_key})}}
    # version 1 unless the policy needs version 2's lstm op or mask: readers from before version 2 read the rest
    return {"format": FORMAT, "version": VERSION if cell or mask else 1, **mask, "encoder": leaves,
            "layers": encoder_ops + head,
            "dist": {"kind": spec.kind, "dim": int(spec.input_dim),
                     "nvec": [int(spec.input_dim)] if spec.kind == "categorical" else list(getattr(spec, "nvec", []))},
            "exploration": describe_exploration(exploration, timestep)}


def acting_plan(module: RLModule, exploration: Exploration) -> dict[str, Any]:
    """What an env runner needs to act with numpy alone (``actors.env.numpy_acting``): the keyed policy, the
    exploration's rule over timesteps and, for a recurrent module, its ``max_seq_len``, as plain data. Raises ``ValueError`` naming what numpy cannot
    act with (then the runner acts with the torch module)."""
    policy = export_policy(module, exploration, keyed=True)
    if type(exploration) is StochasticSampling:
        rule: dict[str, Any] = {"type": "sample", "random_timesteps": int(exploration.random_timesteps)}
    elif type(exploration) is EpsilonGreedy:
        rule = {"type": "epsilon_greedy", "schedule": [[int(t), float(e)] for t, e in exploration.schedule]}
    else:  # SoftQ: describe_exploration has checked it is one of the three
        rule = {"type": "softmax", "temperature": float(exploration.temperature)}
    plan = {"policy": policy, "exploration": rule}
    if getattr(module, "is_recurrent", False):  # the runner cuts its chunks to the learner's sequences
        plan["max_seq_len"] = int(module.config.max_seq_len)
    return plan


def describe_exploration(exploration: Exploration | None, timestep: int) -> dict[str, Any]:
    """The exploration piece's behaviour at ``timestep`` (schedules are evaluated, not exported)."""
    if exploration is None:
        return {"type": "sample"}
    if type(exploration) is StochasticSampling:
        return {"type": "random" if timestep < exploration.random_timesteps else "sample"}
    if type(exploration) is EpsilonGreedy:
        return {"type": "epsilon_greedy", "epsilon": float(exploration.epsilon(timestep))}
    if type(exploration) is SoftQ:
        return {"type": "softmax", "temperature": float(exploration.temperature)}
    raise ValueError(f"exploration {type(exploration).__name__} has no numpy counterpart (supported: "
                     f"StochasticSampling, EpsilonGreedy, SoftQ) -- {_USE_REMOTE}")


def _encoder(encoder: nn.Module, space: gym.Space, names: dict[int, str] | None
             ) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """The encoder's leaves, and the ops that follow them (a CNN's layers)."""
    if type(encoder) is CNNEncoder and encoder.normalizer is not None:
        raise ValueError(f"a CNN with model_config normalize_input=True has no numpy export -- {_USE_REMOTE}")
    if type(encoder) is CNNEncoder:
        leaf = {"kind": "image", "shape": [int(n) for n in space.shape], "scale": float(encoder.scale)}
        return [leaf], _sequential(encoder.net, names)
    if type(encoder) is not ObsEncoder:
        raise ValueError(f"encoder {type(encoder).__name__} has no numpy export -- {_USE_REMOTE}")
    leaves = []
    for kind, dim in encoder.leaves:
        if kind == "box":
            leaves.append({"kind": "box", "size": int(dim)})
        else:
            _, nvec, start = kind
            leaves.append({"kind": "onehot", "nvec": [int(n) for n in nvec], "start": int(start)})
    return leaves, []


def _array(t: Any) -> np.ndarray:
    return t.detach().cpu().numpy().astype(np.float32)  # astype copies: a snapshot of weights that train on


def _linear(layer: nn.Linear, names: dict[int, str] | None) -> dict[str, Any]:
    return _keyed({"op": "linear", "weight": _array(layer.weight), "bias": _array(layer.bias)}, layer, names)


def _keyed(op: dict[str, Any], layer: nn.Module, names: dict[int, str] | None) -> dict[str, Any]:
    """``op`` with the state-dict names of its ``weight`` and ``bias`` (``names``: id(parameter) -> name)."""
    if names is not None:
        op["keys"] = {"weight": names[id(layer.weight)], "bias": names[id(layer.bias)]}
    return op


def _lstm(lstm: nn.LSTM, names: dict[int, str] | None) -> dict[str, Any]:
    """A one-layer, one-direction LSTM as the format's ``lstm`` op (torch's weight layout and gate order)."""
    if (lstm.num_layers != 1 or lstm.bidirectional or not lstm.bias or getattr(lstm, "proj_size", 0)
            or not lstm.batch_first):
        raise ValueError(f"{lstm} has no numpy counterpart (one layer, one direction, with biases) -- {_USE_REMOTE}")
    keys = ("weight_ih", "weight_hh", "bias_ih", "bias_hh")
    op: dict[str, Any] = {"op": "lstm", **{k: _array(getattr(lstm, f"{k}_l0")) for k in keys}}
    if names is not None:
        op["keys"] = {k: names[id(getattr(lstm, f"{k}_l0"))] for k in keys}
    return op


def _sequential(seq: nn.Sequential, names: dict[int, str] | None) -> list[dict[str, Any]]:
    ops = []
    for layer in seq:
        if type(layer) is nn.Linear and layer.bias is not None:
            ops.append(_linear(layer, names))
        elif type(layer) in _ELEMENTWISE and getattr(layer, "alpha", 1.0) == 1.0:
            ops.append({"op": _ELEMENTWISE[type(layer)]})
        elif (type(layer) is nn.Conv2d and layer.bias is not None and layer.padding == (0, 0)
              and layer.dilation == (1, 1) and layer.groups == 1):
            ops.append(_keyed({"op": "conv2d", "weight": _array(layer.weight), "bias": _array(layer.bias),
                               "stride": [int(s) for s in layer.stride]}, layer, names))
        elif type(layer) is nn.Flatten and layer.start_dim == 1 and layer.end_dim == -1:
            ops.append({"op": "flatten"})
        else:
            raise ValueError(f"layer {layer} has no numpy counterpart -- {_USE_REMOTE}")
    return ops
