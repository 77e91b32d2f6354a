"""Makes the CartPole recordings the offline learning tests train from (checked in beside this file).

    python tests/data/make_cartpole_recordings.py

- ``cartpole_expert/``: 20 greedy episodes of a PPO policy trained (seed 0, 2 env runners) until
  its evaluation return is >= 475; every step carries the policy's ``action_logp``.
- ``cartpole_random/``: episodes of a freshly initialized PPO policy with sampled actions (its
  logits start near zero, so it acts close to uniformly at random), about as many steps as the
  expert recording, so a 50/50 mix of the two has half of its steps from each.

Made with ``pipeline.offline.record.record_policy``, the same path as ``runnel record``: shard files and a
manifest, nothing pickled. The recordings are small (well under 1 MB) and double as a check that
recordings made by an earlier runnel version still read.
"""
from __future__ import annotations

import os
import shutil
import sys

import ray

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(os.path.dirname(HERE)))

from pipeline import PPOConfig  # noqa: E402
from pipeline.offline.record import record_policy  # noqa: E402


def main() -> None:
    ray.init(address="local", num_cpus=2, include_dashboard=False)
    try:
        config = (PPOConfig().environment("CartPole-v1").env_runners(num_env_runners=2).debugging(seed=0)
                  .evaluation(evaluation_interval=5, evaluation_duration=20, evaluation_duration_unit="episodes"))
        algo = config.build()
        for _ in range(200):
            result = algo.train()
            ret = result.get("evaluation", {}).get("env_runners", {}).get("episode_return_mean")
            print(result["training_iteration"], result["env_runners"].get("episode_return_mean"), ret, flush=True)
            if ret is not None and ret >= 475:
                break
        expert = os.path.join(HERE, "cartpole_expert")
        shutil.rmtree(expert, ignore_errors=True)
        out = record_policy(algo, 20, expert, explore=False)
        print("expert", out["episode_return_mean"], out["steps"])
        algo.stop()

        fresh = PPOConfig().environment("CartPole-v1").env_runners(num_env_runners=0).debugging(seed=1).build()
        rand = os.path.join(HERE, "cartpole_random")
        shutil.rmtree(rand, ignore_errors=True)
        out = record_policy(fresh, int(out["steps"] / 22), rand, explore=True)
        print("random", out["episode_return_mean"], out["steps"])
        fresh.stop()
    finally:
        ray.shutdown()


if __name__ == "__main__":
    main()
