"""A replay algorithm's learner pipeline (``actors.replay.intake``): DQN, SAC and CQL train on transitions
drawn from a buffer, so their ``learner_connector`` runs on the chunks the replay stage stores -- in the
driver's replay and in a remote one -- checked like a learner's batch, with its state in checkpoints."""
from __future__ import annotations

import dataclasses

import gymnasium as gym
import numpy as np
import pytest

from actors.connectors import ClipRewards, LearnerConnector, LearnerPipeline
from actors.replay import ReplayBuffer, ReplaySettings
from actors.replay.intake import ReplayIntake
from pipeline import DQNConfig
from protocols.episode import EpisodeChunk
from tests.pieces import CountSteps, counting_pieces

OBS = gym.spaces.Box(-1.0, 1.0, (2,), np.float32)
ACT = gym.spaces.Discrete(2)


class NaNRewards(LearnerConnector):
    def __call__(self, chunks):
        return [dataclasses.replace(c, rewards=np.full(len(c), np.nan, np.float32)) for c in chunks]


class Raises(LearnerConnector):
    def __call__(self, chunks):
        raise RuntimeError("a bug in the user's piece")


def chunk(episode: str, n: int = 5, reward: float = 2.0) -> EpisodeChunk:
    return EpisodeChunk(episode_id=episode, chunk_index=0, obs=np.full((n + 1, 2), 0.8, np.float32),
                        actions=np.ones(n, np.int64), rewards=np.full(n, reward, np.float32),
                        terminated=True, truncated=False).validate()


def replay_with(*pieces) -> ReplayBuffer:
    intake = ReplayIntake(LearnerPipeline(list(pieces), OBS, ACT), OBS, ACT)
    return ReplayBuffer(ReplaySettings(capacity=100, n_step=1, samples_per_insert=None, seed=0), intake)


def test_the_buffer_stores_what_the_pipeline_makes_of_each_chunk_once():
    replay = replay_with(ClipRewards(limit=0.5), CountSteps())
    replay.add([chunk("a"), chunk("b", 3)])
    batch = replay.sample(16)
    np.testing.assert_array_equal(batch["rewards"], np.full(16, 0.5, np.float32))
    np.testing.assert_array_equal(batch["obs"], np.full((16, 2), 0.4, np.float32))
    assert replay.intake.pipeline.pieces[1].seen == 8  # once per stored step, not per draw


@pytest.mark.parametrize("piece, needle", [(NaNRewards(), "rewards"), (Raises(), "a bug in the user's piece")])
def test_chunks_a_piece_spoils_or_fails_on_are_refused_and_counted_and_the_rest_go_on(piece, needle, caplog):
    replay = replay_with(piece)
    replay.add([chunk("a")])
    assert len(replay) == 0
    assert replay.intake.num_chunks_refused == 1
    assert needle in caplog.text
    assert replay.get_metrics()["learner_connector/num_chunks_refused"]["value"] == 1  # in results under replay/
    good = replay_with(ClipRewards())
    good.add([chunk("a")])
    assert len(good) == 5


def test_the_intake_state_travels_with_the_buffer_state():
    replay = replay_with(CountSteps())
    replay.add([chunk("a")])
    other = replay_with(CountSteps())
    other.set_state(replay.get_state())
    assert other.intake.pipeline.pieces[0].seen == 5
    other.set_intake_state({"pipeline": [{"piece": "CountSteps", "state": {"seen": 9}}]})
    assert other.get_intake_state()["pipeline"][0]["state"] == {"seen": 9}


def dqn(**training):
    return (DQNConfig().environment("CartPole-v1")
            .env_runners(num_env_runners=0, num_envs_per_env_runner=2, rollout_fragment_length=25)
            .training(n_step=1, num_steps_sampled_before_learning_starts=100, train_batch_size_per_learner=32,
                      **training)
            .reporting(min_sample_timesteps_per_iteration=0).debugging(seed=0))


def test_dqn_trains_on_what_its_learner_pipeline_stored_and_a_checkpoint_restores_its_state(tmp_path):
    algo = dqn(learner_connector=counting_pieces).build(logdir=None)
    try:
        for _ in range(6):
            result = algo.train()
        replay = algo.plan.replay
        stored = replay.storage.cols["has_action"]  # the stored steps, read without a draw (the rate limiter's)
        np.testing.assert_array_equal(replay.storage.cols["rewards"][stored], np.full(int(stored.sum()), 0.25))
        assert np.abs(replay.storage.obs[0][stored][:, 2]).max() <= 0.5 * 0.21  # pole angle halved (limit 0.2095)
        seen = replay.intake.pipeline.pieces[1].seen
        assert seen == result["num_env_steps_sampled_lifetime"] >= 300
        assert result["num_env_steps_trained_lifetime"] > 0
        assert algo.learner_group.local.learner_connector is None  # learners train on transitions: no second pass
        path = algo.save_to_path(str(tmp_path / "ckpt"))  # store_buffer_in_checkpoints is off: the intake alone
    finally:
        algo.stop()
    restored = dqn(learner_connector=counting_pieces).build(logdir=None)
    try:
        restored.restore(path)
        assert len(restored.plan.replay) == 0
        assert restored.plan.replay.intake.pipeline.pieces[1].seen == seen
    finally:
        restored.stop()


def test_in_a_multi_agent_run_each_module_has_its_own_pipeline_in_its_learner_or_its_buffer(tmp_path):
    from pipeline import PPOConfig, make_multi_agent

    env = make_multi_agent("CartPole-v1")

    def two(config):
        return (config.environment(env, env_config={"num_agents": 2})
                .multi_agent(policies={"p0", "p1"}, policy_mapping_fn=lambda aid, ep, **kw: f"p{aid}")
                .env_runners(num_env_runners=0, num_envs_per_env_runner=2).debugging(seed=0))

    ppo = two(PPOConfig()).training(train_batch_size_per_learner=200, minibatch_size=100, num_epochs=1,
                                    learner_connector=counting_pieces).build(logdir=None)
    try:
        result = ppo.train()
        learners = ppo.learner_group.local.learners
        seen = {mid: learners[mid].learner_connector.pieces[1].seen for mid in ("p0", "p1")}
        assert learners["p0"].learner_connector is not learners["p1"].learner_connector
        assert all(n > 0 for n in seen.values())
        assert sum(seen.values()) == result["env_runners"]["num_agent_steps_sampled_lifetime"]
    finally:
        ppo.stop()
    dqn_ma = two(DQNConfig()).training(n_step=1, num_steps_sampled_before_learning_starts=100,
                                       learner_connector=counting_pieces
                                       ).reporting(min_sample_timesteps_per_iteration=0)
    algo = dqn_ma.build(logdir=None)
    try:
        for _ in range(4):
            algo.train()
        buffers = algo.plan.multi.replay.buffers
        assert buffers["p0"].intake is not buffers["p1"].intake
        seen = {}
        for mid, buffer in buffers.items():
            stored = buffer.storage.cols["has_action"]
            seen[mid] = buffer.intake.pipeline.pieces[1].seen
            assert seen[mid] == int(stored.sum()) > 0, mid
            np.testing.assert_array_equal(buffer.storage.cols["rewards"][stored], 0.25)
        assert algo.learner_group.local.learners["p0"].learner_connector is None
        path = algo.save_to_path(str(tmp_path / "ma"))  # without the buffers: each module's intake state alone
    finally:
        algo.stop()
    restored = dqn_ma.build(logdir=None)
    try:
        restored.restore(path)
        for mid, buffer in restored.plan.multi.replay.buffers.items():
            assert len(buffer) == 0 and buffer.intake.pipeline.pieces[1].seen == seen[mid], mid
    finally:
        restored.stop()
