"""Multi-agent training through the public API: ``PPOConfig().multi_agent(...).build()``, then ``train()``.

Two-agent CartPole (``make_multi_agent``), agent ``i`` mapped to module ``p<i>``: both modules train
(in-process runner and Ray runners), results carry RLlib's multi-agent keys, a module left out of
``policies_to_train`` keeps its weights, checkpoints hold one subdirectory per module and restore
both, and what is not built for multi-agent runs fails at set-up naming the setting. A single-agent
config keeps the single-agent stages.
"""
from __future__ import annotations

import os
import time
from typing import Any

import pytest
import torch

from actors.env.env_runner import EnvRunner
from actors.env.multi_agent_runner import MultiAgentEnvRunner
from pipeline import PPOConfig, make_multi_agent
from pipeline.algorithm import Algorithm
from pipeline.config.base import ConfigError
from pipeline.groups.learner_group import LearnerGroup
from pipeline.groups.multi_agent import MultiLearnerGroup
from tests.pieces import by_agent

OBS = [0.01, -0.02, 0.03, 0.0]


def config(model_config: dict | None = None, **training: Any) -> PPOConfig:
    """Small and fast unless told otherwise: 400 env steps an iteration, a 16-unit network."""
    training = {"train_batch_size_per_learner": 400, "minibatch_size": 200, "num_epochs": 2} | training
    model_config = {"fcnet_hiddens": [16]} if model_config is None else model_config
    return (PPOConfig().environment(make_multi_agent("CartPole-v1"), env_config={"num_agents": 2})
            .multi_agent(policies={"p0", "p1"}, policy_mapping_fn=by_agent)
            .rl_module(model_config=model_config).training(**training)
            .env_runners(num_env_runners=0).debugging(seed=0))


def weights(algo: Algorithm, module_id: str) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in algo.get_module(module_id).state_dict().items()}


def same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


@pytest.fixture(scope="module")
def trained() -> Any:
    """One in-process run, two iterations: (algo, initial weights per module, the last result)."""
    algo = config().build(logdir=None)
    initial = {mid: weights(algo, mid) for mid in ("p0", "p1")}
    algo.train()
    result = algo.train()
    yield algo, initial, result
    algo.stop()


def test_a_multi_agent_config_builds_the_multi_agent_stages(trained):
    algo, _, _ = trained
    assert isinstance(algo.learner_group, MultiLearnerGroup)
    assert isinstance(algo.env_runner_group.local, MultiAgentEnvRunner)
    assert algo.learner_group.module_ids == ["p0", "p1"]


def test_both_modules_train_and_results_carry_rllib_multi_agent_keys(trained):
    algo, initial, r = trained
    for mid in ("p0", "p1"):
        assert not same(initial[mid], weights(algo, mid)), f"module {mid} did not change"
        assert {"policy_loss", "vf_loss", "entropy", "num_module_steps_trained"} <= set(r["learners"][mid])
    assert "default_policy" not in r["learners"]
    env = r["env_runners"]
    assert set(env["agent_episode_returns_mean"]) == {"0", "1"}
    assert set(env["module_episode_returns_mean"]) == {"p0", "p1"}
    # every episode holds both agents, so the mean of the summed returns is the sum of the agents' means
    assert env["episode_return_mean"] == pytest.approx(sum(env["agent_episode_returns_mean"].values()))
    assert env["episode_return_mean"] > max(env["agent_episode_returns_mean"].values())
    # two iterations of at least 400 env steps; each env step is one or two agents' steps
    assert 800 <= r["num_env_steps_sampled_lifetime"] < r["num_agent_steps_sampled_lifetime"] \
        <= 2 * r["num_env_steps_sampled_lifetime"]
    all_modules = r["learners"]["__all_modules__"]
    assert r["num_env_steps_trained_lifetime"] == r["num_env_steps_sampled_lifetime"]
    assert r["num_agent_steps_trained_lifetime"] == r["num_agent_steps_sampled_lifetime"]
    assert all_modules["num_modules_trained"] == 2 and all_modules["weights_version"] == 2
    module_steps = sum(r["learners"][mid]["num_module_steps_trained"] for mid in ("p0", "p1"))
    assert module_steps == all_modules["num_agent_steps_trained"]


def test_actions_and_modules_per_policy_id(trained):
    algo, _, _ = trained
    for mid in ("p0", "p1"):
        assert algo.compute_single_action(OBS, explore=False, policy_id=mid) in (0, 1)
        with torch.no_grad():
            logits = algo.get_module(mid).forward_inference(torch.tensor([OBS]))["action_dist_inputs"]
        assert algo.compute_single_action(OBS, explore=False, policy_id=mid) == int(logits.argmax())
    with pytest.raises(KeyError, match=r"'p0', 'p1'"):
        algo.compute_single_action(OBS)  # two modules: which one acts must be named
    with pytest.raises(KeyError, match="'nope'"):
        algo.get_module("nope")


def test_a_module_left_out_of_policies_to_train_keeps_its_weights():
    algo = config().multi_agent(policies_to_train=["p0"]).build(logdir=None)
    try:
        before = {mid: weights(algo, mid) for mid in ("p0", "p1")}
        r = algo.train()
        r = algo.train()
        assert same(before["p1"], weights(algo, "p1"))
        assert not same(before["p0"], weights(algo, "p0"))
        assert "p1" not in r["learners"] and "policy_loss" in r["learners"]["p0"]
        assert r["learners"]["__all_modules__"]["num_frozen_batches_dropped"] == 1
        # the runners act with the same frozen weights
        runner = algo.env_runner_group.local.get_weights(["p1"])
        assert all(torch.equal(torch.as_tensor(runner[f"p1/{k}"]), v) for k, v in before["p1"].items()
                   if f"p1/{k}" in runner)
    finally:
        algo.stop()


def test_count_steps_by_agent_steps_fills_the_batch_with_agent_steps():
    algo = config().multi_agent(count_steps_by="agent_steps").build(logdir=None)
    try:
        r = algo.train()
        assert r["num_agent_steps_sampled_lifetime"] >= 400
        assert r["num_env_steps_sampled_lifetime"] < r["num_agent_steps_sampled_lifetime"]
    finally:
        algo.stop()


def test_checkpoint_holds_a_directory_per_module_and_restores_both(tmp_path):
    algo = config().multi_agent(policies_to_train=["p0"]).build(logdir=None)
    try:
        algo.train()
        path = algo.save(str(tmp_path / "ckpt"))
        saved = {mid: weights(algo, mid) for mid in ("p0", "p1")}
        counters = algo.counters
    finally:
        algo.stop()
    for mid in ("p0", "p1"):
        assert os.path.isfile(os.path.join(path, "modules", mid, "learner.pt"))
    restored = Algorithm.from_checkpoint(path, logdir=None)
    try:
        assert restored.iteration == 1 and restored.counters == counters
        for mid in ("p0", "p1"):
            assert same(saved[mid], weights(restored, mid)), f"module {mid} not restored"
        r = restored.train()
        assert r["training_iteration"] == 2 and "p1" not in r["learners"]
        assert same(saved["p1"], weights(restored, "p1"))  # still frozen after the restore
    finally:
        restored.stop()


@pytest.mark.slow
def test_ray_env_runners_and_two_data_parallel_learners_train_both_modules(ray_cluster):
    algo = config().env_runners(num_env_runners=2).learners(num_learners=2).build(logdir=None)
    try:
        before = {mid: weights(algo, mid) for mid in ("p0", "p1")}
        r = algo.train()
        first, second = algo.learner_group.foreach_learner(lambda learner: learner.get_weights())
        assert first.keys() == second.keys() and all((first[k] == second[k]).all() for k in first)
        assert set(algo.foreach_env_runner(lambda runner: type(runner).__name__)) == {"MultiAgentEnvRunner"}
        assert r["num_env_steps_sampled_lifetime"] >= 800  # 400 per learner
        assert set(r["env_runners"]["module_episode_returns_mean"]) == {"p0", "p1"}
        for mid in ("p0", "p1"):
            assert "policy_loss" in r["learners"][mid]
            assert not same(before[mid], weights(algo, mid))
            assert algo.compute_single_action(OBS, policy_id=mid) in (0, 1)
    finally:
        algo.stop()


def test_a_single_agent_config_keeps_the_single_agent_stages():
    algo = (PPOConfig().environment("CartPole-v1").env_runners(num_env_runners=0)
            .training(train_batch_size_per_learner=200, minibatch_size=100, num_epochs=1).build(logdir=None))
    try:
        assert algo.multi_agent is None
        assert type(algo.learner_group) is LearnerGroup and type(algo.env_runner_group.local) is EnvRunner
        r = algo.train()
        assert "policy_loss" in r["learners"]["default_policy"] and "num_agent_steps_sampled_lifetime" not in r
    finally:
        algo.stop()


def test_what_is_not_built_for_multi_agent_runs_fails_at_build_naming_the_setting():
    with pytest.raises(ConfigError, match="single-agent"):
        config().environment("CartPole-v1", env_config={}).build(logdir=None)


@pytest.mark.learning
def test_ppo_trains_two_policies_on_two_agent_cartpole():
    """Summed return (both agents) of 800 within 300k env steps. Measured: seed 0 at 34k env steps (14-33 s
    on 2 busy cores); seeds 1-3 at 124k, 68k, 38k."""
    # PPO's defaults (2000-step batches, 500-step minibatches, 8 epochs), 4 envs; the mean over the
    # last 20 episodes, not 100: at 800 a 100-episode window spans some 80k env steps of the past
    algo = (config(model_config={}, train_batch_size_per_learner=2000, minibatch_size=500, num_epochs=8)
            .env_runners(num_envs_per_env_runner=4).reporting(metrics_num_episodes_for_smoothing=20)
            .build(logdir=None))
    try:
        t0, best, r = time.perf_counter(), float("-inf"), {}
        while best < 800 and r.get("num_env_steps_sampled_lifetime", 0) < 300_000:
            r = algo.train()
            best = max(best, r["env_runners"]["episode_return_mean"])
        print(f"summed return {best:.0f} after {r['num_env_steps_sampled_lifetime']} env steps, "
              f"{time.perf_counter() - t0:.0f} s")
        assert best >= 800, f"summed return {best:.0f} after {r['num_env_steps_sampled_lifetime']} env steps"
        module_means = r["env_runners"]["module_episode_returns_mean"]
        assert min(module_means.values()) >= 200, f"one policy lags: {module_means}"  # random play: ~22
    finally:
        algo.stop()
