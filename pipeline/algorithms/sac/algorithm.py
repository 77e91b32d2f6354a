"""``SAC``: the off-policy plan (``pipeline.plans.offpolicy``) drives every step."""
from __future__ import annotations

from pipeline.algorithm import Algorithm
from pipeline.algorithms.sac.config import SACConfig
from pipeline.algorithms.sac.learner import SACLearner
from pipeline.plans.offpolicy import OffPolicyPlan
from pipeline.registry import register_algorithm


@register_algorithm
class SAC(Algorithm):
    config_class = SACConfig
    learner_class = SACLearner

    def build_plan(self) -> OffPolicyPlan:
        return OffPolicyPlan.of(self)

    def training_step(self) -> None:
        self.plan.training_step()

