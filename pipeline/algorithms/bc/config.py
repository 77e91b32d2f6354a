"""BC's settings: ``BCConfig``."""
from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from pipeline.config.base import AlgorithmConfig
from pipeline.config.offline import input_required_problems


@dataclass
class BCConfig(AlgorithmConfig):
    algo_name = "BC"
    algorithm_module = "pipeline.algorithms.bc.algorithm"

    beta: ClassVar[float] = 0.0  # fixed: unweighted likelihood
    vf_coeff: ClassVar[float] = 0.0  # fixed: no value function to fit
    lambda_: ClassVar[float] = 1.0
    moving_average_sqd_adv_norm_start: ClassVar[float] = 100.0
    moving_average_sqd_adv_norm_update_rate: ClassVar[float] = 0.0

    lr: float | list = 1e-3
    """Learning rate, or a piecewise-linear schedule ``[[timestep, lr], ...]``."""
    train_batch_size_per_learner: int = 2000
    """Recorded steps per learner per update."""
    minibatch_size: int = 500
    """Steps per SGD minibatch."""
    num_epochs: int = 1
    """SGD passes over each batch."""
    rollout_fragment_length: int | str = "auto"
    """Recorded steps a reader hands over per request ("auto": the train batch split over readers)."""

    def _problems(self) -> list[str]:
        problems = super()._problems() + input_required_problems(self)
        if self.minibatch_size > self.train_batch_size_per_learner:
            problems.append(f"minibatch_size ({self.minibatch_size}) must not exceed train_batch_size_per_learner "
                            f"({self.train_batch_size_per_learner})")
        return problems

