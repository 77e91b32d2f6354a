"""What a MARWIL (and BC) learner runs: ``marwil_loss`` (pure) and ``MARWILLearner``, whose one piece of
state is the moving average of squared advantages. Imports no Ray Tune."""
from __future__ import annotations

from typing import Any

import numpy as np
import torch

from actors.learner import Learner, as_batch
from actors.modules import RLModule
from pipeline.algorithms.returns import gae
from protocols.episode import EpisodeChunk

MAX_EXPONENT = 20.0


def marwil_loss(module: RLModule, batch: dict[str, Any], config: Any,
                sqd_adv_norm: float) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Advantage-weighted negative log-likelihood of the recorded actions, plus the value loss.

    ``batch`` holds ``obs``, ``actions``, ``advantages`` and ``value_targets``; ``config`` has
    ``beta`` and ``vf_coeff``; ``sqd_adv_norm`` is the moving average of squared advantages.
    """
    out = module.forward_train(batch["obs"])
    logp = module.action_dist(out["action_dist_inputs"]).logp(batch["actions"])
    stats: dict[str, torch.Tensor] = {}
    if config.beta > 0:
        exponent = config.beta * batch["advantages"] / (1e-8 + float(np.sqrt(sqd_adv_norm)))
        weights = torch.exp(exponent.clamp(max=MAX_EXPONENT)).detach()
        stats["advantage_weight_mean"] = weights.mean()
    else:
        weights = torch.ones_like(logp)
    policy_loss = -(weights * logp).mean()
    total = policy_loss
    stats |= {"policy_loss": policy_loss.detach(), "action_logp_mean": logp.detach().mean()}
    if config.vf_coeff > 0:
        vf_loss = 0.5 * (out["vf_preds"] - batch["value_targets"]).pow(2).mean()
        total = total + config.vf_coeff * vf_loss
        stats["vf_loss"] = vf_loss.detach()
    stats["total_loss"] = total.detach()
    return total, stats


class MARWILLearner(Learner):
    """Advantages from the learner's value function, then SGD on ``marwil_loss``. Serves BC too (its
    config fixes ``beta`` and ``vf_coeff`` at 0, and no value is computed)."""

    state_fields = ("sqd_adv_norm",)

    def __init__(self, config: Any, observation_space: Any, action_space: Any, **placement: Any) -> None:
        self.config = config
        self.sqd_adv_norm = float(config.moving_average_sqd_adv_norm_start)
        super().__init__(config.learner_settings(), observation_space, action_space, **placement)

    def train_on_batch(self, chunks: list[EpisodeChunk], timestep: int) -> dict[str, float]:
        cfg = self.config
        b = as_batch(chunks, self.device)
        tensors = {"obs": b.obs, "actions": b.actions}
        if cfg.beta > 0 or cfg.vf_coeff > 0:
            with torch.no_grad():
                values = self.module.compute_values(b.all_obs).cpu().numpy()
            adv, targets = gae(b.rewards, values, b.lengths, b.terminated, cfg.gamma, cfg.lambda_)
            mean_sq = float(self.allreduce_mean(np.array([np.mean(adv ** 2)]))[0])
            self.sqd_adv_norm += cfg.moving_average_sqd_adv_norm_update_rate * (mean_sq - self.sqd_adv_norm)
            tensors["advantages"] = torch.as_tensor(adv, device=self.device)
            tensors["value_targets"] = torch.as_tensor(targets, device=self.device)
        num_minibatches = -(-cfg.train_batch_size_per_learner // cfg.minibatch_size)
        norm = self.sqd_adv_norm
        out = self.sgd(tensors, lambda mb: marwil_loss(self.module, mb, cfg, norm),
                       len(b), cfg.minibatch_size, num_minibatches, cfg.num_epochs)
        out["moving_average_sqd_adv_norm"] = self.sqd_adv_norm
        out["num_module_steps_trained"] = float(len(b))
        return out

