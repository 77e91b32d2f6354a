"""``PPO``: the driver's training step (sample from every runner, one update, weights out)."""
from __future__ import annotations

from pipeline.algorithm import Algorithm
from pipeline.algorithms.ppo.config import PPOConfig
from pipeline.algorithms.ppo.learner import PPOLearner
from pipeline.registry import register_algorithm


@register_algorithm
class PPO(Algorithm):
    config_class = PPOConfig
    learner_class = PPOLearner

    def training_step(self) -> None:
        """Sample a train batch from every runner, one learner update, weights out."""
        cfg, m = self.config, self.metrics
        batch_size = cfg.train_batch_size_per_learner * max(1, cfg.num_learners)
        sampled0 = self.counters["num_env_steps_sampled_lifetime"]
        with m.log_time("timers/env_runner_sampling_timer"):
            chunks = self.env_runner_group.sample(batch_size, m)
        sampled = self.counters["num_env_steps_sampled_lifetime"]
        # multi-agent chunks count agent steps: the learners are told the env steps the batch holds
        env_steps = {} if self.multi_agent is None else {"num_env_steps": sampled - sampled0}
        with m.log_time("timers/learner_update_timer"):
            self.learner_group.update(chunks, sampled, m, **env_steps)
        with m.log_time("timers/synch_weights"):
            self.sync_weights()

