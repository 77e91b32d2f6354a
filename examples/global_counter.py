"""Global coordination through a named Ray actor (RLlib's "Global Coordination" example, on runnel).

Every sub-environment of every env runner increments one shared counter on each step; the driver
reads it after each training iteration. The same pattern serves a global average, a hyperparameter
that a callback reads, or a parameter server: any Ray actor created with a ``name`` is reachable with
``ray.get_actor(name)`` from envs, callbacks and custom evaluation functions, in any process of the job.

    python examples/global_counter.py
"""
from __future__ import annotations

import gymnasium as gym
import ray

from pipeline import PPOConfig


@ray.remote
class Counter:
    def __init__(self) -> None:
        self.count = 0

    def inc(self, n: int) -> None:
        self.count += n

    def get(self) -> int:
        return self.count


class CountedCartPole(gym.Wrapper):
    """CartPole that reports every step to the actor named "global_counter"."""

    def __init__(self, config: dict | None = None) -> None:
        super().__init__(gym.make("CartPole-v1"))
        self.counter = ray.get_actor("global_counter")  # created by the driver before the runners start

    def step(self, action):
        self.counter.inc.remote(1)  # fire and forget: the env does not wait for the counter
        return self.env.step(action)


def main(num_iterations: int = 3, num_env_runners: int = 2) -> list[tuple[int, int]]:
    """Train a few iterations; returns (env steps sampled, global count) after each."""
    started = not ray.is_initialized()
    if started:
        ray.init(address="local", num_cpus=num_env_runners + 1, include_dashboard=False)
    counter = Counter.options(name="global_counter").remote()
    algo = (PPOConfig().environment(CountedCartPole)
            .env_runners(num_env_runners=num_env_runners, num_envs_per_env_runner=2)
            .training(train_batch_size_per_learner=400, minibatch_size=200)
            .build())
    seen = []
    try:
        for _ in range(num_iterations):
            result = algo.train()
            count = ray.get(counter.get.remote())  # the latest count
            seen.append((result["num_env_steps_sampled_lifetime"], count))
            print(f"env steps sampled {seen[-1][0]:>6}   global counter {count:>6}")
    finally:
        algo.stop()
        ray.kill(counter)
        if started:
            ray.shutdown()
    return seen


if __name__ == "__main__":
    main()
