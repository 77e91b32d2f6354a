"""Helpers shared by the learning tests."""
import contextlib
import tempfile
import time

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


def train_until_seen(algo, seen, timeout_s=300.0):
    """Train until ``seen(result)`` holds (an actor restarted, a stage recreated...) and return that result;
    after ``timeout_s`` seconds without it, the last result (the test's assertions then say what is missing).
    Bounded by time, not by a count of iterations: a replacement actor takes seconds to start on a loaded
    machine while an iteration may take a fraction of one."""
    deadline = time.monotonic() + timeout_s
    result = algo.train()
    while not seen(result) and time.monotonic() < deadline:
        result = algo.train()
    return result


@contextlib.contextmanager
def straight_and_resumed(build, k, m, logdir="auto"):
    """``build()`` trained ``k`` iterations, saved, then ``m`` more; and the algorithm restored from that checkpoint
    trained ``m``: yields ``(straight, restored)`` for the test to compare, and stops both."""
    from pipeline import Algorithm

    straight = build()
    try:
        for _ in range(k):
            straight.train()
        path = straight.save(tempfile.mkdtemp() + "/checkpoint")
        for _ in range(m):
            straight.train()
        restored = Algorithm.from_checkpoint(path, logdir=logdir)
        try:
            for _ in range(m):
                restored.train()
            yield straight, restored
        finally:
            restored.stop()
    finally:
        straight.stop()


def small_batches_config(config_class, env, model_config):
    """``config_class`` on ``env`` in the driver with batches of 64 steps (2 envs x 32) in minibatches of 32,
    each batch trained once (APPO's circular buffer too): what the statistics tests count steps with."""
    config = (config_class().environment(env).rl_module(model_config=model_config)
              .env_runners(num_env_runners=0, num_envs_per_env_runner=2, rollout_fragment_length=32)
              .training(train_batch_size_per_learner=64, minibatch_size=32).debugging(seed=0))
    if hasattr(config, "circular_buffer_iterations_per_batch"):
        config.training(circular_buffer_iterations_per_batch=1)
    return config


def train_steps(algo, steps, max_iterations=40):
    """``algo.train()`` until at least ``steps`` env steps were trained; the results."""
    from pipeline.algorithm_results import lookup

    results = []
    while not results or (lookup(results[-1], "num_env_steps_trained_lifetime") or 0) < steps:
        assert len(results) < max_iterations, f"not {steps} env steps trained in {max_iterations} iterations"
        results.append(algo.train())
    return results
