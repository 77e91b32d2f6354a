"""FusedActors: one acting forward pass for several modules of the same architecture.

A multi-agent env runner acts with one module per policy. For small networks a forward pass costs
its per-op overhead, not its arithmetic: two policies of CartPole's 64x64 MLP cost twice one, though
each sees only half the rows. When the modules are the default ``ActorCriticModule`` (exactly that
class, so a subclass's own forward is never skipped) with equal spaces and model configs and no action
mask, their layers are stacked once per weights update into ``[M, in, out]`` tensors and every row
of every module goes through ``torch.baddbmm`` together: rows are laid out ``[module, row]``, padded
to the largest module's rows, and read back in the order they came. The result is the rows' own
module's distribution inputs, the same numbers each module's ``forward_inference`` gives (a test
compares them). For the activations numpy has (tanh, relu, linear) the pass runs in numpy on views of the
stacked weights: a dozen ops on a few rows cost their call overhead, and numpy's is a fraction of torch's
dispatch; the numbers are the same up to float rounding.

Anything else -- another module class, a masked or nested observation, differing configs -- is not
fused; ``fusable`` says why not, and the caller runs each module alone.
"""
from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence

import gymnasium as gym
import numpy as np
import torch
from torch import nn

from actors.modules.actor_critic import ActorCriticModule
from actors.modules.encoders import ObsEncoder
from actors.modules.rl_module import RLModule

_ELEMENTWISE = (nn.Tanh, nn.ReLU, nn.ELU, nn.SiLU, nn.Identity)
_NUMPY_TWINS: dict[type, Callable[[np.ndarray], np.ndarray]] = {
    nn.Tanh: np.tanh, nn.ReLU: lambda h: np.maximum(h, 0), nn.Identity: lambda h: h}
"""The activations the numpy pass knows; a trunk with another one is run by torch."""


def fusion_key(module: RLModule) -> tuple | None:
    """Modules with equal keys can act in one pass; None: this module cannot be fused."""
    if type(module) is not ActorCriticModule or module.masking is not None or module.lstm is not None:
        return None  # a mask or a recurrent state acts per module
    if module.autocast_dtype is not None:  # acts alone, under its autocast (the fused pass is float32)
        return None
    if (isinstance(module.observation_space, (gym.spaces.Dict, gym.spaces.Tuple)) or type(module.encoder) is not ObsEncoder
            or len(module.encoder.leaves) != 1 or module.encoder.leaves[0][0] != "box"):
        return None  # one array leaf of numbers: the features are the observation itself, flattened
    if not all(isinstance(layer, (nn.Linear,) + _ELEMENTWISE) for layer in module.pi_trunk):
        return None
    cfg = module.config
    return (repr(module.observation_space), repr(module.action_space), tuple(cfg.trunk_hiddens(module.encoder)), cfg.fcnet_activation)


class FusedActors:
    """The acting pass of ``modules`` (equal ``fusion_key``s; one or more) as one batched pass.

    ``refresh()`` restacks the weights: call it after the modules' weights change (the sampler does at
    the start of every run, which is where new weights take effect)."""

    def __init__(self, modules: Mapping[str, RLModule]) -> None:
        keys = {mid: fusion_key(m) for mid, m in modules.items()}
        if not modules or None in keys.values() or len(set(keys.values())) != 1:
            raise ValueError(f"FusedActors needs modules of one fusable architecture, got {keys}")
        self.module_ids = list(modules)
        self.modules = [modules[mid] for mid in self.module_ids]
        first = self.modules[0]
        self.dist_spec = first.dist_spec
        # the layer pattern, shared: Linear positions get stacked weights, the others are applied as they are
        self.pattern = [layer if not isinstance(layer, nn.Linear) else None
                        for layer in list(first.pi_trunk) + [first.pi_head]]
        self.weights: list[torch.Tensor] = []
        self.biases: list[torch.Tensor] = []
        self._layouts: dict[tuple, torch.Tensor | np.ndarray] = {}
        twins = [None if layer is None else _NUMPY_TWINS.get(type(layer)) for layer in self.pattern]
        missing = any(layer is not None and twin is None for layer, twin in zip(self.pattern, twins))
        self._numpy_pattern = None if missing else twins
        """The pass in numpy (None: an activation without a numpy twin): for these few rows and small layers
        each torch op costs its dispatch, several times numpy's call, and the pass is a dozen ops."""
        self._np_weights: list[tuple[np.ndarray, np.ndarray]] = []
        self._seen: tuple = ()
        self.refresh()

    def refresh(self) -> None:
        # restacked only when a weight changed: in-place updates (load_state_dict, optimizer steps) bump a
        # tensor's version counter, and a replaced tensor has another storage
        seen = tuple((p.data_ptr(), p._version) for m in self.modules for p in m.parameters())
        if seen == self._seen:
            return
        self._seen = seen
        with torch.no_grad():
            linears = [[layer for layer in list(m.pi_trunk) + [m.pi_head] if isinstance(layer, nn.Linear)]
                       for m in self.modules]
            self.weights = [torch.stack([ls[k].weight.t() for ls in linears]).contiguous() for k in range(len(linears[0]))]
            self.biases = [torch.stack([ls[k].bias for ls in linears]).unsqueeze(1).contiguous()
                           for k in range(len(linears[0]))]
        on_cpu = all(w.device.type == "cpu" for w in self.weights)
        self._np_weights = [(w.numpy(), b.numpy()) for w, b in zip(self.weights, self.biases)] if on_cpu else []

    @property
    def numpy_ready(self) -> bool:
        """The pass runs in numpy (``dist_inputs_numpy``): known activations, weights on the CPU."""
        return self._numpy_pattern is not None and bool(self._np_weights)

    def dist_inputs_numpy(self, obs: np.ndarray, counts: Sequence[int], padded: bool = False) -> np.ndarray:
        """``dist_inputs`` from a numpy batch to a numpy array, for a caller that stays in numpy (``numpy_ready``)."""
        return self._numpy_rows(obs, counts, padded)

    def dist_inputs(self, obs: torch.Tensor, counts: Sequence[int], padded: bool = False) -> torch.Tensor:
        """Distribution inputs ``[N, D]`` for ``obs`` ``[N, ...]`` whose rows are grouped by module:
        the first ``counts[0]`` rows are ``module_ids[0]``'s, and so on. ``padded``: ``obs`` is laid out
        as ``pad_rows`` gives it, ``max(counts)`` rows per module (the result is the real rows only)."""
        if self._numpy_pattern is not None and self._np_weights and obs.device.type == "cpu":  # views of the weights
            return self._numpy_pass(obs, counts, padded)
        # one flat Box leaf (fusion_key's condition): the encoder would only flatten and cast to float
        feats = obs.reshape(obs.shape[0], -1)
        if feats.dtype != torch.float32:
            feats = feats.float()
        n_modules, widest = len(counts), max(counts)
        rows = _real_rows(feats.shape[0], counts, padded)
        h = feats if padded or all(c == widest for c in counts) else self._padded(feats, counts, widest)
        h = h.reshape(n_modules, widest, -1)
        k = 0
        for layer in self.pattern:
            if layer is None:
                h = torch.baddbmm(self.biases[k], h, self.weights[k])
                k += 1
            else:
                h = layer(h)
        h = h.reshape(n_modules * widest, -1)
        return h if h.shape[0] == rows else h.index_select(0, self._rows(counts, widest))

    def _numpy_pass(self, obs: torch.Tensor, counts: Sequence[int], padded: bool) -> torch.Tensor:
        """``dist_inputs`` in numpy: the same layers on the same ``[module, row]`` layout (the same numbers up
        to float rounding, as the torch pass's are up to its own)."""
        return torch.from_numpy(self._numpy_rows(obs.numpy(), counts, padded))

    def _numpy_rows(self, obs: np.ndarray, counts: Sequence[int], padded: bool) -> np.ndarray:
        feats = obs.reshape(obs.shape[0], -1)
        if feats.dtype != np.float32:
            feats = feats.astype(np.float32)
        n_modules, widest = len(counts), max(counts)
        rows = _real_rows(feats.shape[0], counts, padded)
        if not padded and rows != n_modules * widest:
            out = np.zeros((n_modules * widest, feats.shape[1]), np.float32)
            out[self._rows(counts, widest).numpy()] = feats
            feats = out
        h = feats.reshape(n_modules, widest, -1)
        k = 0
        for twin in self._numpy_pattern:
            if twin is None:
                weight, bias = self._np_weights[k]
                h = np.matmul(h, weight)
                h += bias
                k += 1
            else:
                h = twin(h)
        h = h.reshape(n_modules * widest, -1)
        return h if h.shape[0] == rows else h.take(self._numpy_layout(counts, widest), axis=0)

    def _numpy_layout(self, counts: Sequence[int], widest: int) -> np.ndarray:
        """``_rows`` as a numpy index array, cached alike."""
        key = (tuple(counts), "numpy")
        rows = self._layouts.get(key)
        if rows is None:
            rows = self._layouts[key] = self._rows(counts, widest).numpy()
        return rows

    def _padded(self, feats: torch.Tensor, counts: Sequence[int], widest: int) -> torch.Tensor:
        """``feats`` laid out ``[module * widest + row]`` with zero rows where a module has fewer."""
        out = feats.new_zeros(len(counts) * widest, feats.shape[-1])
        return out.index_copy_(0, self._rows(counts, widest), feats)

    def _rows(self, counts: Sequence[int], widest: int) -> torch.Tensor:
        """Where each row goes in the padded layout; the few count patterns of a run are cached."""
        key = tuple(counts)
        rows = self._layouts.get(key)
        if rows is None:
            if len(self._layouts) >= 256:
                self._layouts.clear()
            rows = self._layouts[key] = torch.cat([torch.arange(c) + k * widest for k, c in enumerate(counts)])
        return rows


def _real_rows(given: int, counts: Sequence[int], padded: bool) -> int:
    """How many of the ``given`` rows are real; padded rows must be laid out as ``pad_rows`` lays them."""
    if padded and given != len(counts) * max(counts):
        raise ValueError(f"padded rows: {given} for {len(counts)} modules of at most {max(counts)}; give "
                         f"pad_rows(items, counts)'s layout")
    return sum(counts) if padded else given


def pad_rows(items: list, counts: Sequence[int]) -> list:
    """``items`` (grouped by module, ``counts`` each) laid out ``max(counts)`` per module, the gaps filled
    with ``items[0]``: padding a list before the one stack costs less than padding the tensor after it, and
    a real row (not zeros) keeps the padded batch inside the observation space that is checked on it."""
    widest = max(counts)
    if all(c == widest for c in counts):
        return items
    out, start = [], 0
    for c in counts:
        out += items[start:start + c]
        out += [items[0]] * (widest - c)
        start += c
    return out
