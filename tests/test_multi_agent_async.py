"""IMPALA and APPO train several modules: streamed multi-agent chunks, per-module batches, one update.

Fast: the loader cuts a multi-agent stream into ``ModuleBatches`` (exact agent-step size, a chunk cut
across two batches, each module's part laid out, a chunk of an unknown module dropped and counted);
a ``MultiAgentEnvRunner`` streams the chunks of both modules, tagged, counted in env and agent steps,
with weights sent meanwhile applied between fragments; APPO and IMPALA in-process train both modules
with RLlib's multi-agent result keys, and a frozen module's weights never move. Learning (Ray, two
streaming runners): two policies on two-agent CartPole learn clearly (APPO: a summed return of 400 within
600k env steps; IMPALA: a best of 400 within 300k); ``long``: APPO reaches 800.
"""
from __future__ import annotations

import threading
from typing import Any

import numpy as np
import pytest
import ray
import torch

from actors.env.multi_agent_env import make_multi_agent
from actors.env.multi_agent_runner import MultiAgentEnvRunner
from actors.env.settings import EnvRunnerSettings
from actors.learner.loader import ChunkReceiver, ModuleBatches
from actors.modules import ModuleSpec
from pipeline import APPOConfig, IMPALAConfig
from pipeline.algorithm import Algorithm
from protocols.episode import EpisodeChunk
from protocols.transport import ChunkSender
from tests.pieces import by_agent

CARTPOLES = make_multi_agent("CartPole-v1")
_ENV = CARTPOLES({"num_agents": 2})
OBS, ACT = _ENV.get_observation_space(0), _ENV.get_action_space(0)
SPACES = {"p0": (OBS, ACT), "p1": (OBS, ACT)}
MODEL = {"fcnet_hiddens": [16]}


@pytest.fixture(scope="module", autouse=True)
def ray_cluster():
    """Ray once for the module (the learning runs host their runners as actors)."""
    ray.init(address="local", num_cpus=3, include_dashboard=False, logging_level="ERROR", log_to_driver=False)
    yield
    ray.shutdown()


def chunk(module_id: str, steps: int, episode: str, version: int = 0) -> EpisodeChunk:
    rng = np.random.default_rng(steps)
    return EpisodeChunk(episode_id=episode, chunk_index=0, obs=rng.normal(size=(steps + 1, 4)).astype(np.float32),
                        actions=rng.integers(0, 2, steps), rewards=np.ones(steps, np.float32),
                        extra={"action_logp": np.full(steps, -0.69, np.float32)}, weights_version=version,
                        agent_id=module_id[1], module_id=module_id)


def runner_threads() -> list[str]:
    return [t.name for t in threading.enumerate() if t.name.startswith("runnel-")]


# --- the loader ---------------------------------------------------------------------------------
def test_receiver_cuts_multi_module_batches_of_exact_agent_steps():
    receiver = ChunkReceiver(None, None, 100, module_spaces=SPACES, queue_size=4).start()
    sender = ChunkSender(receiver.address, "test-sender")
    try:
        sender.send([chunk("p0", 60, "a.0", version=3), chunk("p1", 30, "a.1", version=4)])
        sender.send([chunk("p1", 50, "b.1", version=5), chunk("p9", 20, "c.0")])  # p9: no such module
        first = receiver.get_batch(timeout=30)
        assert isinstance(first, ModuleBatches)
        assert sorted(first) == ["p0", "p1"] and first.num_steps == 100
        assert first["p0"].num_steps == 60 and first["p1"].num_steps == 40  # b.1 cut after 10 steps
        for mid, part in first.items():
            assert all(c.module_id == mid for c in part)
            assert part.batch is not None and len(part.batch.rewards) == part.num_steps  # laid out per module
        versions, steps = first.weights_versions()
        assert sorted(zip(versions.tolist(), steps.tolist())) == [(3, 60), (4, 30), (5, 10)]
        assert receiver.stats()["num_env_steps_pending"] == 40  # the rest of b.1 waits for the next batch
        assert receiver.stats()["num_chunks_dropped_invalid"] == 1
        assert sum(receiver.dropped_by_sender.values()) == 1
    finally:
        sender.close()
        receiver.close()


def test_receiver_takes_a_module_added_later_and_drops_a_removed_ones_chunks():
    receiver = ChunkReceiver(None, None, 50, module_spaces={"p0": SPACES["p0"]}, queue_size=4).start()
    sender = ChunkSender(receiver.address, "test-sender")
    try:
        receiver.add_module("p1", OBS, ACT)
        receiver.remove_module("p0")
        sender.send([chunk("p0", 30, "a.0"), chunk("p1", 50, "a.1")])
        batch = receiver.get_batch(timeout=30)
        assert sorted(batch) == ["p1"] and batch.num_steps == 50
        assert receiver.stats()["num_chunks_dropped_invalid"] == 1  # p0's chunk: no longer one of the modules
    finally:
        sender.close()
        receiver.close()
    single = ChunkReceiver(OBS, ACT, 50)  # never started, but its socket is bound: closed below, not left to GC
    try:
        with pytest.raises(ValueError, match="takes a single-agent stream"):
            single.add_module("p1", OBS, ACT)
    finally:
        single.close()


def test_receiver_refuses_an_empty_module_list():
    with pytest.raises(ValueError, match="module_spaces is empty"):
        ChunkReceiver(None, None, 100, module_spaces={})


# --- the streaming runner ----------------------------------------------------------------------
def make_runner(count_steps_by: str = "env_steps") -> MultiAgentEnvRunner:
    settings = EnvRunnerSettings(env_creator=CARTPOLES, env_config={"num_agents": 2}, num_envs=2,
                                 rollout_fragment_length=10, seed=0, model_config=MODEL)
    return MultiAgentEnvRunner(settings, {mid: ModuleSpec(OBS, ACT, MODEL) for mid in SPACES}, by_agent,
                               count_steps_by=count_steps_by)


@pytest.mark.parametrize("count_steps_by", ["env_steps", "agent_steps"])
def test_multi_agent_runner_streams_both_modules_tagged_and_counted(count_steps_by):
    runner = make_runner(count_steps_by)
    receiver = ChunkReceiver(None, None, 200, module_spaces=SPACES, queue_size=2).start()
    weights = runner.get_weights()
    try:
        runner.start_streaming(receiver.address, hwm=2)
        assert runner.is_streaming()
        runner.set_weights(weights, weights_version=7)  # held back, applied between two fragments
        got: list[ModuleBatches] = []
        while not any(c.weights_version == 7 for b in got for part in b.values() for c in part):
            batch = receiver.get_batch(timeout=60)
            assert batch is not None, "no batch streamed within 60 s"
            got.append(batch)
    finally:
        assert runner.stop_streaming()
        receiver.close()
    assert not runner.is_streaming() and runner_threads() == []
    chunks = [c for b in got for part in b.values() for c in part]
    assert {c.module_id for c in chunks} == {"p0", "p1"}
    assert all(c.module_id == f"p{c.agent_id}" for c in chunks)
    assert all(b.num_steps == 200 for b in got)
    exported = runner.get_metrics()
    env_steps = exported["num_env_steps_sampled"]["value"]
    agent_steps = exported["num_agent_steps_sampled"]["value"]
    # both agents act at each step of both envs until one falls: between 1 and 2 agent steps per env step
    assert env_steps <= agent_steps <= 2 * env_steps
    assert agent_steps >= sum(b.num_steps for b in got)  # what arrived was sampled
    assert runner.weights_version == 7 and exported["num_weight_updates_applied"]["value"] == 1
    # a fragment is rollout_fragment_length * num_envs = 20 steps in count_steps_by units (agent steps: at least
    # that, as every env steps at once); one frame each
    frames = exported["stream/runner_num_frames_sent"]["value"]
    assert frames >= len(got) and frames * 20 <= (agent_steps if count_steps_by == "agent_steps" else env_steps)
    if count_steps_by == "env_steps":
        assert env_steps % 20 == 0
    runner.stop()


def test_while_streaming_bad_weights_and_module_changes_are_refused_in_the_callers_thread():
    runner = make_runner()
    receiver = ChunkReceiver(None, None, 200, module_spaces=SPACES).start()
    try:
        runner.start_streaming(receiver.address)
        with pytest.raises(ValueError, match="p7"):
            runner.set_weights({"p7/encoder.0.weight": np.zeros(3)}, weights_version=1)
        with pytest.raises(RuntimeError, match="stop_streaming"):
            runner.remove_module("p1")
        with pytest.raises(RuntimeError, match="stop_streaming"):  # the sampling thread reads the module tables
            runner.add_module("p2", ModuleSpec(OBS, ACT, MODEL))
        assert runner.is_streaming() and runner.module_ids == ["p0", "p1"]
    finally:
        runner.stop()
        receiver.close()


# --- APPO and IMPALA in-process -------------------------------------------------------------------
def config(config_cls: type, **multi_agent: Any) -> Any:
    return (config_cls().environment(CARTPOLES, env_config={"num_agents": 2})
            .multi_agent(policies={"p0", "p1"}, policy_mapping_fn=by_agent, **multi_agent)
            .rl_module(model_config=MODEL).env_runners(num_env_runners=0, num_envs_per_env_runner=4)
            .reporting(min_time_s_per_iteration=0.3).debugging(seed=0))


def module_weights(algo: Algorithm, module_id: str) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in algo.get_module(module_id).state_dict().items()}


def same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def train_until_updates(algo: Algorithm, updates: int) -> list[dict]:
    """Iterations until the learner made ``updates`` updates (a count, never a time)."""
    results = []
    while not results or algo.weights_version < updates:
        assert len(results) < 100, f"only {algo.weights_version} updates in 100 iterations"
        results.append(algo.train())
    return results


@pytest.mark.parametrize("config_cls", [APPOConfig, IMPALAConfig], ids=["APPO", "IMPALA"])
def test_both_modules_train_in_each_update_with_rllib_keys(config_cls):
    algo = config(config_cls).build(logdir=None)
    initial = {mid: module_weights(algo, mid) for mid in SPACES}
    try:
        results = train_until_updates(algo, 6)
        runner_weights = algo.env_runner_group.local.get_weights()
        final = {mid: module_weights(algo, mid) for mid in SPACES}
    finally:
        algo.stop()
    assert runner_threads() == [] and algo.plan.receiver.closed
    r = results[-1]
    for mid in SPACES:
        assert not same(initial[mid], final[mid]), f"module {mid} did not train"
        assert {"policy_loss", "vf_loss", "entropy", "num_module_steps_trained"} <= set(r["learners"][mid])
        assert np.isfinite(r["learners"][mid]["policy_loss"])
    everything = r["learners"]["__all_modules__"]
    assert everything["num_modules_trained"] == 2  # every update steps both modules
    assert everything["num_agent_steps_trained"] >= everything["num_env_steps_trained"] > 0
    assert "default_policy" not in r["learners"]
    assert set(r["env_runners"]["module_episode_returns_mean"]) == {"p0", "p1"}
    assert set(r["env_runners"]["agent_episode_returns_mean"]) == {"0", "1"}
    lifetime = [x["num_env_steps_sampled_lifetime"] for x in results]
    assert lifetime == sorted(lifetime) and lifetime[-1] > 0
    assert r["env_runners"]["num_agent_steps_sampled_lifetime"] >= lifetime[-1]
    assert r["stream"]["weights_lag_max"] >= r["stream"]["weights_lag_mean"] >= 0
    assert r["stream"]["num_chunks_dropped_invalid"] == 0
    assert set(k.split("/")[0] for k in runner_weights) == {"p0", "p1"}  # the flat per-module weights


def test_appo_keeps_a_target_network_per_module():
    algo = config(APPOConfig).training(target_network_update_freq=2).build(logdir=None)
    try:
        train_until_updates(algo, 6)
        learners = algo.learner_group.local.learners
        for mid in SPACES:
            assert learners[mid].num_target_updates >= 1, mid
            target, online = learners[mid].target.state_dict(), learners[mid].module.state_dict()
            assert all(k in online for k in target)
        assert learners["p0"].target is not learners["p1"].target
    finally:
        algo.stop()


def test_each_modules_share_of_a_stream_goes_through_that_modules_learner_pipeline():
    from tests.test_replay_learner_connector import counting_pieces

    algo = config(APPOConfig).training(learner_connector=counting_pieces).build(logdir=None)
    try:
        train_until_updates(algo, 4)
        learners = algo.learner_group.local.learners
        pipelines = {mid: learners[mid].learner_connector for mid in SPACES}
        assert pipelines["p0"] is not pipelines["p1"]  # one per module, built for its spaces
        for mid in SPACES:  # the loader ran each module's pipeline on that module's share of every batch
            assert pipelines[mid].pieces[1].seen > 0, mid
        assert algo.plan.receiver.num_batches_dropped_by_connector == 0
    finally:
        algo.stop()


@pytest.mark.parametrize("config_cls", [APPOConfig, IMPALAConfig], ids=["APPO", "IMPALA"])
def test_a_frozen_module_never_moves(config_cls):
    algo = config(config_cls, policies_to_train=["p0"]).build(logdir=None)
    initial = {mid: module_weights(algo, mid) for mid in SPACES}
    try:
        results = train_until_updates(algo, 6)
        acting = algo.env_runner_group.local.get_weights(["p1"])
        final = {mid: module_weights(algo, mid) for mid in SPACES}
    finally:
        algo.stop()
    assert not same(initial["p0"], final["p0"])
    assert same(initial["p1"], final["p1"])
    assert all(torch.equal(torch.as_tensor(v), initial["p1"][k.partition("/")[2]]) for k, v in acting.items())
    r = results[-1]
    assert "p1" not in r["learners"] and "p0" in r["learners"]
    assert r["learners"]["__all_modules__"]["num_frozen_batches_dropped"] >= 1


def test_a_module_added_while_streaming_trains_and_a_removed_ones_chunks_stop():
    algo = config(APPOConfig).build(logdir=None)
    try:
        train_until_updates(algo, 2)
        # agent 1 plays for the new module from now on: its chunks must be taken, not dropped as unknown
        algo.add_module("p2", new_agent_to_module_mapping_fn=lambda agent_id, episode, **kw: f"p{2 * int(agent_id)}")
        added = module_weights(algo, "p2")
        # Until the learner reports an update of p2: the first updates after the change may all draw batches cut
        # before it (APPO's circular buffer, episodes begun under the old mapping) -- one iteration made 7 such
        # updates on a busy machine, so no fixed number of updates is enough (a fresh clone, 2026-12-06)
        results = []
        while not any("p2" in r["learners"] for r in results):
            assert len(results) < 100, "no update of the added module in 100 iterations"
            results.append(algo.train())
        assert not same(added, module_weights(algo, "p2")), "the added module did not train"
        assert results[-1]["stream"]["num_chunks_dropped_invalid"] == 0
        algo.remove_module("p1")  # no agent maps to it any more; chunks still naming it are dropped and counted
        version = algo.weights_version
        results = train_until_updates(algo, version + 2)
        assert not any("p1" in r["learners"] for r in results) and any("p2" in r["learners"] for r in results)
    finally:
        algo.stop()


def test_add_module_stops_the_in_process_runners_stream_before_the_shared_mapping_changes():
    # The in-process runner holds the run's mapping object itself: changed while its sampling thread still ran,
    # an episode starting in between mapped agent 1 to "p2" before the runner held it, and the thread failed
    # (a fresh clone, 2026-12-06). The streams must be stopped before the run's module tables change.
    algo = config(IMPALAConfig).build(logdir=None)
    try:
        train_until_updates(algo, 1)
        runner = algo.env_runner_group.local
        assert runner.is_streaming()
        setup = algo.multi_agent
        change_modules = setup.change_modules
        streaming_at_change: list[bool] = []

        def recording_change(*args, **kwargs):
            streaming_at_change.append(runner.is_streaming())
            return change_modules(*args, **kwargs)

        setup.change_modules = recording_change
        algo.add_module("p2", new_agent_to_module_mapping_fn=lambda agent_id, episode, **kw: f"p{2 * int(agent_id)}")
        assert streaming_at_change == [False]
        train_until_updates(algo, algo.weights_version + 2)
        assert runner.is_streaming() and "p2" in runner.module_ids
    finally:
        algo.stop()


class GoesBad:
    """A mapping that works for its first ``calls`` calls in each process, then names a module nobody holds."""

    def __init__(self, calls: int) -> None:
        self.calls = calls

    def __call__(self, agent_id: Any, episode: Any, **kwargs: Any) -> str:
        self.calls -= 1
        return f"p{agent_id}" if self.calls >= 0 else "p9"


@pytest.mark.parametrize("num_env_runners", [0, 1], ids=["in-process", "actor"])
def test_a_mapping_gone_bad_mid_run_ends_the_run_with_its_own_message(num_env_runners):
    # The user's error: restarting the runner would meet it again (and a restarted stream used to cut a malformed
    # chunk from the half-started episode it left), so the run ends at once, naming the agent and the module.
    from pipeline import MappingError

    algo = (config(IMPALAConfig).multi_agent(policy_mapping_fn=GoesBad(200)).env_runners(num_env_runners=num_env_runners)
            .fault_tolerance(restart_failed_env_runners=True).build(logdir=None))
    try:
        with pytest.raises(MappingError, match=r"mapped agent 0 to module 'p9', which does not exist; "
                                               r"modules: \['p0', 'p1'\]"):
            for _ in range(200):
                algo.train()
        if num_env_runners:
            assert algo.env_runner_group.manager.num_restarts == 0  # handed to the caller, not restarted
    finally:
        algo.stop()
    assert runner_threads() == []


# --- learning (Ray: two streaming runners) -----------------------------------------------------------
def history(results: list[dict]) -> list:
    """(summed return, each module's return, env steps) per iteration: what a failed learning run's message shows."""
    return [(round(r["env_runners"].get("episode_return_mean", float("nan")), 1),
             {m: round(v, 1) for m, v in r["env_runners"].get("module_episode_returns_mean", {}).items()},
             r["num_env_steps_sampled_lifetime"]) for r in results]


def learn(config_cls: type, target: float, max_env_steps: int = 300_000, each: float = 0.0, num_learners: int = 0,
          batch: int = 1000) -> list[dict]:
    """Until the summed return reaches ``target`` and each module's ``each`` (both counted over the same
    episodes), or ``max_env_steps`` are sampled. A batch of 1000 agent steps gives each module about the 500
    steps a single-agent batch has; two SGD passes over each. (Several learners cut a batch per module:
    give ``batch=500`` there.)"""
    algo = (config_cls().environment(CARTPOLES, env_config={"num_agents": 2})
            .multi_agent(policies={"p0", "p1"}, policy_mapping_fn=by_agent)
            .training(train_batch_size_per_learner=batch, num_epochs=2)
            .env_runners(num_env_runners=2).learners(num_learners=num_learners).debugging(seed=0).build(logdir=None))
    results: list[dict] = []
    try:
        while True:
            results.append(algo.train())
            r = results[-1]
            modules = r["env_runners"].get("module_episode_returns_mean", {})
            reached = r["env_runners"].get("episode_return_mean", 0) >= target \
                and len(modules) == 2 and min(modules.values()) >= each
            if reached or r["num_env_steps_sampled_lifetime"] >= max_env_steps:
                break
        streaming = [x.value for x in algo.env_runner_group.manager.foreach_actor("is_streaming")]
    finally:
        algo.stop()
    assert streaming == [True, True]
    assert runner_threads() == []
    return results


@pytest.mark.learning
def test_appo_trains_two_policies_on_two_agent_cartpole():
    """Both policies learn clearly: a summed return of 400 within 600k env steps, seed 0 (random play: about
    45). Measured on 2 cores: 467 at 50k env steps with two busy processes beside it. The issue's bar, 800, is
    the ``long`` test below: on a loaded machine asynchronous runs of seed 0 differ, and two fresh-clone suites
    ended at 443 and 509 after 600k (one plateaued between 450 and 750 for 200k env steps). Each policy must
    reach 100 too (random play: about 22): a run once stopped at a summed 419 with one policy at 91, on its way."""
    results = learn(APPOConfig, 400, max_env_steps=600_000, each=100)
    last = results[-1]
    assert last["env_runners"]["episode_return_mean"] >= 400, \
        f"summed return {last['env_runners']['episode_return_mean']} after {last['num_env_steps_sampled_lifetime']}; " \
        f"per iteration: {history(results)}"
    assert min(last["env_runners"]["module_episode_returns_mean"].values()) >= 100  # both policies learned
    # asynchronous: the policy lags (an iteration that ended before its first update logs no lag)
    assert any(r["stream"]["weights_lag_mean"] > 0 for r in results if r["num_learner_updates"])


@pytest.mark.long
def test_appo_trains_two_policies_to_a_summed_return_of_800_on_two_agent_cartpole():
    """Issue 27's bar: a summed 800, seed 0, within 1.5M env steps. On a quiet 2-core VM (2026-11-27) runs reached it
    at 211k-500k env steps in about three of four cases; the others fell back on the way -- both policies at once,
    e.g. from 634 to 94 at 525k -- and climbed again, one reaching 800 at 1.0M. Single-agent APPO does the same
    with these settings (seed 0: from 314 down to 22 at 498k, 500 at 625k): it is APPO's, not the multi-agent
    path's. In six runs with this budget all six reached 800 (241k-1.0M)."""
    results = learn(APPOConfig, 800, max_env_steps=1_500_000)
    last = results[-1]
    assert last["env_runners"]["episode_return_mean"] >= 800, \
        f"summed return {last['env_runners']['episode_return_mean']} after {last['num_env_steps_sampled_lifetime']}; " \
        f"per iteration: {history(results)}"
    assert last["num_env_steps_sampled_lifetime"] <= 1_500_000
    assert min(last["env_runners"]["module_episode_returns_mean"].values()) >= 250  # both policies learned


@pytest.mark.learning
def test_impala_trains_two_policies_on_two_agent_cartpole():
    """Both policies learn clearly within 300k env steps, seed 0 (a random policy's summed return is about 45;
    the run stops early at 800). Measured on 2 busy cores: 800 at 131k env steps in one run, in another a best
    of 500-650 by 300k: asynchronous runs differ from one to the next."""
    results = learn(IMPALAConfig, 800)
    ran = [r["env_runners"] for r in results if "module_episode_returns_mean" in r["env_runners"]
           and r["num_env_steps_sampled_lifetime"] <= 300_000]
    best = max(e["episode_return_mean"] for e in ran)
    assert best >= 400, f"best summed return {best}, first {ran[0]['episode_return_mean']}"
    for mid in ("p0", "p1"):
        assert max(e["module_episode_returns_mean"][mid] for e in ran) >= 150, mid
