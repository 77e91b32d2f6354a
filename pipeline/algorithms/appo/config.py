"""APPO's settings: ``APPOConfig`` (V-trace's and the asynchronous plan's, plus APPO's own)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from pipeline.algorithms.vtrace import VTraceSettings
from pipeline.config.base import AlgorithmConfig
from pipeline.config.checks import is_int, is_number
from pipeline.plans.asynchronous import AsyncPlanSettings


@dataclass
class APPOConfig(VTraceSettings, AsyncPlanSettings, AlgorithmConfig):
    algo_name = "APPO"
    algorithm_module = "pipeline.algorithms.appo.algorithm"
    updates_input_stats: ClassVar[bool] = True
    updates_return_stats: ClassVar[bool] = True
    """Its learner updates ``model_config normalize_input``'s statistics after each train batch."""

    broadcast_interval: int = 2
    """Send new weights to the runners every this many updates (APPO updates up to
    ``circular_buffer_iterations_per_batch`` times per sampled batch: 2 keeps IMPALA's rate per env step)."""
    entropy_coeff: float | list = 0.0
    """Weight of the entropy bonus, or a schedule ``[[timestep, coeff], ...]``."""
    clip_param: float = 0.4
    """PPO clip range for the ratio of the current to the target policy."""
    use_kl_loss: bool = False
    """Add an adaptive KL(target || current) penalty to the loss."""
    kl_coeff: float = 1.0
    """Initial coefficient of the KL penalty."""
    kl_target: float = 0.01
    """At each target update the KL coefficient grows x1.5 above 2x this KL, and halves below half of it."""
    target_network_update_freq: int = 4
    """Refresh the target network (and tune the KL coefficient) every this many learner updates."""
    target_worker_clipping: float = 2.0
    """Upper clip of the behaviour-to-target probability ratio inside the surrogate's ratio."""
    circular_buffer_num_batches: int = 4
    """Train batches the circular buffer holds (N in the IMPACT paper)."""
    circular_buffer_iterations_per_batch: int = 2
    """Updates a batch may serve before it leaves the buffer (K in the IMPACT paper)."""
    normalize_advantages: bool = False
    """Scale each minibatch's V-trace policy-gradient advantages to zero mean and unit variance (runnel's own;
    Sample Factory's APPO does it by default, RLlib's does not): once the value function is good the raw
    advantages of a sparse-reward task are small beside the entropy bonus."""

    def _problems(self) -> list[str]:
        problems = super()._problems() + self.async_plan_problems() + self.vtrace_problems()
        if not is_number(self.clip_param) or not 0 < self.clip_param < 1:
            problems.append(f"clip_param must be in (0, 1), got {self.clip_param!r}")
        for key in ("kl_coeff", "kl_target", "target_worker_clipping"):
            if not is_number(getattr(self, key)) or getattr(self, key) <= 0:
                problems.append(f"{key} must be a number > 0, got {getattr(self, key)!r}")
        if not isinstance(self.normalize_advantages, bool):
            problems.append(f"normalize_advantages must be True or False, got {self.normalize_advantages!r}")
        for key in ("target_network_update_freq", "circular_buffer_num_batches", "circular_buffer_iterations_per_batch"):
            if not is_int(getattr(self, key)) or getattr(self, key) < 1:
                problems.append(f"{key} must be an int >= 1, got {getattr(self, key)!r}")
        return problems

