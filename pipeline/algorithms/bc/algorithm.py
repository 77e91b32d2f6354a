"""``BC``: MARWIL's learner and step with ``beta = 0``."""
from __future__ import annotations

from pipeline.algorithm import Algorithm
from pipeline.algorithms.bc.config import BCConfig
from pipeline.algorithms.marwil.algorithm import offline_training_step
from pipeline.algorithms.marwil.learner import MARWILLearner
from pipeline.registry import register_algorithm


@register_algorithm
class BC(Algorithm):
    config_class = BCConfig
    learner_class = MARWILLearner

    def training_step(self) -> None:
        offline_training_step(self)

