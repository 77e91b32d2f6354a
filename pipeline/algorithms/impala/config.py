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

    vtrace_clip_pg_rho_threshold: float = 3.0
    """V-trace: clip the importance ratio of the policy-gradient advantages at this (runnel's IMPALA default; the
    paper and RLlib use 1, as APPO does here). Clipped at 1, a value function that overestimates after a dip in
    return pushes the learner's policy further from the lagging runners' -- towards one action -- and on CartPole
    runs with the learner as the bottleneck collapsed to a return of 9 in 7 of 11 (2026-12-05); at 3, none of
    8 did, and without the bottleneck all 13 runs reached 450 within 1M env steps (12 of 13 at 1). APPO's clipped
    surrogate and target network hold the same drift back."""
    minibatch_size: int = 250
    """Steps per SGD step: two steps per default 500-step batch (runnel's IMPALA default since 2026-12-05; the
    whole batch in one step before). On CartPole to 1M env steps, one step per batch missed 450 in 2 of 22 runs
    (stuck at 150-300, the shape of the failed CI runs; 243k-838k for the others), two steps reached it in 22 of 22
    (189k-613k), and with the learner the bottleneck in 8 of 8 against 15 of 15 (177k-417k). Must not exceed
    ``train_batch_size_per_learner``: lower both for smaller batches."""

    def _problems(self) -> list[str]:
        return super()._problems() + self.async_plan_problems() + self.vtrace_problems()

