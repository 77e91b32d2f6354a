"""``MARWIL`` and ``offline_training_step``, the step it shares with BC: read a train batch, one update."""
from __future__ import annotations

from pipeline.algorithm import Algorithm
from pipeline.algorithms.marwil.config import MARWILConfig
from pipeline.algorithms.marwil.learner import MARWILLearner
from pipeline.registry import register_algorithm


def offline_training_step(algo: Algorithm) -> None:
    """Read a train batch from the readers, one learner update, weights to the evaluators' source."""
    cfg, m = algo.config, algo.metrics
    batch_size = cfg.train_batch_size_per_learner * max(1, cfg.num_learners)
    with m.log_time("timers/offline_sampling_timer"):
        chunks = algo.env_runner_group.sample(batch_size, m)
    with m.log_time("timers/learner_update_timer"):
        algo.learner_group.update(chunks, algo.counters["num_env_steps_sampled_lifetime"], m)
    with m.log_time("timers/synch_weights"):
        algo.sync_weights()


@register_algorithm
class MARWIL(Algorithm):
    config_class = MARWILConfig
    learner_class = MARWILLearner

    def training_step(self) -> None:
        offline_training_step(self)

