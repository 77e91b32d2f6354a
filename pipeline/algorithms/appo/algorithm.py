"""``APPO``: IMPALA's asynchronous plan with a circular buffer as the batch source."""
from __future__ import annotations

from pipeline.algorithm import Algorithm
from pipeline.algorithms.appo.config import APPOConfig
from pipeline.algorithms.appo.learner import APPOLearner, CircularBuffer
from pipeline.plans.asynchronous import AsyncPlan
from pipeline.registry import register_algorithm


@register_algorithm
class APPO(Algorithm):
    config_class = APPOConfig
    learner_class = APPOLearner

    def build_plan(self) -> AsyncPlan:
        cfg = self.config
        buffer = CircularBuffer(cfg.circular_buffer_num_batches, cfg.circular_buffer_iterations_per_batch, cfg.seed)
        return AsyncPlan(cfg, self.env_runner_group, self.learner_group, self.metrics, self.observation_space,
                         self.action_space, compress=self.compress_frames(), batches=buffer,
                         multi_agent=self.multi_agent)

    def training_step(self) -> None:
        self.plan.training_step()

