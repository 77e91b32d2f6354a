"""What a SAC learner runs: the critic, actor and temperature losses (pure functions of module, batch
and settings) and ``SACLearner``, which steps the three optimizers and the target critics. Imports
no Ray Tune."""
from __future__ import annotations

import math
from contextlib import contextmanager
from typing import Any, Iterator

import gymnasium as gym
import torch

from actors.learner import Learner, Optimizer, batch_slices, combined_stats
from actors.modules import SACModule
from pipeline.algorithms.sac.config import SACConfig
from pipeline.plans.offpolicy import polyak, to_tensors


def sac_critic_loss(module: SACModule, target: SACModule, batch: dict[str, Any], config: SACConfig,
                    alpha: torch.Tensor) -> tuple[torch.Tensor, dict[str, torch.Tensor], torch.Tensor]:
    """Soft Bellman error of both critics; returns (loss, stats, per-sample TD error for priorities).
    Discrete actions: the next state's soft value is the expectation over the policy's probabilities,
    ``sum_a pi(a|s') (min Q'(s', a) - alpha log pi(a|s'))``, instead of one sampled action's."""
    q1, q2 = module.q_values(batch["obs"], batch["actions"])
    with torch.no_grad():
        logits = module.forward_inference(batch["next_obs"])["action_dist_inputs"]
        if module.discrete:
            next_logp = torch.log_softmax(logits, -1)
            tq1, tq2 = target.all_q_values(batch["next_obs"])
            next_q = torch.min(tq1, tq2) if config.twin_q else tq1
            next_v = (next_logp.exp() * (next_q - alpha * next_logp)).sum(-1)
        else:
            next_actions, next_logp = module.action_dist(logits).rsample_with_logp()
            tq1, tq2 = target.q_values(batch["next_obs"], next_actions)
            next_q = torch.min(tq1, tq2) if config.twin_q else tq1
            next_v = next_q - alpha * next_logp
        y = batch["rewards"] + batch["discounts"] * next_v
    w = batch["weights"]
    loss = 0.5 * (w * (q1 - y).pow(2)).mean() + (0.5 * (w * (q2 - y).pow(2)).mean() if config.twin_q else 0.0)
    td_error = (0.5 * ((q1 - y).abs() + (q2 - y).abs()) if config.twin_q else (q1 - y).abs()).detach()
    stats = {"qf_loss": loss.detach(), "qf_mean": q1.detach().mean(), "qf_max": q1.detach().max(),
             "qf_min": q1.detach().min(), "td_error_mean": td_error.mean()}
    return loss, stats, td_error


def sac_actor_loss(module: SACModule, batch: dict[str, Any], config: SACConfig,
                   alpha: torch.Tensor) -> tuple[torch.Tensor, dict[str, torch.Tensor], torch.Tensor]:
    """``alpha * log pi(a|s) - min Q(s, a)`` with reparameterized actions; returns the log-probs too.
    Discrete actions: its expectation over the policy's probabilities (exact, no sample), and as "log-probs"
    each state's ``sum_a pi log pi`` (minus its entropy), which is what the temperature's loss needs."""
    logits = module.forward_inference(batch["obs"])["action_dist_inputs"]
    if module.discrete:
        log_pi = torch.log_softmax(logits, -1)
        q1, q2 = module.all_q_values(batch["obs"])
        q = torch.min(q1, q2) if config.twin_q else q1
        pi = log_pi.exp()
        loss = (pi * (alpha * log_pi - q)).sum(-1).mean()
        logp = (pi * log_pi).sum(-1)
    else:
        actions, logp = module.action_dist(logits).rsample_with_logp()
        q1, q2 = module.q_values(batch["obs"], actions)
        q = torch.min(q1, q2) if config.twin_q else q1
        loss = (alpha * logp - q).mean()
    return loss, {"actor_loss": loss.detach(), "entropy": -logp.detach().mean()}, logp.detach()


def sac_alpha_loss(log_alpha: torch.Tensor, logp: torch.Tensor, target_entropy: float) -> torch.Tensor:
    """Raises the temperature while the policy's entropy is below ``target_entropy``, lowers it above."""
    return -(log_alpha * (logp + target_entropy)).mean()


class SACLearner(Learner):
    """Critics, actor and temperature, each with its own optimizer, from one backward pass; target critics by Polyak."""

    module_class = SACModule
    fused_adam = True
    adam_eps = 1e-8  # torch's default, which SAC's (and CQL's) seeded runs were measured with
    state_fields = ("num_target_updates",)

    def __init__(self, config: SACConfig, observation_space: Any, action_space: Any, **placement: Any) -> None:
        self.config = config
        self.target_entropy = (auto_target_entropy(action_space, config.discrete_target_entropy_scale)
                               if config.target_entropy == "auto" else float(config.target_entropy))
        self.num_target_updates = 0
        super().__init__(config.learner_settings(), observation_space, action_space, **placement)

    def build_targets(self) -> dict[str, torch.nn.Module]:
        return {"target": self.module_copy()}

    def build_optimizers(self) -> dict[str, Optimizer]:
        cfg, m = self.config, self.module
        slots = {"actor": (m.actor_parameters(), cfg.actor_lr), "critic": (m.critic_parameters(), cfg.critic_lr),
                 "alpha": ([m.log_alpha], cfg.alpha_lr)}
        return {name: Optimizer(self.adam(params, lr), params, lr)
                for name, (params, lr) in slots.items()}

    def train_on_batch(self, batch: dict[str, Any], timestep: int) -> dict[str, float]:
        return self.train_on_batches(batch, timestep, 1)

    def train_on_batches(self, batch: dict[str, Any], timestep: int, num_batches: int) -> dict[str, float]:
        """One ``step`` per slice, the batch converted to tensors once and the statistics read once."""
        steps, td_errors = [], []
        for part in batch_slices(to_tensors(batch, self.device), num_batches):
            stats, td_error = self.step(part)
            steps.append(stats)
            td_errors.append(td_error)
        self.last_outputs = {"td_error": torch.cat(td_errors).cpu().numpy()}
        out = combined_stats(steps)
        out |= {"target_entropy": self.target_entropy, "num_target_updates": float(self.num_target_updates),
                "num_module_steps_trained": float(len(batch["rewards"]) // num_batches)}  # per update
        return out

    def step(self, t: dict[str, Any]) -> tuple[dict[str, Any], torch.Tensor]:
        """Critics, actor, temperature and target critics on one batch of tensors; returns the
        statistics (tensors, read later) and the per-sample TD errors.

        The three losses are computed first and minimised in one backward pass (as RLlib's SAC learner
        does): each reaches only its own optimizer's parameters -- the critics' targets and the
        temperature in the actor's loss are constants, and the critics' weights are frozen while the
        actor's loss goes through them -- so the sum's gradients are each loss's own. The actor's loss
        therefore sees the critics before this update, not after it."""
        cfg, m = self.config, self.module
        alpha = m.log_alpha.exp().detach()
        critic_loss, stats, td_error = sac_critic_loss(m, self.targets["target"], t, cfg, alpha)
        with frozen(self.optimizers["critic"].params):  # the actor's loss needs no gradients of the critics' weights
            actor_loss, actor_stats, logp = sac_actor_loss(m, t, cfg, alpha)
        alpha_loss = sac_alpha_loss(m.log_alpha, logp, self.target_entropy)
        critic_norm, actor_norm, _ = self.apply_gradients_to(critic_loss + actor_loss + alpha_loss,
                                                             ("critic", "actor", "alpha"))
        polyak(self.targets["target"], m, cfg.tau, prefixes=("q_encoder.", "qf1.", "qf2."))
        self.num_target_updates += 1
        stats |= actor_stats
        stats |= {"critic_gradients_global_norm": critic_norm, "actor_gradients_global_norm": actor_norm,
                  "alpha_loss": alpha_loss.detach(), "alpha_value": alpha}
        return stats, td_error


def auto_target_entropy(action_space: Any, discrete_scale: float) -> float:
    """``target_entropy="auto"``: minus the action dimension for a Box (Haarnoja et al.); for Discrete(n),
    ``discrete_scale`` times the uniform policy's entropy ``log n``."""
    if isinstance(action_space, gym.spaces.Discrete):
        return float(discrete_scale * math.log(int(action_space.n)))
    return -float(action_space.shape[0])


@contextmanager
def frozen(params: list[torch.nn.Parameter]) -> Iterator[None]:
    """``params`` take no gradients inside the block (what flows through them still does)."""
    for p in params:
        p.requires_grad_(False)
    try:
        yield
    finally:
        for p in params:
            p.requires_grad_(True)

