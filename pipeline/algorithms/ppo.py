"""PPO: proximal policy optimization (Schulman et al., 2017), synchronous.

Each training step: every env runner samples its share of ``train_batch_size_per_learner``
steps with the current weights; the learner(s) compute GAE with their own value function and
run ``num_epochs`` passes of minibatch SGD on the clipped surrogate loss; new weights go out.
Here: ``PPOConfig`` (settings), ``ppo_loss`` (a pure function of module, batch and config),
``PPOLearner`` (its update and its one piece of state, the KL coefficient) and ``PPO`` (the step).

The defaults solve CartPole-v1 and are sound elsewhere (``tuned/cartpole-ppo.yaml`` holds CartPole's faster
settings: half the env steps); scale ``train_batch_size_per_learner`` up for harder tasks.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

import numpy as np
import torch

from actors.learner import Learner, as_batch, grad_if, piecewise
from actors.learner.sequences import chunks_to_sequences, sequence_outputs, sequence_sgd
from actors.modules import RLModule
from pipeline.algorithm import Algorithm
from pipeline.algorithms.returns import adapt_kl_coeff, gae, normalized
from pipeline.config.base import AlgorithmConfig
from pipeline.registry import register_algorithm
from protocols import nested
from protocols.episode import EpisodeChunk


@dataclass
class PPOConfig(AlgorithmConfig):
    algo_name = "PPO"
    trains_on_policy = True
    supports_recurrent: ClassVar[bool] = True
    """``model_config`` ``use_lstm``: the learner unrolls chunks as sequences (``train_on_sequences``)."""

    gamma: float = 0.995
    """Discount factor. 0.995 (a ~200-step horizon) rather than 0.99: on CartPole-v1 it reached a mean
    return of 450 within 200k steps on 8 of 8 seeds, where 0.99 missed on 1 of 8."""
    lr: float | list = 1e-3
    """Learning rate, or a piecewise-linear schedule ``[[timestep, lr], ...]``."""
    train_batch_size_per_learner: int = 2000
    """Env steps per learner per update."""
    minibatch_size: int = 500
    """Steps per SGD minibatch."""
    num_epochs: int = 8
    """SGD passes over each train batch."""
    lambda_: float = 0.95
    """GAE lambda: bias/variance trade-off of the advantage estimate."""
    use_gae: bool = True
    """Use GAE advantages; False uses plain discounted returns minus the value baseline (lambda = 1)."""
    use_critic: bool = True
    """Learn a value function (needed for GAE)."""
    clip_param: float = 0.2
    """PPO clip range for the probability ratio."""
    vf_clip_param: float | None = None
    """Clip the squared value error at this (RLlib's default of 10 stalls the critic once returns
    exceed ~3, so runnel leaves it off); None disables."""
    vf_loss_coeff: float = 0.5
    """Weight of the value loss in the total loss."""
    entropy_coeff: float | list = 0.0
    """Weight of the entropy bonus, or a schedule ``[[timestep, coeff], ...]``."""
    use_kl_loss: bool = False
    """Add an adaptive KL(old || new) penalty to the loss."""
    kl_coeff: float = 0.2
    """Initial coefficient of the KL penalty."""
    kl_target: float = 0.01
    """The KL coefficient grows x1.5 when the KL exceeds 2x this, and halves below half of it."""
    normalize_advantages: bool = True
    """Standardize advantages per minibatch."""

    def _problems(self) -> list[str]:
        problems = super()._problems()
        if not 0 < self.clip_param < 1:
            problems.append(f"clip_param must be in (0, 1), got {self.clip_param!r}")
        if not 0 <= self.lambda_ <= 1:
            problems.append(f"lambda_ must be in [0, 1], got {self.lambda_!r}")
        if self.use_gae and not self.use_critic:
            problems.append("use_gae=True needs use_critic=True (GAE bootstraps from the value function)")
        if self.minibatch_size > self.train_batch_size_per_learner:
            problems.append(f"minibatch_size ({self.minibatch_size}) must not exceed train_batch_size_per_learner "
                            f"({self.train_batch_size_per_learner})")
        return problems


def ppo_loss(module: RLModule, batch: dict[str, Any], config: PPOConfig, kl_coeff: float,
             entropy_coeff: float, out: dict[str, torch.Tensor] | None = None
             ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Clipped-surrogate PPO loss on one minibatch.

    ``batch`` holds ``obs``, ``actions``, ``action_logp`` and ``action_dist_inputs`` (of the
    policy that sampled), ``advantages`` and ``value_targets``. ``out``: the module's outputs for these
    steps when the caller computed them (a recurrent module unrolls whole sequences); else
    ``forward_train(obs)``.
    """
    if out is None:
        out = module.forward_train(batch["obs"])
    dist = module.action_dist(out["action_dist_inputs"])
    logp = dist.logp(batch["actions"])
    ratio = torch.exp(logp - batch["action_logp"])
    adv = batch["advantages"]
    if config.normalize_advantages:
        adv = normalized(adv)
    surrogate = torch.min(ratio * adv, ratio.clamp(1 - config.clip_param, 1 + config.clip_param) * adv)
    policy_loss = -surrogate.mean()
    total = policy_loss
    with grad_if(entropy_coeff != 0):
        entropy = dist.entropy().mean()
    if entropy_coeff != 0:
        total = total - entropy_coeff * entropy
    with grad_if(config.use_kl_loss):
        kl = module.action_dist(batch["action_dist_inputs"]).kl(dist).mean()
    if config.use_kl_loss:
        total = total + kl_coeff * kl
    stats = {"policy_loss": policy_loss.detach(), "entropy": entropy.detach(), "mean_kl_loss": kl.detach()}
    if config.use_critic:
        vf_err = (out["vf_preds"] - batch["value_targets"]).pow(2)
        vf_loss = vf_err.clamp(max=config.vf_clip_param) if config.vf_clip_param is not None else vf_err
        vf_mean = vf_loss.mean()
        total = total + config.vf_loss_coeff * vf_mean
        with torch.no_grad():
            var = batch["value_targets"].var()
            stats |= {"vf_loss": vf_mean.detach(), "vf_loss_unclipped": vf_err.mean(),
                      "vf_explained_var": 1 - (batch["value_targets"] - out["vf_preds"]).var() / var
                      if var > 0 else torch.tensor(0.0)}
    stats["total_loss"] = total.detach()
    return total, stats


class PPOLearner(Learner):
    """GAE with the learner's own value function, then ``num_epochs`` of minibatch SGD on ``ppo_loss``;
    the KL coefficient adapts after each update when ``use_kl_loss`` is on."""

    state_fields = ("kl_coeff",)
    fused_adam = True  # an SGD step of the 64x64 default nets: 1.3 ms fused, 1.8 ms with the default Adam

    def __init__(self, config: PPOConfig, observation_space: Any = None, action_space: Any = None,
                 **placement: Any) -> None:
        self.config = config
        self.kl_coeff = float(config.kl_coeff)
        super().__init__(config.learner_settings(), observation_space, action_space, **placement)

    def train_on_batch(self, chunks: list[EpisodeChunk], timestep: int) -> dict[str, float]:
        if getattr(self.module, "is_recurrent", False):
            return self.train_on_sequences(chunks, timestep)
        cfg = self.config
        b = as_batch(chunks, self.device)
        if cfg.use_critic:
            with torch.no_grad():
                values = self.module.compute_values(b.all_obs).cpu().numpy()
        else:
            values = np.zeros(len(b) + len(b.lengths), np.float32)
        lam = cfg.lambda_ if cfg.use_gae else 1.0
        adv, targets = gae(b.rewards, values, b.lengths, b.terminated, cfg.gamma, lam)
        tensors = {"obs": b.obs, "actions": b.actions, "action_logp": b.extra["action_logp"],
                   "action_dist_inputs": b.extra["action_dist_inputs"],
                   "advantages": torch.as_tensor(adv, device=self.device),
                   "value_targets": torch.as_tensor(targets, device=self.device)}
        kl_coeff, entropy_coeff = self.kl_coeff, piecewise(cfg.entropy_coeff, timestep)
        # The minibatch count comes from the config, not the shard size: data-parallel learners must
        # take the same number of steps to meet at every gradient all-reduce.
        num_minibatches = -(-cfg.train_batch_size_per_learner // cfg.minibatch_size)
        out = self.sgd(tensors, lambda mb: ppo_loss(self.module, mb, cfg, kl_coeff, entropy_coeff),
                       len(b), cfg.minibatch_size, num_minibatches, cfg.num_epochs)
        return self._after_sgd(out, kl_coeff, entropy_coeff, len(b))

    def _after_sgd(self, out: dict[str, float], kl_coeff: float, entropy_coeff: float, steps: int) -> dict[str, float]:
        """The KL coefficient adapted to the update's KL, and the coefficients and step count reported."""
        if self.config.use_kl_loss:
            kl = float(self.allreduce_mean(np.array([out["mean_kl_loss"]]))[0])
            self.kl_coeff = adapt_kl_coeff(kl_coeff, kl, self.config.kl_target)
        out["curr_kl_coeff"] = self.kl_coeff
        out["curr_entropy_coeff"] = entropy_coeff
        out["num_module_steps_trained"] = float(steps)
        return out


    def train_on_sequences(self, chunks: list[EpisodeChunk], timestep: int) -> dict[str, float]:
        """A recurrent module: GAE as usual, then minibatches of whole chunks, each unrolled from its
        ``state_in`` (``actors.learner.sequences``); the loss sees the real steps only."""
        cfg = self.config
        b = as_batch(chunks, self.device)
        seq = chunks_to_sequences(list(chunks), self.device)
        if cfg.use_critic:
            with torch.no_grad():
                values = sequence_outputs(self.module, seq)["vf_all"].cpu().numpy()
        else:
            values = np.zeros(len(b) + len(b.lengths), np.float32)
        lam = cfg.lambda_ if cfg.use_gae else 1.0
        adv, targets = gae(b.rewards, values, b.lengths, b.terminated, cfg.gamma, lam)
        steps = {"actions": b.actions, "action_logp": b.extra["action_logp"],
                 "action_dist_inputs": b.extra["action_dist_inputs"],
                 "advantages": torch.as_tensor(adv, device=self.device),
                 "value_targets": torch.as_tensor(targets, device=self.device)}
        kl_coeff, entropy_coeff = self.kl_coeff, piecewise(cfg.entropy_coeff, timestep)
        num_minibatches = -(-cfg.train_batch_size_per_learner // cfg.minibatch_size)
        out = sequence_sgd(self, seq, steps, lambda mb, out: ppo_loss(self.module, mb, cfg, kl_coeff, entropy_coeff, out),
                           len(b), cfg.minibatch_size, num_minibatches, cfg.num_epochs)
        return self._after_sgd(out, kl_coeff, entropy_coeff, len(b))


@register_algorithm
class PPO(Algorithm):
    config_class = PPOConfig
    learner_class = PPOLearner

    def training_step(self) -> None:
        """Sample a train batch from every runner, one learner update, weights out."""
        cfg, m = self.config, self.metrics
        batch_size = cfg.train_batch_size_per_learner * max(1, cfg.num_learners)
        sampled0 = self.counters["num_env_steps_sampled_lifetime"]
        with m.log_time("timers/env_runner_sampling_timer"):
            chunks = self.env_runner_group.sample(batch_size, m)
        sampled = self.counters["num_env_steps_sampled_lifetime"]
        # multi-agent chunks count agent steps: the learners are told the env steps the batch holds
        env_steps = {} if self.multi_agent is None else {"num_env_steps": sampled - sampled0}
        with m.log_time("timers/learner_update_timer"):
            self.learner_group.update(chunks, sampled, m, **env_steps)
        with m.log_time("timers/synch_weights"):
            self.sync_weights()
