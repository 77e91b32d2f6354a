"""Steps a module acted on itself, without an environment: what the loss tests' fake batches start from."""
from __future__ import annotations

from typing import Any

import torch


def on_policy_steps(module: Any, n: int = 64, seed: int = 0) -> tuple[dict[str, torch.Tensor], torch.Generator]:
    """``n`` random 4-feature observations, the module's action distribution inputs there, an action sampled
    from each and its log-probability (``obs``, ``dist_inputs``, ``actions``, ``logp``); and the generator
    that drew the observations, for the batch's further random columns."""
    g = torch.Generator().manual_seed(seed)
    obs = torch.randn(n, 4, generator=g)
    with torch.no_grad():
        dist_inputs = module.forward_inference(obs)["action_dist_inputs"]
        dist = module.action_dist(dist_inputs)
        actions = dist.sample()
        logp = dist.logp(actions)
    return {"obs": obs, "dist_inputs": dist_inputs, "actions": actions, "logp": logp}, g
