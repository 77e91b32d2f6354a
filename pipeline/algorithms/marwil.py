"""MARWIL: monotonic advantage re-weighted imitation learning (Wang et al., 2018), from recordings.

Trains on recorded experience (``config.offline_data(input_=DIR)``; readers take the env
runners' place, so no env is stepped -- an env, if given, serves evaluation only). Each training
step reads ``train_batch_size_per_learner`` recorded steps; the learner estimates advantages with
its own value function (GAE with ``lambda_``, 1.0 by default: discounted returns bootstrapped at
a chunk's cut-off end), and fits the policy by log-likelihood of the recorded actions weighted by
``exp(beta * advantage / sqrt(c))``, where ``c`` is a slow moving average of squared advantages.
``beta = 0`` is plain behaviour cloning (``pipeline/algorithms/bc.py``). Here: ``MARWILConfig``,
``marwil_loss`` (pure), ``MARWILLearner`` (its one piece of state: the moving average), ``MARWIL``.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from actors.learner import Learner, as_batch
from actors.modules import RLModule
from pipeline.algorithm import Algorithm
from pipeline.algorithms.returns import gae
from pipeline.config.base import AlgorithmConfig
from pipeline.config.checks import is_number
from pipeline.config.offline import input_required_problems
from pipeline.registry import register_algorithm
from protocols.episode import EpisodeChunk

MAX_EXPONENT = 20.0
"""Cap of ``beta * advantage / sqrt(c)``: one outlier advantage must not make a weight of inf."""


@dataclass
class MARWILConfig(AlgorithmConfig):
    algo_name = "MARWIL"

    beta: float = 1.0
    """Advantage weighting: 0 is behaviour cloning, larger trusts the advantage estimate more."""
    vf_coeff: float = 1.0
    """Weight of the value function's loss (the value function estimates the advantages)."""
    moving_average_sqd_adv_norm_start: float = 100.0
    """Initial moving average of squared advantages (the weights' normalizer)."""
    moving_average_sqd_adv_norm_update_rate: float = 1e-8
    """Rate at which that average follows the batches' mean squared advantage."""
    lambda_: float = 1.0
    """GAE lambda of the advantage estimate (1.0: bootstrapped discounted returns minus the baseline)."""
    lr: float | list = 1e-4
    """Learning rate, or a piecewise-linear schedule ``[[timestep, lr], ...]``."""
    gamma: float = 0.99
    """Discount of the returns the advantages are estimated from."""
    train_batch_size_per_learner: int = 2000
    """Recorded steps per learner per update."""
    minibatch_size: int = 2000
    """Steps per SGD minibatch (default: the whole batch, one step, as RLlib's MARWIL)."""
    num_epochs: int = 1
    """SGD passes over each batch."""
    rollout_fragment_length: int | str = "auto"
    """Recorded steps a reader hands over per request ("auto": the train batch split over readers)."""

    def _problems(self) -> list[str]:
        problems = super()._problems() + input_required_problems(self)
        for key in ("beta", "vf_coeff", "moving_average_sqd_adv_norm_start", "moving_average_sqd_adv_norm_update_rate"):
            value = getattr(self, key)
            if not is_number(value) or value < 0:
                problems.append(f"{key} must be a number >= 0, got {value!r}")
        if is_number(self.moving_average_sqd_adv_norm_start) and self.moving_average_sqd_adv_norm_start <= 0:
            problems.append("moving_average_sqd_adv_norm_start must be > 0 (it divides the advantages)")
        if not is_number(self.lambda_) or not 0 <= self.lambda_ <= 1:
            problems.append(f"lambda_ must be in [0, 1], got {self.lambda_!r}")
        if self.minibatch_size > self.train_batch_size_per_learner:
            problems.append(f"minibatch_size ({self.minibatch_size}) must not exceed train_batch_size_per_learner "
                            f"({self.train_batch_size_per_learner})")
        return problems


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


def offline_training_step(algo: Algorithm) -> None:
    """Read a train batch from the readers, one learner update, weights to the evaluators' source."""
    cfg, m = algo.config, algo.metrics
    batch_size = cfg.train_batch_size_per_learner * max(1, cfg.num_learners)
    with m.log_time("timers/offline_sampling_timer"):
        chunks = algo.env_runner_group.sample(batch_size, m)
    with m.log_time("timers/learner_update_timer"):
        algo.learner_group.update(chunks, algo.counters["num_env_steps_sampled_lifetime"], m)
    with m.log_time("timers/synch_weights"):
        algo.sync_weights()


@register_algorithm
class MARWIL(Algorithm):
    config_class = MARWILConfig
    learner_class = MARWILLearner

    def training_step(self) -> None:
        offline_training_step(self)

