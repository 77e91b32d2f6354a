"""Callbacks (RLlib's "Callbacks and Custom Metrics" page): every hook fires at its documented moment,
episode hooks see the episode and log metrics into the results, trajectories can be rewritten, classes
chain, and a failing hook names itself. In-process (no Ray): runner hooks run in this process here;
tests/test_evaluation.py checks them inside remote runners."""
from __future__ import annotations

import numpy as np
import pytest

from pipeline import CallbackError, DefaultCallbacks, PPOConfig, make_multi_callbacks
from tests.envs import CountingEnv

EVENTS: list[tuple] = []


def small_ppo(env=CountingEnv, **env_config):
    return (PPOConfig().environment(env, env_config=env_config)
            .env_runners(num_env_runners=0, num_envs_per_env_runner=2, rollout_fragment_length=10)
            .training(train_batch_size_per_learner=20, minibatch_size=10, num_epochs=1)
            .debugging(seed=0))


class Recorder(DefaultCallbacks):
    def on_algorithm_init(self, *, algorithm, **kwargs):
        EVENTS.append(("algorithm_init",))

    def on_environment_created(self, *, env_runner, env, env_context, **kwargs):
        EVENTS.append(("environment_created", env_runner.worker_index))

    def on_sub_environment_created(self, *, worker, sub_environment, env_context, env_index=None, **kwargs):
        EVENTS.append(("sub_environment_created", env_index))

    def on_episode_created(self, *, episode, env_index, **kwargs):
        EVENTS.append(("created", episode.id_, env_index, len(episode.get_observations())))

    def on_episode_start(self, *, episode, env_index, **kwargs):
        EVENTS.append(("start", episode.id_, env_index, len(episode.get_observations())))

    def on_episode_step(self, *, episode, env_index, **kwargs):
        EVENTS.append(("step", episode.id_, env_index, float(episode.get_observations(-1)[0])))

    def on_episode_end(self, *, episode, env_index, metrics_logger, **kwargs):
        EVENTS.append(("end", episode.id_, env_index, len(episode), episode.is_terminated))

    def on_sample_end(self, *, env_runner, samples, **kwargs):
        EVENTS.append(("sample_end", sum(len(c) for c in samples)))

    def on_learn_on_batch(self, *, train_batch, result, **kwargs):
        EVENTS.append(("learn_on_batch", sum(len(c) for c in train_batch)))

    def on_train_result(self, *, algorithm, result, **kwargs):
        EVENTS.append(("train_result", result["training_iteration"]))

    def on_evaluate_start(self, *, algorithm, **kwargs):
        EVENTS.append(("evaluate_start",))

    def on_evaluate_end(self, *, algorithm, evaluation_metrics, **kwargs):
        EVENTS.append(("evaluate_end", evaluation_metrics["env_runners"]["num_episodes"]))

    def on_checkpoint_loaded(self, *, algorithm, **kwargs):
        EVENTS.append(("checkpoint_loaded",))


def test_every_hook_fires_at_its_moment(tmp_path):
    EVENTS.clear()
    algo = small_ppo(length=4).callbacks(Recorder).evaluation(evaluation_duration=2).build()
    try:
        algo.train()
        algo.evaluate()
        path = algo.save(str(tmp_path / "ckpt"))
        algo.restore(path)
    finally:
        algo.stop()
    kinds = [e[0] for e in EVENTS]
    # the training runner: one vector env (2 sub-envs), then init
    assert kinds[:3] == ["sub_environment_created", "sub_environment_created", "environment_created"]
    assert kinds.index("algorithm_init") < kinds.index("sample_end") < kinds.index("learn_on_batch") \
        < kinds.index("train_result") < kinds.index("evaluate_start") < kinds.index("evaluate_end") \
        < kinds.index("checkpoint_loaded")
    assert ("learn_on_batch", 20) in EVENTS and ("sample_end", 20) in EVENTS
    assert ("evaluate_end", 2) in EVENTS
    # one episode's events, in order: created (before the reset: no observation yet), start (the reset
    # observation), a step per env step (the last one included), then end
    first = next(e for e in EVENTS if e[0] == "created")
    mine = [e for e in EVENTS if len(e) > 1 and e[1] == first[1]]
    assert [e[0] for e in mine] == ["created", "start", "step", "step", "step", "step", "end"]
    assert mine[0][3] == 0 and mine[1][3] == 1
    assert [e[3] for e in mine if e[0] == "step"] == [1.0, 2.0, 3.0, 4.0]
    assert mine[-1][3:] == (4, True)


class AngleMetrics(DefaultCallbacks):
    """The page's custom-metrics example, on CountingEnv: per-step data, then metrics at the end."""

    def on_episode_start(self, *, episode, **kwargs):
        episode.user_data["seen"] = []

    def on_episode_step(self, *, episode, **kwargs):
        episode.user_data["seen"].append(float(episode.last_observation_for()[0]))
        episode.add_temporary_timestep_data("reward", episode.last_reward_for())

    def on_episode_end(self, *, episode, metrics_logger, **kwargs):
        metrics_logger.log_value("obs_sum", sum(episode.user_data["seen"]), reduce="mean")
        metrics_logger.log_value("temp_rewards", sum(episode.get_temporary_timestep_data("reward")), reduce="max")
        episode.custom_metrics["length_seen"] = len(episode.user_data["seen"])


def test_episode_metrics_reach_the_results():
    algo = small_ppo(length=3).callbacks(AngleMetrics).build()
    try:
        result = algo.train()
    finally:
        algo.stop()
    env = result["env_runners"]
    assert env["obs_sum"] == 1 + 2 + 3
    assert env["temp_rewards"] == 3.0
    assert env["custom_metrics"]["length_seen_mean"] == 3
    assert env["custom_metrics"]["length_seen_max"] == 3


class SevenRewards(DefaultCallbacks):
    """Rewriting trajectories: every reward becomes 7 before the chunk leaves the runner."""

    def on_postprocess_trajectory(self, *, postprocessed_batch, **kwargs):
        postprocessed_batch["rewards"] = np.full(len(postprocessed_batch), 7.0)


class BatchRewards(DefaultCallbacks):
    def on_learn_on_batch(self, *, train_batch, result, **kwargs):
        rewards = np.concatenate([c["rewards"] for c in train_batch])
        result["min_reward_seen"] = float(rewards.min())
        result["max_reward_seen"] = float(rewards.max())


def test_postprocess_rewrites_rewards_the_learner_sees_and_classes_chain():
    algo = small_ppo().callbacks(make_multi_callbacks([SevenRewards, BatchRewards])).build()
    try:
        result = algo.train()
    finally:
        algo.stop()
    stats = result["learners"]["default_policy"]
    assert stats["min_reward_seen"] == stats["max_reward_seen"] == 7.0
    assert result["env_runners"]["episode_return_mean"] == 5.0  # metrics keep the env's own rewards


def count_ends(*, episode, metrics_logger, **kwargs):
    metrics_logger.log_value("ends_by_function", 1, reduce="sum")


def test_callbacks_as_functions_per_hook_and_as_a_list():
    order = []

    class A(DefaultCallbacks):
        def on_train_result(self, *, result, **kwargs):
            order.append("A")

    class B(DefaultCallbacks):
        def on_train_result(self, *, result, **kwargs):
            order.append("B")

    algo = small_ppo().callbacks([A, B], on_episode_end=count_ends,
                                 on_train_result=lambda **kw: order.append("fn")).build()
    try:
        result = algo.train()
    finally:
        algo.stop()
    assert order == ["A", "B", "fn"]
    assert result["env_runners"]["ends_by_function"] == result["env_runners"]["num_episodes"] > 0


class Broken(DefaultCallbacks):
    def on_episode_end(self, **kwargs):
        raise ZeroDivisionError("boom")


def test_a_failing_hook_names_itself_and_its_class():
    algo = small_ppo().callbacks(Broken).build()
    try:
        with pytest.raises(CallbackError, match=r"on_episode_end of class .*Broken raised ZeroDivisionError: boom "
                                                r"\(in env runner 0\)"):
            algo.train()
    finally:
        algo.stop()


def test_unknown_hook_name_is_a_config_error():
    from pipeline import ConfigError

    with pytest.raises(ConfigError, match="on_episode_end"):
        small_ppo().callbacks(on_episode_ends=count_ends).build()
