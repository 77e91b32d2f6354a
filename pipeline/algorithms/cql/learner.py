"""What a CQL learner runs: ``cql_regularizer`` and ``bc_actor_loss`` (pure) and ``CQLLearner``, SAC's
learner with the conservative critic step. Imports no Ray Tune."""
from __future__ import annotations

import math
from typing import Any

import gymnasium as gym
import torch

from actors.learner import Optimizer
from actors.modules import SACModule
from pipeline.algorithms.cql.config import CQLConfig
from pipeline.algorithms.sac.learner import SACLearner, frozen, sac_actor_loss, sac_alpha_loss, sac_critic_loss
from pipeline.plans.offpolicy import polyak


def cql_regularizer(module: SACModule, batch: dict[str, Any], config: Any,
                    q_data: tuple[torch.Tensor, torch.Tensor]) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """``min_q_weight * (temperature * logsumexp(Q(s, a~) / temperature) - Q(s, a_data))`` per critic,
    summed over the twin critics, with ``a~`` uniform random and policy actions (importance-weighted
    by their densities, CQL(H) of the paper). ``q_data``: both critics' Q of the recorded actions."""
    obs, next_obs = batch["obs"], batch["next_obs"]
    n, b = config.num_actions, q_data[0].shape[0]
    act_dim = batch["actions"].shape[-1] if batch["actions"].dim() > 1 else 1

    def repeat(x: torch.Tensor) -> torch.Tensor:  # [B, ...] -> [B * n, ...], each row n times
        return x.repeat_interleave(n, dim=0)

    obs_rep, next_rep = repeat(obs), repeat(next_obs)
    with torch.no_grad():
        random_actions = torch.rand(b * n, act_dim, device=obs.device) * 2 - 1
        random_logp = torch.full((b * n,), act_dim * math.log(0.5), device=obs.device)  # uniform on [-1, 1]^d
        # the policy's actions are candidates for the critics' soft maximum: no gradient goes to the actor
        curr_actions, curr_logp = module.action_dist(
            module.forward_inference(obs_rep)["action_dist_inputs"]).rsample_with_logp()
        next_actions, next_logp = module.action_dist(
            module.forward_inference(next_rep)["action_dist_inputs"]).rsample_with_logp()
    if batch["actions"].dim() == 1:
        random_actions = random_actions.squeeze(-1)
    total = torch.zeros((), device=obs.device)
    stats: dict[str, torch.Tensor] = {}
    candidates = [(random_actions, random_logp), (curr_actions, curr_logp), (next_actions, next_logp)]
    qs = [module.q_values(obs_rep, a) for a, _ in candidates]  # each (q1, q2), [B * n]
    for k in range(2 if config.twin_q else 1):
        cat = torch.cat([(q[k] - logp).view(b, n) for q, (_, logp) in zip(qs, candidates)], dim=1)
        soft_max = torch.logsumexp(cat / config.temperature, dim=1) * config.temperature
        gap = (soft_max - q_data[k]).mean()
        total = total + config.min_q_weight * gap
        stats[f"cql_gap_q{k + 1}"] = gap.detach()
    return total, stats


def discrete_problem(action_space: Any) -> str | None:
    """Why CQL cannot train on ``action_space`` (None: it can): its regularizer draws uniform Box actions and
    their densities."""
    if not isinstance(action_space, gym.spaces.Discrete):
        return None
    return (f"CQL needs a 1-d Box action space, got {action_space}; for Discrete actions train from the recording "
            f"with BC or MARWIL, or mix it into DQN (offline_data(input_=...))")


class CQLLearner(SACLearner):
    """SAC's updates with CQL's regularizer in the critic step and behaviour cloning for the actor's
    first ``bc_iters`` updates; with ``lagrangian``, a learned multiplier on the regularizer."""

    module_class = SACModule
    state_fields = ("num_target_updates", "log_alpha_prime_value")

    def __init__(self, config: CQLConfig, observation_space: Any, action_space: Any, **placement: Any) -> None:
        problem = discrete_problem(action_space)  # a module added later reaches the learner without check_spaces
        if problem is not None:
            raise ValueError(problem)
        self.log_alpha_prime = torch.nn.Parameter(torch.zeros(()))
        super().__init__(config, observation_space, action_space, **placement)

    @property
    def log_alpha_prime_value(self) -> float:
        return float(self.log_alpha_prime.detach())

    @log_alpha_prime_value.setter
    def log_alpha_prime_value(self, value: float) -> None:
        with torch.no_grad():
            self.log_alpha_prime.fill_(float(value))

    def build_optimizers(self) -> dict[str, Optimizer]:
        slots = super().build_optimizers()
        if self.config.lagrangian:
            self.log_alpha_prime = torch.nn.Parameter(self.log_alpha_prime.detach().to(self.device))
            slots["alpha_prime"] = Optimizer(self.adam([self.log_alpha_prime], self.config.critic_lr),
                                             [self.log_alpha_prime], self.config.critic_lr)
        return slots

    def step(self, t: dict[str, Any]) -> tuple[dict[str, Any], torch.Tensor]:
        """SAC's step (every loss from the weights before this update, one backward pass) with the
        regularizer in the critics' loss and, with ``lagrangian``, the multiplier's loss beside them."""
        cfg, m = self.config, self.module
        alpha = m.log_alpha.exp().detach()
        critic_loss, stats, td_error = sac_critic_loss(m, self.targets["target"], t, cfg, alpha)
        q_data = m.q_values(t["obs"], t["actions"])
        reg, reg_stats = cql_regularizer(m, t, cfg, q_data)
        stats |= reg_stats
        slots, total = ("critic", "actor", "alpha"), critic_loss
        if cfg.lagrangian:
            alpha_prime = self.log_alpha_prime.exp().clamp(0.0, 1e6)
            n_q = 2 if cfg.twin_q else 1
            total = total + alpha_prime.detach() * (reg - n_q * cfg.min_q_weight * cfg.lagrangian_thresh)
            total = total - alpha_prime * (reg.detach() - n_q * cfg.min_q_weight * cfg.lagrangian_thresh)
            slots += ("alpha_prime",)
            stats["alpha_prime_value"] = alpha_prime.detach()
        else:
            total = total + reg
        stats["cql_loss"] = reg.detach()
        with frozen(self.optimizers["critic"].params):
            if self.num_target_updates < cfg.bc_iters:  # counts batches (num_updates counts optimizer steps)
                actor_loss, actor_stats, logp = bc_actor_loss(m, t, alpha)
            else:
                actor_loss, actor_stats, logp = sac_actor_loss(m, t, cfg, alpha)
        stats |= actor_stats
        alpha_loss = sac_alpha_loss(m.log_alpha, logp, self.target_entropy)
        norms = self.apply_gradients_to(total + actor_loss + alpha_loss, slots)
        polyak(self.targets["target"], m, cfg.tau, prefixes=("q_encoder.", "qf1.", "qf2."))
        self.num_target_updates += 1
        stats |= {"critic_gradients_global_norm": norms[0], "actor_gradients_global_norm": norms[1],
                  "alpha_loss": alpha_loss.detach(), "alpha_value": alpha}
        return stats, td_error


def bc_actor_loss(module: SACModule, batch: dict[str, Any],
                  alpha: torch.Tensor) -> tuple[torch.Tensor, dict[str, torch.Tensor], torch.Tensor]:
    """``alpha * log pi(a~|s) - log pi(a_data|s)``: imitate the recorded actions, keep the entropy term."""
    dist = module.action_dist(module.forward_inference(batch["obs"])["action_dist_inputs"])
    _, logp = dist.rsample_with_logp()
    data_logp = dist.logp(batch["actions"])
    loss = (alpha * logp - data_logp).mean()
    return loss, {"actor_loss": loss.detach(), "bc_logp": data_logp.detach().mean(),
                  "entropy": -logp.detach().mean()}, logp.detach()

