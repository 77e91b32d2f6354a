"""A learner actor that dies is rebuilt inside the job, and training goes on in the same ``train()`` loop.

PPO with two data-parallel learners (one killed: rebuilt from its peer, the update retried on the same
batch), PPO with one learner (rebuilt from the in-memory snapshot), APPO with two learners (the dead
learner's runners re-pointed to its replacement, what they had sent it counted as lost, no chunk trained
twice), a multi-agent run whose modules changed before the death, and DQN's remote replay actor (rebuilt
from its snapshot). Each recovery is counted in the results; past ``max_num_learner_restarts`` /
``max_num_replay_restarts`` the run ends naming what died, the count and the setting. Learners are killed
with ``ray.kill`` on the handle the learner group's manager gives out.

The suite runs the PPO peer case and the replay budget case; the other five take 1-3 minutes each on
2 cores and are marked ``long`` (``make test-long``).
"""
import os
import pathlib
import re
import shutil

import numpy as np
import pytest
import ray

from actors.manager import ActorGroupError
from pipeline import APPOConfig, ConfigError, DefaultCallbacks, DQNConfig, PPOConfig
from tests.helpers import train_until, train_until_seen
from tests.test_multi_agent_modules import config as multi_agent_config, snapshot


def trained_dir():
    """Where learners write what they trained: the suite's results directory, which Ray's workers know
    (conftest sets it before Ray starts), so a learner's record outlives its process."""
    return pathlib.Path(os.environ["RUNNEL_RESULTS_DIR"]) / "trained-pieces"


class RecordTrainedToFiles(DefaultCallbacks):
    """Each learner appends the pieces of chunks it trains on (episode id, chunk index, first step, env
    runner) to a file named by its rank and process id."""

    def on_learn_on_batch(self, *, train_batch, learner, **kwargs):
        trained_dir().mkdir(exist_ok=True)
        with open(trained_dir() / f"{learner.rank}-{os.getpid()}.txt", "a", encoding="utf-8") as f:
            f.writelines(f"{c.episode_id} {c.chunk_index} {c.t_started} {c.env_runner_index}\n" for c in train_batch)


def trained_pieces():
    """(rank, pid) -> the set of pieces that learner process trained on."""
    out = {}
    for path in trained_dir().glob("*.txt"):
        rank, pid = map(int, path.stem.split("-"))
        out[rank, pid] = {tuple(line.split()) for line in path.read_text().splitlines()}
    return out


def kill_learner(algo, index):
    ray.kill(algo.learner_group.manager.handle(index), no_restart=True)


def learner_states(algo):
    return algo.learner_group.foreach_learner(lambda learner: learner.get_state())


def assert_identical(states):
    """Every learner holds the same module, target networks, optimizer moments and algorithm fields."""
    first = states[0]
    for other in states[1:]:
        for part in ("module", "targets"):
            a = first[part] if part == "module" else {f"{n}/{k}": v for n, t in first[part].items() for k, v in t.items()}
            b = other[part] if part == "module" else {f"{n}/{k}": v for n, t in other[part].items() for k, v in t.items()}
            assert a.keys() == b.keys()
            for k in a:
                assert np.array_equal(a[k].numpy(), b[k].numpy()), (part, k)
        for name, opt in first["optimizers"].items():
            for slot, moments in opt["state"].items():
                for k, v in moments.items():
                    assert np.array_equal(np.asarray(v), np.asarray(other["optimizers"][name]["state"][slot][k])), \
                        (name, slot, k)
        assert first["fields"] == other["fields"] and first["num_updates"] == other["num_updates"]


def fault_tolerance(result):
    return {k: v for k, v in result["fault_tolerance"].items() if "learner" in k or "replay" in k}


# --- settings -----------------------------------------------------------------------------------
def test_recovery_settings_are_checked_naming_the_valid_values():
    base = PPOConfig().environment("CartPole-v1")
    base.copy().fault_tolerance(max_num_learner_restarts=0, learner_snapshot_interval_s=None,
                                max_num_replay_restarts=3).validate()
    with pytest.raises(ConfigError, match=r"max_num_learner_restarts must be an int >= 0, got -1"):
        base.copy().fault_tolerance(max_num_learner_restarts=-1).validate()
    with pytest.raises(ConfigError, match=r"learner_snapshot_interval_s must be a number of seconds > 0, or None"):
        base.copy().fault_tolerance(learner_snapshot_interval_s=0).validate()
    with pytest.raises(ConfigError, match=r"max_num_replay_restarts must be an int >= 0, got 1.5"):
        base.copy().fault_tolerance(max_num_replay_restarts=1.5).validate()
    with pytest.raises(ConfigError, match=r"snapshot_interval_s=0 must be a number of seconds > 0, or None"):
        DQNConfig().environment("CartPole-v1").training(
            replay_buffer_config={"remote": True, "snapshot_interval_s": 0}).env_runners(num_env_runners=1).validate()


# --- PPO ----------------------------------------------------------------------------------------
def small_ppo(num_learners, **fault_tolerance):
    return (PPOConfig().environment("CartPole-v1").env_runners(num_env_runners=1).learners(num_learners=num_learners)
            .training(train_batch_size_per_learner=500, minibatch_size=250, num_epochs=2)
            .fault_tolerance(**fault_tolerance).debugging(seed=0))


@pytest.mark.learning
def test_ppo_learner_killed_is_rebuilt_from_its_peer_and_learning_goes_on(ray_cluster):
    algo = small_ppo(2).build(logdir=None)
    try:
        for _ in range(2):
            result = algo.train()
        assert fault_tolerance(result) == {"num_learner_recoveries": 0, "num_learner_restarts": 0}
        version, trained = algo.weights_version, result["num_env_steps_trained_lifetime"]
        kill_learner(algo, 1)
        result = algo.train()  # the same loop: the update finds learner 1 dead, the group is rebuilt, it is retried
        assert fault_tolerance(result) == {"num_learner_recoveries": 1, "num_learner_restarts": 1}
        assert result["training_iteration"] == 3
        assert algo.weights_version == version + 1  # one update, not lost and not made twice
        # one batch of 1000 env steps (up to one more step of each sub-env: CartPole's own vector env leaves
        # reset-only steps out of the count), not lost and not trained twice
        batch = result["num_env_steps_trained_lifetime"] - trained
        assert 1000 <= batch < 1000 + algo.config.num_envs_per_env_runner
        assert_identical(learner_states(algo))
        best, result = train_until(algo, 200, 300_000)
        assert best >= 200, f"mean return {best} after {result['num_env_steps_sampled_lifetime']} steps"
        assert fault_tolerance(result) == {"num_learner_recoveries": 1, "num_learner_restarts": 1}
        assert_identical(learner_states(algo))
    finally:
        algo.stop()


@pytest.mark.slow
@pytest.mark.long
def test_a_single_learner_is_rebuilt_from_the_latest_snapshot(ray_cluster):
    algo = small_ppo(1, learner_snapshot_interval_s=1e-6).build(logdir=None)  # a snapshot after every update
    try:
        algo.train()
        weights = algo.learner_group.get_weights()
        kill_learner(algo, 0)
        # no learner survives: the next call rebuilds it from the snapshot of the last update's state
        restored = algo.learner_group.get_weights()
        assert weights.keys() == restored.keys() and all(np.array_equal(weights[k], restored[k]) for k in weights)
        result = algo.train()
        assert fault_tolerance(result) == {"num_learner_recoveries": 1, "num_learner_restarts": 1}
        assert result["training_iteration"] == 2 and np.isfinite(result["learners"]["default_policy"]["policy_loss"])
    finally:
        algo.stop()


@pytest.mark.slow
@pytest.mark.long
def test_a_learner_death_past_max_num_learner_restarts_ends_the_run_naming_it(ray_cluster):
    algo = small_ppo(2, max_num_learner_restarts=1).build(logdir=None)
    try:
        algo.train()
        kill_learner(algo, 1)
        assert fault_tolerance(algo.train())["num_learner_restarts"] == 1
        kill_learner(algo, 0)
        with pytest.raises(ActorGroupError, match=r"learner 0 failed \(.*ActorDiedError.*\) and cannot be recreated: "
                                                  r"the job has recreated 1 learner\(s\) already and "
                                                  r"max_num_learner_restarts=1 allows 1 in all"):
            algo.train()
    finally:
        algo.stop()


@pytest.mark.slow
@pytest.mark.long
def test_a_multi_agent_learner_is_rebuilt_with_the_modules_the_run_has_now(ray_cluster):
    algo = multi_agent_config().env_runners(num_env_runners=1).learners(num_learners=2).build(logdir=None)
    try:
        algo.train()
        snapshot(algo)  # a module added while training: the recreated learner must hold it too
        kill_learner(algo, 1)
        result = algo.train()
        assert fault_tolerance(result) == {"num_learner_recoveries": 1, "num_learner_restarts": 1}
        assert set(result["learners"]) >= {"p0", "p1"} and "p0_v1" not in result["learners"]  # frozen
        modules = algo.learner_group.foreach_learner(lambda learner: (learner.module_ids, sorted(learner.trainable)))
        assert modules == [(["p0", "p0_v1", "p1"], ["p0", "p1"])] * 2
        for first, second in zip(*[s["modules"].values() for s in learner_states(algo)]):
            assert_identical([first, second])
    finally:
        algo.stop()


# --- APPO ---------------------------------------------------------------------------------------
@pytest.mark.learning
@pytest.mark.long
def test_appo_learner_killed_is_rebuilt_its_runners_repointed_and_learning_goes_on(ray_cluster):
    shutil.rmtree(trained_dir(), ignore_errors=True)
    algo = (APPOConfig().environment("CartPole-v1").env_runners(num_env_runners=2).learners(num_learners=2)
            .training(train_batch_size_per_learner=250, minibatch_size=250).callbacks(RecordTrainedToFiles)
            .debugging(seed=0).build(logdir=None))
    try:
        results = [algo.train() for _ in range(2)]
        old_address = algo.plan.feeds.addresses[1]
        kill_learner(algo, 1)
        while fault_tolerance(results[-1])["num_learner_recoveries"] == 0:
            results.append(algo.train())
            assert len(results) < 10, "no recovery within 8 iterations"
        version = algo.weights_version
        results.append(algo.train())
        assert algo.weights_version > version  # both learners update again: the new one gets batches
        ft = fault_tolerance(results[-1])
        assert ft["num_learner_recoveries"] == 1 and ft["num_learner_restarts"] == 1
        assert ft["num_env_steps_lost_with_learners"] > 0  # what runner 1 had sent the dead learner, untrained
        assert algo.plan.feeds.addresses[1] != old_address
        # runner 1 streams to the new learner 1: its address, and the chunks the new learner trained
        totals = [r.value for r in algo.env_runner_group.manager.foreach_actor("stream_totals")]
        assert totals[0].get(algo.plan.feeds.addresses[1], 0) > 0 and algo.plan.feeds.addresses[1] not in totals[1]
        # no piece of a chunk trained by two learners -- the dead one and its replacement included; each
        # learner trains its own runner's chunks (the circular buffer reuses a batch within one learner)
        pids = algo.learner_group.foreach_learner(lambda learner: os.getpid())
        pieces = trained_pieces()
        (dead,) = [key for key in pieces if key[0] == 1 and key[1] != pids[1]]
        new, survivor = pieces[1, pids[1]], pieces[0, pids[0]]
        assert new and pieces[dead] and not new & pieces[dead] and not survivor & (new | pieces[dead])
        assert {p[3] for p in new | pieces[dead]} == {"1"} and {p[3] for p in survivor} == {"2"}
        assert_identical(learner_states(algo))
        # the stream counters never go back: the dead feed's counts stay in the sums
        for key in ("num_env_steps_sampled_lifetime", "num_env_steps_trained_lifetime"):
            values = [r[key] for r in results]
            assert values == sorted(values), key
        frames = [r["stream"]["num_frames_received"] for r in results]
        assert frames == sorted(frames)
        best, result = train_until(algo, 150, 1_000_000)  # the budget of tests/test_async_learners.py
        assert best >= 150, f"mean return {best} after {result['num_env_steps_sampled_lifetime']} steps"
        assert_identical(learner_states(algo))
    finally:
        algo.stop()


# --- the replay actor ---------------------------------------------------------------------------
def remote_dqn(**fault_tolerance):
    return (DQNConfig().environment("CartPole-v1").env_runners(num_env_runners=2, num_envs_per_env_runner=4)
            .training(replay_buffer_config={"type": "PrioritizedEpisodeReplayBuffer", "capacity": 50_000,
                                            "remote": True, "snapshot_interval_s": 1.0},
                      num_steps_sampled_before_learning_starts=1000, lr=5e-4, train_batch_size_per_learner=64,
                      training_intensity=16,
                      target_network_update_freq=500, n_step=[2, 5], double_q=True, dueling=True,
                      epsilon=[[0, 1.0], [10_000, 0.02]])
            .rl_module(model_config={"fcnet_hiddens": [64, 64]}).fault_tolerance(**fault_tolerance)
            .reporting(min_time_s_per_iteration=1.0).debugging(seed=0))


def replay_size(algo):
    return algo.plan.streaming.group.foreach_actor("apply", len)[0].value


@pytest.mark.learning
@pytest.mark.long
def test_dqn_remote_replay_killed_is_rebuilt_from_its_snapshot_and_learning_goes_on(ray_cluster):
    algo = remote_dqn().build(logdir=None)
    streaming = algo.plan.streaming
    try:
        for _ in range(60):  # until it trains, and the driver holds a snapshot of the replay
            result = algo.train()
            if streaming.last_state is not None and result["num_env_steps_trained_lifetime"] > 0:
                break
        snapshot_steps = streaming.last_state["storage"]["num_steps"]
        assert snapshot_steps > 0
        ray.kill(streaming.group.handle(1), no_restart=True)
        trained = result["num_env_steps_trained_lifetime"]
        # the next training step that looks finds it dead and recreates it
        result = train_until_seen(algo, lambda r: r["fault_tolerance"]["num_replay_restarts"] > 0)
        # recreated holding the snapshot's transitions (and what streamed in since), not empty
        assert replay_size(algo) >= min(snapshot_steps, 50_000 - 1)
        assert fault_tolerance(result)["num_replay_restarts"] == 1
        # inserted after the snapshot (as the replay last reported its inserts): at most what it ever stored
        assert 0 <= result["fault_tolerance"]["num_replay_steps_lost"] <= result["replay"]["inserts"]
        best, result = train_until(algo, 150, 150_000)
        assert best >= 150, f"mean return {best} after {result['num_env_steps_sampled_lifetime']} steps"
        assert result["num_env_steps_trained_lifetime"] > trained
        assert result["fault_tolerance"]["num_replay_restarts"] == 1
    finally:
        algo.stop()


@pytest.mark.slow
def test_a_replay_death_past_max_num_replay_restarts_ends_the_run_naming_it(ray_cluster):
    algo = remote_dqn(max_num_replay_restarts=0).build(logdir=None)
    try:
        assert fault_tolerance(algo.train())["num_replay_restarts"] == 0
        ray.kill(algo.plan.streaming.group.handle(1), no_restart=True)
        with pytest.raises(ActorGroupError) as failure:
            for _ in range(30):  # the next training step that looks finds it dead
                algo.train()
    finally:
        algo.stop()
    assert re.search(r"the replay actor died \(actor died.*\) and cannot be recreated: the job has recreated it "
                     r"0 time\(s\) and max_num_replay_restarts=0 allows no more", str(failure.value))
