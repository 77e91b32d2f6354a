"""IMPALA's settings: ``IMPALAConfig`` (V-trace's and the asynchronous plan's)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from pipeline.algorithms.vtrace import VTraceSettings
from pipeline.config.base import AlgorithmConfig
from pipeline.plans.asynchronous import AsyncPlanSettings


# defaults tuned for CartPole-speed tasks; they are sound elsewhere (scale the batch up for harder ones)
@dataclass
class IMPALAConfig(VTraceSettings, AsyncPlanSettings, AlgorithmConfig):
    algo_name = "IMPALA"
    algorithm_module = "pipeline.algorithms.impala.algorithm"
    updates_input_stats: ClassVar[bool] = True
    updates_return_stats: ClassVar[bool] = True
    """Its learner updates ``model_config normalize_input``'s statistics after each train batch."""

    vtrace_clip_pg_rho_threshold: float = 100.0
    """V-trace: clip the importance ratio of the policy-gradient advantages at this. runnel's IMPALA default is
    high enough that the learner's own policy almost never meets it (the paper and RLlib use 1, as APPO does
    here; runnel used 3 from 2026-12-05): every clipped ratio turns a value function that overestimates -- as it
    does after any dip in return -- into a pull towards the actions the learner already favours over the lagging
    runners', a feedback that ends on one action (the property test in ``tests/test_impala_appo_losses.py``). On
    CartPole with the learner the bottleneck (data ~12 updates old), 9 of 30 runs at 3 fell below a return of 50
    and 2 never reached 450 in 1M env steps; effectively unclipped, none of 30 fell and 1 stayed at ~200; at 100,
    run as the learning test runs (stop at 450), 2 of 95 stayed on such a plateau and 1 dipped below 50 once
    (2026-12-06, ``tests/benchmarks/impala_stability.py``). The bound keeps one implausible behaviour
    log-probability (an external client's) from outweighing a whole batch. APPO's clipped surrogate and target
    network hold the drift back, so it keeps 1."""
    minibatch_size: int = 250
    """Steps per SGD step: two steps per default 500-step batch (runnel's IMPALA default since 2026-12-05; the
    whole batch in one step before). On CartPole to 1M env steps, one step per batch missed 450 in 2 of 22 runs
    (stuck at 150-300, the shape of the failed CI runs; 243k-838k for the others), two steps reached it in 22 of 22
    (189k-613k), and with the learner the bottleneck in 8 of 8 against 15 of 15 (177k-417k). Must not exceed
    ``train_batch_size_per_learner``: lower both for smaller batches."""

    num_epochs: int = 2
    """Passes over each train batch (runnel's IMPALA default since 2026-12-06; one before, as in RLlib). With the
    learner the bottleneck (the learning test's setting, stop at 450, 1M budget) two passes reached CartPole's 450
    at a median 225k env steps (65 runs; 90 % by 334k) against 323k for one pass (557k; 1 of 65 never within 1M);
    with the learner's Adam epsilon at 1e-2 (``IMPALALearner.adam_eps``; ``adam_epsilon`` overrides it; without it 7 of 16 two-pass runs fell
    from 500 to 9 when run on past 450), 30 of 30 at a median 248k, max 501k
    (``results_impala_clip_amd_2026-12-06.jsonl``)."""

    def _problems(self) -> list[str]:
        return super()._problems() + self.async_plan_problems() + self.vtrace_problems()

