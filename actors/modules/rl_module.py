"""RLModule: what every policy network offers the stages that carry it.

Env runners call ``forward_exploration``/``forward_inference`` on an inference-only copy;
learners call ``forward_train`` on the full module. Weights travel as ``{name: numpy array}``
(``get_state``/``set_state``), which Ray broadcasts with one ``ray.put`` and a checkpoint stores.
A subclass lists in ``train_only_prefixes`` the parameters an inference-only copy leaves out
(value heads, critics, target networks' sources), so runners hold and receive only what they use.
Observations with an ``"action_mask"`` key are split here (``split_mask``/``mask_outputs``, see
``actors.modules.action_mask``): a subclass builds its encoder on ``encoder_space``.

Mixed precision (a learner's ``learner_precision="bfloat16"``, ``set_autocast``): a module with
``autocast_dtype`` set runs its forward methods (``AUTOCAST_METHODS``, in every subclass, a user's too)
under ``torch.autocast`` and hands back float32 outputs, so the losses -- log-softmax, ratios, value
errors -- compute in float32 while the convolutions and matrix products run in bfloat16. Parameters,
gradients and optimizer state stay float32. A method called from inside another runs in its autocast.
"""
from __future__ import annotations

import functools
import warnings
from typing import Any, Callable, ClassVar

import gymnasium as gym
import numpy as np
import torch
from torch import nn

from actors.modules.action_mask import masking_for
from actors.modules.distributions import ActionDistSpec
from actors.modules.encoders import ModelConfig
from protocols import nested


AUTOCAST_METHODS = ("forward_train", "forward_sequences", "forward_inference", "forward_exploration",
                    "compute_values", "q_values")
"""The forward methods a module with ``autocast_dtype`` runs under autocast (those its subclasses define)."""


class RLModule(nn.Module):
    train_only_prefixes: ClassVar[tuple[str, ...]] = ()
    """State-dict prefixes that exist only in the full (learner) module."""
    autocast_dtype: torch.dtype | None = None
    """Set by ``set_autocast``: the forward methods run under autocast to this dtype (None: as built)."""
    autocast_device: str = "cpu"

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        for name in AUTOCAST_METHODS:
            method = cls.__dict__.get(name)
            if method is not None and not getattr(method, "autocasts", False):
                setattr(cls, name, _autocasting(method))

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


def set_autocast(module: nn.Module, precision: str, device_type: str) -> None:
    """Every ``RLModule`` in ``module`` runs its forward methods under autocast to ``precision`` ("bfloat16")
    on ``device_type``, with float32 outputs; "float32" turns it off."""
    dtype = None if precision == "float32" else getattr(torch, precision)
    for m in module.modules():
        if isinstance(m, RLModule):
            m.autocast_dtype, m.autocast_device = dtype, device_type


def _autocasting(method: Callable) -> Callable:
    @functools.wraps(method)
    def run(self: RLModule, *args: Any, **kwargs: Any) -> Any:
        dtype = self.autocast_dtype
        if dtype is None or _autocast_on(self.autocast_device):  # off, or inside an outer call's
            return method(self, *args, **kwargs)
        with torch.autocast(self.autocast_device, dtype=dtype):
            out = method(self, *args, **kwargs)
        return _float32(out)

    run.autocasts = True  # type: ignore[attr-defined]
    return run


def _autocast_on(device_type: str) -> bool:
    try:
        return torch.is_autocast_enabled(device_type)
    except TypeError:  # torch < 2.4: one function per device
        return torch.is_autocast_cpu_enabled() if device_type == "cpu" else torch.is_autocast_enabled()


def _float32(out: Any) -> Any:
    """Low-precision float tensors in a method's output (a tensor, or dicts, lists and tuples of them) as float32."""
    if isinstance(out, torch.Tensor):
        return out.float() if out.is_floating_point() and out.dtype != torch.float32 and out.dtype != torch.float64 \
            else out
    if isinstance(out, dict):
        return {k: _float32(v) for k, v in out.items()}
    if isinstance(out, (list, tuple)):
        return type(out)(_float32(v) for v in out)
    return out


def to_torch(obs: Any, device: torch.device | str = "cpu") -> Any:
    """Nested numpy -> nested torch tensors (no copy on CPU where the dtype allows)."""
    return nested.map_structure(lambda a: torch.as_tensor(a, device=device), obs)


def _silence_read_only_warning() -> None:
    """Read-only arrays (decoded frames, Ray objects) become tensors without a copy, and no module writes
    its inputs, so torch's warning about writing through such a tensor does not apply. torch gives it
    once per process: it is drawn here, at import, under a filter. A filter around each call instead would
    cost 2.5 us a call and is not thread-safe (``catch_warnings`` swaps the process's filter list: two
    threads interleaving can leave either's filters behind)."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", "The given NumPy array is not writable", UserWarning)
        torch.as_tensor(np.frombuffer(bytes(4), dtype=np.float32))


_silence_read_only_warning()

