"""Helpers shared by the learning tests."""
import numpy as np


def train_until(algo, target, max_steps):
    """Train until the smoothed return reaches ``target`` or ``max_steps`` env steps were sampled.
    Returns (best return seen, last result)."""
    best, result = -np.inf, None
    while True:
        result = algo.train()
        ret = result["env_runners"]["episode_return_mean"]
        best = max(best, ret) if not np.isnan(ret) else best
        if best >= target or result["num_env_steps_sampled_lifetime"] >= max_steps:
            return best, result
