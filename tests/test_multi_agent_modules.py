"""Changing a multi-agent run's modules: ``add_module``/``remove_module`` (the self-play pattern), a
``policies_to_train`` function, per-module module classes, checkpoints after add/remove, and one
module restored from a checkpoint into another algorithm (``load_module``).

Two-agent CartPole (``make_multi_agent``) with small batches; in-process runners and learners, and
once with Ray runners and two data-parallel learners.
"""
from __future__ import annotations

import os
import time
from typing import Any

import numpy as np
import pytest
import torch

from actors.modules import ActorCriticModule
from actors.modules.q_module import QModule
from pipeline import PPOConfig, make_multi_agent
from pipeline.algorithm import Algorithm
from pipeline.config.base import ConfigError
from pipeline.config.multi_agent import PolicySpec
from actors.modules.rl_module_spec import RLModuleSpec
from tests.pieces import against_snapshot, by_agent


def only_p0(module_id: str, batch: Any) -> bool:
    return module_id == "p0"


class WideActorCritic(ActorCriticModule):
    """A module class of its own for one module (what the learner's loss needs, by inheritance)."""


def config(**training: Any) -> PPOConfig:
    training = {"train_batch_size_per_learner": 400, "minibatch_size": 200, "num_epochs": 2} | training
    return (PPOConfig().environment(make_multi_agent("CartPole-v1"), env_config={"num_agents": 2})
            .multi_agent(policies={"p0", "p1"}, policy_mapping_fn=by_agent)
            .rl_module(model_config={"fcnet_hiddens": [16]}).training(**training)
            .env_runners(num_env_runners=0).debugging(seed=0))


def weights(algo: Algorithm, module_id: str) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in algo.get_module(module_id).state_dict().items()}


def same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def runner_weights(algo: Algorithm, module_id: str) -> list[dict[str, torch.Tensor]]:
    """The module's weights on every env runner, as tensors (the runners hold inference-only copies)."""
    prefix = f"{module_id}/"
    return [{k[len(prefix):]: torch.tensor(np.array(v)) for k, v in w.items()}
            for w in algo.foreach_env_runner(lambda runner: runner.get_weights([module_id]))]


def snapshot(algo: Algorithm) -> None:
    """The league step: "main" (p0) copied into a frozen "p0_v1", which agent 1 now plays."""
    algo.add_module("p0_v1", RLModuleSpec(), new_agent_to_module_mapping_fn=against_snapshot,
                    new_should_module_be_updated=["p0", "p1"])
    algo.set_state({"learner_group": {"learner": {"rl_module": {"p0_v1": algo.get_module("p0").get_state()}}}})


def check_frozen_snapshot_stays_fixed(algo: Algorithm) -> None:
    snapshot(algo)
    frozen = weights(algo, "p0_v1")
    assert same(frozen, weights(algo, "p0"))
    r = algo.train()
    r = algo.train()
    assert same(frozen, weights(algo, "p0_v1")), "the frozen snapshot changed"
    assert not same(frozen, weights(algo, "p0")), "the learning module did not train"
    for on_runner in runner_weights(algo, "p0_v1"):  # the runners act with the snapshot's weights
        assert all(torch.equal(v, frozen[k]) for k, v in on_runner.items())
    assert r["env_runners"]["module_episode_returns_mean"].get("p0_v1", 0) > 0  # episodes played against it
    assert r["learners"]["__all_modules__"]["num_frozen_batches_dropped"] >= 1
    assert "p0_v1" not in r["learners"]


def test_add_a_frozen_snapshot_of_a_module_and_play_against_it():
    algo = config().build(logdir=None)
    try:
        algo.train()
        check_frozen_snapshot_stays_fixed(algo)
        assert algo.learner_group.module_ids == ["p0", "p0_v1", "p1"]
        assert algo.compute_single_action([0.0, 0.0, 0.0, 0.0], explore=False, policy_id="p0_v1") in (0, 1)
        with pytest.raises(ValueError, match="exists already"):
            algo.add_module("p0_v1")
    finally:
        algo.stop()


def test_remove_a_module_everywhere():
    algo = config().build(logdir=None)
    try:
        assert "policy_loss" in algo.train()["learners"]["p1"]
        snapshot(algo)
        algo.remove_module("p1", new_agent_to_module_mapping_fn=against_snapshot)
        assert algo.learner_group.module_ids == ["p0", "p0_v1"]
        assert algo.foreach_env_runner(lambda runner: runner.module_ids) == [["p0", "p0_v1"]]
        assert set(algo.config.policies) == {"p0", "p0_v1"} and algo.config.policies_to_train == ["p0"]
        with pytest.raises(KeyError, match="'p1'"):
            algo.get_module("p1")
        r = algo.train()
        assert r["learners"]["__all_modules__"]["num_modules_trained"] == 1  # p0 only; p0_v1 is frozen
        assert "p1" not in r["learners"]  # its statistics left with it
        with pytest.raises(KeyError, match="no module 'p1'"):
            algo.remove_module("p1")
    finally:
        algo.stop()


def test_checkpoint_after_add_and_remove_restores_the_same_modules(tmp_path):
    algo = config().build(logdir=None)
    try:
        snapshot(algo)
        algo.remove_module("p1", new_agent_to_module_mapping_fn=against_snapshot)
        algo.train()
        path = algo.save(str(tmp_path / "ckpt"))
        saved = {mid: weights(algo, mid) for mid in ("p0", "p0_v1")}
    finally:
        algo.stop()
    assert sorted(os.listdir(os.path.join(path, "modules"))) == ["p0", "p0_v1"]
    restored = Algorithm.from_checkpoint(path, logdir=None)
    try:
        assert restored.learner_group.module_ids == ["p0", "p0_v1"]
        for mid in ("p0", "p0_v1"):
            assert same(saved[mid], weights(restored, mid)), f"module {mid} not restored"
        r = restored.train()
        assert "p0_v1" in r["env_runners"]["module_episode_returns_mean"]
        assert same(saved["p0_v1"], weights(restored, "p0_v1"))  # still frozen
        assert not same(saved["p0"], weights(restored, "p0"))
    finally:
        restored.stop()


def single_agent() -> PPOConfig:
    return (PPOConfig().environment("CartPole-v1").env_runners(num_env_runners=0)
            .rl_module(model_config={"fcnet_hiddens": [16]})
            .training(train_batch_size_per_learner=200, minibatch_size=100, num_epochs=1))


def trained_checkpoint(algo: Algorithm, path: str, module_id: str) -> tuple[str, dict[str, torch.Tensor]]:
    """One iteration, a checkpoint at ``path``; -> (its path, module ``module_id``'s weights). Stops ``algo``."""
    try:
        algo.train()
        return algo.save(path), weights(algo, module_id)
    finally:
        algo.stop()


def test_load_one_module_from_a_checkpoint_into_another_algorithm(tmp_path):
    path, p1 = trained_checkpoint(config().build(logdir=None), str(tmp_path / "ckpt"), "p1")
    other = (config().multi_agent(policies={"a", "b"}, policy_mapping_fn=lambda aid, ep, **kw: "ab"[aid])
             .debugging(seed=7).build(logdir=None))
    try:
        b_before = weights(other, "b")
        other.load_module("a", path, source_module_id="p1")  # RLlib's rl_module component: the weights
        assert same(p1, weights(other, "a")) and same(b_before, weights(other, "b"))
        for on_runner in runner_weights(other, "a"):
            assert all(torch.equal(v, p1[k]) for k, v in on_runner.items())
        other.load_module("b", path, source_module_id="p1", weights_only=False)  # and the optimizer, counters
        updates = other.learner_group.foreach_learner(lambda ml: {m: ml.learner(m).num_updates for m in ("a", "b")})
        assert updates[0]["a"] == 0 and updates[0]["b"] > 0 and same(p1, weights(other, "b"))
        other.train()
        with pytest.raises(ValueError, match="no module 'p7'"):
            other.load_module("a", path, source_module_id="p7")
    finally:
        other.stop()
    narrow = config().rl_module(model_config={"fcnet_hiddens": [8]}).build(logdir=None)
    try:
        with pytest.raises(ValueError, match="module 'p1' of .* does not fit module 'p0'"):
            narrow.load_module("p0", path, source_module_id="p1")
    finally:
        narrow.stop()


def test_load_a_single_agent_checkpoint_into_one_module(tmp_path):
    path, trained = trained_checkpoint(single_agent().build(logdir=None), str(tmp_path / "single"), "default_policy")
    algo = config().build(logdir=None)
    try:
        algo.load_module("p0", path, source_module_id="default_policy")
        assert same(trained, weights(algo, "p0"))
    finally:
        algo.stop()


def test_policies_to_train_as_a_function(tmp_path):
    algo = config().multi_agent(policies_to_train=only_p0).build(logdir=None)
    try:
        before = {mid: weights(algo, mid) for mid in ("p0", "p1")}
        r = algo.train()
        assert same(before["p1"], weights(algo, "p1")) and not same(before["p0"], weights(algo, "p0"))
        assert "policy_loss" in r["learners"]["p0"] and "p1" not in r["learners"]
        assert r["learners"]["__all_modules__"]["num_frozen_batches_dropped"] == 1
        path = algo.save(str(tmp_path / "ckpt"))
        # and set by add_module: from now on both train
        algo.add_module("p2", new_should_module_be_updated=lambda mid, batch: mid in ("p0", "p1"))
        r = algo.train()
        assert not same(before["p1"], weights(algo, "p1"))
    finally:
        algo.stop()
    restored = Algorithm.from_checkpoint(path, logdir=None)  # the function comes back by its import path
    try:
        restored.train()
        assert same(before["p1"], weights(restored, "p1"))
    finally:
        restored.stop()


def test_per_module_module_classes():
    spec = PolicySpec(policy_class=WideActorCritic, config={"model_config": {"fcnet_hiddens": [8]}})
    algo = config().multi_agent(policies={"p0": None, "p1": spec}).build(logdir=None)
    try:
        assert type(algo.get_module("p1")) is WideActorCritic and type(algo.get_module("p0")) is ActorCriticModule
        learner_classes = algo.learner_group.foreach_learner(
            lambda learner: {mid: type(learner.module(mid)).__name__ for mid in learner.module_ids})
        assert learner_classes == [{"p0": "ActorCriticModule", "p1": "WideActorCritic"}]
        assert algo.foreach_env_runner(lambda runner: type(runner.module["p1"]).__name__) == ["WideActorCritic"]
        before = weights(algo, "p1")
        r = algo.train()
        assert "policy_loss" in r["learners"]["p1"] and not same(before, weights(algo, "p1"))
    finally:
        algo.stop()
    with pytest.raises(ConfigError, match=r"module 'p1' asks for module class QModule.*needs a ActorCriticModule"):
        config().multi_agent(policies={"p0": None, "p1": PolicySpec(policy_class=QModule)}).build(logdir=None)


def test_add_module_refuses_what_it_cannot_do():
    single = single_agent().build(logdir=None)
    try:
        with pytest.raises(ValueError, match="multi-agent run"):
            single.add_module("p1")
    finally:
        single.stop()
    algo = config().build(logdir=None)
    try:
        with pytest.raises(ConfigError, match="module 'q' asks for module class QModule"):
            algo.add_module("q", RLModuleSpec(module_class=QModule))
        with pytest.raises(ConfigError, match=r"config_overrides keys \['lrr'\]"):
            algo.add_module("p2", config_overrides={"lrr": 0.1})
        with pytest.raises(ValueError, match="new_should_module_be_updated='p0'"):
            algo.add_module("p2", new_should_module_be_updated="p0")
        with pytest.raises(NotImplementedError, match=r"add_module\(add_to_learners=False\) is not built"):
            algo.add_module("p2", add_to_learners=False)
        with pytest.raises(NotImplementedError, match="remove_from_eval_env_runners=False"):
            algo.remove_module("p1", remove_from_eval_env_runners=False)
        assert algo.learner_group.module_ids == ["p0", "p1"]  # nothing half-added or half-removed
        assert algo.foreach_env_runner(lambda runner: runner.module_ids) == [["p0", "p1"]]
    finally:
        algo.stop()


@pytest.mark.slow
def test_add_and_remove_with_ray_runners_and_two_learners(ray_cluster):
    algo = (config().env_runners(num_env_runners=2).learners(num_learners=2)
            .fault_tolerance(delay_between_env_runner_restarts_s=0.0).build(logdir=None))
    try:
        algo.train()
        check_frozen_snapshot_stays_fixed(algo)
        first, second = algo.learner_group.foreach_learner(lambda learner: learner.get_weights())
        assert first.keys() == second.keys() and all((first[k] == second[k]).all() for k in first)
        algo.remove_module("p1", new_agent_to_module_mapping_fn=against_snapshot)
        assert algo.foreach_env_runner(lambda runner: runner.module_ids) == [["p0", "p0_v1"]] * 2
        ray_cluster.kill(algo.env_runner_group.manager.handle(2))
        algo.train()  # finds runner 2 dead and starts its replacement (which gets the weights synced next)
        assert algo.env_runner_group.wait_until_whole(120)
        r = algo.train()
        assert r["fault_tolerance"]["num_remote_worker_restarts"] == 1
        assert r["learners"]["__all_modules__"]["num_modules_trained"] == 1
        # the recreated runner holds the run's modules now, with their weights, and maps agents as the others do
        assert algo.foreach_env_runner(lambda runner: runner.module_ids) == [["p0", "p0_v1"]] * 2
        assert algo.foreach_env_runner(lambda runner: sorted({c.module_id for c in runner.sample(num_episodes=2)})) \
            == [["p0", "p0_v1"]] * 2
        for on_runner in runner_weights(algo, "p0_v1"):
            assert all(torch.equal(v, weights(algo, "p0_v1")[k]) for k, v in on_runner.items())
    finally:
        algo.stop()


class SlowToBuildInActors(ActorCriticModule):
    """Takes seconds to build inside a Ray actor (as a big module or a busy, niced runner does)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        import ray
        if ray.is_initialized() and ray.get_runtime_context().get_actor_id() is not None:
            time.sleep(8.0)
        super().__init__(*args, **kwargs)


@pytest.mark.slow
def test_adding_a_module_slower_than_a_probe_keeps_the_runners(ray_cluster):
    # building a module is start-up work: it waits the start timeout, not the 5 s health probe (which the other
    # calls here, to idle runners, answer well within)
    algo = (config().env_runners(num_env_runners=2)
            .fault_tolerance(env_runner_health_probe_timeout_s=5.0).build(logdir=None))
    try:
        algo.add_module("slow", RLModuleSpec(module_class=SlowToBuildInActors),
                        new_agent_to_module_mapping_fn=by_agent)
        assert algo.env_runner_group.manager.healthy_ids() == [1, 2]
        assert algo.env_runner_group.manager.num_failures == 0
        assert algo.foreach_env_runner(lambda runner: runner.module_ids) == [["p0", "p1", "slow"]] * 2
    finally:
        algo.stop()
