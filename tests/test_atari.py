"""Atari: the preprocessing wrappers, ALE ids in configs, the Nature CNN as the default image model,
and short (not learning) PPO and APPO runs on Pong whose chunks keep 84x84x1 uint8 frames.

The wrappers' arithmetic (max-pool, reward sign, area resize) is checked on small fake envs with known
frames; what depends on the emulator (frames per step, no-op starts, lives) on real ALE games.
"""
from __future__ import annotations

import gymnasium as gym
import numpy as np
import pytest
import torch
from torch import nn

pytest.importorskip("ale_py", reason="the Atari tests need ale-py: pip install -e '.[atari]' (make setup installs it)")

from actors.env import EnvContext  # noqa: E402
from actors.env.atari import AtariSettings, ale_env_id, direct_frames, make_atari  # noqa: E402
from actors.env.atari_wrappers import (AreaResize, EpisodicLife, MaxPoolFrameSkip, NoopReset,  # noqa: E402
                                       area_blocks, area_matrix, area_weights, clip_rewards)
from actors.modules import ActorCriticModule, QModule  # noqa: E402
from actors.modules.encoders import CNNEncoder  # noqa: E402
from actors.modules.export import export_policy  # noqa: E402
from pipeline import APPOConfig, ConfigError, DQNConfig, PPOConfig  # noqa: E402
from pipeline.envs import env_creator  # noqa: E402
from tests.pieces import FrameCheck  # noqa: E402
from protocols.numpy_policy import NumpyPolicy  # noqa: E402

FRAME = gym.spaces.Box(0, 255, (84, 84, 1), np.uint8)


class Frames(gym.Env):
    """Step k (from 1) shows ``10 * k`` on the rows of k's parity and 0 elsewhere (a flickering sprite),
    pays ``rewards[k - 1]`` and ends after ``len(rewards)`` steps."""

    observation_space = gym.spaces.Box(0, 255, (4, 4), np.uint8)
    action_space = gym.spaces.Discrete(2)

    def __init__(self, rewards=(1.0,) * 8) -> None:
        self.rewards, self.k = list(rewards), 0

    def reset(self, *, seed=None, options=None):
        self.k = 0
        return np.zeros((4, 4), np.uint8), {}

    def step(self, action):
        self.k += 1
        frame = np.zeros((4, 4), np.uint8)
        frame[self.k % 2::2] = 10 * self.k
        return frame, self.rewards[self.k - 1], self.k == len(self.rewards), False, {"k": self.k}


def ale_env(game: str, **kwargs) -> gym.Env:
    return gym.make(game, frameskip=1, obs_type="grayscale", repeat_action_probability=0.0, **kwargs)


# --- the wrappers -----------------------------------------------------------------------------
def test_frame_skip_repeats_the_action_sums_rewards_and_max_pools_the_last_two_frames():
    env = MaxPoolFrameSkip(Frames(), skip=4)
    env.reset()
    frame, reward, terminated, _, info = env.step(0)
    assert info["k"] == 4 and reward == 4.0 and not terminated
    # frame 3 lit the odd rows (30), frame 4 the even rows (40): the max holds both
    assert (frame[0::2] == 40).all() and (frame[1::2] == 30).all()
    frame, reward, terminated, _, info = env.step(0)
    assert info["k"] == 8 and terminated and (frame[0::2] == 80).all() and (frame[1::2] == 70).all()


def test_frame_skip_stops_at_the_end_of_an_episode():
    env = MaxPoolFrameSkip(Frames(rewards=[1.0, 2.0]), skip=4)
    env.reset()
    frame, reward, terminated, _, info = env.step(0)
    assert info["k"] == 2 and reward == 3.0 and terminated
    assert (frame[0::2] == 20).all() and (frame[1::2] == 0).all()  # the last frame, nothing pooled past the end


def test_rewards_are_clipped_to_their_sign():
    env = clip_rewards(Frames(rewards=[7.0, -3.0, 0.0, 0.5]))
    env.reset()
    assert [env.step(0)[1] for _ in range(4)] == [1.0, -1.0, 0.0, 1.0]


def test_area_weights_average_each_output_interval():
    index, weight = area_weights(8, 4)  # integer factor: the mean of two samples
    assert (index[:, :2] == [[0, 1], [2, 3], [4, 5], [6, 7]]).all()
    assert np.allclose(weight[:, :2], 0.5) and np.allclose(weight[:, 2:], 0.0)
    for n_in in (160, 210):
        index, weight = area_weights(n_in, 84)
        assert np.allclose(weight.sum(1), 1.0)
        covered = np.zeros(n_in)
        np.add.at(covered, index, weight * n_in / 84)
        assert np.allclose(covered, 1.0)  # every input sample counts once in all
    with pytest.raises(ValueError, match="shrinks only"):
        area_weights(4, 8)


def test_area_resize_gives_84x84x1_uint8_means():
    class Screen(Frames):
        observation_space = gym.spaces.Box(0, 255, (210, 160), np.uint8)

        def reset(self, *, seed=None, options=None):
            rng = np.random.default_rng(0)
            return rng.integers(0, 256, (210, 160), dtype=np.uint8), {}

    env = AreaResize(Screen(), 84)
    assert env.observation_space == FRAME
    frame, _ = env.reset()
    raw = Screen().reset()[0].astype(np.float64)
    assert frame.shape == (84, 84, 1) and frame.dtype == np.uint8
    # output (0, 0) covers rows [0, 2.5) and columns [0, 1.905): area-weighted mean of those pixels
    rows, cols = np.array([1, 1, 0.5]), np.array([1, 160 / 84 - 1])
    expected = rows @ raw[:3, :2] @ cols / (rows.sum() * cols.sum())
    assert abs(int(frame[0, 0, 0]) - expected) <= 0.5 + 1e-6
    assert abs(frame.mean() - raw.mean()) < 1.0
    with pytest.raises(ValueError, match="grayscale"):
        AreaResize(gym.make("CartPole-v1"), 84)


def test_area_resize_rounds_the_exact_area_mean_of_every_output_pixel():
    """Every output pixel, for Atari's frame and for sizes whose runs do not divide evenly, is the exact
    (float64) area-weighted mean of the input rounded to the nearest integer, up to float32 summation."""
    rng = np.random.default_rng(1)
    for (h, w), size in (((210, 160), 84), ((210, 160), 42), ((210, 160), 83), ((97, 61), 29)):
        class Screen(Frames):
            observation_space = gym.spaces.Box(0, 255, (h, w), np.uint8)

        frame = rng.integers(0, 256, (h, w), dtype=np.uint8)
        out = AreaResize(Screen(), size).observation(frame)
        exact = area_matrix(h, size) @ frame.astype(np.float64) @ area_matrix(w, size).T
        assert out.shape == (size, size, 1) and out.dtype == np.uint8
        assert np.abs(out[:, :, 0] - exact).max() <= 0.5 + 1e-3, ((h, w), size)
    assert area_blocks(210, 84).shape == (2, 5) and area_blocks(160, 84).shape == (21, 40)
    assert np.allclose(area_blocks(210, 84).sum(1), 1.0)


def frame_skip_steps(direct: bool, game: str, steps: int, **kwargs) -> list:
    """``steps`` random actions through a 4-frame skip over ``game`` (resets after each end): everything each
    step returned."""
    config = dict(frameskip=1, obs_type="grayscale", **kwargs)
    inner = gym.make(game, **config)
    env = MaxPoolFrameSkip(NoopReset(inner, 5), 4, direct_frames(inner, config) if direct else None)
    assert (env.direct is not None) == direct
    rng = np.random.default_rng(0)
    env.reset(seed=3)
    out = []
    for _ in range(steps):
        obs, reward, terminated, truncated, info = env.step(int(rng.integers(env.action_space.n)))
        out.append((obs.tobytes(), reward, terminated, truncated, sorted(info.items())))
        if terminated or truncated:
            env.reset()
    return out


@pytest.mark.parametrize("game,kwargs", [
    ("ALE/Breakout-v5", {"repeat_action_probability": 0.25}),  # sticky actions: the ALE's own draws, same order
    ("ALE/Breakout-v5", {"repeat_action_probability": 0.0, "max_num_frames_per_episode": 201}),  # truncated mid-skip
    ("ALE/Pong-v5", {"repeat_action_probability": 0.0, "full_action_space": True, "max_num_frames_per_episode": 1001}),
])
def test_frames_emulated_directly_give_the_same_steps_bit_for_bit(game, kwargs):
    plain = frame_skip_steps(False, game, 600, **kwargs)
    assert sum(step[2] or step[3] for step in plain) >= 2  # episodes end inside the run
    assert frame_skip_steps(True, game, 600, **kwargs) == plain


def test_direct_frames_only_where_nothing_between_counts_or_changes_steps():
    config = dict(frameskip=1, obs_type="grayscale")
    assert direct_frames(gym.make("ALE/Pong-v5", **config), config) is not None
    timed = dict(config, max_episode_steps=100)  # a TimeLimit counts steps
    assert direct_frames(gym.make("ALE/Pong-v5", **timed), timed) is None
    rgb = dict(frameskip=1, obs_type="rgb")
    assert direct_frames(gym.make("ALE/Pong-v5", **rgb), rgb) is None
    env = make_atari("ALE/Pong-v5")
    while not isinstance(env, MaxPoolFrameSkip):
        env = env.env
    assert env.direct is not None
    env = make_atari("ALE/Pong-v5", {"max_episode_steps": 100})
    while not isinstance(env, MaxPoolFrameSkip):
        env = env.env
    assert env.direct is None


def test_make_atari_observations_and_frames_per_step():
    env = make_atari("ALE/Pong-v5", {"atari": {"noop_max": 0}})
    assert env.observation_space == FRAME and env.action_space == gym.spaces.Discrete(6)
    frame, info = env.reset(seed=1)
    assert frame.shape == (84, 84, 1) and frame.dtype == np.uint8 and info["episode_frame_number"] == 0
    for step in range(1, 4):
        frame, _, _, _, info = env.step(env.action_space.sample())
        assert frame.shape == (84, 84, 1) and frame.dtype == np.uint8
        assert info["episode_frame_number"] == 4 * step
    assert frame.max() > frame.min()  # a picture, not a blank
    env = make_atari("ALE/Pong-v5", {"atari": {"frame_skip": 2, "screen_size": 42, "noop_max": 0}})
    env.reset(seed=1)
    frame, _, _, _, info = env.step(0)
    assert frame.shape == (42, 42, 1) and info["episode_frame_number"] == 2


class SeedCounting(Frames):
    """``Frames`` that counts the seeds its resets get (an ALE env reloads its ROM for each)."""

    def __init__(self, reseed_each_episode=None):
        super().__init__(rewards=(1.0,) * 3)
        self.seeds = []
        if reseed_each_episode is not None:
            self.reseed_each_episode = reseed_each_episode

    def reset(self, *, seed=None, options=None):
        if seed is not None:
            self.seeds.append(seed)
        return super().reset(seed=seed, options=options)


@pytest.mark.parametrize("reseed", [None, False])
def test_seeded_runs_reseed_every_episode_unless_the_env_says_a_seeded_reset_costs_too_much(reseed):
    from actors.env.vector_env import SyncVectorEnv

    def run():
        vec = SyncVectorEnv(lambda ctx: SeedCounting(reseed), {}, 2, worker_index=1, num_workers=1, seed=7,
                            restart_failed=False)
        vec.reset()
        for _ in range(10):  # 3 steps an episode: 3 more episodes per sub-env
            vec.step(np.zeros(2, np.int64))
        return vec

    vec = run()
    seeds = [env.seeds for env in vec.envs]
    assert [len(s) for s in seeds] == ([4, 4] if reseed is None else [1, 1])
    assert seeds == [env.seeds for env in run().envs]  # the same run for the same seed either way
    state = vec.get_state()
    assert (state["seeds"][0] is not None) == (reseed is None)  # a checkpoint replays the episode only when seeded
    assert make_atari("ALE/Pong-v5").reseed_each_episode is False
    assert make_atari("ALE/Pong-v5", {"atari": False}).reseed_each_episode is False


def test_noop_reset_starts_after_1_to_noop_max_frames():
    env = NoopReset(ale_env("ALE/Pong-v5"), noop_max=30)
    env.reset(seed=0)  # later resets draw their no-op counts from the generator this seeds
    starts = [env.reset()[1]["episode_frame_number"] for _ in range(40)]
    assert all(1 <= n <= 30 for n in starts) and len(set(starts)) > 10
    env = NoopReset(ale_env("ALE/Pong-v5"), noop_max=0)
    assert env.reset(seed=0)[1]["episode_frame_number"] == 0


def play_until_done(env: gym.Env, rng: np.random.Generator, limit: int = 20_000):
    for _ in range(limit):
        _, reward, terminated, truncated, info = env.step(int(rng.integers(env.action_space.n)))
        if terminated or truncated:
            return terminated, info
    raise AssertionError(f"no end in {limit} steps")


def test_a_lost_life_ends_a_training_episode_and_the_game_goes_on():
    env = make_atari("ALE/Breakout-v5", EnvContext({}, in_evaluation=False))
    ale = env.unwrapped.ale
    rng = np.random.default_rng(0)
    env.reset(seed=0)
    assert ale.lives() == 5
    terminated, _ = play_until_done(env, rng)
    assert terminated and ale.lives() == 4 and not ale.game_over()
    frames_before = ale.getEpisodeFrameNumber()
    env.reset(seed=1)  # continues the game: one NOOP step, no restart
    assert ale.lives() == 4 and ale.getEpisodeFrameNumber() == frames_before + 4
    for lives in (3, 2, 1):
        assert play_until_done(env, rng)[0] and ale.lives() == lives
        env.reset()
    assert play_until_done(env, rng)[0] and ale.game_over()
    env.reset()
    assert ale.lives() == 5 and ale.getEpisodeFrameNumber() <= 30  # a new game (after its no-ops)


def test_a_reset_without_a_lost_life_restarts_the_game():
    env = EpisodicLife(MaxPoolFrameSkip(ale_env("ALE/Breakout-v5"), 4))
    env.reset(seed=0)
    for _ in range(5):
        env.step(0)
    env.reset(seed=0)
    assert env.unwrapped.ale.getEpisodeFrameNumber() == 0


def test_evaluation_plays_whole_games_with_the_games_own_rewards():
    env = make_atari("ALE/Breakout-v5", EnvContext({}, in_evaluation=True))
    wrappers = []
    inner = env
    while inner is not inner.unwrapped:
        wrappers.append(type(inner).__name__)
        inner = inner.env
    assert "EpisodicLife" not in wrappers and "TransformReward" not in wrappers
    env.reset(seed=0)
    terminated, info = play_until_done(env, np.random.default_rng(0))
    assert terminated and info["lives"] == 0 and env.unwrapped.ale.game_over()
    training = make_atari("ALE/Breakout-v5", EnvContext({}, in_evaluation=False))
    assert isinstance(training, gym.wrappers.TransformReward)
    forced = make_atari("ALE/Breakout-v5", EnvContext({"atari": {"episodic_life": True, "clip_rewards": True}},
                                                      in_evaluation=True))
    assert isinstance(forced, gym.wrappers.TransformReward) and isinstance(forced.env.env, EpisodicLife)


def sticky(env: gym.Env) -> float:
    return env.unwrapped.ale.getFloat("repeat_action_probability")


def test_sticky_actions_keep_the_ids_default_unless_set():
    assert sticky(make_atari("ALE/Pong-v5")) == 0.25
    assert sticky(make_atari("PongNoFrameskip-v4")) == 0.0
    assert sticky(make_atari("ALE/Pong-v5", {"repeat_action_probability": 0.0})) == 0.0


def test_settings_errors_name_the_value_and_the_fix():
    with pytest.raises(ValueError, match=r"unknown env_config\['atari'\] key\(s\) \['frame_stack'\].*noop_max"):
        make_atari("ALE/Pong-v5", {"atari": {"frame_stack": 4}})
    with pytest.raises(ValueError, match=r"'frame_skip'\] must be an int >= 1, got 0"):
        AtariSettings.from_config({"frame_skip": 0})
    with pytest.raises(ValueError, match=r"frameskip.*=4 conflicts.*env_config\['atari'\]\['frame_skip'\]"):
        make_atari("ALE/Pong-v5", {"frameskip": 4})
    make_atari("ALE/Pong-v5", {"frameskip": 1})  # what RLlib's Pong examples pass: the same as ours
    bare = make_atari("ALE/Pong-v5", {"atari": False})
    assert bare.observation_space.shape == (210, 160, 3)
    with pytest.raises(ValueError, match="not an ALE env id"):
        make_atari("CartPole-v1")


# --- ids in configs ---------------------------------------------------------------------------
def test_ale_ids_resolve_to_the_preprocessed_game():
    assert ale_env_id("ale_py:ALE/Pong-v5") == ale_env_id("ALE/Pong-v5") == "ALE/Pong-v5"
    assert ale_env_id("BreakoutNoFrameskip-v4") == "BreakoutNoFrameskip-v4"
    assert ale_env_id("CartPole-v1") is None and ale_env_id("tests.envs:FlakyEnv") is None
    env = env_creator("ale_py:ALE/Pong-v5")(EnvContext({}))
    assert env.observation_space == FRAME
    with pytest.raises(ConfigError, match="ALE/Pong-v5"):
        env_creator("ALE/Pongg-v5")


# --- the default model for images -------------------------------------------------------------
def test_the_default_image_model_is_the_nature_cnn_scaling_uint8_inside():
    torch.manual_seed(0)
    for channels in (1, 4):
        space = gym.spaces.Box(0, 255, (84, 84, channels), np.uint8)
        module = ActorCriticModule(space, gym.spaces.Discrete(6))
        assert isinstance(module.encoder, CNNEncoder) and module.encoder.out_dim == 512
        layers = [m for m in module.encoder.net if not isinstance(m, (nn.ReLU, nn.Flatten))]
        assert [(m.in_channels, m.out_channels, m.kernel_size, m.stride) for m in layers[:3]] == [
            (channels, 32, (8, 8), (4, 4)), (32, 64, (4, 4), (2, 2)), (64, 64, (3, 3), (1, 1))]
        assert isinstance(layers[3], nn.Linear) and (layers[3].in_features, layers[3].out_features) == (3136, 512)
        assert sum(isinstance(m, nn.ReLU) for m in module.encoder.net) == 4
        assert len(module.pi_trunk) == 0 and module.pi_head.in_features == module.vf_head.in_features == 512
        obs = torch.randint(0, 256, (3, 84, 84, channels), dtype=torch.uint8)
        with torch.no_grad():
            by_hand = module.pi_head(module.encoder.net(obs.permute(0, 3, 1, 2).float() / 255))
            assert torch.allclose(module.forward_inference(obs)["action_dist_inputs"], by_hand, atol=1e-5)
    q = QModule(FRAME, gym.spaces.Discrete(6), DQNConfig().model_config)
    assert isinstance(q.encoder, CNNEncoder) and len(q.trunk) == 0 and q.advantage.in_features == 512
    flat = ActorCriticModule(gym.spaces.Box(-1, 1, (4,), np.float32), gym.spaces.Discrete(2))
    assert [m.out_features for m in flat.pi_trunk if isinstance(m, nn.Linear)] == [64, 64]


def test_the_nature_cnn_exports_to_numpy():
    torch.manual_seed(0)
    module = ActorCriticModule(FRAME, gym.spaces.Discrete(6), inference_only=True)
    with torch.no_grad():
        for p in module.pi_head.parameters():
            p.normal_()  # the head's small init would leave every logit near 0
    policy = NumpyPolicy(export_policy(module))
    obs = np.random.default_rng(0).integers(0, 256, (2, 84, 84, 1), dtype=np.uint8)
    with torch.no_grad():
        expected = module.forward_inference(torch.from_numpy(obs))["action_dist_inputs"].numpy()
    assert np.allclose(policy.dist_inputs(obs), expected, rtol=1e-4, atol=1e-4)


# --- short runs on Pong -----------------------------------------------------------------------
def check_losses(result):
    learner = result["learners"]["default_policy"]
    assert learner["uint8_frames"] == 1.0
    for key in ("policy_loss", "vf_loss", "entropy", "total_loss"):
        assert np.isfinite(learner[key]), key


def test_ppo_on_pong_trains_on_uint8_frames():
    algo = (PPOConfig().environment("ALE/Pong-v5").callbacks(FrameCheck)
            .env_runners(num_env_runners=0, num_envs_per_env_runner=2, rollout_fragment_length=32)
            .training(train_batch_size_per_learner=64, minibatch_size=32, num_epochs=1).debugging(seed=0).build())
    try:
        results = [algo.train() for _ in range(2)]
    finally:
        algo.stop()
    for r in results:
        check_losses(r)
    assert results[-1]["num_env_steps_sampled_lifetime"] == 128


@pytest.mark.slow
def test_appo_on_pong_streams_uint8_frames_from_a_ray_runner(ray_cluster):
    algo = (APPOConfig().environment("ale_py:ALE/Pong-v5").callbacks(FrameCheck)
            .env_runners(num_env_runners=1, num_envs_per_env_runner=4, rollout_fragment_length=32)
            .training(train_batch_size_per_learner=128, minibatch_size=128).debugging(seed=0).build())
    try:
        results = []
        while not results or results[-1]["num_learner_updates"] < 1:
            assert len(results) < 60, "APPO made no update in 60 iterations"
            results.append(algo.train())
    finally:
        algo.stop()
    check_losses(results[-1])
    assert results[-1]["num_env_steps_sampled_lifetime"] >= 128


@pytest.mark.slow
def test_appo_on_pong_acts_through_a_central_inference_server(ray_cluster):
    """The case central inference is for: a torch-free Ray runner sends uint8 frames, the server acts with
    the default Nature CNN and the learner's weights. (No FrameCheck callbacks: the runner would import this
    module, and torch with it, to unpickle them.)"""
    from tests.inference_probes import torch_loaded

    algo = (APPOConfig().environment("ale_py:ALE/Pong-v5")
            .env_runners(num_env_runners=1, num_envs_per_env_runner=4, rollout_fragment_length=32)
            .training(train_batch_size_per_learner=128, minibatch_size=128, broadcast_interval=1)
            .inference(mode="central").debugging(seed=0).build())
    try:
        results = []
        while not results or results[-1]["num_learner_updates"] < 1:
            assert len(results) < 60, "APPO made no update in 60 iterations"
            results.append(algo.train())
        assert algo.foreach_env_runner(torch_loaded, local_env_runner=False) == [False]
        servers = algo.env_runner_group.inference.manager
        [encoder] = [r.value for r in servers.foreach_actor("apply", lambda s: type(s.forward.module.encoder))]
    finally:
        algo.stop()
    learner = results[-1]["learners"]["default_policy"]
    assert all(np.isfinite(learner[k]) for k in ("policy_loss", "vf_loss", "entropy", "total_loss"))
    assert encoder is CNNEncoder
    served = results[-1]["inference"]
    # the runner streams: it acted for steps the learner has not received yet
    assert served["num_actions"] >= results[-1]["num_env_steps_sampled_lifetime"] >= 128
    assert served["weights_version"] >= 1 and served["num_bad_requests"] == served["num_failed_batches"] == 0


def test_the_tuned_pong_file_is_a_valid_appo_config():
    import yaml

    spec = yaml.safe_load(open("tuned/pong-appo.yaml"))
    assert spec["algo"] == "APPO" and ale_env_id(spec["env"]) == "ALE/Pong-v5"
    assert spec["stop"]["num_env_steps_sampled_lifetime"] * 4 == 10_000_000  # the 10M frames
    config = APPOConfig().environment(spec["env"]).update_from_dict(spec["config"])
    config.validate()  # unknown keys or bad values raise
    assert config.env_config == {"repeat_action_probability": 0.0} and config.clip_param == 0.1 and config.grad_clip == 0.5
    assert config.model_config == {"normalize_input": True}


def test_the_tuned_pong_ppo_file_is_a_valid_ppo_config():
    import yaml

    spec = yaml.safe_load(open("tuned/pong-ppo.yaml"))
    assert spec["algo"] == "PPO" and ale_env_id(spec["env"]) == "ALE/Pong-v5"
    config = PPOConfig().environment(spec["env"]).update_from_dict(spec["config"])
    config.validate()
    assert (config.train_batch_size_per_learner, config.minibatch_size, config.num_epochs) == (1024, 256, 4)
    assert config.model_config == {"normalize_input": True}
