"""``CQL``: SAC's off-policy plan fed by readers of a recording."""
from __future__ import annotations

from pipeline.algorithm import Algorithm
from pipeline.algorithms.cql.config import CQLConfig
from pipeline.algorithms.cql.learner import CQLLearner
from pipeline.plans.offpolicy import OffPolicyPlan
from pipeline.registry import register_algorithm


@register_algorithm
class CQL(Algorithm):
    config_class = CQLConfig
    learner_class = CQLLearner

    def build_plan(self) -> OffPolicyPlan:
        return OffPolicyPlan.of(self)

    def training_step(self) -> None:
        self.plan.training_step()

