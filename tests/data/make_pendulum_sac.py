"""Makes the Pendulum-v1 recording CQL's learning test trains from (checked in beside this file).

    python tests/data/make_pendulum_sac.py

``pendulum_sac/training/``: everything SAC's runner sampled while it learned (seed 0, the settings
of tuned/pendulum-sac.yaml, until its mean return over 5 episodes reached -200 or 20k steps) --
from random early episodes to good late ones, like D4RL's "medium-replay" datasets.
``pendulum_sac/final/``: 25 episodes of the final policy with sampled actions.
Both are made by runnel's own recording path (``offline_data(output=...)`` and
``pipeline.offline.record.record_policy``).
"""
from __future__ import annotations

import os
import shutil
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(os.path.dirname(HERE)))

from pipeline import SACConfig  # noqa: E402
from pipeline.offline.record import record_policy  # noqa: E402


def main() -> None:
    root = os.path.join(HERE, "pendulum_sac")
    shutil.rmtree(root, ignore_errors=True)
    config = (SACConfig().environment("Pendulum-v1").env_runners(num_env_runners=0, rollout_fragment_length=1)
              .training(actor_lr=1e-3, critic_lr=1e-3, alpha_lr=1e-3, train_batch_size_per_learner=256,
                        training_intensity=256, num_steps_sampled_before_learning_starts=1000)
              .reporting(metrics_num_episodes_for_smoothing=5).debugging(seed=0)
              .offline_data(output=os.path.join(root, "training")))
    algo = config.build()
    while True:
        result = algo.train()
        steps, ret = result["num_env_steps_sampled_lifetime"], result["env_runners"]["episode_return_mean"]
        if result["training_iteration"] % 1000 == 0:
            print(steps, ret, flush=True)
        if steps >= 20_000 or (steps >= 3000 and ret >= -200):
            break
    print("trained", steps, ret, flush=True)
    out = record_policy(algo, 25, os.path.join(root, "final"), explore=True)
    print("final policy", out["episode_return_mean"], out["steps"], flush=True)
    algo.stop()


if __name__ == "__main__":
    main()
