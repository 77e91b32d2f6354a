"""SAC's settings: ``SACConfig`` (the off-policy plan's, plus SAC's own)."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from pipeline.config.base import AlgorithmConfig
from pipeline.config.checks import check_schedule, is_number
from pipeline.plans.offpolicy import OffPolicySettings


@dataclass
class SACConfig(OffPolicySettings, AlgorithmConfig):
    algo_name = "SAC"
    algorithm_module = "pipeline.algorithms.sac.algorithm"

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
    """Entropy the temperature steers toward; "auto" is minus the action dimension for a Box, and
    ``discrete_target_entropy_scale * log(n)`` for Discrete(n) actions."""
    discrete_target_entropy_scale: float = 0.3
    """Discrete actions with ``target_entropy="auto"``: the target as a fraction of the uniform policy's
    entropy (runnel-only). RLlib's old stack used 0.98, which keeps the policy close to uniform; a
    lower target lets it commit where the critics tell actions apart."""
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
        scale = self.discrete_target_entropy_scale
        if not is_number(scale) or not 0 < scale < 1:
            problems.append(f"discrete_target_entropy_scale must be a number in (0, 1), got {scale!r}")
        return problems

