"""IMPALA: importance-weighted actor-learner architecture (Espeholt et al., 2018), asynchronous.

Runners stream fragments, the learner trains on whatever arrives and corrects the policy lag with
V-trace (the ratio of the learner's and the behaviour policy's action probabilities); the loop is
``pipeline.plans.asynchronous.AsyncPlan``. Here: ``IMPALAConfig``, ``impala_loss`` (a pure function of
module, batch and config), ``IMPALALearner`` and ``IMPALA``. With ``num_learners=0`` the learner runs in
the driver beside the loader thread that receives every stream; with ``num_learners=n`` it runs as n Ray
actors, each receiving the streams of its own env runners (runner i feeds learner ``i mod n``) and
cutting its own batches of ``train_batch_size_per_learner`` steps, gradients averaged every minibatch
and weights broadcast from learner 0 (``actors.learner.feed``, ``pipeline.plans.learner_feeds``).
Multi-agent runs and external clients train with ``num_learners=0`` only.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from actors.learner import Learner, grad_if, piecewise
from actors.modules import RLModule
from pipeline.algorithm import Algorithm
from pipeline.algorithms.vtrace import VTraceSettings, sgd_epochs, value_pass, vtrace_targets
from pipeline.plans.asynchronous import AsyncPlan, AsyncPlanSettings
from pipeline.config.base import AlgorithmConfig
from pipeline.registry import register_algorithm
from protocols.episode import EpisodeChunk


# defaults tuned for CartPole-speed tasks; they are sound elsewhere (scale the batch up for harder ones)
@dataclass
class IMPALAConfig(VTraceSettings, AsyncPlanSettings, AlgorithmConfig):
    algo_name = "IMPALA"

    def _problems(self) -> list[str]:
        return super()._problems() + self.async_plan_problems() + self.vtrace_problems()


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
    vf_loss = 0.5 * (out["vf_preds"] - targets).pow(2).mean()
    total = policy_loss + config.vf_loss_coeff * vf_loss
    with grad_if(entropy_coeff != 0):
        entropy = dist.entropy().mean()
    if entropy_coeff != 0:
        total = total - entropy_coeff * entropy
    with torch.no_grad():
        var = targets.var() if targets.numel() > 1 else torch.tensor(0.0)
        stats = {"policy_loss": policy_loss.detach(), "vf_loss": vf_loss.detach(), "entropy": entropy.detach(),
                 "total_loss": total.detach(),
                 "vf_explained_var": 1 - (targets - out["vf_preds"]).var() / var if var > 0 else torch.tensor(0.0)}
    return total, stats


class IMPALALearner(Learner):
    """V-trace targets with the learner's current policy and values, then SGD on ``impala_loss``."""

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
        tensors = {"obs": b.obs, "actions": b.actions, "vtrace_targets": vs, "pg_advantages": pg_adv}
        entropy_coeff = piecewise(cfg.entropy_coeff, timestep)
        out = sgd_epochs(self, cfg, tensors, lambda mb, out: impala_loss(self.module, mb, cfg, entropy_coeff, out),
                         len(b), seq)
        rho = torch.exp(target_logp - behaviour_logp)
        out["mean_rho"] = float(rho.mean())
        out["rho_clipped_fraction"] = float((rho > cfg.vtrace_clip_rho_threshold).float().mean())
        out["curr_entropy_coeff"] = entropy_coeff
        out["num_module_steps_trained"] = float(len(b))
        return out


@register_algorithm
class IMPALA(Algorithm):
    config_class = IMPALAConfig
    learner_class = IMPALALearner

    def build_plan(self) -> AsyncPlan:
        return AsyncPlan(self.config, self.env_runner_group, self.learner_group, self.metrics,
                         self.observation_space, self.action_space, compress=self.compress_frames(),
                         multi_agent=self.multi_agent)

    def training_step(self) -> None:
        self.plan.training_step()
