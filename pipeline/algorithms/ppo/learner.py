"""What a PPO learner runs (in the driver or as a Ray actor): ``ppo_loss``, a pure function of module,
batch and settings, and ``PPOLearner``, GAE then minibatch SGD, with its one piece of state (the KL
coefficient). Imports no Ray Tune: learner actors load this module and the config's, not ``algorithm``."""
from __future__ import annotations

from typing import Any

import numpy as np
import torch

from actors.learner import Learner, as_batch, grad_if, piecewise
from actors.learner.sequences import chunks_to_sequences, sequence_outputs, sequence_sgd
from actors.modules import RLModule
from actors.modules.normalizers import value_error
from pipeline.algorithms.ppo.config import PPOConfig
from pipeline.algorithms.returns import adapt_kl_coeff, explained_variance, gae, normalized
from protocols.episode import EpisodeChunk


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
        vf_err = value_error(module, out["vf_preds"], batch["value_targets"]).pow(2)
        vf_loss = vf_err.clamp(max=config.vf_clip_param) if config.vf_clip_param is not None else vf_err
        vf_mean = vf_loss.mean()
        total = total + config.vf_loss_coeff * vf_mean
        with torch.no_grad():
            stats |= {"vf_loss": vf_mean.detach(), "vf_loss_unclipped": vf_err.mean(),
                      "vf_explained_var": explained_variance(batch["value_targets"], out["vf_preds"])}
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
        self.update_return_stats(targets)
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
        self.update_input_stats(b.obs)
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
        self.update_return_stats(targets)
        steps = {"actions": b.actions, "action_logp": b.extra["action_logp"],
                 "action_dist_inputs": b.extra["action_dist_inputs"],
                 "advantages": torch.as_tensor(adv, device=self.device),
                 "value_targets": torch.as_tensor(targets, device=self.device)}
        kl_coeff, entropy_coeff = self.kl_coeff, piecewise(cfg.entropy_coeff, timestep)
        num_minibatches = -(-cfg.train_batch_size_per_learner // cfg.minibatch_size)
        out = sequence_sgd(self, seq, steps, lambda mb, out: ppo_loss(self.module, mb, cfg, kl_coeff, entropy_coeff, out),
                           len(b), cfg.minibatch_size, num_minibatches, cfg.num_epochs)
        self.update_input_stats(b.obs)
        return self._after_sgd(out, kl_coeff, entropy_coeff, len(b))

