"""IMPALA and APPO with remote learners (``num_learners > 0``): each learner receives the streams of its
own env runners, the learners update together with gradients averaged, weights go out from learner 0.

Without Ray: a learner's feed (``actors.learner.feed``) holds a batch once it says it is ready and
refuses to update without one. With Ray: two learners hold identical weights (and APPO target
networks), each trains only on its own runners' chunks, no chunk is trained twice or lost (counted by
chunk ids), the run's counters add up over the learners, a killed learner ends the run naming it when no
restarts are allowed (tests/test_learner_recovery.py: rebuilt otherwise), and
(learning) CartPole-v1 reaches 450 within the budget of the single-learner tests.
"""
import threading
import time
from collections import defaultdict

import gymnasium as gym
import numpy as np
import pytest
import ray

from actors.env import EnvRunner, EnvRunnerSettings
from actors.learner.feed import FeedSettings, FreshBatches, LearnerFeed
from actors.manager import ActorGroupError
from pipeline import APPOConfig, ConfigError, IMPALAConfig
from pipeline.algorithms.appo.learner import CircularBuffer
from pipeline.algorithms.impala.learner import IMPALALearner
from protocols.transport import ChunkSender
from tests.test_impala_appo import check_cartpole
from tests.helpers import train_until_seen
from tests.pieces import RecordTrainedChunks, loaded_modules, optimizer_steps

MAX_STEPS = 1_000_000  # the single-learner learning tests' budget (tests/test_impala_appo.py)

# --- configs ----------------------------------------------------------------------------------
def test_remote_learner_configs_validate_or_name_what_to_change():
    IMPALAConfig().environment("CartPole-v1").env_runners(num_env_runners=2).learners(num_learners=2).validate()
    APPOConfig().environment("CartPole-v1").env_runners(num_env_runners=0).learners(num_learners=1).validate()
    with pytest.raises(ConfigError, match=r"num_learners=3 needs num_env_runners >= 3.*got num_env_runners=2"):
        APPOConfig().environment("CartPole-v1").env_runners(num_env_runners=2).learners(num_learners=3).validate()
    # multi-agent runs too (tests/test_multi_agent_async_learners.py), with policies_to_train as ids
    (APPOConfig().environment("CartPole-v1").env_runners(num_env_runners=2).learners(num_learners=2)
     .multi_agent(policies={"a", "b"}, policy_mapping_fn=lambda agent_id, episode, **kw: "a").validate())
    with pytest.raises(ConfigError, match=r"takes policies_to_train as module ids, not a function"):
        (APPOConfig().environment("CartPole-v1").env_runners(num_env_runners=2).learners(num_learners=2)
         .multi_agent(policies={"a", "b"}, policy_mapping_fn=lambda agent_id, episode, **kw: "a",
                      policies_to_train=lambda mid, batch: True).validate())

# --- a learner's feed, in this process ----------------------------------------------------------
def make_feed(source):
    settings = EnvRunnerSettings(env_creator=lambda ctx: gym.make("CartPole-v1"), num_envs=4,
                                 rollout_fragment_length=25, seed=0)
    runner = EnvRunner(settings, worker_index=1)
    cfg = (IMPALAConfig().environment("CartPole-v1").training(train_batch_size_per_learner=100, minibatch_size=100)
           .debugging(seed=0))
    learner = IMPALALearner(cfg, runner.observation_space, runner.action_space)
    runner.set_weights(learner.get_weights(inference_only=True))
    feed = LearnerFeed(learner, FeedSettings(batch_size=100, queue_size=2), source)
    return runner, learner, feed

def test_feed_holds_a_batch_once_ready_and_never_updates_without_one():
    runner, learner, feed = make_feed(FreshBatches())
    sender = ChunkSender(feed.address, "env-runner-1", compress=False)
    try:
        assert not feed.ready(0.0)
        with pytest.raises(RuntimeError, match="holds no train batch"):
            feed.update(timestep=0)
        assert learner.num_updates == 0
        chunks = runner.sample()  # 4 sub-envs x 25 steps: one batch of 100
        assert sender.send(chunks)
        assert feed.ready(60.0)
        status = feed.status()
        assert status.ready and status.stats["num_chunks_received"] == len(chunks)
        assert status.stats["learner_queue_size"] == 0  # the batch is held for the update, out of the queue
        update = feed.update(timestep=0)
        assert update.num_steps == 100 and int(update.steps.sum()) == 100 and set(update.versions) == {0}
        # one SGD step per epoch: the batch is one minibatch
        assert learner.num_updates == learner.config.num_epochs and np.isfinite(update.stats["policy_loss"])
        assert not update.status.ready  # nothing more came
    finally:
        sender.close()
        feed.close()
    assert feed.receiver.closed

def test_feed_with_a_circular_buffer_is_ready_while_the_buffer_holds_batches():
    runner, learner, feed = make_feed(CircularBuffer(num_batches=2, iterations_per_batch=2, seed=0))
    sender = ChunkSender(feed.address, "env-runner-1", compress=False)
    try:
        assert sender.send(runner.sample())
        assert feed.ready(60.0)
        first = feed.update(timestep=0)
        assert first.status.ready and first.status.stats["source"]["size"] == 1  # the batch serves K=2 updates
        second = feed.update(timestep=0)
        assert not second.status.ready and second.status.stats["source"]["size"] == 0
        assert learner.num_updates == 2 * learner.config.num_epochs
    finally:
        sender.close()
        feed.close()

# --- with Ray: two learners ---------------------------------------------------------------------

def build(config_cls, **training):
    return (config_cls().environment("CartPole-v1").env_runners(num_env_runners=2, num_envs_per_env_runner=4)
            .learners(num_learners=2).training(**training).callbacks(RecordTrainedChunks)
            .reporting(min_time_s_per_iteration=0.5).debugging(seed=0).build(logdir=None))

def runnel_threads():
    return [t.name for t in threading.enumerate() if t.name.startswith("runnel-")]

@pytest.mark.slow
def test_two_impala_learners_train_their_own_runners_chunks_each_once(ray_cluster):
    algo = build(IMPALAConfig, train_batch_size_per_learner=200, minibatch_size=100)
    try:
        results = [algo.train() for _ in range(4)]
        while algo.weights_version < 5 and len(results) < 40:  # a loaded machine updates less per iteration
            results.append(algo.train())
        trained = algo.learner_group.foreach_learner(lambda l: l.callbacks.trained)
        weights = algo.learner_group.foreach_learner(lambda l: l.get_weights())
        received = algo.learner_group.foreach_learner(lambda l: l.feed.receiver.stats())
        updates = algo.learner_group.foreach_learner(lambda l: l.num_updates)
        epochs = algo.config.num_epochs
        modules = algo.learner_group.foreach_learner(loaded_modules)
    finally:
        algo.stop()
    assert runnel_threads() == []
    # a learner actor loads its algorithm's config and learner modules, not the Algorithm (Ray Tune)
    for loaded in modules:
        assert {"pipeline.algorithms.impala.learner", "pipeline.algorithms.impala.config"} <= set(loaded)
        assert not {"ray.tune", "pandas", "pipeline.algorithm"} & set(loaded), sorted(loaded)
    last = results[-1]
    assert algo.weights_version >= 5, algo.weights_version
    # identical weights after every update (gradients averaged every minibatch): 2 minibatches per epoch
    for k in weights[0]:
        np.testing.assert_array_equal(weights[0][k], weights[1][k])
    assert updates[0] == updates[1] == 2 * epochs * algo.weights_version
    # runner i streams to learner i mod 2, and each learner trained chunks of its runner only
    for rank, pieces in enumerate(trained):
        assert pieces and {p[4] for p in pieces} == {2 - rank}, (rank, {p[4] for p in pieces})
    # no piece of a chunk twice, across both learners; each episode's pieces on one learner, gap-free from step 0
    pieces = [p for ps in trained for p in ps]
    assert len({p[:3] for p in pieces}) == len(pieces)
    by_episode = defaultdict(list)
    for rank, ps in enumerate(trained):
        for episode_id, _, t, n, _, _ in ps:
            by_episode[episode_id].append((t, n, rank))
    for episode_id, parts in by_episode.items():
        parts.sort()
        assert parts[0][0] == 0 and len({r for _, _, r in parts}) == 1, episode_id
        for (t, n, _), (t_next, _, _) in zip(parts, parts[1:]):
            assert t_next == t + n, f"episode {episode_id}: steps {t + n}..{t_next} lost"
    # the counters add up over the learners
    steps = [sum(p[3] for p in ps) for ps in trained]
    assert steps[0] == steps[1] == 200 * algo.weights_version
    assert last["num_env_steps_trained_lifetime"] == sum(steps)
    assert sum(steps) <= last["num_env_steps_sampled_lifetime"] <= sum(r["num_env_steps_received"] for r in received)
    assert 0 < last["stream"]["num_chunks_received"] <= sum(r["num_chunks_received"] for r in received)
    assert last["learner_queue"]["capacity"] == 2 * 4 and 0 <= last["learner_queue"]["size"] <= 8
    assert last["stream"]["num_frames_dropped_decode_error"] == last["stream"]["num_chunks_dropped_invalid"] == 0

@pytest.mark.slow
def test_two_appo_learners_keep_identical_weights_and_target_networks(ray_cluster):
    algo = build(APPOConfig, train_batch_size_per_learner=200, minibatch_size=100, target_network_update_freq=2,
                 use_kl_loss=True)
    try:
        for _ in range(30):
            result = algo.train()
            if result["learners"]["default_policy"].get("num_target_updates", 0) >= 2:
                break
        states = algo.learner_group.foreach_learner(lambda l: l.get_state())
        trained = algo.learner_group.foreach_learner(lambda l: l.callbacks.trained)
    finally:
        algo.stop()
    for part in ("module", "targets"):
        a, b = states[0][part], states[1][part]
        if part == "targets":
            a, b = a["target_policy"], b["target_policy"]
        for k in a:
            assert np.array_equal(a[k].numpy(), b[k].numpy()), (part, k)
    assert states[0]["fields"]["num_target_updates"] >= 2
    assert states[0]["fields"] == states[1]["fields"]  # the KL coefficient, tuned on the averaged KL
    for rank, pieces in enumerate(trained):
        assert pieces and {p[4] for p in pieces} == {2 - rank}
    assert result["circular_buffer"]["num_batches_added"] > 0
    assert runnel_threads() == []

@pytest.mark.slow
@pytest.mark.parametrize("config_cls", [IMPALAConfig, APPOConfig])
def test_two_learners_train_a_recurrent_module_in_step(ray_cluster, config_cls):
    """An LSTM: each learner's batch is whole chunks, so the two batches differ in size; the learners still take
    the same number of (all-reduced) steps -- the minibatches come from the settings -- and keep identical
    weights, trained on sequences from their own runners."""
    from tests.envs import StatelessCartPole

    algo = (config_cls().environment(StatelessCartPole).env_runners(num_env_runners=2, num_envs_per_env_runner=2)
            .rl_module(model_config={"use_lstm": True, "lstm_cell_size": 16, "max_seq_len": 7})
            .training(train_batch_size_per_learner=200, minibatch_size=50, num_epochs=2)
            .learners(num_learners=2).debugging(seed=0).build(logdir=None))
    try:
        for _ in range(4):
            result = algo.train()
        weights = algo.learner_group.foreach_learner(lambda l: l.get_weights())
        steps = algo.learner_group.foreach_learner(optimizer_steps)
    finally:
        algo.stop()
    assert steps[0] == steps[1] > 0
    assert weights[0].keys() == weights[1].keys() and any(k.startswith("lstm.") for k in weights[0])
    for k in weights[0]:
        np.testing.assert_array_equal(weights[0][k], weights[1][k], err_msg=k)
    learner = result["learners"]["default_policy"]
    assert np.isfinite(learner["total_loss"]) and learner["num_module_steps_trained"] >= 200


@pytest.mark.slow
def test_a_killed_learner_ends_the_run_naming_it_when_no_restarts_are_allowed(ray_cluster):
    # with restarts allowed the learner is rebuilt instead: tests/test_learner_recovery.py
    algo = (IMPALAConfig().environment("CartPole-v1").env_runners(num_env_runners=2, num_envs_per_env_runner=4)
            .learners(num_learners=2).training(train_batch_size_per_learner=200, minibatch_size=200)
            .fault_tolerance(max_num_learner_restarts=0).reporting(min_time_s_per_iteration=0.5).debugging(seed=0)
            .build(logdir=None))
    try:
        algo.train()
        ray.kill(algo.learner_group.manager.handle(1), no_restart=True)
        with pytest.raises(ActorGroupError, match=r"learner 1 failed .* max_num_learner_restarts=0 allows none"):
            for _ in range(20):
                algo.train()
    finally:
        algo.stop()
    assert runnel_threads() == []

@pytest.mark.slow
def test_a_recreated_runner_streams_to_its_learner_again(ray_cluster):
    algo = (IMPALAConfig().environment("CartPole-v1").env_runners(num_env_runners=2, num_envs_per_env_runner=4)
            .learners(num_learners=2).training(train_batch_size_per_learner=200, minibatch_size=200)
            .fault_tolerance(delay_between_env_runner_restarts_s=0.2, env_runner_health_probe_timeout_s=3.0)
            .callbacks(RecordTrainedChunks).reporting(min_time_s_per_iteration=0.5).debugging(seed=0).build(logdir=None))
    try:
        algo.train()
        killed_at = algo.weights_version  # runner 1 never acts with a later version: only its replacement does
        ray.kill(algo.env_runner_group.manager.handle(1), no_restart=True)
        deadline = time.monotonic() + 120  # a loaded machine restarts slowly: wait on what is checked, not a count
        while algo.train()["fault_tolerance"]["num_remote_worker_restarts"] < 1 and time.monotonic() < deadline:
            pass
        version = algo.weights_version
        while True:  # train until the replacement's chunks reached learner 1 (or the deadline)
            result = algo.train()
            trained = algo.learner_group.foreach_learner(lambda l: l.callbacks.trained)
            if (algo.weights_version > version and any(p[5] > killed_at for p in trained[1])) \
                    or time.monotonic() > deadline:
                break
    finally:
        algo.stop()
    assert result["fault_tolerance"]["num_remote_worker_restarts"] == 1
    assert algo.weights_version > version
    assert {p[4] for p in trained[1]} == {1} and {p[4] for p in trained[0]} == {2}
    assert any(p[5] > killed_at for p in trained[1])  # chunks of the recreated runner 1, trained by learner 1
    assert runnel_threads() == []


@pytest.mark.slow
def test_a_learner_whose_runners_are_gone_ends_the_run_after_the_queue_timeout_naming_it(ray_cluster):
    algo = (IMPALAConfig().environment("CartPole-v1").env_runners(num_env_runners=2, num_envs_per_env_runner=4)
            .learners(num_learners=2).training(train_batch_size_per_learner=200, minibatch_size=200,
                                                learner_queue_timeout=5.0)
            .fault_tolerance(restart_failed_env_runners=False, ignore_env_runner_failures=True,
                             env_runner_health_probe_timeout_s=3.0)
            .reporting(min_time_s_per_iteration=0.5).debugging(seed=0).build(logdir=None))
    try:
        # an update takes a batch at every learner: learner 1 has had frames from runner 1 (one iteration alone
        # may end before the first arrive, and the message then says 0)
        result = train_until_seen(algo, lambda r: r["num_env_steps_trained_lifetime"] > 0)
        assert result["num_env_steps_trained_lifetime"] > 0
        ray.kill(algo.env_runner_group.manager.handle(1), no_restart=True)  # learner 1's only runner
        with pytest.raises(RuntimeError, match=r"learner_queue_timeout=5.0\) at learner 1 \(fed by env runners "
                                               r"with index % 2 == 1; frames received: [1-9]"):
            for _ in range(100):
                algo.train()
    finally:
        algo.stop()
    assert runnel_threads() == []


# --- learning -----------------------------------------------------------------------------------
def run_to_450(config_cls):
    """Two learners, each with half the single-learner batch (the same steps per update, RLlib's rule
    for ``train_batch_size_per_learner``), to a mean return of 450 or the budget."""
    algo = (config_cls().environment("CartPole-v1").env_runners(num_env_runners=2).learners(num_learners=2)
            .training(train_batch_size_per_learner=250, minibatch_size=250)
            .debugging(seed=0).build(logdir=None))
    results = []
    try:
        while True:
            results.append(algo.train())
            if (results[-1]["env_runners"]["episode_return_mean"] >= 450
                    or results[-1]["num_env_steps_sampled_lifetime"] >= MAX_STEPS):
                break
        streaming = [r.value for r in algo.env_runner_group.manager.foreach_actor("is_streaming")]
    finally:
        algo.stop()
    assert runnel_threads() == []
    return results, streaming

# Both runs are 'long' (make test-long): on 2 cores two learner processes, two runners and the driver
# share the CPUs and the learners are slower than their runners, so what they train on is as old as the
# streams let it be. With the default credit-based streams (one unread fragment per runner,
# stream_frames_in_flight=1) the lag is ~15 updates and nothing is dropped: measured on a quiet AMD VM
# (2026-12-02) APPO reached 450 at 399k env steps, IMPALA in three of three runs at 203k-378k (and not in a
# fourth, beside another learning test: 108 after 1M). With IMPALA's policy-gradient ratio clipped at 3 (its
# default from 2026-12-05 to 2026-12-06; at 100 since, 6 of 6 at 241k-929k, none fell) 9 of 9 runs to 1M
# reached 450 at 268k-934k env steps and none fell back, against 8 of 9 and 3 that fell to 9 when clipped at 1 (tests/benchmarks/results_impala_two_learners_amd_2026-12-05.jsonl); one
# run at 934k was near the budget, so the test was an xfail until 2026-12-06: with two passes per batch and Adam's
# epsilon at 1e-2 (IMPALA's defaults since) 16 of 16 runs reached 450 at 192k-549k, median 308k. Before
# (4 frames each side, 256-KiB socket buffers, ~25 of a learner's batches in flight per runner) both ended
# at 154 and 50 after 1M env steps, and with streams one frame deep and 16-KiB buffers (lag 12-24) IMPALA
# reached 450 in only three of six runs.
@pytest.mark.learning
@pytest.mark.long
def test_appo_with_two_learners_reaches_450(ray_cluster):
    results, streaming = run_to_450(APPOConfig)
    check_cartpole(results, streaming)
    assert results[-1]["learners"]["default_policy"]["num_target_updates"] >= 1
    assert results[-1]["circular_buffer"]["num_batches_added"] > 0

@pytest.mark.learning
@pytest.mark.long
def test_impala_with_two_learners_reaches_450(ray_cluster):
    results, streaming = run_to_450(IMPALAConfig)
    check_cartpole(results, streaming)
    assert results[-1]["num_env_steps_trained_lifetime"] <= results[-1]["num_env_steps_sampled_lifetime"]
