"""IMPALA's settings: ``IMPALAConfig`` (V-trace's and the asynchronous plan's)."""
from __future__ import annotations

from dataclasses import dataclass

from pipeline.algorithms.vtrace import VTraceSettings
from pipeline.config.base import AlgorithmConfig
from pipeline.plans.asynchronous import AsyncPlanSettings


# defaults tuned for CartPole-speed tasks; they are sound elsewhere (scale the batch up for harder ones)
@dataclass
class IMPALAConfig(VTraceSettings, AsyncPlanSettings, AlgorithmConfig):
    algo_name = "IMPALA"
    algorithm_module = "pipeline.algorithms.impala.algorithm"

    def _problems(self) -> list[str]:
        return super()._problems() + self.async_plan_problems() + self.vtrace_problems()

