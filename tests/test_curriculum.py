"""Curriculum (TaskSettableEnv + env_task_fn), global coordination through named actors, and the
runner-side pieces that must survive restarts and checkpoints: tasks, exploration schedules, log level.
Remote env runners throughout."""
from __future__ import annotations

import logging
import time

import pytest
import ray

from pipeline import DQNConfig, PPO, PPOConfig
from tests.envs import CurriculumEnv, curriculum_fn


@pytest.fixture(scope="module", autouse=True)
def cluster(ray_cluster):
    yield ray_cluster


def tasks(algo):
    return algo.foreach_env_runner(lambda w: w.foreach_env(lambda env: (env.get_task(), env.end_pos)),
                                   local_env_runner=False)


@pytest.mark.slow
def test_curriculum_reaches_every_sub_env_survives_restarts_and_checkpoints(tmp_path):
    config = PPOConfig.from_dict({"env": CurriculumEnv, "env_task_fn": curriculum_fn, "num_env_runners": 2,
                                  "num_envs_per_env_runner": 2, "train_batch_size_per_learner": 100,
                                  "minibatch_size": 50, "num_epochs": 1, "seed": 0,
                                  "delay_between_env_runner_restarts_s": 0.0})
    algo = config.build()
    try:
        for _ in range(2):
            algo.train()
        assert tasks(algo) == [[(3, 5), (3, 5)], [(3, 5), (3, 5)]]
        path = algo.save(str(tmp_path / "ckpt"))
        ray.kill(algo.env_runner_group.manager.handle(2))
        failed: list = []  # ray.kill is asynchronous: probe until runner 2 is seen dead (a loaded machine is slow)
        deadline = time.monotonic() + 60
        while 2 not in failed and time.monotonic() < deadline:
            failed += algo.env_runner_group.manager.probe_health()
        assert 2 in failed, failed
        assert algo.env_runner_group.wait_until_whole(120)  # recreated with its task, outside train()
        result = algo.train()
        assert result["fault_tolerance"]["num_remote_worker_restarts"] == 1
        # runner 2 came back with task 3, then the curriculum moved everyone to 4
        assert tasks(algo) == [[(4, 6), (4, 6)], [(4, 6), (4, 6)]]
    finally:
        algo.stop()
    restored = PPO.from_checkpoint(path)
    try:
        assert tasks(restored) == [[(3, 5), (3, 5)], [(3, 5), (3, 5)]]
    finally:
        restored.stop()


@pytest.mark.slow
def test_global_counter_example_counts_every_env_step():
    from examples.global_counter import Counter, main

    seen = main(num_iterations=2, num_env_runners=2)
    assert [steps for steps, _ in seen] == [400, 800]
    counter = Counter.options(name="global_counter").remote()  # the example killed its own; reach a new one
    try:
        assert ray.get(ray.get_actor("global_counter").get.remote()) == 0
    finally:
        ray.kill(counter)


@pytest.mark.slow
def test_global_counter_reaches_the_driver_count():
    """Every step of every runner reaches the counter: wait (bounded) until the fire-and-forget
    increments have all arrived."""
    from examples.global_counter import CountedCartPole, Counter

    counter = Counter.options(name="global_counter").remote()
    algo = (PPOConfig().environment(CountedCartPole).env_runners(num_env_runners=2, num_envs_per_env_runner=2)
            .training(train_batch_size_per_learner=200, minibatch_size=100, num_epochs=1).build())
    try:
        sampled = algo.train()["num_env_steps_sampled_lifetime"]
        deadline = time.monotonic() + 60
        while ray.get(counter.get.remote()) < sampled and time.monotonic() < deadline:
            pass
        assert ray.get(counter.get.remote()) == sampled
    finally:
        algo.stop()
        ray.kill(counter)


@pytest.mark.slow
def test_exploration_schedule_log_level_and_sys_usage_reach_remote_runners(tmp_path):
    config = (DQNConfig().environment("CartPole-v1")
              .env_runners(num_env_runners=1, num_envs_per_env_runner=1, rollout_fragment_length=50)
              .exploration(exploration_config={"type": "EpsilonGreedy", "initial_epsilon": 1.0,
                                               "final_epsilon": 0.02, "epsilon_timesteps": 10000})
              .training(num_steps_sampled_before_learning_starts=100, train_batch_size_per_learner=32)
              .debugging(log_level="DEBUG", log_sys_usage=True, seed=0)
              .reporting(min_sample_timesteps_per_iteration=500)
              .fault_tolerance(delay_between_env_runner_restarts_s=0.0))
    algo = config.build()
    try:
        result = algo.train()
        sampled = result["num_env_steps_sampled_lifetime"]
        [(timestep, epsilon, level)] = algo.foreach_env_runner(
            lambda w: (w.timestep, w.exploration.epsilon(w.timestep), logging.getLogger("runnel").level),
            local_env_runner=False)
        assert level == logging.DEBUG
        assert timestep >= sampled - 50 and epsilon < 1.0 - 0.98 * (sampled - 50) / 10000 + 1e-9
        assert result["perf"]["env_runner_1"]["rss_mb"] > 50 and result["perf"]["driver"]["rss_mb"] > 50
        ray.kill(algo.env_runner_group.manager.handle(1))
        algo.train()
        assert algo.env_runner_group.wait_until_whole(120)
        # the recreated runner continues the schedule from the run's step count, not from 0
        [recreated] = algo.foreach_env_runner(lambda w: w.timestep, local_env_runner=False)
        assert recreated >= sampled
    finally:
        algo.stop()
