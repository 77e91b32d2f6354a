"""ALE games through EnvPool (``gym_env_vectorize_mode="envpool"`` with an ALE id): the same settings, spaces and
frames as ``make_atari``'s, and the settings EnvPool cannot follow refused with the one to use.

The option tests need ale-py only (``make setup`` installs it); the stepping tests need the optional extra
``runnel-rl[envpool]`` and skip without it."""
from __future__ import annotations

import numpy as np
import pytest

from actors.env.atari import import_ale, make_atari
from actors.env.envpool_atari import envpool_atari_options, envpool_game_id
from pipeline import PPOConfig
from pipeline.config.checks import ConfigError

try:
    import envpool  # noqa: F401 - the optional extra runnel-rl[envpool]
    HAVE_ENVPOOL = True
except ImportError:
    HAVE_ENVPOOL = False
needs_envpool = pytest.mark.skipif(not HAVE_ENVPOOL, reason="needs runnel-rl[envpool]")


@pytest.fixture(scope="module", autouse=True)
def ale_ids():
    import_ale()  # registers the ALE ids with gymnasium


def test_game_ids():
    assert envpool_game_id("ALE/Pong-v5") == "Pong-v5"
    assert envpool_game_id("PongNoFrameskip-v4") == "Pong-v5"
    assert envpool_game_id("BreakoutDeterministic-v4") == "Breakout-v5"
    assert envpool_game_id("ALE/SpaceInvaders-v5") == "SpaceInvaders-v5"


def test_options_follow_make_atari_in_training_and_in_evaluation():
    train = envpool_atari_options("ALE/Pong-v5", {}, in_evaluation=False)
    assert train["episodic_life"] and train["reward_clip"]
    assert train["repeat_action_probability"] == 0.25  # v5's sticky actions, as the ALE id defaults
    assert (train["frame_skip"], train["noop_max"], train["stack_num"]) == (4, 30, 1)
    assert (train["img_height"], train["img_width"], train["gray_scale"]) == (84, 84, True)
    assert train["use_fire_reset"] is False  # make_atari presses no FIRE at reset
    assert train["max_episode_steps"] == 108_000 // 4  # v5's 108k frames per episode
    evaluation = envpool_atari_options("ALE/Pong-v5", {}, in_evaluation=True)
    assert not evaluation["episodic_life"] and not evaluation["reward_clip"]  # whole games, the game's score
    v4 = envpool_atari_options("PongNoFrameskip-v4", {}, in_evaluation=False)
    assert v4["repeat_action_probability"] == 0.0


def test_options_take_the_same_env_config_as_make_atari():
    config = {"repeat_action_probability": 0.0, "full_action_space": True, "max_num_frames_per_episode": 1000,
              "atari": {"noop_max": 0, "frame_skip": 3, "screen_size": 64, "episodic_life": False,
                        "clip_rewards": True}}
    opts = envpool_atari_options("ALE/Pong-v5", config, in_evaluation=False)
    assert opts["repeat_action_probability"] == 0.0 and opts["full_action_space"] is True
    assert opts["frame_skip"] == 3 and opts["img_height"] == opts["img_width"] == 64
    assert opts["max_episode_steps"] == 334  # 1000 frames at 3 a step, the last step cut short
    assert opts["episodic_life"] is False and opts["reward_clip"] is True
    assert opts["noop_max"] == 1  # EnvPool draws from [0, noop_max): 1 is none, as make_atari's 0


@pytest.mark.parametrize("config, match", [
    ({"atari": False}, r"bare ALE env.*'sync'"),
    ({"render_mode": "rgb_array"}, r"render_mode.*'sync'"),
    ({"frameskip": 4}, r"frameskip.*conflicts"),
    ({"obs_type": "rgb"}, r"obs_type.*conflicts"),
    ({"sound_obs": True}, r"\['sound_obs'\].*no equivalent"),
    ({"atari": {"stack": 4}}, r"unknown env_config\['atari'\] key"),
    ({"max_num_frames_per_episode": 0}, r"frame limit.*>= 1"),
])
def test_settings_envpool_cannot_follow_are_refused_with_the_way_out(config, match):
    with pytest.raises(ValueError, match=match):
        envpool_atari_options("ALE/Pong-v5", config, in_evaluation=False)


def test_a_config_that_sets_envpools_own_options_names_the_setting_to_use():
    config = (PPOConfig().environment("CartPole-v1", env_config={"num_threads": 4})
              .env_runners(gym_env_vectorize_mode="envpool"))
    with pytest.raises(ConfigError, match=r"\['num_threads'\].*num_cpus_per_env_runner"):
        config.validate()


def _runner(vectorize_mode: str, seed: int = 3, num_envs: int = 4, worker_index: int = 0, env_config=None,
            in_evaluation: bool = False, threads: int = 1):
    from actors.env import EnvRunner, EnvRunnerSettings
    from actors.env.creators import AtariMaker

    settings = EnvRunnerSettings(env_creator=AtariMaker("ALE/Pong-v5"), num_envs=num_envs,
                                 env_config=env_config if env_config is not None else
                                 {"repeat_action_probability": 0.0}, vectorize_mode=vectorize_mode,
                                 rollout_fragment_length=16, seed=seed, in_evaluation=in_evaluation,
                                 env_threads=threads,
                                 model_config={"conv_filters": [[8, [8, 8], 4]], "conv_fc_hiddens": [16]})
    return EnvRunner(settings, worker_index=worker_index)


@needs_envpool
def test_envpool_pong_has_make_atari_spaces_and_frames():
    """The first frame of a game without no-ops is the same picture in both (EnvPool's OpenCV area resize
    against make_atari's exact area average: a few edge pixels apart), and a transposed or stacked frame
    would not be."""
    config = {"repeat_action_probability": 0.0, "atari": {"noop_max": 0}}
    ours = make_atari("ALE/Pong-v5", config)
    theirs = _runner("envpool", env_config=config, num_envs=2)
    assert theirs.env.backend == "envpool_atari"
    assert theirs.env.single_observation_space == ours.observation_space  # Box(0, 255, (84, 84, 1), uint8)
    assert theirs.env.single_action_space == ours.action_space  # the minimal action set, Discrete(6)
    first, _ = ours.reset(seed=0)
    pooled = theirs.env.reset()
    assert pooled.shape == (2, 84, 84, 1) and pooled.dtype == np.uint8
    diff = np.abs(pooled[0].astype(int) - first.astype(int))
    assert (diff > 2).mean() < 0.01 and diff.mean() < 0.5, (diff.max(), diff.mean(), (diff > 2).mean())
    ours.close()
    theirs.stop()


@needs_envpool
def test_envpool_pong_samples_checked_chunks_and_runners_differ_by_seed():
    runners = [_runner("envpool", worker_index=i) for i in (1, 2)]
    chunks = [r.sample(num_timesteps=64) for r in runners]
    for r, cs in zip(runners, chunks):
        assert sum(len(c.rewards) for c in cs) >= 64
        for c in cs:
            obs = np.asarray(c.obs)
            assert obs.dtype == np.uint8 and obs.shape[1:] == (84, 84, 1)
            assert all(r.env.single_action_space.contains(int(a)) for a in np.asarray(c.actions))
            assert set(np.unique(c.rewards)) <= {-1.0, 0.0, 1.0}  # clipped in training
    a = np.concatenate([np.asarray(c.obs) for c in chunks[0]])
    b = np.concatenate([np.asarray(c.obs) for c in chunks[1]])
    assert not np.array_equal(a[:64], b[:64])  # each runner its own seed
    for r in runners:
        r.stop()


@needs_envpool
def test_envpool_gets_the_runners_cpus_as_threads_and_evaluation_plays_whole_games():
    """EnvPool's threads are the runner's CPUs (``env_threads``, from ``num_cpus_per_env_runner``), and an evaluation
    runner's envs play whole games with unclipped rewards, as ``make_atari``'s do."""
    runner = _runner("envpool", threads=2, in_evaluation=True, num_envs=2)
    assert runner.env.threads == 2
    envpool_config = runner.env.vector_env.env.config  # EnvPool's own record of its options
    assert envpool_config["num_threads"] == 2
    assert envpool_config["episodic_life"] is False and envpool_config["reward_clip"] is False
    runner.stop()


@needs_envpool
def test_ppo_trains_on_envpool_pong():
    algo = (PPOConfig().environment("ALE/Pong-v5", env_config={"repeat_action_probability": 0.0})
            .env_runners(num_env_runners=0, num_envs_per_env_runner=2, rollout_fragment_length=32,
                         gym_env_vectorize_mode="envpool")
            .training(train_batch_size_per_learner=64, minibatch_size=32, num_epochs=1)
            .rl_module(model_config={"conv_filters": [[8, [8, 8], 4]], "conv_fc_hiddens": [16]})
            .debugging(seed=0).build())
    try:
        result = algo.train()
        assert result["num_env_steps_sampled_lifetime"] >= 64
        assert np.isfinite(result["learners"]["default_policy"]["policy_loss"])
    finally:
        algo.stop()
