"""``IMPALA``: the asynchronous plan (``pipeline.plans.asynchronous``) drives every step."""
from __future__ import annotations

from pipeline.algorithm import Algorithm
from pipeline.algorithms.impala.config import IMPALAConfig
from pipeline.algorithms.impala.learner import IMPALALearner
from pipeline.plans.asynchronous import AsyncPlan
from pipeline.registry import register_algorithm


@register_algorithm
class IMPALA(Algorithm):
    config_class = IMPALAConfig
    learner_class = IMPALALearner

    def build_plan(self) -> AsyncPlan:
        return AsyncPlan(self.config, self.env_runner_group, self.learner_group, self.metrics,
                         self.observation_space, self.action_space, compress=self.compress_frames(),
                         multi_agent=self.multi_agent)

    def training_step(self) -> None:
        self.plan.training_step()

