"""What a DQN learner runs: ``dqn_loss`` (pure: module, target, batch, settings), the categorical
projection of C51, and ``DQNLearner`` with its target network. Recurrent modules train on replayed
sequences with ``recurrent.r2d2_loss``. Imports no Ray Tune."""
from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from actors.learner import Learner, batch_slices, combined_stats
from actors.modules import QModule
from pipeline.algorithms.dqn.config import DQNConfig
from pipeline.algorithms.dqn.recurrent import r2d2_loss, sequence_priorities
from pipeline.plans.offpolicy import polyak, to_tensors
from protocols import nested


def dqn_loss(module: QModule, target: QModule, batch: dict[str, Any], config: DQNConfig
             ) -> tuple[torch.Tensor, dict[str, torch.Tensor], torch.Tensor]:
    """DQN's loss on a replayed batch; returns (loss, stats, per-sample TD error for priorities).

    ``batch`` holds ``obs``, ``actions``, ``rewards`` (n-step discounted sums), ``next_obs`` (the
    bootstrap observation), ``discounts`` (gamma**n, 0 after a terminal step) and ``weights``
    (importance weights; ones without prioritized replay). MultiDiscrete actions are trained branch
    by branch against their own targets, and the losses averaged. With action masks in the
    observations, the bootstrap action is the best *legal* next action.
    """
    n = len(batch["rewards"])
    actions = batch["actions"].long().reshape(n, -1)
    with torch.no_grad():
        target_out = target.forward_train(batch["next_obs"])
        target_logits = target_out["branch_logits"]
    if config.double_q:
        # one pass of the online net over obs and next obs (the small nets here cost per call, not
        # per row); the next-obs half only picks the bootstrap action, so it carries no gradient
        both = nested.map_structure(lambda a, b: torch.cat([a, b]), batch["obs"], batch["next_obs"])
        both_logits = module.forward_train(both)["branch_logits"]
        logits, select = [q[:n] for q in both_logits], [q[n:].detach() for q in both_logits]
    else:
        logits, select = module.forward_train(batch["obs"])["branch_logits"], target_logits
    weights, rewards, discounts = batch["weights"], batch["rewards"], batch["discounts"]
    select = legal_values(module, select, target_out.get("action_mask"))
    losses, td_errors, q_taken_all = [], [], []
    for b, (q, tq, sq) in enumerate(zip(logits, target_logits, select)):
        a = actions[:, b]
        if module.num_atoms == 1:
            q_taken = q.gather(1, a[:, None]).squeeze(1)
            with torch.no_grad():
                best = sq.argmax(-1, keepdim=True)
                y = rewards + discounts * tq.gather(1, best).squeeze(1)
            td = y - q_taken
            per_sample = F.huber_loss(q_taken, y, reduction="none") if config.td_error_loss_fn == "huber" \
                else 0.5 * td.pow(2)
            td_abs = td.abs().detach()
        else:
            support = module.support
            q_taken = (q.softmax(-1) * support).sum(-1).gather(1, a[:, None]).squeeze(1)
            with torch.no_grad():
                best = sq.argmax(-1)
                next_probs = tq.softmax(-1)[torch.arange(len(best)), best]
                projected = categorical_projection(next_probs, rewards, discounts, support)
            log_p = q.log_softmax(-1)[torch.arange(len(a)), a]
            per_sample = -(projected * log_p).sum(-1)
            td_abs = per_sample.detach()
        losses.append((weights * per_sample).mean())
        td_errors.append(td_abs)
        q_taken_all.append(q_taken.detach())
    loss = torch.stack(losses).mean()
    td_error = torch.stack(td_errors).mean(0)
    q_taken = torch.stack(q_taken_all).mean(0)
    stats = {"qf_loss": loss.detach(), "qf_mean": q_taken.mean(), "qf_min": q_taken.min(), "qf_max": q_taken.max(),
             "td_error_mean": td_error.mean()}
    return loss, stats, td_error


def legal_values(module: QModule, select: list[torch.Tensor], next_mask: torch.Tensor | None) -> list[torch.Tensor]:
    """Per branch, the expected Q-values that pick the bootstrap action ``[B, n]``, illegal next actions
    at the minimum (a next observation with no legal action -- a finished game -- keeps all: its
    discount is 0)."""
    with torch.no_grad():
        if module.num_atoms > 1:
            select = [(sq.softmax(-1) * module.support).sum(-1) for sq in select]
        if next_mask is None:
            return select
        masked = module.mask_outputs(torch.cat(select, -1), next_mask, acting=False)
        return list(torch.split(masked, [sq.shape[1] for sq in select], dim=-1))


def categorical_projection(probs: torch.Tensor, rewards: torch.Tensor, discounts: torch.Tensor,
                           support: torch.Tensor) -> torch.Tensor:
    """Project the distribution of ``rewards + discounts * Z`` (Z on ``support`` with ``probs``)
    back onto ``support`` (C51's projection, Bellemare et al. 2017, Algorithm 1)."""
    v_min, v_max, atoms = float(support[0]), float(support[-1]), support.numel()
    dz = (v_max - v_min) / (atoms - 1)
    tz = (rewards[:, None] + discounts[:, None] * support[None, :]).clamp(v_min, v_max)
    b = (tz - v_min) / dz
    lower, upper = b.floor().long(), b.ceil().long()
    # an atom that lands exactly on the grid would get no mass from (upper - b) + (b - lower) = 0
    lower[(upper > 0) & (lower == upper)] -= 1
    upper[(lower < atoms - 1) & (lower == upper)] += 1
    out = torch.zeros_like(probs)
    out.scatter_add_(1, lower.clamp(0, atoms - 1), probs * (upper.float() - b))
    out.scatter_add_(1, upper.clamp(0, atoms - 1), probs * (b - lower.float()))
    return out


class DQNLearner(Learner):
    """One gradient step per replayed batch; the target network follows by env steps sampled."""

    module_class = QModule
    fused_adam = True
    state_fields = ("last_target_update", "num_target_updates")

    def __init__(self, config: DQNConfig, observation_space: Any, action_space: Any, **placement: Any) -> None:
        self.config = config
        self.last_target_update = 0
        self.num_target_updates = 0
        super().__init__(config.learner_settings(), observation_space, action_space, **placement)

    def build_targets(self) -> dict[str, torch.nn.Module]:
        return {"target": self.module_copy()}

    def train_on_batch(self, batch: dict[str, Any], timestep: int) -> dict[str, float]:
        return self.train_on_batches(batch, timestep, 1)

    def train_on_batches(self, batch: dict[str, Any], timestep: int, num_batches: int) -> dict[str, float]:
        """One gradient step per slice, the batch converted to tensors once and the statistics read once."""
        cfg = self.config
        steps, td_errors = [], []
        recurrent = self.module.is_recurrent
        trained = 0
        for part in batch_slices(to_tensors(batch, self.device), num_batches):
            if recurrent:  # sequences: td_error per sequence, R2D2's priority mix
                loss, stats, td_abs, valid = r2d2_loss(
                    self.module, self.targets["target"], part, cfg.gamma, cfg.burn_in, cfg.td_error_loss_fn,
                    cfg.double_q, cfg.h_function_epsilon if cfg.use_h_function else None)
                td_error = sequence_priorities(td_abs, valid)
                trained = valid.sum()
            else:
                loss, stats, td_error = dqn_loss(self.module, self.targets["target"], part, cfg)
            stats["gradients_global_norm"] = self.apply_gradients(loss)
            if timestep - self.last_target_update >= cfg.target_network_update_freq:
                polyak(self.targets["target"], self.module, cfg.tau)
                self.last_target_update = timestep
                self.num_target_updates += 1
            steps.append(stats)
            td_errors.append(td_error)
        self.last_outputs = {"td_error": torch.cat(td_errors).cpu().numpy()}
        out = combined_stats(steps)
        out["num_target_updates"] = float(self.num_target_updates)
        out["num_module_steps_trained"] = float(trained) if recurrent else float(len(batch["rewards"]) // num_batches)
        return out

