"""What an APPO learner runs: ``appo_loss`` (pure), ``APPOLearner`` (target network, KL coefficient) and
``CircularBuffer``, the learner's batch source (in the driver, or in each learner actor with
``num_learners > 0``). Imports no Ray Tune."""
from __future__ import annotations

import collections
from typing import Any

import numpy as np
import torch
from torch import nn

from actors.learner import ChunkBatch, Learner, grad_if, piecewise
from actors.learner.feed import TakeBatch
from actors.modules import RLModule
from actors.modules.normalizers import value_error
from pipeline.algorithms.appo.config import APPOConfig
from pipeline.algorithms.returns import adapt_kl_coeff, explained_variance, normalized
from pipeline.algorithms.vtrace import policy_inputs, sgd_epochs, value_pass, vtrace_targets
from protocols.episode import EpisodeChunk


# --- loss -------------------------------------------------------------------------------------
def appo_loss(module: RLModule, batch: dict[str, Any], config: APPOConfig, kl_coeff: float,
              entropy_coeff: float | None = None, out: dict[str, torch.Tensor] | None = None
              ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """APPO's loss on one (mini)batch.

    ``batch`` holds ``obs``, ``actions``, ``action_logp`` (behaviour policy), ``old_action_logp``
    and ``old_action_dist_inputs`` (target network), and the V-trace ``vtrace_targets`` and
    ``pg_advantages`` (computed with the target network as V-trace's target policy). ``out``: the
    module's outputs for these steps when the caller computed them (a recurrent module's sequences).
    """
    entropy_coeff = config.entropy_coeff if entropy_coeff is None else entropy_coeff
    if out is None:
        out = module.forward_train(batch["obs"])
    dist = module.action_dist(out["action_dist_inputs"])
    logp = dist.logp(batch["actions"])
    behaviour_logp, old_logp = batch["action_logp"], batch["old_action_logp"]
    is_ratio = torch.exp(behaviour_logp - old_logp).clamp(0.0, config.target_worker_clipping)
    ratio = is_ratio * torch.exp(logp - behaviour_logp)
    adv = batch["pg_advantages"]
    if config.normalize_advantages:
        adv = normalized(adv)
    surrogate = torch.min(ratio * adv, ratio.clamp(1 - config.clip_param, 1 + config.clip_param) * adv)
    policy_loss = -surrogate.mean()
    targets = batch["vtrace_targets"]
    vf_loss = 0.5 * value_error(module, out["vf_preds"], targets).pow(2).mean()
    total = policy_loss + config.vf_loss_coeff * vf_loss
    with grad_if(entropy_coeff != 0):
        entropy = dist.entropy().mean()
    if entropy_coeff != 0:
        total = total - entropy_coeff * entropy
    with grad_if(config.use_kl_loss):
        kl = module.action_dist(batch["old_action_dist_inputs"]).kl(dist).mean()
    if config.use_kl_loss:
        total = total + kl_coeff * kl
    with torch.no_grad():
        stats = {"policy_loss": policy_loss.detach(), "vf_loss": vf_loss.detach(), "entropy": entropy.detach(),
                 "mean_kl_loss": kl.detach(), "total_loss": total.detach(), "mean_ratio": ratio.mean(),
                 "vf_explained_var": explained_variance(targets, out["vf_preds"])}
    return total, stats


# --- learner ----------------------------------------------------------------------------------
class APPOLearner(Learner):
    """V-trace with the target network as target policy, one PPO-clip update, then (every
    ``target_network_update_freq`` updates) refresh the target network and tune the KL coefficient."""

    state_fields = ("kl_coeff", "updates_since_target_update", "num_target_updates")

    def __init__(self, config: APPOConfig, observation_space: Any, action_space: Any, **placement: Any) -> None:
        self.config = config
        self.kl_coeff = float(config.kl_coeff)
        self.updates_since_target_update = 0
        self.num_target_updates = 0
        super().__init__(config.learner_settings(), observation_space, action_space, **placement)

    def build_targets(self) -> dict[str, nn.Module]:
        target = self.module_class(self.observation_space, self.action_space, self.settings.model_config,
                                   inference_only=True)
        target.set_state(self.module.get_state(inference_only=True))
        return {"target_policy": target}

    @property
    def target(self) -> RLModule:
        return self.targets["target_policy"]

    def train_on_batch(self, chunks: list[EpisodeChunk], timestep: int) -> dict[str, float]:
        cfg, target = self.config, self.target
        b, values, _, seq = value_pass(self, chunks)
        old_inputs = policy_inputs(target, b, seq)
        with torch.no_grad():
            old_logp = target.action_dist(old_inputs).logp(b.actions)
        behaviour_logp = b.extra["action_logp"]
        vs, pg_adv = vtrace_targets(cfg, b, behaviour_logp, old_logp, values)
        self.update_return_stats(vs)
        tensors = {"obs": b.obs, "actions": b.actions, "action_logp": behaviour_logp, "old_action_logp": old_logp,
                   "old_action_dist_inputs": old_inputs, "vtrace_targets": vs, "pg_advantages": pg_adv}
        kl_coeff, entropy_coeff = self.kl_coeff, piecewise(cfg.entropy_coeff, timestep)
        out = sgd_epochs(self, cfg, tensors,
                         lambda mb, out: appo_loss(self.module, mb, cfg, kl_coeff, entropy_coeff, out), len(b), seq)
        self.update_input_stats(b.obs)
        self.updates_since_target_update += 1
        if self.updates_since_target_update >= cfg.target_network_update_freq:
            target.set_state(self.module.get_state(inference_only=True))
            self.updates_since_target_update = 0
            self.num_target_updates += 1
            if cfg.use_kl_loss:  # the KL averaged over the learners: every learner tunes the same coefficient
                kl = float(self.allreduce_mean(np.array([out["mean_kl_loss"]]))[0])
                self.kl_coeff = adapt_kl_coeff(kl_coeff, kl, cfg.kl_target)
        out["curr_kl_coeff"] = self.kl_coeff
        out["curr_entropy_coeff"] = entropy_coeff
        out["num_target_updates"] = float(self.num_target_updates)
        out["num_module_steps_trained"] = float(len(b))
        return out


# --- circular buffer --------------------------------------------------------------------------
class CircularBuffer:
    """Holds up to N train batches; each sample is a uniformly random one, which leaves after K samples.
    As the plan's batch source: take a new batch when there is one, and wait for one only when
    the buffer has nothing left to train on."""

    def __init__(self, num_batches: int, iterations_per_batch: int, seed: int | None = None) -> None:
        self.num_batches, self.iterations_per_batch = num_batches, iterations_per_batch
        self._entries: collections.deque[list] = collections.deque()  # [batch, times sampled]
        self._rng = np.random.default_rng(seed)
        self.num_added = 0
        self.num_evicted_unused = 0
        """Batches pushed out by newer ones before they were trained on even once."""
        self.num_reused = 0
        """Samples that drew a batch already trained on (the reuse the buffer is for)."""

    def __len__(self) -> int:
        return len(self._entries)

    def add(self, batch: ChunkBatch) -> None:
        if len(self._entries) >= self.num_batches:
            _, uses = self._entries.popleft()
            self.num_evicted_unused += uses == 0
        self._entries.append([batch, 0])
        self.num_added += 1

    def sample(self) -> ChunkBatch:
        if not self._entries:
            raise IndexError("sample from an empty circular buffer")
        i = int(self._rng.integers(len(self._entries)))
        entry = self._entries[i]
        self.num_reused += entry[1] > 0
        entry[1] += 1
        if entry[1] >= self.iterations_per_batch:
            del self._entries[i]
        return entry[0]

    def next(self, take: TakeBatch) -> ChunkBatch | None:
        batch = take(0.0 if len(self) else 0.1)
        if batch is not None:
            self.add(batch)
        return self.sample() if len(self) else None

    metrics_prefix = "circular_buffer"

    def stats(self) -> dict[str, int]:
        return {"size": len(self), "num_batches_added": self.num_added,
                "num_batches_evicted_unused": self.num_evicted_unused, "num_batches_reused": self.num_reused}

