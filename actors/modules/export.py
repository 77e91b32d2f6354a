"""Export a module's acting path as plain data that numpy -- or a client in any language -- evaluates.

A policy server sends this description to clients in local inference mode (the ``policy`` body of
a ``weights`` reply, EXTERNAL.md section 6); ``protocols.numpy_policy.NumpyPolicy`` evaluates it.
It is plain data (maps with str keys, lists, str, int, float, float32 arrays), sent with runnel's
msgpack codec, never pickled. Format, version 1::

    {"format": "runnel-numpy-policy", "version": 1,
     "encoder": [leaf, ...], "layers": [op, ...],
     "dist": {"kind": ..., "dim": D, "nvec": [...]}, "exploration": {"type": ..., ...}}

``encoder``: one leaf per observation leaf, visiting dicts in sorted-key order and tuples in order.
Each observation carries a leading batch dimension; per row:

    {"kind": "box", "size": n}    the leaf's n numbers, flattened in C order, as float32
                                  (Box and MultiBinary spaces)
    {"kind": "onehot", "nvec": [n_0, ...], "start": s}
                                  the leaf holds len(nvec) integers x_i (Discrete: one); each becomes
                                  a one-hot vector of length n_i, hot at min(max(x_i - s, 0), n_i - 1)
    {"kind": "image", "shape": [H, W, C], "scale": f}
                                  the only leaf when present: an H x W x C image (channels last)
                                  times f (1/255 for uint8 images), kept as an H x W x C tensor

Vector leaves are concatenated in order into one float32 vector, the input of ``layers``.

``layers``: applied in order; shapes must chain (an image tensor until ``flatten``, then a vector):

    {"op": "linear", "weight": float32 [out, in], "bias": float32 [out]}      y = W x + b
    {"op": "conv2d", "weight": float32 [out, in, kh, kw], "bias": float32 [out], "stride": [sh, sw]}
        unpadded cross-correlation of an H x W x in tensor into an H' x W' x out one,
        H' = (H - kh) // sh + 1, W' = (W - kw) // sw + 1:
        y[i, j, o] = b[o] + sum over c, u, v of W[o, c, u, v] * x[i*sh + u, j*sw + v, c]
    {"op": "flatten"}    H x W x C tensor -> vector of C*H*W, channel-major: x[i, j, c] at c*H*W + i*W + j
    {"op": "tanh" | "relu" | "elu" | "silu" | "identity"}    elementwise: relu max(x, 0);
        elu x if x > 0 else exp(x) - 1; silu x * sigmoid(x) (model_config "swish" too);
        identity leaves x (model_config "linear")
    {"op": "dueling", "branches": [n_0, ...], "advantage": [op, ...], "value": [op, ...]}
        a Q-value head; both op lists (linear and elementwise ops only) read the same input vector;
        "value" gives one number v, "advantage" sum(n_i) numbers, split in order into branches a_i;
        output: the concatenation over branches of v + a_i - mean(a_i)

The last op outputs the D distribution inputs (chunks record them as ``action_dist_inputs``).

``dist``: what the D numbers mean, and the actions (module units; clients map them onto the env's
space by the welcome's ``action_mapping``):

    "categorical"        nvec [D]: logits; an action is one integer in [0, D)
    "multi_categorical"  nvec [n_0, ...] summing to D: logits per component, split in order;
                         an action is one integer per component (MultiDiscrete, MultiBinary)
    "gaussian"           nvec []: D = 2A, mean = the first A, log_std = the last A clipped to
                         [-20, 2]; an action is A floats

An action's log-probability (chunks record it as ``action_logp``): for logits, log_softmax(logits)[a]
summed over components; for a gaussian, the sum over components of
-((a - mean) / exp(log_std))^2 / 2 - log_std - log(2 pi) / 2.

``exploration``: how to act when exploring; not exploring is always greedy (argmax per component,
or the mean):

    {"type": "sample"}                         sample the distribution
    {"type": "random"}                         uniformly random (gaussian: uniform in [-1, 1] per component)
    {"type": "epsilon_greedy", "epsilon": e}   per row, random with probability e, else greedy
    {"type": "softmax", "temperature": t}      (logits only) sample softmax(logits / t) per component

Readers ignore keys they do not know, and reject anything else that departs from this.

Exported: ``ActorCriticModule`` (encoder, policy trunk, policy head; the value head stays behind)
and ``QModule`` without distributional atoms (dueling or not, Discrete or MultiDiscrete), on the
flattening or the CNN encoder, with StochasticSampling, EpsilonGreedy or SoftQ exploration.
Anything else raises ``ValueError`` naming it; such a policy serves clients in remote inference mode.
"""
from __future__ import annotations

from typing import Any

import gymnasium as gym
import numpy as np
from torch import nn

from actors.env.exploration import EpsilonGreedy, Exploration, SoftQ, StochasticSampling
from actors.modules.actor_critic import ActorCriticModule
from actors.modules.encoders import CNNEncoder, ObsEncoder
from actors.modules.q_module import QModule
from actors.modules.rl_module import RLModule
from protocols.numpy_policy import FORMAT, VERSION

_ELEMENTWISE = {nn.Tanh: "tanh", nn.ReLU: "relu", nn.ELU: "elu", nn.SiLU: "silu", nn.Identity: "identity"}
_USE_REMOTE = "use inference_mode='remote'"


def export_policy(module: RLModule, exploration: Exploration | None = None, timestep: int = 0) -> dict[str, Any]:
    """The module's acting path and the exploration it uses at ``timestep``, as plain data."""
    # exact classes: a subclass may compute its actions differently from the layers exported here
    if type(module) is ActorCriticModule:
        head = _sequential(module.pi_trunk) + [_linear(module.pi_head)]
    elif type(module) is QModule:
        if module.num_atoms > 1:
            raise ValueError(f"distributional QModule (num_atoms={module.num_atoms}) has no numpy export -- "
                             f"{_USE_REMOTE}")
        q = ({"op": "dueling", "branches": [int(n) for n in module.branches],
              "advantage": [_linear(module.advantage)], "value": [_linear(module.value)]}
             if module.dueling else _linear(module.advantage))
        head = _sequential(module.trunk) + [q]
    else:
        raise ValueError(f"{type(module).__name__} has no numpy export (supported: ActorCriticModule, QModule "
                         f"with num_atoms=1) -- {_USE_REMOTE}")
    spec = module.dist_spec
    if spec.kind not in ("categorical", "multi_categorical", "gaussian"):
        raise ValueError(f"{spec.kind} action distributions have no numpy export -- {_USE_REMOTE}")
    leaves, encoder_ops = _encoder(module.encoder, module.observation_space)
    return {"format": FORMAT, "version": VERSION, "encoder": leaves, "layers": encoder_ops + head,
            "dist": {"kind": spec.kind, "dim": int(spec.input_dim),
                     "nvec": [int(spec.input_dim)] if spec.kind == "categorical" else list(getattr(spec, "nvec", []))},
            "exploration": describe_exploration(exploration, timestep)}


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


def _encoder(encoder: nn.Module, space: gym.Space) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """The encoder's leaves, and the ops that follow them (a CNN's layers)."""
    if type(encoder) is CNNEncoder:
        leaf = {"kind": "image", "shape": [int(n) for n in space.shape], "scale": float(encoder.scale)}
        return [leaf], _sequential(encoder.net)
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


def _linear(layer: nn.Linear) -> dict[str, Any]:
    return {"op": "linear", "weight": _array(layer.weight), "bias": _array(layer.bias)}


def _sequential(seq: nn.Sequential) -> list[dict[str, Any]]:
    ops = []
    for layer in seq:
        if type(layer) is nn.Linear and layer.bias is not None:
            ops.append(_linear(layer))
        elif type(layer) in _ELEMENTWISE and getattr(layer, "alpha", 1.0) == 1.0:
            ops.append({"op": _ELEMENTWISE[type(layer)]})
        elif (type(layer) is nn.Conv2d and layer.bias is not None and layer.padding == (0, 0)
              and layer.dilation == (1, 1) and layer.groups == 1):
            ops.append({"op": "conv2d", "weight": _array(layer.weight), "bias": _array(layer.bias),
                        "stride": [int(s) for s in layer.stride]})
        elif type(layer) is nn.Flatten and layer.start_dim == 1 and layer.end_dim == -1:
            ops.append({"op": "flatten"})
        else:
            raise ValueError(f"layer {layer} has no numpy counterpart -- {_USE_REMOTE}")
    return ops
