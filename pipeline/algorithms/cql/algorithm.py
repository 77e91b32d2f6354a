"""``CQL``: SAC's off-policy plan fed by readers of a recording."""
from __future__ import annotations

from pipeline.algorithm import Algorithm
from pipeline.algorithms.cql.config import CQLConfig
from pipeline.algorithms.cql.learner import CQLLearner, discrete_problem
from pipeline.config.base import ConfigError
from pipeline.plans.offpolicy import OffPolicyPlan
from pipeline.registry import register_algorithm


@register_algorithm
class CQL(Algorithm):
    config_class = CQLConfig
    learner_class = CQLLearner

    def check_spaces(self) -> None:
        spaces = ([self.action_space] if self.multi_agent is None else
                  [spec.action_space for spec in self.multi_agent.plan.module_specs.values()])
        problem = next((p for p in map(discrete_problem, spaces) if p is not None), None)
        if problem is not None:
            raise ConfigError(problem)

    def build_plan(self) -> OffPolicyPlan:
        return OffPolicyPlan.of(self)

    def training_step(self) -> None:
        self.plan.training_step()

