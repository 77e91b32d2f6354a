"""MARWIL's settings: ``MARWILConfig``."""
from __future__ import annotations

from dataclasses import dataclass

from pipeline.config.base import AlgorithmConfig
from pipeline.config.checks import is_number
from pipeline.config.offline import input_required_problems


@dataclass
class MARWILConfig(AlgorithmConfig):
    algo_name = "MARWIL"
    algorithm_module = "pipeline.algorithms.marwil.algorithm"

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

