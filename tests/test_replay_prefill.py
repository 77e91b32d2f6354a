"""DQN/SAC replay prefilled from a recording: the data is there before the first sampled step,
and the replay ratio still holds (a prefill of thousands of steps unlocks no burst of updates)."""
import pathlib

import pytest

from actors.replay import ReplayBuffer, ReplaySettings
from pipeline import DQNConfig
from pipeline.config.base import ConfigError
from protocols.shards import ShardReader, decode_record

ROOT = pathlib.Path(__file__).resolve().parents[1]
EXPERT = ROOT / "tests" / "data" / "cartpole_expert"


def _recorded_chunks():
    chunks = []
    for path in sorted(EXPERT.glob("*.shard")) or sorted(p for p in EXPERT.iterdir() if p.suffix != ".json"):
        reader = ShardReader(str(path))
        for _, frame in reader.frames():
            chunks += decode_record(frame, reader.limits)
    return chunks


def _samples_allowed(replay, batch=32, cap=100_000):
    allowed = 0
    while replay.can_sample(batch) and allowed < cap:
        replay.sample(batch)
        allowed += batch
    return allowed


def test_prefilled_steps_fill_the_table_but_allow_no_samples_of_their_own():
    replay = ReplayBuffer(ReplaySettings(capacity=20_000, samples_per_insert=4.0, min_size_to_sample=500,
                                         error_buffer=2_500.0))
    chunks = _recorded_chunks()
    stored = replay.prefill(chunks[:-1])
    assert stored == 9_500 and len(replay) == 9_500
    # sampling starts at once (the prefill stands in for the warm-up inserts), but only the limiter's
    # slack is allowed -- not 9,500 * 4 transitions
    assert 32 <= _samples_allowed(replay) <= 2_500 + 32
    fresh = chunks[-1]
    fresh.episode_id = "not-prefilled"
    replay.add([fresh])  # 500 inserted steps allow 500 * 4 more sampled transitions
    assert 2_000 - 32 <= _samples_allowed(replay) <= 2_000 + 32


def _config(tmp_path, **buffer):
    return (DQNConfig().environment("CartPole-v1")
            .env_runners(num_env_runners=0, num_envs_per_env_runner=1, rollout_fragment_length=50)
            .training(train_batch_size_per_learner=32, training_intensity=32 / 50 * 2,
                      num_steps_sampled_before_learning_starts=1000,
                      replay_buffer_config={"type": "EpisodeReplayBuffer", "capacity": 50_000, **buffer})
            .reporting(min_sample_timesteps_per_iteration=0)  # one training step (50 env steps) a train()
            .debugging(seed=0))


def test_dqn_starts_learning_at_once_from_a_prefilled_replay_at_the_configured_ratio(tmp_path):
    algo = _config(tmp_path, prefill_from=str(EXPERT)).build(logdir=None)
    try:
        assert len(algo.plan.replay) == 10_000
        result = algo.train()
        sampled = result["num_env_steps_sampled_lifetime"]
        updates = result["learners"]["__all_modules__"]["num_updates"]
        assert sampled == 50
        # learning starts without 1000 sampled steps of its own (the recording filled the table), and at
        # the configured ratio: 2 updates of 32 per 50 steps (plus the limiter's slack), not 10,000 * ratio
        assert 1 <= updates <= 2 + 3
        assert result["replay"]["num_prefilled_steps"] == 10_000
    finally:
        algo.stop()
    plain = _config(tmp_path).build(logdir=None)
    try:
        assert plain.train()["learners"]["__all_modules__"]["num_updates"] == 0  # 50 < 1000 steps: no learning yet
    finally:
        plain.stop()


def test_prefill_settings_are_checked(tmp_path):
    with pytest.raises(ConfigError, match="prefill_from=.* names no recording"):
        _config(tmp_path, prefill_from=str(tmp_path / "nothing")).validate()
    with pytest.raises(ConfigError, match="prefill_steps=0 must be an int >= 1"):
        _config(tmp_path, prefill_from=str(EXPERT), prefill_steps=0).validate()
    pendulum = ROOT / "tests" / "data" / "pendulum_sac" / "training"
    with pytest.raises(ValueError, match="the recording's observation_space .* is not this algorithm's"):
        _config(tmp_path, prefill_from=str(pendulum)).build(logdir=None)


def test_prefill_steps_caps_the_prefill(tmp_path):
    algo = _config(tmp_path, prefill_from=str(EXPERT), prefill_steps=2_000).build(logdir=None)
    try:
        assert 2_000 <= len(algo.plan.replay) < 2_000 + 500  # whole records: at most one record over
    finally:
        algo.stop()
