"""``DQN``: the off-policy plan (``pipeline.plans.offpolicy``) drives every step."""
from __future__ import annotations

from pipeline.algorithm import Algorithm
from pipeline.algorithms.dqn.config import DQNConfig
from pipeline.algorithms.dqn.learner import DQNLearner
from pipeline.plans.offpolicy import OffPolicyPlan
from pipeline.registry import register_algorithm


@register_algorithm
class DQN(Algorithm):
    config_class = DQNConfig
    learner_class = DQNLearner

    def build_plan(self) -> OffPolicyPlan:
        return OffPolicyPlan.of(self)

    def training_step(self) -> None:
        self.plan.training_step()

