"""SAC: soft actor-critic (Haarnoja et al., 2018) with twin critics, target critics and automatic
entropy tuning, for Box actions.

Each training step: env runners sample from the squashed-Gaussian policy, the chunks go into the
replay stage, and the learner trains on replayed batches as often as the replay ratio allows
(``pipeline.plans.offpolicy.OffPolicyPlan``). One update: the critics toward
``r + discount * (min target Q(s', a') - alpha * log pi(a'|s'))``, the actor toward
``min Q(s, a) - alpha * log pi(a|s)``, the temperature toward ``target_entropy``, each with its own
optimizer and learning rate; the target critics follow by Polyak averaging (``tau``). Here:
``SACConfig``, the three losses (pure functions of module, batch and config), ``SACLearner``, ``SAC``.
"""
from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Iterator

import torch

from actors.learner import Learner, Optimizer, batch_slices, combined_stats
from actors.modules import SACModule
from pipeline.algorithm import Algorithm
from pipeline.config.base import AlgorithmConfig
from pipeline.config.checks import check_schedule, is_number
from pipeline.plans.offpolicy import OffPolicyPlan, OffPolicySettings, polyak, to_tensors
from pipeline.registry import register_algorithm


@dataclass
class SACConfig(OffPolicySettings, AlgorithmConfig):
    algo_name = "SAC"

    num_envs_per_env_runner: int = 1
    """Sub-environments each runner steps as one vector."""
    rollout_fragment_length: int | str = 1
    """Steps per sub-env per training step (then the learner catches up with the replay ratio)."""
    num_env_runners: int = 0
    """Remote env runner actors; 0 samples in the driver process (SAC learns from few, expensive steps)."""
    train_batch_size_per_learner: int = 256
    """Transitions per replayed batch (one learner update each)."""
    training_intensity: float | None = 256.0
    """Transitions trained per transition sampled: 256 with batches of 256 is one update per env step."""
    replay_buffer_config: dict = field(default_factory=lambda: {"type": "EpisodeReplayBuffer", "capacity": 1_000_000})
    """See ``OffPolicySettings``; SAC keeps everything it ever sampled on small tasks."""
    min_sample_timesteps_per_iteration: int = 100
    """Env steps one ``train()`` samples at least (RLlib's SAC default): a training step samples one env step
    per sub-env, and a result per step cost a third of the time of the tuned Pendulum run."""
    actor_lr: float | list = 3e-4
    """Learning rate of the policy, or a schedule ``[[timestep, lr], ...]``."""
    critic_lr: float | list = 3e-4
    """Learning rate of the twin critics, or a schedule."""
    alpha_lr: float | list = 3e-4
    """Learning rate of the entropy temperature, or a schedule."""
    tau: float = 5e-3
    """Polyak coefficient of the target critics after every update."""
    twin_q: bool = True
    """Bootstrap from the smaller of two critics (clipped double Q, Fujimoto et al.)."""
    initial_alpha: float = 1.0
    """Initial entropy temperature."""
    target_entropy: float | str = "auto"
    """Entropy the temperature steers toward; "auto" is minus the action dimension."""
    grad_clip: float | None = None
    """Clip threshold for gradients (None: no clipping)."""
    model_config: dict = field(default_factory=lambda: {"fcnet_hiddens": [256, 256], "fcnet_activation": "relu"})
    """Settings of the actor's and the critics' networks (see ``actors.modules.ModelConfig``)."""

    def module_kwargs(self) -> dict[str, Any]:
        return {"initial_alpha": self.initial_alpha}

    def _problems(self) -> list[str]:
        problems = super()._problems() + self.offpolicy_problems()
        for key in ("actor_lr", "critic_lr", "alpha_lr"):
            problems += check_schedule(key, getattr(self, key))
        if not is_number(self.tau) or not 0 < self.tau <= 1:
            problems.append(f"tau must be in (0, 1], got {self.tau!r}")
        if not is_number(self.initial_alpha) or self.initial_alpha <= 0:
            problems.append(f"initial_alpha must be a number > 0, got {self.initial_alpha!r}")
        if self.target_entropy != "auto" and not is_number(self.target_entropy):
            problems.append(f"target_entropy must be 'auto' or a number, got {self.target_entropy!r}")
        return problems


def sac_critic_loss(module: SACModule, target: SACModule, batch: dict[str, Any], config: SACConfig,
                    alpha: torch.Tensor) -> tuple[torch.Tensor, dict[str, torch.Tensor], torch.Tensor]:
    """Soft Bellman error of both critics; returns (loss, stats, per-sample TD error for priorities)."""
    q1, q2 = module.q_values(batch["obs"], batch["actions"])
    with torch.no_grad():
        next_dist = module.action_dist(module.forward_inference(batch["next_obs"])["action_dist_inputs"])
        next_actions, next_logp = next_dist.rsample_with_logp()
        tq1, tq2 = target.q_values(batch["next_obs"], next_actions)
        next_q = torch.min(tq1, tq2) if config.twin_q else tq1
        y = batch["rewards"] + batch["discounts"] * (next_q - alpha * next_logp)
    w = batch["weights"]
    loss = 0.5 * (w * (q1 - y).pow(2)).mean() + (0.5 * (w * (q2 - y).pow(2)).mean() if config.twin_q else 0.0)
    td_error = (0.5 * ((q1 - y).abs() + (q2 - y).abs()) if config.twin_q else (q1 - y).abs()).detach()
    stats = {"qf_loss": loss.detach(), "qf_mean": q1.detach().mean(), "qf_max": q1.detach().max(),
             "qf_min": q1.detach().min(), "td_error_mean": td_error.mean()}
    return loss, stats, td_error


def sac_actor_loss(module: SACModule, batch: dict[str, Any], config: SACConfig,
                   alpha: torch.Tensor) -> tuple[torch.Tensor, dict[str, torch.Tensor], torch.Tensor]:
    """``alpha * log pi(a|s) - min Q(s, a)`` with reparameterized actions; returns the log-probs too."""
    dist = module.action_dist(module.forward_inference(batch["obs"])["action_dist_inputs"])
    actions, logp = dist.rsample_with_logp()
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
    state_fields = ("num_target_updates",)

    def __init__(self, config: SACConfig, observation_space: Any, action_space: Any, **placement: Any) -> None:
        self.config = config
        act_dim = int(action_space.shape[0]) if getattr(action_space, "shape", None) else 1
        self.target_entropy = -float(act_dim) if config.target_entropy == "auto" else float(config.target_entropy)
        self.num_target_updates = 0
        super().__init__(config.learner_settings(), observation_space, action_space, **placement)

    def build_targets(self) -> dict[str, torch.nn.Module]:
        target = self.build_module()
        target.load_state_dict(self.module.state_dict())
        return {"target": target}

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


@register_algorithm
class SAC(Algorithm):
    config_class = SACConfig
    learner_class = SACLearner

    def build_plan(self) -> OffPolicyPlan:
        return OffPolicyPlan.of(self)

    def training_step(self) -> None:
        self.plan.training_step()
