"""PolicyForward: one batched forward pass of an inference-only module, and the actions chosen from it.

Every stage that acts with a torch module goes through this: an env runner acting locally
(``actors.env.acting.LocalActing``), the central inference server (``actors.inference.server``) and
the external-client policy server's torch backend (``actors.external.inference``). The forward pass
runs on the module's device (CUDA for a server given a GPU: observations go up through pinned host
memory with non-blocking copies); the distribution inputs come back to the CPU, where exploration
draws its noise from the CPU generator -- the same draws wherever the module ran, which is what lets
central inference reproduce a runner's own actions (``actors.inference.streams``).
"""
from __future__ import annotations

from typing import Any

import numpy as np
import torch

from actors.env.exploration import Exploration
from actors.modules import RLModule
from protocols import nested


class PolicyForward:
    def __init__(self, module: RLModule, device: torch.device | str = "cpu") -> None:
        self.device = torch.device(device)
        self.module = module.to(self.device)
        self.module.eval()
        self.dist_spec = module.dist_spec
        self.cuda = self.device.type == "cuda"

    def dist_inputs(self, obs: Any, explore: bool) -> torch.Tensor:
        """The action distribution inputs for a batch of numpy observations, on the CPU. The caller
        holds ``torch.inference_mode``."""
        module = self.module
        forward = module.forward_exploration if explore else module.forward_inference
        inputs = forward(nested.map_structure(self._to_device, obs))["action_dist_inputs"]
        if self.cuda:
            return inputs.to("cpu")  # waits for the pass: the answers are needed now
        return inputs

    def _to_device(self, a: np.ndarray) -> torch.Tensor:
        t = torch.from_numpy(a) if a.flags.writeable else torch.from_numpy(np.array(a))  # codec views are read-only
        if not self.cuda:
            return t
        return t.pin_memory().to(self.device, non_blocking=True)

    def choose(self, inputs: torch.Tensor, exploration: Exploration, explore: bool, timestep: int
               ) -> tuple[torch.Tensor, torch.Tensor]:
        """(actions, their log-probabilities) for CPU distribution inputs, as ``exploration`` picks them."""
        dist = self.dist_spec.build(inputs)
        actions = exploration.actions(dist, explore, timestep)
        return actions, dist.logp(actions)

    def set_state(self, weights: dict[str, Any]) -> None:
        self.module.set_state(weights)

    def get_state(self) -> dict[str, np.ndarray]:
        return self.module.get_state()
