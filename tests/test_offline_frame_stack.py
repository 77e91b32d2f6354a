"""Recordings of runs with frame stacking hold one frame per step plus the look-back rows; BC/MARWIL learners
and CQL's replay rebuild the stacks from them when the reading run names the same view."""
from __future__ import annotations

import numpy as np
import pytest

from pipeline import BCConfig, ConfigError, CQLConfig, PPOConfig
from pipeline.connectors import MeanStdFilter
from tests.pieces import stack4


@pytest.fixture(scope="module")
def recording(tmp_path_factory):
    out = str(tmp_path_factory.mktemp("stacked"))
    algo = (PPOConfig().environment("CartPole-v1")
            .env_runners(num_env_runners=0, num_envs_per_env_runner=2, env_to_module_connector=stack4)
            .training(train_batch_size_per_learner=400, minibatch_size=200, num_epochs=1)
            .offline_data(output=out).debugging(seed=0)).build(logdir=None)
    try:
        for _ in range(2):
            algo.train()
    finally:
        algo.stop()
    return out


def test_bc_rebuilds_the_recorded_stacks_and_trains_on_them(recording):
    algo = (BCConfig().environment("CartPole-v1").offline_data(input_=recording)
            .env_runners(num_env_runners=0, env_to_module_connector=stack4)
            .training(train_batch_size_per_learner=200, minibatch_size=100)
            .debugging(seed=0)).build(logdir=None)
    try:
        assert algo.get_module().observation_space.shape == (16,)
        chunks = algo.env_runner_group.local.sample(num_timesteps=300)
        view = algo.learner_group.local.observation_view
        for c in chunks:
            assert c.obs.shape[1:] == (4,) and c.look_back.shape == (3, 4)  # one frame a step, as recorded
            frames = np.concatenate([c.look_back, c.obs])
            want = np.concatenate([frames[i: i + len(c.obs)] for i in range(4)], axis=-1)
            np.testing.assert_array_equal(view.rebuild([c])[0].obs, want)
            if c.chunk_index == 0:  # an episode's start: its first frame fills the stack
                np.testing.assert_array_equal(c.look_back, np.repeat(c.obs[:1], 3, axis=0))
        result = algo.train()
        assert result["num_env_steps_trained_lifetime"] > 0
        assert "num_batches_refused" not in result["learners"]["default_policy"]
    finally:
        algo.stop()


def test_cql_replay_keeps_frames_and_rebuilds_stacks(tmp_path):
    from pipeline import SACConfig

    out = str(tmp_path)
    sac = (SACConfig().environment("Pendulum-v1").env_runners(num_env_runners=0, env_to_module_connector=stack4)
           .training(num_steps_sampled_before_learning_starts=10_000).offline_data(output=out)
           .debugging(seed=0)).build(logdir=None)
    try:
        sac.train()  # sampling only: learning starts later
    finally:
        sac.stop()
    cql = (CQLConfig().environment("Pendulum-v1").offline_data(input_=out)
           .env_runners(num_env_runners=0, env_to_module_connector=stack4)
           .debugging(seed=0)).build(logdir=None)
    try:
        assert cql.get_module().observation_space.shape == (12,)
        chunks = cql.env_runner_group.local.sample(num_timesteps=100)
        cql.plan.replay.add(chunks)  # what a training step stores: frames, linked
        storage = cql.plan.replay.storage
        assert storage.look_back == 3 and storage.obs[0].shape[1:] == (3,) and len(cql.plan.replay) == 100
        idx, valid = storage.stack_rows(np.flatnonzero(storage.cols["has_action"]))
        assert valid.all()
        stacks = cql.plan.replay.view.piece.view_gather(storage.obs[0], idx)
        assert stacks.shape == (100, 12)
        np.testing.assert_array_equal(stacks[:, 9:], storage.obs[0][idx[:, -1]])  # the newest frame last
    finally:
        cql.stop()


def test_recording_pieces_are_refused_with_offline_input(recording):
    with pytest.raises(ConfigError, match=r"holds what \[MeanStdFilter"):
        (BCConfig().environment("CartPole-v1").offline_data(input_=recording)
         .env_runners(num_env_runners=0, env_to_module_connector=lambda env: [MeanStdFilter(), stack4(env)])
         .build(logdir=None))
