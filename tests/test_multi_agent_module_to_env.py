"""Module-to-env pipelines in multi-agent runs: one per module, built for that module's spaces, applied to its
agents' actions each step (one batch per module) -- what the env gets (``actions_for_env``) or what is
recorded too (``actions``) -- their state in the runner's checkpoint, Ray runners, and the errors users meet."""
from __future__ import annotations

import numpy as np
import pytest

from actors.connectors import MeanStdFilter, ModuleToEnvConnector
from actors.metrics import MetricsLogger
from pipeline import ConfigError, PPOConfig
from tests.envs import ActionEchoes
from tests.pieces import ShiftFor, by_agent


class Always(ModuleToEnvConnector):
    """Overrides the module's choice with action 2 (and its log-probability): what is recorded changes too."""

    def __call__(self, batch, *, observations=None, explore=True):
        logits = batch["action_dist_inputs"]
        logp = logits[:, 2] - np.log(np.exp(logits).sum(1))
        return {**batch, "actions": np.full(len(logits), 2, batch["actions"].dtype), "action_logp": logp}


def ppo(factory, runners=0):
    return (PPOConfig().environment(ActionEchoes)
            .env_runners(num_env_runners=runners, num_envs_per_env_runner=3, rollout_fragment_length=8,
                         module_to_env_connector=factory)
            .multi_agent(policies={"p0", "p1"}, policy_mapping_fn=by_agent)
            .training(train_batch_size_per_learner=96, minibatch_size=48, num_epochs=1).debugging(seed=0))


def shift_by_module(env):
    # called once per module (and once per module by the driver's check at build): each copy its own shift
    shift_by_module.made += 1
    return [ShiftFor(shift_by_module.made)]


shift_by_module.made = 0


def test_each_modules_pipeline_changes_what_its_agents_envs_get_not_what_chunks_store():
    shift_by_module.made = 0
    algo = ppo(shift_by_module).build(logdir=None)
    try:
        runner = algo.env_runner_group.local
        assert set(runner.module_to_env) == {"p0", "p1"}
        shifts = {mid: p.pieces[0].shift for mid, p in runner.module_to_env.items()}
        assert len({shift % 3 for shift in shifts.values()}) == 2  # each module its own piece
        chunks = {}
        for c in runner.sample():
            chunks.setdefault(c.module_id, []).append(c)
        assert set(chunks) == {"p0", "p1"}
        for mid, cs in chunks.items():
            for c in cs:  # the env got (action + shift) % 3: it echoes it back as the next observation and reward
                np.testing.assert_array_equal(c.obs[1:, 0], (c.actions + shifts[mid]) % 3)
                np.testing.assert_array_equal(c.rewards, (c.actions + shifts[mid]) % 3)
        rows = {mid: p.pieces[0].rows for mid, p in runner.module_to_env.items()}
        assert rows == {mid: sum(len(c) for c in cs) for mid, cs in chunks.items()}  # every agent step, once
        state = runner.get_state()["module_to_env"]
        assert {mid: s[0]["state"]["rows"] for mid, s in state.items()} == rows
        algo.train()  # and training goes on through the general sampler
    finally:
        algo.stop()


def test_a_piece_that_overrides_the_choice_is_recorded_and_a_runner_restores_its_pipelines():
    algo = ppo(lambda env: Always()).build(logdir=None)
    try:
        runner = algo.env_runner_group.local
        chunks = runner.sample()
        assert {c.module_id for c in chunks} == {"p0", "p1"}
        for c in chunks:
            assert np.all(c.actions == 2) and np.all(c.obs[1:, 0] == 2)
            assert np.all(c.extra["action_logp"] < 0)
    finally:
        algo.stop()
    shift_by_module.made = 0
    first = ppo(shift_by_module).build(logdir=None)
    second = ppo(shift_by_module).build(logdir=None)
    try:
        first.env_runner_group.local.sample()
        state = first.env_runner_group.local.get_state()
        second.env_runner_group.local.set_state(state)
        got = {mid: p.get_state() for mid, p in second.env_runner_group.local.module_to_env.items()}
        assert got == state["module_to_env"] and all(s[0]["state"]["calls"] > 0 for s in got.values())
    finally:
        first.stop()
        second.stop()


def test_compute_actions_in_the_driver_go_through_the_modules_pipeline():
    shift_by_module.made = 0
    plain = ppo(None).build(logdir=None)
    shifted = ppo(shift_by_module).build(logdir=None)
    try:
        policies = shifted.multi_agent.driver_policies
        shifts = {mid: policies[mid].module_to_env.pieces[0].shift for mid in ("p0", "p1")}
        assert len({s % 3 for s in shifts.values()}) == 2  # the driver's copies: one pipeline per module
        obs = np.array([[0.0], [1.0], [2.0]], np.float32)
        for mid in ("p0", "p1"):
            same = plain.get_module(mid).get_state(), shifted.get_module(mid).get_state()
            assert all(np.array_equal(same[0][k], same[1][k]) for k in same[0])  # one seed: the same weights
            chosen = plain.compute_actions(obs, explore=False, policy_id=mid)
            np.testing.assert_array_equal(shifted.compute_actions(obs, explore=False, policy_id=mid),
                                          (chosen + shifts[mid]) % 3)
            assert shifted.compute_single_action(obs[2], explore=False, policy_id=mid) == \
                (int(chosen[2]) + shifts[mid]) % 3
    finally:
        plain.stop()
        shifted.stop()


@pytest.mark.slow  # Ray runner actors
def test_ray_runners_run_each_modules_pipeline(ray_cluster):
    algo = ppo(lambda env: [ShiftFor(1)], runners=2).build(logdir=None)
    try:
        chunks = algo.env_runner_group.sample(96, MetricsLogger())
        assert sum(len(c) for c in chunks) >= 96 and {c.module_id for c in chunks} == {"p0", "p1"}
        for c in chunks:
            np.testing.assert_array_equal(c.obs[1:, 0], (c.actions + 1) % 3)
    finally:
        algo.stop()


def test_module_to_env_settings_that_cannot_work_are_config_errors_in_multi_agent_runs():
    with pytest.raises(ConfigError, match="module_to_env_connector: .*ModuleToEnvConnector"):
        ppo(lambda env: MeanStdFilter()).build(logdir=None)
    algo = ppo(lambda env: Always()).build(logdir=None)
    try:
        with pytest.raises(NotImplementedError, match="module_to_env_connector"):
            algo.env_runner_group.local.add_module("p2", algo.env_runner_group.local.module_specs["p0"])
    finally:
        algo.stop()
