"""DQN (Mnih et al., 2015) with the Rainbow parts RLlib offers: double Q, dueling heads, n-step
returns, prioritized replay, distributional atoms (C51); Discrete actions, and MultiDiscrete
actions as branches.

Each training step: env runners sample with epsilon-greedy exploration, the chunks go into the
replay stage, and the learner trains on replayed batches as often as the replay ratio
(``training_intensity``) allows; the target network follows every ``target_network_update_freq``
env steps (``tau`` < 1: Polyak averaging). The loop is ``pipeline.plans.offpolicy.OffPolicyPlan``.
Here: ``DQNConfig``, ``dqn_loss`` (a pure function of module, target, batch and config),
``DQNLearner`` and ``DQN``.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, ClassVar

import torch
import torch.nn.functional as F

from actors.learner import Learner, batch_slices, combined_stats
from actors.modules import QModule
from pipeline.algorithm import Algorithm
from pipeline.algorithms.dqn_recurrent import r2d2_loss, sequence_priorities
from pipeline.config.base import AlgorithmConfig
from pipeline.config.checks import check_schedule, is_int, is_number
from pipeline.plans.offpolicy import OffPolicyPlan, OffPolicySettings, polyak, recurrent, sequence_length, to_tensors
from pipeline.registry import register_algorithm
from protocols import nested

TD_ERROR_LOSS_FNS = ("huber", "mse")


@dataclass
class DQNConfig(OffPolicySettings, AlgorithmConfig):
    algo_name = "DQN"
    supports_recurrent: ClassVar[bool] = True
    """``model_config`` ``use_lstm``: R2D2 -- sequences replayed with their stored states (``dqn_recurrent``)."""

    num_envs_per_env_runner: int = 8
    """Sub-environments each runner steps as one vector."""
    rollout_fragment_length: int | str = 4
    """Steps per sub-env per training step (then the learner catches up with the replay ratio)."""
    lr: float | list = 5e-4
    """Learning rate, or a piecewise-linear schedule ``[[timestep, lr], ...]``."""
    grad_clip: float | None = 10.0
    """Clip threshold for gradients (global norm by default)."""
    train_batch_size_per_learner: int = 128
    """Transitions per replayed batch (one learner update each). 128 rather than 64: on CartPole half the
    updates for the same replay ratio, and seeds 0-2 reached 450 in fewer env steps (68-91k against 86-143k)."""
    training_intensity: float | None = 16.0
    """Transitions trained per transition sampled (the replay ratio); None: one update per training step."""
    replay_buffer_config: dict = field(default_factory=lambda: {
        "type": "PrioritizedEpisodeReplayBuffer", "capacity": 50_000, "alpha": 0.6, "beta": 0.4})
    """See ``OffPolicySettings``: prioritized replay by default, as RLlib's DQN."""
    min_sample_timesteps_per_iteration: int = 1000
    """Env steps one ``train()`` samples at least (RLlib's DQN default): a training step samples only
    32, and a result for each would cost more than the step."""
    n_step: int | list = field(default_factory=lambda: [2, 5])
    """n-step returns, computed at sample time: an int, or ``[lo, hi]`` drawn per transition."""
    num_steps_sampled_before_learning_starts: int = 1000
    """Env steps stored before the first update."""
    target_network_update_freq: int = 500
    """Update the target network every this many env steps sampled."""
    tau: float = 1.0
    """Target update: 1.0 copies the network, smaller values average (target = tau * net + (1 - tau) * target)."""
    double_q: bool = True
    """Pick the next action with the online network, value it with the target network (van Hasselt et al.)."""
    dueling: bool = True
    """A state-value stream plus mean-centred advantages."""
    num_atoms: int = 1
    """Atoms of the return distribution (> 1: C51, Discrete actions only)."""
    v_min: float = -10.0
    """Lowest return the distribution's support covers."""
    v_max: float = 10.0
    """Highest return the distribution's support covers."""
    epsilon: list = field(default_factory=lambda: [[0, 1.0], [10_000, 0.02]])
    """Epsilon-greedy schedule ``[[timestep, epsilon], ...]`` over env steps sampled (off when explore=False)."""
    burn_in: bool = False
    """Recurrent modules (``use_lstm``): before a replayed sequence, the networks run without gradients over the
    chunk before it in its episode, from that chunk's stored state, to refresh the state the sequence starts
    from (R2D2's burn-in, over one previous chunk of up to ``max_seq_len`` steps)."""
    use_h_function: bool = False
    """Recurrent modules (R2D2): learn h-rescaled returns, h(x) = sign(x) (sqrt(|x| + 1) - 1) + eps x, so that
    large returns do not dominate the loss (RLlib's old R2D2 option; R2D2 used it on Atari's unclipped rewards)."""
    h_function_epsilon: float = 1e-3
    """The eps of ``use_h_function`` (> 0; it keeps h invertible)."""
    td_error_loss_fn: str = "huber"
    """Loss on the TD error: "huber" or "mse" (ignored with num_atoms > 1, which uses cross-entropy)."""
    model_config: dict = field(default_factory=lambda: {"fcnet_activation": "relu"})
    """Default module settings (see ``actors.modules.ModelConfig``): ReLU trunks of [64, 64] on flat observations,
    the Nature CNN alone on images."""

    def module_kwargs(self) -> dict[str, Any]:
        return {"dueling": self.dueling, "num_atoms": self.num_atoms, "v_min": self.v_min, "v_max": self.v_max}

    def default_exploration(self) -> dict[str, Any]:
        return {"type": "EpsilonGreedy", "epsilon_schedule": [list(p) for p in self.epsilon]}

    def _problems(self) -> list[str]:
        problems = super()._problems() + self.offpolicy_problems()
        if self.td_error_loss_fn not in TD_ERROR_LOSS_FNS:
            problems.append(f"td_error_loss_fn={self.td_error_loss_fn!r} is not one of {list(TD_ERROR_LOSS_FNS)}")
        if not is_int(self.num_atoms) or self.num_atoms < 1:
            problems.append(f"num_atoms must be an int >= 1, got {self.num_atoms!r}")
        if not (is_number(self.v_min) and is_number(self.v_max) and self.v_min < self.v_max):
            problems.append(f"v_min must be below v_max, got v_min={self.v_min!r}, v_max={self.v_max!r}")
        if not is_int(self.target_network_update_freq) or self.target_network_update_freq < 1:
            problems.append(f"target_network_update_freq must be an int >= 1, got {self.target_network_update_freq!r}")
        if not is_number(self.tau) or not 0 < self.tau <= 1:
            problems.append(f"tau must be in (0, 1], got {self.tau!r}")
        problems += [p.replace("epsilon must", "epsilon must be a schedule; it must") for p in
                     check_schedule("epsilon", self.epsilon) if not isinstance(self.epsilon, (int, float))]
        problems += self._recurrent_problems()
        if isinstance(self.epsilon, (int, float)):
            problems.append(f"epsilon must be a schedule [[timestep, epsilon], ...], got {self.epsilon!r}; "
                            f"a constant is [[0, {self.epsilon}]]")
        return problems


    def _recurrent_problems(self) -> list[str]:
        max_seq_len = sequence_length(self)
        if not isinstance(self.burn_in, bool):
            return [f"burn_in must be True or False, got {self.burn_in!r} (it unrolls one previous chunk of up to "
                    f"max_seq_len steps; set model_config max_seq_len for a longer burn-in)"]
        if not isinstance(self.use_h_function, bool):
            return [f"use_h_function must be True or False, got {self.use_h_function!r}"]
        if not is_number(self.h_function_epsilon) or self.h_function_epsilon <= 0:
            return [f"h_function_epsilon must be a number > 0, got {self.h_function_epsilon!r}"]
        if not recurrent(self):
            return [f"{key}=True is for recurrent modules (R2D2): set model_config use_lstm=True, or {key}=False"
                    for key in ("burn_in", "use_h_function") if getattr(self, key)]
        problems = []
        fragment = self.get_rollout_fragment_length()
        if is_int(max_seq_len) and is_int(fragment) and fragment < max_seq_len:
            problems.append(f"rollout_fragment_length={fragment} with use_lstm=True cuts sequences of {fragment} steps, "
                            f"each stored in a slot of max_seq_len={max_seq_len}: set rollout_fragment_length="
                            f"{max_seq_len} (or a multiple), or lower max_seq_len")
        if self.num_atoms != 1:
            problems.append(f"num_atoms={self.num_atoms} with use_lstm=True: recurrent DQN learns one Q-value per "
                            f"action; set num_atoms=1")
        c = self.replay_buffer_config if isinstance(self.replay_buffer_config, dict) else {}
        for key, why in (("remote", "the replay actor stores transitions"),
                         ("prefill_from", "recordings are replayed as transitions")):
            if c.get(key) not in (None, False):
                problems.append(f"replay_buffer_config {key}={c[key]!r} with use_lstm=True: not built for sequence "
                                f"replay ({why}); leave it unset")
        if (self.offline_data_config or {}).get("input_") is not None:
            problems.append("offline input with DQN use_lstm=True: recorded chunks carry no recurrent states; "
                            "leave input_ unset")
        if self.learner_connector is not None:
            problems.append("learner_connector with DQN use_lstm=True: the sequence replay runs no learner pipeline; "
                            "leave it unset")
        return problems


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
        target = self.build_module()
        target.load_state_dict(self.module.state_dict())
        return {"target": target}

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


@register_algorithm
class DQN(Algorithm):
    config_class = DQNConfig
    learner_class = DQNLearner

    def build_plan(self) -> OffPolicyPlan:
        return OffPolicyPlan.of(self)

    def training_step(self) -> None:
        self.plan.training_step()
