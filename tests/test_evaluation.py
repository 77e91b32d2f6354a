"""Evaluation during training (RLlib's "Customized Evaluation During Training" page), with remote
evaluators: the order of train and eval steps and their weights, parallel evaluation that overlaps the
training step, durations split among evaluators, crashing and hanging evaluators, a custom evaluation
function, overrides, and runner callbacks running inside remote runners."""
from __future__ import annotations

import os

import numpy as np
import pytest
import ray

from pipeline import (AlgorithmConfig, CallbackError, ConfigError, PPOConfig, collect_episodes,
                      summarize_episodes)
from tests.envs import CountingEnv, EvalFaultEnv, SimpleCorridor
from tests.pieces import BrokenInRunner, EpisodesPerRunner, Overlap


@pytest.fixture(scope="module", autouse=True)
def cluster(ray_cluster):
    yield ray_cluster


def ppo(env="CartPole-v1", num_env_runners=0, **env_config):
    return (PPOConfig().environment(env, env_config=env_config)
            .env_runners(num_env_runners=num_env_runners, num_envs_per_env_runner=2, rollout_fragment_length=50)
            .training(train_batch_size_per_learner=100, minibatch_size=50, num_epochs=1)
            .debugging(seed=0))


@pytest.mark.slow
def test_sequential_order_interval_and_attaching():
    """train(0->1), train(1->2), eval(2), train(2->3), train(3->4), eval(4) -- with evaluation_interval=2."""
    algo = ppo().evaluation(evaluation_interval=2, evaluation_duration=3, always_attach_evaluation_results=False).build()
    try:
        results = [algo.train() for _ in range(4)]
    finally:
        algo.stop()
    assert ["evaluation" in r for r in results] == [False, True, False, True]
    for r in results[1::2]:
        assert r["evaluation"]["weights_version"] == r["learners"]["__all_modules__"]["weights_version"]
        assert r["evaluation"]["env_runners"]["num_episodes"] == 3
    assert results[3]["evaluation"]["weights_version"] == 4


@ray.remote
class EventLog:
    """A named actor both sides of the test reach (global coordination through Ray)."""

    def __init__(self):
        import asyncio

        self.events: dict[str, asyncio.Event] = {}

    def _event(self, name):
        import asyncio

        return self.events.setdefault(name, asyncio.Event())

    async def mark(self, name):
        self._event(name).set()

    async def seen(self, name):
        return self._event(name).is_set()

    async def wait_for(self, name, timeout):
        import asyncio

        try:
            await asyncio.wait_for(self._event(name).wait(), timeout)
            return True
        except asyncio.TimeoutError:
            return False


@pytest.mark.slow
def test_parallel_evaluation_overlaps_training_and_is_one_behind():
    log = EventLog.options(name="overlap_log").remote()
    algo = (ppo().callbacks(Overlap)
            .evaluation(evaluation_interval=1, evaluation_num_env_runners=1, evaluation_parallel_to_training=True,
                        evaluation_duration="auto")
            .build())
    try:
        results = [algo.train() for _ in range(3)]
    finally:
        algo.stop()
        ray.kill(log)
    for r in results:
        assert r["learners"]["default_policy"]["overlap_seen"] == 1.0
        # train(v -> v+1) + eval(v): the evaluation's weights are one behind the trained ones
        assert r["evaluation"]["weights_version"] == r["learners"]["__all_modules__"]["weights_version"] - 1
        assert r["evaluation"]["env_runners"]["num_env_steps_sampled"] > 0


@pytest.mark.slow
def test_durations_split_among_evaluators_and_hooks_run_in_the_runners():
    """10 episodes on 3 evaluators: 4, 3, 3 (the remainder on the first ones); 200 timesteps on 3
    evaluators: rounded up to 201, 67 each (at least, whole vector steps)."""
    algo = (ppo().callbacks(EpisodesPerRunner)
            .evaluation(evaluation_num_env_runners=3, evaluation_duration=10).build())
    try:
        ev = algo.evaluate()["evaluation"]
        env = ev["env_runners"]
        assert env["num_episodes"] == 10 and len(ev["hist_stats"]["episode_return"]) == 10
        assert [env[f"episodes_on_{i}"] for i in (1, 2, 3)] == [4, 3, 3]
        assert env["pid"] != os.getpid()  # the episode hooks ran in the evaluators' processes
        algo.config.evaluation_duration_unit = "timesteps"  # the evaluators read their own copy:
        algo.evaluators.config.evaluation_duration_unit = "timesteps"
        algo.evaluators.config.evaluation_duration = 200
        ev = algo.evaluate()["evaluation"]
        assert ev["evaluation_duration"] == 201
        assert ev["env_runners"]["num_env_steps_sampled"] >= 201
    finally:
        algo.stop()


@pytest.mark.slow
@pytest.mark.parametrize("hang", [False, True], ids=["crash", "hang"])
def test_a_crashing_or_hanging_evaluator_is_survived_and_reported(hang):
    algo = (ppo(EvalFaultEnv, eval_fail_on=[1], hang=hang)
            .evaluation(evaluation_interval=1, evaluation_num_env_runners=2, evaluation_duration=4,
                        evaluation_sample_timeout_s=5)
            .build())
    try:
        result = algo.train()
    finally:
        algo.stop()
    ev = result["evaluation"]
    assert ev["num_failed_env_runners"] == 1
    assert ev["env_runners"]["num_episodes"] == 4  # evaluator 2 played evaluator 1's share too
    assert ev["fault_tolerance"]["num_remote_worker_failures"] >= 1
    # training did not notice
    assert result["env_runners"]["num_env_steps_sampled"] == 100
    assert result["fault_tolerance"]["num_remote_worker_failures"] == 0


# --- the page's custom evaluation function, on its corridor env ------------------------------------
def custom_eval_function(algorithm, eval_workers):
    """Evaluator 1 walks corridors of length 4, evaluator 2 of length 7."""
    eval_workers.foreach_worker(
        func=lambda w: w.foreach_env(lambda env: env.set_corridor_length(4 if w.worker_index == 1 else 7)))
    for i in range(3):
        eval_workers.foreach_worker(func=lambda w: w.sample(), local_worker=False)
    episodes = collect_episodes(workers=eval_workers, timeout_seconds=99999)
    metrics = summarize_episodes(episodes)
    metrics["foo"] = 1
    return metrics


def test_custom_evaluation_function_with_corridor_lengths():
    algo = (ppo(SimpleCorridor, corridor_length=10)
            .evaluation(evaluation_interval=1, evaluation_num_env_runners=2, custom_evaluation_function=custom_eval_function)
            .build())
    try:
        result = algo.train()
        lengths = algo.eval_env_runner_group.foreach_env_runner(
            lambda w: w.foreach_env(lambda env: env.end_pos), local_env_runner=False)
    finally:
        algo.stop()
    assert result["evaluation"]["foo"] == 1
    assert lengths == [[4, 4], [7, 7]]
    assert result["evaluation"]["episodes_this_iter"] > 0
    assert result["evaluation"]["episode_len_mean"] >= 4


def test_evaluation_config_overrides_env_config_and_explore():
    algo = (ppo(CountingEnv, length=5)
            .evaluation(evaluation_num_env_runners=1, evaluation_duration=4,
                        evaluation_config=AlgorithmConfig.overrides(explore=False, env_config={"length": 3})).build())
    try:
        ev = algo.evaluate()["evaluation"]
        explore = algo.eval_env_runner_group.foreach_env_runner(lambda w: w.config.explore)
        train_explore = algo.foreach_env_runner(lambda w: w.config.explore)
    finally:
        algo.stop()
    assert ev["hist_stats"]["episode_lengths"] == [3, 3, 3, 3]
    assert explore == [False] and train_explore == [True]


def test_evaluation_config_is_validated_like_the_main_config():
    with pytest.raises(ConfigError, match=r"evaluation_config: unknown evaluation_config setting 'exploer'.*'explore'"):
        ppo().evaluation(evaluation_config={"exploer": False}).build()
    with pytest.raises(ConfigError, match=r"evaluation_config: num_envs_per_env_runner must be an int >= 1"):
        ppo().evaluation(evaluation_config={"num_envs_per_env_runner": 0}).build()
    with pytest.raises(ConfigError, match="evaluation_duration='auto' needs evaluation_parallel_to_training=True"):
        ppo().evaluation(evaluation_duration="auto").build()


@pytest.mark.slow
def test_a_callback_error_in_a_remote_runner_ends_the_run_with_its_name():
    algo = ppo(num_env_runners=1).callbacks(BrokenInRunner).build()
    try:
        with pytest.raises(CallbackError, match=r"on_sample_end of class .*BrokenInRunner raised KeyError.*"
                                                r"\(in env runner 1\)") as err:
            algo.train()
        assert "raise KeyError(\"no such thing\")" in str(err.value)  # with the stack trace from the runner
        assert algo.env_runner_group.manager.num_restarts == 0  # not mistaken for a dead runner
    finally:
        algo.stop()


def test_evaluate_any_time_and_results_keys():
    algo = ppo().build()
    try:
        assert algo.evaluators is None
        out = algo.evaluate()
        result = algo.train()
    finally:
        algo.stop()
    env = out["evaluation"]["env_runners"]
    assert env["num_episodes"] == 10 and np.isfinite(env["episode_return_mean"])
    assert result["evaluation"] == out["evaluation"]  # attached to the next result


def test_every_evaluation_snippet_of_the_page_builds():
    """The page's config excerpts, with only the import changed, set what the text says; each also
    validates on a real algorithm config."""
    snippets = [
        (AlgorithmConfig().evaluation(evaluation_interval=3), {"evaluation_interval": 3}),
        (AlgorithmConfig().evaluation(evaluation_duration=10, evaluation_duration_unit="episodes"),
         {"evaluation_duration": 10, "evaluation_duration_unit": "episodes"}),
        (AlgorithmConfig().evaluation(evaluation_duration=200, evaluation_duration_unit="timesteps"),
         {"evaluation_duration": 200, "evaluation_duration_unit": "timesteps"}),
        (AlgorithmConfig().evaluation(evaluation_duration=10, evaluation_duration_unit="episodes",
                                      evaluation_num_workers=7),  # the page's older name
         {"evaluation_num_env_runners": 7}),
        (AlgorithmConfig().evaluation(evaluation_interval=2, evaluation_parallel_to_training=True,
                                      evaluation_duration="auto", evaluation_duration_unit="timesteps"),
         {"evaluation_duration": "auto", "evaluation_parallel_to_training": True}),
        (AlgorithmConfig().evaluation(evaluation_config=AlgorithmConfig.overrides(explore=False)),
         {"evaluation_config": {"explore": False}}),
        (AlgorithmConfig().evaluation(evaluation_config={"explore": False}), {"evaluation_config": {"explore": False}}),
        (AlgorithmConfig().evaluation(evaluation_interval=1, evaluation_parallel_to_training=True,
                                      evaluation_duration="auto", evaluation_duration_unit="timesteps",
                                      evaluation_force_reset_envs_before_iteration=True),
         {"evaluation_force_reset_envs_before_iteration": True}),
    ]
    for snippet, expected in snippets:
        assert {k: getattr(snippet, k) for k in expected} == expected
        real = ppo().update_from_dict({k: v for k, v in snippet.to_dict().items() if k.startswith("evaluation")})
        real.validate()
        assert real.evaluation_settings().explore is (snippet.evaluation_config or {}).get("explore", True)


def test_evaluation_config_as_a_config_object_keeps_what_it_changes():
    cfg = ppo().evaluation(evaluation_config=PPOConfig().env_runners(explore=False, num_envs_per_env_runner=1))
    assert cfg.evaluation_config == {"explore": False, "num_envs_per_env_runner": 1}
    back = PPOConfig.from_dict(cfg.to_dict())
    back.validate()
    assert back.evaluation_settings().explore is False
