"""``offline_data(input_={...})``: recordings mixed with probabilities, and recordings mixed into
what DQN's env runners sample (``"sampler"``)."""
import pathlib

import pytest

from actors.env import EnvRunnerSettings
from actors.offline import OfflineReader, ReaderSettings
from pipeline import BCConfig, DQNConfig, PPOConfig
from pipeline.config.base import ConfigError

DATA = pathlib.Path(__file__).resolve().parent / "data"
EXPERT, RANDOM = str(DATA / "cartpole_expert"), str(DATA / "cartpole_random")


def _settings():
    return EnvRunnerSettings(env_creator=None, rollout_fragment_length=50, seed=0)


def _ids(path):
    reader = OfflineReader(_settings(), offline=ReaderSettings(input_=path, shuffle_buffer_size=0, seed=0))
    ids = set()
    while reader.epoch == 0:
        ids.update(c.episode_id for c in reader.sample(num_timesteps=1))
    return ids


def test_records_are_drawn_from_each_recording_with_its_probability():
    expert_ids = _ids(EXPERT)
    reader = OfflineReader(_settings(), offline=ReaderSettings(
        input_={EXPERT: 0.8, RANDOM: 0.2}, shuffle_buffer_size=0, seed=0))
    picks = [c.episode_id in expert_ids for _ in range(400) for c in reader.sample(num_timesteps=1)[:1]]
    share = sum(picks) / len(picks)
    assert 0.7 <= share <= 0.9, share  # seeded: the same every run; 0.8 expected
    assert len(reader.sources) == 2 and len(reader.files) == 2  # one shard each


def test_bc_trains_on_two_mixed_recordings():
    algo = (BCConfig()
            .offline_data(input_={EXPERT: 0.5, RANDOM: 0.5})
            .env_runners(num_env_runners=0).training(train_batch_size_per_learner=256, minibatch_size=128)
            .debugging(seed=0).build(logdir=None))
    try:
        result = algo.train()
        assert result["num_env_steps_trained_lifetime"] >= 256
    finally:
        algo.stop()


def test_dqn_mixes_recorded_steps_into_what_its_runners_sample():
    algo = (DQNConfig().environment("CartPole-v1")
            .env_runners(num_env_runners=0, num_envs_per_env_runner=1, rollout_fragment_length=100)
            .training(train_batch_size_per_learner=32, num_steps_sampled_before_learning_starts=100)
            .offline_data(input_={"sampler": 0.5, EXPERT: 0.5})
            .reporting(min_sample_timesteps_per_iteration=0)  # one training step (100 env steps) a train()
            .debugging(seed=0).build(logdir=None))
    try:
        for _ in range(3):
            result = algo.train()
        sampled = result["num_env_steps_sampled_lifetime"]
        assert sampled == 300  # the counters count env steps only
        read = result["offline_data"]["num_env_steps_read_lifetime"]
        assert sampled <= read <= sampled + 100  # 1:1, give or take the last piece (one round: 100 steps)
        assert len(algo.plan.replay) == sampled + read
    finally:
        algo.stop()


def test_mixing_settings_are_checked():
    with pytest.raises(ConfigError, match="DQN and SAC do that; PPO cannot"):
        PPOConfig().environment("CartPole-v1").offline_data(input_={"sampler": 0.5, EXPERT: 0.5}).validate()
    with pytest.raises(ConfigError, match="samples an env too"):
        DQNConfig().offline_data(input_={"sampler": 0.5, EXPERT: 0.5}).validate()
    with pytest.raises(ConfigError, match="probabilities > 0"):
        BCConfig().offline_data(input_={EXPERT: 0, RANDOM: 1}).validate()
    with pytest.raises(ConfigError, match="names no recording besides 'sampler'"):
        DQNConfig().environment("CartPole-v1").offline_data(input_={"sampler": 1.0}).validate()
    with pytest.raises(ConfigError, match="recorded with other spaces"):
        BCConfig().offline_data(input_={EXPERT: 0.5, str(DATA / "pendulum_sac" / "training"): 0.5}).validate()
