"""PolicyForward: one batched forward pass of an inference-only module, and the actions chosen from it.

Every stage that acts with a torch module goes through this: an env runner acting locally
(``actors.env.acting.LocalActing``), the central inference server (``actors.inference.server``) and
the external-client policy server's torch backend (``actors.external.inference``). The forward pass
runs on the module's device (CUDA for a server given a GPU: observations go up through pinned host
buffers, reused from batch to batch, with non-blocking copies); the distribution inputs come back to the CPU, where exploration
draws its noise from the CPU generator -- the same draws wherever the module ran, which is what lets
central inference reproduce a runner's own actions (``actors.inference.streams``).

CUDA graphs (``graphs=True``, the inference server on a GPU): a small batch's pass is a few dozen kernel
launches, and launching them costs more than running them (0.74 ms for the default CNN at 32 rows on an
H200, most of a server's batch). The pass is captured once per batch bucket (the next power of two of
the rows) and replayed: the batch is copied into the bucket's static input, the graph runs, the first
rows of its static output are the answer. Weights are copied into the module's tensors in place
(``load_weights``), so the captured graphs act with new weights without a new capture. A module whose
pass cannot be captured (a sync to the CPU, data-dependent shapes) runs eagerly, as before.

Precision (``precision="bfloat16"``): the pass runs a bfloat16 copy of the module under autocast; the
float32 module stays the one whose weights are read and written (``set_state``, ``load_weights`` refresh
the copy). On CPUs with bfloat16 matrix units (AMX, AVX512-BF16) the Nature CNN's pass costs about half the
float32 one (8 frames: 0.9 against 1.8 ms on one thread), on a GPU's tensor cores less still; on CPUs without
them it costs several times more. The distribution inputs come back as float32 and the actions are drawn
from them as before: the log-probabilities recorded are those of the policy that acted (the bfloat16 one),
which is what the learners' importance ratios need.
"""
from __future__ import annotations

import copy
import itertools
import logging
from typing import Any

import numpy as np
import torch

from actors.env.exploration import Exploration
from actors.inference.settings import PRECISIONS
from actors.modules import RLModule
from protocols import nested


log = logging.getLogger("runnel")

MAX_HOST_ARRAYS = 4096
GRAPH_MAX_ROWS = 1024
"""Batches up to this many rows replay a captured graph; larger ones run eagerly."""


class PolicyForward:
    def __init__(self, module: RLModule, device: torch.device | str = "cpu", graphs: bool = False,
                 precision: str = "float32") -> None:
        """``graphs``: replay CUDA graphs of the pass (on a CUDA device; ignored on the CPU). ``precision``: one
        of ``PRECISIONS``, the dtype the pass computes in."""
        if precision not in PRECISIONS:
            raise ValueError(f"inference precision={precision!r} is not one of {list(PRECISIONS)}")
        self.device = torch.device(device)
        self.module = module.to(self.device)
        self.module.eval()
        self.precision = precision
        self._low: RLModule | None = None  # the bfloat16 copy that runs the pass, made at the first one
        self.dist_spec = module.dist_spec
        self.cuda = self.device.type == "cuda"
        self._pinned: dict[tuple, torch.Tensor] = {}  # (leaf, dtype, row shape) -> a pinned host buffer
        self._host: dict[Any, torch.Tensor] = {}  # host_array's buffers, by key
        self._pinned_sizes: dict[int, int] = {}  # pinned host_array buffers: start address -> bytes
        self.graphs = graphs and self.cuda
        self._graphs: dict[tuple, tuple[torch.Tensor, torch.cuda.CUDAGraph, torch.Tensor]] = {}

    def dist_inputs(self, obs: Any, explore: bool) -> torch.Tensor:
        """The action distribution inputs for a batch of numpy observations, on the CPU. The caller
        holds ``torch.inference_mode``."""
        if not self.cuda:
            return self._pass(explore, nested.map_structure(_tensor, obs))["action_dist_inputs"]
        if self.graphs and type(obs) is np.ndarray and 0 < len(obs) <= GRAPH_MAX_ROWS:
            return self._replayed(obs, explore)
        leaf = itertools.count()
        inputs = self._pass(explore, nested.map_structure(lambda a: self._upload(next(leaf), a), obs))
        # waits for the pass (the answers are needed now); the pinned buffers are free again after it
        return inputs["action_dist_inputs"].to("cpu")

    def _pass(self, explore: bool, obs: Any, *state: torch.Tensor) -> dict[str, torch.Tensor]:
        """The module's acting pass in this forward's precision; float32 outputs."""
        if self.precision == "float32":
            module = self.module
            return (module.forward_exploration if explore else module.forward_inference)(obs, *state)
        module = self._low_module()
        # no cast cache: the copy's weights are bfloat16 already, and a cache must stay off in CUDA graph capture
        with torch.autocast(self.device.type, dtype=torch.bfloat16, cache_enabled=False):
            out = (module.forward_exploration if explore else module.forward_inference)(
                obs, *(s.to(torch.bfloat16) for s in state))
        return {k: v.float() if v.is_floating_point() else v for k, v in out.items()}

    def _low_module(self) -> RLModule:
        if self._low is None:  # normal tensors, even when the first pass runs in inference mode: updated later
            with torch.inference_mode(False), torch.no_grad():
                self._low = copy.deepcopy(self.module).to(torch.bfloat16)
                if self.device.type == "cpu":
                    # convolution weights in channels-last order: oneDNN's bfloat16 kernels take them without a
                    # reorder per call (the Nature CNN's pass on 8 frames: about 7% less on an AMX CPU); the
                    # frames arrive (B, H, W, C) already. Not measured on a GPU yet, so left as it is there
                    self._low.to(memory_format=torch.channels_last)
        return self._low

    def _refresh(self) -> None:
        """The float32 module's weights changed: the bfloat16 copy takes them (in place, so captured graphs
        read them)."""
        if self._low is not None:
            with torch.inference_mode(False), torch.no_grad():
                self._low.load_state_dict(self.module.state_dict())

    @property
    def num_graphs(self) -> int:
        """CUDA graphs captured so far (one per batch bucket and explore flag)."""
        return len(self._graphs)

    def _replayed(self, obs: np.ndarray, explore: bool) -> torch.Tensor:
        n = len(obs)
        key = (1 << (n - 1).bit_length(), explore, obs.dtype.str, obs.shape[1:])
        captured = self._graphs.get(key)
        if captured is None:
            try:
                captured = self._graphs[key] = self._capture(key, obs)
            except Exception as err:  # noqa: BLE001 - not capturable: eager from now on
                log.warning("inference: the module's pass cannot be captured as a CUDA graph (%s: %s); running it "
                            "eagerly", type(err).__name__, err)
                self.graphs = False
                self._graphs.clear()
                return self.dist_inputs(obs, explore)
        static_in, graph, static_out = captured
        static_in[:n].copy_(self._pinned_host(obs), non_blocking=True)
        graph.replay()
        return static_out[:n].to("cpu")  # waits for the replay

    def _pinned_host(self, a: np.ndarray, leaf: int = 0) -> torch.Tensor:
        """``a`` as a pinned host tensor: itself when it is a ``host_array`` batch (the caller keeps it until
        the pass ends), else copied into a pinned buffer kept for this leaf (grown as batches grow)."""
        if self._pinned_already(a):
            return torch.from_numpy(a)
        key = (leaf, a.dtype.str, a.shape[1:])
        buf = self._pinned.get(key)
        if buf is None or len(buf) < len(a):
            buf = self._pinned[key] = torch.empty((max(len(a), 64), *a.shape[1:]),
                                                  dtype=_tensor(a[:0]).dtype).pin_memory()
        part = buf[:len(a)]
        part.numpy()[...] = a
        return part

    def _capture(self, key: tuple, obs: np.ndarray) -> tuple[torch.Tensor, torch.cuda.CUDAGraph, torch.Tensor]:
        rows, explore = key[0], key[1]
        static_in = torch.zeros((rows, *obs.shape[1:]), dtype=_tensor(obs[:0]).dtype, device=self.device)
        side = torch.cuda.Stream(self.device)
        side.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(side):  # warm-up off the capture: cuDNN picks its kernels, the allocator its blocks
            for _ in range(2):
                self._pass(explore, static_in)
        torch.cuda.current_stream(self.device).wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            static_out = self._pass(explore, static_in)["action_dist_inputs"]
        return static_in, graph, static_out

    def load_weights(self, weights: dict[str, torch.Tensor]) -> None:
        """Tensors already on the module's device, copied into its own in place (captured graphs read those)."""
        self.module.load_state_dict(weights)
        self._refresh()

    def recurrent_dist_inputs(self, obs: Any, state: np.ndarray, explore: bool) -> tuple[torch.Tensor, np.ndarray]:
        """A recurrent module's step: (action distribution inputs on the CPU, the next states as numpy)
        for a batch of observations and the states ``[B, 2, cell]`` they act from."""
        if not self.cuda:
            out = self._pass(explore, nested.map_structure(_tensor, obs), torch.from_numpy(state))
            return out["action_dist_inputs"], out["state_out"].numpy()
        leaf = itertools.count()
        t_obs = nested.map_structure(lambda a: self._upload(next(leaf), a), obs)
        out = self._pass(explore, t_obs, self._upload(-1, state))
        return out["action_dist_inputs"].to("cpu"), out["state_out"].to("cpu").numpy()

    def host_array(self, key: Any, shape: tuple[int, ...], dtype: np.dtype) -> np.ndarray:
        """A writable host array for a batch's observations, kept under ``key`` and reused (grown as needed):
        pinned on CUDA, so a batch of it alone goes to the GPU with no further copy."""
        nbytes = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
        buf = self._host.get(key)
        if buf is None and len(self._host) >= MAX_HOST_ARRAYS:  # bounded, whatever keys callers invent
            self._pinned_sizes.pop(self._host.pop(next(iter(self._host))).data_ptr(), None)
        if buf is None or buf.numel() < nbytes:
            if buf is not None:
                self._pinned_sizes.pop(buf.data_ptr(), None)
            buf = torch.empty(max(nbytes, 4096), dtype=torch.uint8)
            if self.cuda:
                buf = buf.pin_memory()
                self._pinned_sizes[buf.data_ptr()] = buf.numel()
            self._host[key] = buf
        return buf.numpy()[:nbytes].view(dtype).reshape(shape)

    def _pinned_already(self, a: np.ndarray) -> bool:
        """``a`` is a ``host_array`` (which always starts at its buffer's start): one lookup, not a scan of
        every runner's buffer."""
        if not self._pinned_sizes or not a.flags.c_contiguous:
            return False
        return self._pinned_sizes.get(a.__array_interface__["data"][0], -1) >= a.nbytes

    def _upload(self, leaf: int, a: np.ndarray) -> torch.Tensor:
        """``a`` on the GPU through a pinned buffer kept for this leaf (grown as batches grow)."""
        return self._pinned_host(a, leaf).to(self.device, non_blocking=True)

    def choose(self, inputs: torch.Tensor, exploration: Exploration, explore: bool, timestep: int
               ) -> tuple[torch.Tensor, torch.Tensor]:
        """(actions, their log-probabilities) for CPU distribution inputs, as ``exploration`` picks them."""
        dist = self.dist_spec.build(inputs)
        actions = exploration.actions(dist, explore, timestep)
        return actions, dist.logp(actions)

    def set_state(self, weights: dict[str, Any]) -> None:
        self.module.set_state(weights)
        self._refresh()

    def get_state(self) -> dict[str, np.ndarray]:
        return self.module.get_state()


def _tensor(a: np.ndarray) -> torch.Tensor:
    """``a`` as a CPU tensor sharing its memory (a copy for read-only arrays, such as decoded codec views)."""
    return torch.from_numpy(a) if a.flags.writeable else torch.from_numpy(np.array(a))
