"""Env-to-module connectors in multi-agent runs: one pipeline per module (``actors.connectors.multi_agent``)."""
from __future__ import annotations

import gymnasium as gym
import numpy as np
import pytest

from actors.connectors import (ConnectorV2, FlattenObservations, FrameStackingEnvToModule, MeanStdFilter,
                               PrevActionsPrevRewards)
from actors.connectors.multi_agent import ModuleConnectors
from pipeline import Algorithm, ConfigError, PPOConfig
from pipeline.connectors import mean_std_filter
from tests.envs import PlainAndScaledCartPoles, ScaledCartPole
from tests.pieces import by_agent

ACT = gym.spaces.Discrete(2)
SMALL = gym.spaces.Box(-1.0, 1.0, (2,), np.float32)
DICT = gym.spaces.Dict({"pos": gym.spaces.Box(-1.0, 1.0, (2,), np.float32), "mode": gym.spaces.Discrete(3)})


def _ppo(**runners):
    return (PPOConfig().environment(PlainAndScaledCartPoles)
            .env_runners(num_envs_per_env_runner=2, env_to_module_connector=mean_std_filter, **runners)
            .multi_agent(policies={"p0", "p1"}, policy_mapping_fn=by_agent)
            .training(train_batch_size_per_learner=400, minibatch_size=100, num_epochs=2).debugging(seed=0))


# --- the pipelines ------------------------------------------------------------------------------------
def test_each_module_gets_its_own_pipeline_built_for_its_spaces():
    conns = ModuleConnectors.build(lambda env: [FlattenObservations(), MeanStdFilter()],
                                   {"a": (SMALL, ACT), "b": (DICT, ACT)})
    assert conns.observation_space("a").shape == (2,) and conns.observation_space("b").shape == (5,)
    assert conns.input_space("b") == DICT
    a = conns.pipelines["a"].pieces[1]
    assert a is not conns.pipelines["b"].pieces[1]
    out = conns.record("a", np.full((4, 2), 0.5, np.float32), update=True)
    assert out.shape == (4, 2)
    assert conns.get_state()["a"][1]["state"]["count"] == 4 and conns.get_state()["b"][1]["state"]["count"] == 0
    with pytest.raises(KeyError, match="'c'"):
        conns.record("c", np.zeros((1, 2), np.float32), update=False)
    assert ModuleConnectors.build(None, {"a": (SMALL, ACT)}) is None


def test_runner_deltas_merge_per_module_and_the_state_round_trips_bit_for_bit():
    spaces = {"a": (SMALL, ACT), "b": (SMALL, ACT)}
    driver = ModuleConnectors.build(lambda env: MeanStdFilter(), spaces)
    runners = [ModuleConnectors.build(lambda env: MeanStdFilter(), spaces) for _ in range(2)]
    rng = np.random.default_rng(0)
    seen = {"a": [], "b": []}
    for r in runners:
        for mid, scale in (("a", 1.0), ("b", 50.0)):
            x = (rng.normal(size=(7, 2)) * scale).astype(np.float32)
            seen[mid].append(x)
            r.record(mid, x, update=True)
    driver.absorb([r.pop_deltas() for r in runners] + [None])
    state = driver.get_state()
    for mid in ("a", "b"):
        allx = np.concatenate(seen[mid]).astype(np.float64)
        s = state[mid][0]["state"]
        assert s["count"] == 14
        np.testing.assert_allclose(s["mean"], allx.mean(0), rtol=1e-12)
    assert state["b"][0]["state"]["m2"].sum() > 100 * state["a"][0]["state"]["m2"].sum()
    again = ModuleConnectors.build(lambda env: MeanStdFilter(), spaces)
    again.set_state(state)
    for mid in ("a", "b"):
        for key in ("mean", "m2"):
            assert again.get_state()[mid][0]["state"][key].tobytes() == state[mid][0]["state"][key].tobytes()
    with pytest.raises(ValueError, match=r"modules \['a'\].*\['a', 'b'\]"):
        again.set_state({"a": state["a"]})


class LastRewards(ConnectorV2):
    """A user's piece that hears each sub-env's steps but cannot keep its memory per agent (not keyed)."""

    watches_steps = True


@pytest.mark.parametrize("piece, why", [(lambda: LastRewards(), "actions and rewards")])
def test_pieces_with_memory_per_sub_env_are_refused_naming_them(piece, why):
    with pytest.raises(ValueError, match=why):
        ModuleConnectors.build(lambda env: piece(), {"a": (SMALL, ACT)})
    with pytest.raises(ConfigError, match=f"env_to_module_connector: .*{why}"):
        (PPOConfig().environment(PlainAndScaledCartPoles)
         .env_runners(num_env_runners=0, env_to_module_connector=lambda env: piece())
         .multi_agent(policies={"p0", "p1"}, policy_mapping_fn=by_agent).build(logdir=None))


def test_rllibs_multi_agent_flag_is_accepted_where_a_module_pipeline_does_the_same():
    MeanStdFilter(multi_agent=True)
    FlattenObservations(multi_agent=True)
    PrevActionsPrevRewards(multi_agent=True)  # its memory is per agent in multi-agent runs anyway
    FrameStackingEnvToModule(multi_agent=True)  # each agent's stack is built from its own episode


# --- runs ----------------------------------------------------------------------------------------------
def test_each_modules_filter_learns_its_agents_scale_and_chunks_hold_what_the_module_saw():
    algo = _ppo(num_env_runners=0).build(logdir=None)
    try:
        for _ in range(2):
            algo.train()
        state = algo.connector.get_state()
        plain, scaled = state["p0"][0]["state"], state["p1"][0]["state"]
        assert plain["count"] > 0 and scaled["count"] > 0
        assert np.abs(plain["mean"]).max() < 5  # CartPole's own observations
        np.testing.assert_allclose(scaled["mean"], ScaledCartPole.SHIFT, rtol=0.2, atol=10)  # near the shift
        for mid in ("p0", "p1"):  # modules are built for what the filter puts out
            assert algo.get_module(mid).observation_space == gym.spaces.Box(-10.0, 10.0, (4,), np.float32)
        chunks = algo.foreach_env_runner(lambda r: r.sample(num_timesteps=200))[0]
        obs = np.concatenate([c.obs for c in chunks if c.module_id == "p1"])
        assert np.abs(obs.mean(0)).max() < 3 and np.abs(obs).max() <= 10  # normalised, not hundreds
        raw = np.array([300.0, -200.0, 900.0, 150.0], np.float32)  # ScaledCartPole's raw observations at rest
        a = algo.compute_single_action(raw, explore=False, policy_id="p1")
        assert a in (0, 1)
        with pytest.raises(NotImplementedError, match="add_module"):
            algo.add_module("p2", algo.get_module("p0").__class__)
    finally:
        algo.stop()


@pytest.mark.slow
def test_ray_runners_share_each_modules_statistics_and_a_checkpoint_restores_them_bit_for_bit(ray_cluster, tmp_path):
    algo = _ppo(num_env_runners=2).evaluation(evaluation_interval=1, evaluation_num_env_runners=1,
                                              evaluation_duration=2).build()
    try:
        for _ in range(2):
            result = algo.train()
        state = algo.connector.get_state()
        assert state["p0"][0]["state"]["count"] > 0 and state["p1"][0]["state"]["count"] > 0
        for runner_state in algo.foreach_env_runner(lambda r: r.connectors.get_state(), local_env_runner=False):
            for mid in ("p0", "p1"):
                assert runner_state[mid][0]["state"]["count"] >= state[mid][0]["state"]["count"]
        evaluator = algo.eval_env_runner_group.foreach_env_runner(lambda r: r.connectors.get_state(), local=False)[0]
        assert evaluator["p1"][0]["state"]["count"] > 0  # evaluators normalise with the training statistics
        assert "evaluation" in result
        path = algo.save(str(tmp_path / "ck")).checkpoint.path
    finally:
        algo.stop()
    restored = Algorithm.from_checkpoint(path)
    try:
        got = restored.connector.get_state()
        for mid in ("p0", "p1"):
            for key in ("mean", "m2"):
                assert got[mid][0]["state"][key].tobytes() == state[mid][0]["state"][key].tobytes()
        for runner_state in restored.foreach_env_runner(lambda r: r.connectors.get_state(), local_env_runner=False):
            assert runner_state["p1"][0]["state"]["mean"].tobytes() == state["p1"][0]["state"]["mean"].tobytes()
    finally:
        restored.stop()


@pytest.mark.slow
def test_streaming_runners_gather_each_modules_statistics_too(ray_cluster):
    """APPO: runners sample in their own threads while the driver takes and syncs the statistics."""
    from pipeline import APPOConfig

    algo = (APPOConfig().environment(PlainAndScaledCartPoles)
            .env_runners(num_env_runners=2, num_envs_per_env_runner=2, env_to_module_connector=mean_std_filter)
            .multi_agent(policies={"p0", "p1"}, policy_mapping_fn=by_agent)
            .training(train_batch_size_per_learner=500).debugging(seed=0).build(logdir=None))
    try:
        counts = []
        while len(counts) < 3 or counts[-1][1] <= counts[0][1]:
            algo.train()
            state = algo.connector.get_state()
            counts.append((state["p0"][0]["state"]["count"], state["p1"][0]["state"]["count"]))
        for earlier, later in zip(counts, counts[1:]):  # every module's count only grows
            assert later[0] >= earlier[0] and later[1] >= earlier[1]
        assert min(counts[-1]) > 0
        np.testing.assert_allclose(state["p1"][0]["state"]["mean"], ScaledCartPole.SHIFT, rtol=0.2, atol=10)
    finally:
        algo.stop()


def _scaled_agent_return(filtered: bool, budget: int) -> tuple[float, int]:
    """The best smoothed return of module p1 (the agent whose observations are scaled) within ``budget`` env steps."""
    algo = (PPOConfig().environment(PlainAndScaledCartPoles)
            .env_runners(num_env_runners=0, num_envs_per_env_runner=8,
                         env_to_module_connector=mean_std_filter if filtered else None)
            .multi_agent(policies={"p0", "p1"}, policy_mapping_fn=by_agent).debugging(seed=0).build(logdir=None))
    best, steps = -np.inf, 0
    try:
        while steps < budget and best < 400:
            result = algo.train()
            steps = result["num_env_steps_sampled_lifetime"]
            got = result["env_runners"].get("module_episode_returns_mean", {}).get("p1")
            best = max(best, got) if got is not None and not np.isnan(got) else best
    finally:
        algo.stop()
    return best, steps


@pytest.mark.learning
def test_the_scaled_agents_module_learns_with_its_filter_and_not_without():
    """Seed 0: with the filter module p1 reaches 400 at 72k env steps; without it stays near 80 after 300k
    (module p0, on plain CartPole, learns either way)."""
    best, steps = _scaled_agent_return(True, 250_000)
    assert best >= 400, f"with the filter: {best} after {steps} env steps"
    best, steps = _scaled_agent_return(False, 100_000)
    assert best < 200, f"without the filter the scaled agent learned anyway ({best} after {steps} env steps)"
