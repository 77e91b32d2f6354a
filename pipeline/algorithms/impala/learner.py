"""What an IMPALA learner runs: ``impala_loss`` (pure) and ``IMPALALearner``. Imports no Ray Tune."""
from __future__ import annotations

from typing import Any

import torch

from actors.learner import Learner, grad_if, piecewise
from actors.modules import RLModule
from actors.modules.normalizers import value_error
from pipeline.algorithms.impala.config import IMPALAConfig
from pipeline.algorithms.returns import explained_variance
from pipeline.algorithms.vtrace import sgd_epochs, value_pass, vtrace_targets
from protocols.episode import EpisodeChunk


def impala_loss(module: RLModule, batch: dict[str, Any], config: IMPALAConfig,
                entropy_coeff: float | None = None, out: dict[str, torch.Tensor] | None = None
                ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """IMPALA's loss on one (mini)batch.

    ``batch`` holds ``obs``, ``actions`` and the V-trace results ``vtrace_targets`` (value
    targets v_s) and ``pg_advantages`` (``clip(rho_s) * (r_s + gamma * v_{s+1} - V(x_s))``).
    Policy loss ``-mean(logp * pg_advantages)``, value loss ``0.5 * mean((V - v_s)^2)``, minus
    the entropy bonus. ``entropy_coeff`` defaults to ``config.entropy_coeff`` (a number). ``out``: the
    module's outputs for these steps when the caller computed them (a recurrent module's sequences).
    """
    entropy_coeff = config.entropy_coeff if entropy_coeff is None else entropy_coeff
    if out is None:
        out = module.forward_train(batch["obs"])
    dist = module.action_dist(out["action_dist_inputs"])
    logp = dist.logp(batch["actions"])
    policy_loss = -(logp * batch["pg_advantages"]).mean()
    targets = batch["vtrace_targets"]
    vf_loss = 0.5 * value_error(module, out["vf_preds"], targets).pow(2).mean()
    total = policy_loss + config.vf_loss_coeff * vf_loss
    with grad_if(entropy_coeff != 0):
        entropy = dist.entropy().mean()
    if entropy_coeff != 0:
        total = total - entropy_coeff * entropy
    with torch.no_grad():
        stats = {"policy_loss": policy_loss.detach(), "vf_loss": vf_loss.detach(), "entropy": entropy.detach(),
                 "total_loss": total.detach(),
                 "vf_explained_var": explained_variance(targets, out["vf_preds"])}
    return total, stats


class IMPALALearner(Learner):
    """V-trace targets with the learner's current policy and values, then SGD on ``impala_loss``."""

    adam_eps = 1e-2
    """runnel's IMPALA since 2026-12-06 (1e-5 before; the paper's RMSProp used 0.01). Once CartPole is solved
    every episode lasts 500 and the advantages fade; at 1e-5 Adam scales faded gradients back up to full-size
    steps (the likely reason), and with two passes per batch 7 of 16 runs fell from 500 to a return of 9 when
    run on to 1M env steps (8 ended below 450); at 1e-3 none of 8, at 1e-2 one of 16 dipped below 50 and climbed
    back, none ended below 450 (``tests/benchmarks/impala_stability.py``; rows in
    ``results_impala_clip_amd_2026-12-06.jsonl``)."""

    def __init__(self, config: IMPALAConfig, observation_space: Any, action_space: Any, **placement: Any) -> None:
        self.config = config
        super().__init__(config.learner_settings(), observation_space, action_space, **placement)

    def train_on_batch(self, chunks: list[EpisodeChunk], timestep: int) -> dict[str, float]:
        cfg = self.config
        b, values, dist_inputs, seq = value_pass(self, chunks)
        with torch.no_grad():
            target_logp = self.module.action_dist(dist_inputs).logp(b.actions)
        behaviour_logp = b.extra["action_logp"]
        vs, pg_adv = vtrace_targets(cfg, b, behaviour_logp, target_logp, values)
        self.update_return_stats(vs)
        tensors = {"obs": b.obs, "actions": b.actions, "vtrace_targets": vs, "pg_advantages": pg_adv}
        entropy_coeff = piecewise(cfg.entropy_coeff, timestep)
        out = sgd_epochs(self, cfg, tensors, lambda mb, out: impala_loss(self.module, mb, cfg, entropy_coeff, out),
                         len(b), seq)
        self.update_input_stats(b.obs)
        rho = torch.exp(target_logp - behaviour_logp)
        out["mean_rho"] = float(rho.mean())
        out["rho_clipped_fraction"] = float((rho > cfg.vtrace_clip_rho_threshold).float().mean())
        out["curr_entropy_coeff"] = entropy_coeff
        out["num_module_steps_trained"] = float(len(b))
        return out

