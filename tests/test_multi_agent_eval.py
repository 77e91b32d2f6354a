"""Evaluation and callbacks in multi-agent runs.

Evaluators of a multi-agent run are ``MultiAgentEnvRunner``s (exploring as training does unless
``evaluation_config`` turns it off, as in RLlib), run by episodes or timesteps, in-process or as Ray actors, beside training or after it, and
report RLlib's keys under ``evaluation/env_runners/`` with the per-agent and per-module returns. Modules
added while training reach the evaluators. Callbacks' episode hooks get the ``MultiAgentEpisode`` (RLlib's
argument names), and what they log reaches the training and evaluation results.
"""
from __future__ import annotations

from typing import Any

import pytest

from actors.env.multi_agent_runner import MultiAgentEnvRunner
from pipeline import PPOConfig, make_multi_agent
from tests.pieces import AgentReturns, by_agent


def against_p1_v1(agent_id: Any, episode: Any, **kwargs: Any) -> str:
    return "p0" if agent_id == 0 else "p1_v1"


def config(**evaluation: Any) -> PPOConfig:
    return (PPOConfig().environment(make_multi_agent("CartPole-v1"), env_config={"num_agents": 2})
            .multi_agent(policies={"p0", "p1"}, policy_mapping_fn=by_agent)
            .rl_module(model_config={"fcnet_hiddens": [16]})
            .training(train_batch_size_per_learner=400, minibatch_size=200, num_epochs=1)
            .env_runners(num_env_runners=0).evaluation(evaluation_interval=1, **evaluation).debugging(seed=0))


def check_multi_agent_keys(env: dict[str, Any], modules: set[str]) -> None:
    assert set(env["agent_episode_returns_mean"]) == {"0", "1"}
    assert set(env["module_episode_returns_mean"]) == modules
    # every episode holds both agents: the summed return's mean is the sum of the agents' means
    assert env["episode_return_mean"] == pytest.approx(sum(env["agent_episode_returns_mean"].values()))


def test_evaluation_by_episodes_reports_rllib_multi_agent_keys():
    algo = config(evaluation_duration=4, evaluation_duration_unit="episodes").build(logdir=None)
    try:
        r = algo.train()
        evaluation = r["evaluation"]
        env = evaluation["env_runners"]
        assert env["num_episodes"] == 4 and len(evaluation["hist_stats"]["episode_return"]) == 4
        check_multi_agent_keys(env, {"p0", "p1"})
        assert evaluation["weights_version"] == algo.weights_version == 1  # after the iteration's update
        evaluator = algo.evaluators.group.local
        # RLlib's default: evaluators explore as training does, unless evaluation_config says otherwise
        assert isinstance(evaluator, MultiAgentEnvRunner) and evaluator.config.explore is True
        # and evaluate() on demand, with the current weights
        out = algo.evaluate()["evaluation"]
        assert out["env_runners"]["num_episodes"] == 4 and out["weights_version"] == algo.weights_version
    finally:
        algo.stop()


def test_evaluation_by_timesteps_and_evaluation_config_explore():
    algo = config(evaluation_duration=150, evaluation_duration_unit="timesteps",
                  evaluation_config={"explore": False}).build(logdir=None)
    try:
        env = algo.train()["evaluation"]["env_runners"]
        assert env["num_env_steps_sampled"] >= 150  # env steps, whatever count_steps_by is
        assert env["num_agent_steps_sampled"] > env["num_env_steps_sampled"]
        assert algo.evaluators.group.local.config.explore is False and algo.env_runner_group.local.config.explore
    finally:
        algo.stop()


def test_an_added_module_reaches_the_evaluators():
    algo = config(evaluation_duration=4).build(logdir=None)
    try:
        algo.train()
        algo.add_module("p1_v1", new_agent_to_module_mapping_fn=against_p1_v1, new_should_module_be_updated=["p0"])
        assert algo.evaluators.group.local.module_ids == ["p0", "p1", "p1_v1"]
        env = algo.evaluate()["evaluation"]["env_runners"]
        assert set(env["module_episode_returns_mean"]) == {"p0", "p1_v1"}  # fresh episodes: the new mapping
        algo.remove_module("p1")
        assert algo.evaluators.group.local.module_ids == ["p0", "p1_v1"]
        algo.evaluate()
    finally:
        algo.stop()


def test_callbacks_get_the_multi_agent_episode_and_log_per_agent_metrics():
    algo = config(evaluation_duration=3).callbacks(AgentReturns).build(logdir=None)
    try:
        r = algo.train()
        env = r["env_runners"]
        assert set(env["agent_return"]) == {"0", "1"}
        assert env["agent_return"]["0"] == pytest.approx(env["agent_episode_returns_mean"]["0"], rel=0.5)
        assert env["episodes_started"] >= 1 and env["sampled_chunks"] >= 2 and env["in_evaluation"] == 0
        # one on_episode_step per env step of the iteration
        assert env["episode_steps_seen"] == env["num_env_steps_sampled"]
        assert r["modules_seen"] == ["p0", "p1"]
        evaluated = r["evaluation"]["env_runners"]
        assert set(evaluated["agent_return"]) == {"0", "1"} and evaluated["in_evaluation"] == 1
    finally:
        algo.stop()


@pytest.mark.slow
def test_ray_evaluators_parallel_to_training(ray_cluster):
    # a counted duration: "auto" beside training evaluates only as long as the training step takes, so
    # whether an episode ends in it depends on timing; two episodes are waited for
    algo = (config(evaluation_num_env_runners=2, evaluation_duration=2, evaluation_duration_unit="episodes",
                   evaluation_parallel_to_training=True)
            .env_runners(num_env_runners=1).callbacks(AgentReturns).build(logdir=None))
    try:
        algo.train()
        r = algo.train()
        env = r["evaluation"]["env_runners"]
        assert env["num_episodes"] >= 1
        check_multi_agent_keys(env, {"p0", "p1"})
        assert set(env["agent_return"]) == {"0", "1"}
        assert algo.evaluators.group.foreach_env_runner(lambda runner: type(runner).__name__, local=False) \
            == ["MultiAgentEnvRunner"] * 2
        algo.add_module("p1_v1", new_agent_to_module_mapping_fn=against_p1_v1)
        assert algo.evaluators.group.foreach_env_runner(lambda runner: runner.module_ids, local=False) \
            == [["p0", "p1", "p1_v1"]] * 2
        out = algo.evaluate()["evaluation"]["env_runners"]
        assert out["num_episodes"] >= 1
    finally:
        algo.stop()
