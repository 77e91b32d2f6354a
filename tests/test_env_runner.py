"""EnvRunner in-process: chunk layout, episode boundaries, batch modes, nested spaces, sub-env restarts."""
import gymnasium as gym
import numpy as np
import pytest

from actors.env import EnvRunner, EnvRunnerSettings
from protocols.episode import EpisodeChunk
from tests.envs import CountingEnv, DictObsEnv, FlakyEnv


def runner(env_cls=CountingEnv, env_config=None, **kw):
    settings = EnvRunnerSettings(env_creator=lambda ctx: env_cls(ctx), env_config=env_config or {}, seed=0, **kw)
    return EnvRunner(settings, worker_index=1)


def by_episode(chunks):
    eps = {}
    for c in chunks:
        eps.setdefault(c.episode_id, []).append(c)
    return {k: sorted(v, key=lambda c: c.chunk_index) for k, v in eps.items()}


def test_fragments_are_valid_and_glue_into_whole_episodes():
    r = runner(env_config={"length": 7}, num_envs=3, rollout_fragment_length=4)
    chunks = []
    for _ in range(6):  # fragments of 4 steps cut 7-step episodes mid-way
        chunks += r.sample()
    assert sum(len(c) for c in chunks) == 6 * 4 * 3
    for c in chunks:
        c.validate()
        # obs are step indices: each chunk's obs rows count up from t_started without a repeat
        np.testing.assert_array_equal(c.obs[:, 0], np.arange(c.t_started, c.t_started + len(c) + 1))
    whole = [EpisodeChunk.concat(cs) for cs in by_episode(chunks).values() if cs[-1].terminated and cs[0].chunk_index == 0]
    assert whole, "some episodes must have completed"
    for ep in whole:
        assert len(ep) == 7 and ep.ret == 7.0 and ep.terminated
        np.testing.assert_array_equal(ep.obs[:, 0], np.arange(8))  # the terminal obs is kept, not the reset obs
    m = r.get_metrics()
    returns = m["episode_return_mean"]["values"]
    assert returns and all(x == 7.0 for x in returns)
    assert m["num_env_steps_sampled_lifetime"]["value"] == 72


def test_truncated_episodes_are_flagged_truncated():
    r = runner(env_config={"length": 3, "truncate": True}, num_envs=2, rollout_fragment_length=10)
    chunks = r.sample()
    done = [c for c in chunks if c.is_done]
    assert done and all(c.truncated and not c.terminated for c in done)


def test_complete_episodes_mode_returns_only_whole_episodes():
    r = runner(env_config={"length": 5}, num_envs=2, rollout_fragment_length=3, batch_mode="complete_episodes")
    chunks = r.sample(num_timesteps=12)
    assert sum(len(c) for c in chunks) >= 12
    for c in chunks:
        assert c.chunk_index == 0 and c.t_started == 0 and c.terminated and len(c) == 5


def test_sample_num_episodes_returns_exactly_that_many_fresh_episodes():
    r = runner(env_config={"length": 4}, num_envs=3, rollout_fragment_length=2)
    r.sample()  # leaves episodes half done; num_episodes must not return their tails
    eps = r.sample(num_episodes=5, explore=False)
    assert len(eps) == 5
    assert all(e.t_started == 0 and len(e) == 4 and e.terminated for e in eps)


@pytest.mark.parametrize("bad", [{"num_episodes": 0}, {"num_timesteps": -5}, {"num_timesteps": 2.5},
                                 {"num_episodes": True}, {"num_timesteps": "100"}])
def test_sample_counts_that_are_not_whole_numbers_are_named(bad):
    """Before: num_episodes=0 or a negative num_timesteps returned an empty sample, a string raised a TypeError
    from inside the loop. Both runners (single- and multi-agent) check them the same way."""
    (name, value), = bad.items()
    with pytest.raises(ValueError, match=f"{name}={value!r}: give a whole number >= 1"):
        runner().sample(**bad)


def test_nested_dict_tuple_observations():
    r = runner(DictObsEnv, num_envs=2, rollout_fragment_length=25)
    chunks = r.sample()
    c = chunks[0]
    c.validate()
    assert set(c.obs) == {"target", "noise", "pair"}
    assert isinstance(c.obs["pair"], tuple) and c.obs["pair"][1].shape == (len(c) + 1, 2)
    assert c.actions.dtype == np.int64 and c.extra["action_dist_inputs"].shape == (len(c), 3)


def test_box_actions_are_rescaled_into_bounds():
    r = EnvRunner(EnvRunnerSettings(env_creator=lambda ctx: gym.make("Pendulum-v1"), num_envs=2,
                                    rollout_fragment_length=20, seed=0), worker_index=1)
    c = r.sample()[0]
    assert c.actions.shape == (20, 1) and c.actions.dtype == np.float32
    env_actions = r.env_actions(np.array([[-5.0], [0.0], [5.0]], np.float32))
    np.testing.assert_allclose(env_actions[:, 0], [-2.0, 0.0, 2.0])


def test_failing_sub_env_is_recreated_and_its_episode_truncated():
    r = runner(FlakyEnv, env_config={"fail_on_runners": [1], "fail_at_steps": [5, 9]}, num_envs=2,
               rollout_fragment_length=30, restart_failed_sub_environments=True)
    chunks = r.sample()
    assert sum(len(c) for c in chunks) == 60  # nothing lost: the runner kept stepping
    assert r.get_metrics()["fault_tolerance/num_sub_env_restarts"]["value"] == 2  # env 0 and env 1 each failed once at step 5
    assert all(c.truncated for c in chunks if len(c) == 5 and c.t_started == 0)


def test_failing_sub_env_without_restarts_raises():
    r = runner(FlakyEnv, env_config={"fail_on_runners": [1], "fail_at_steps": [3]}, num_envs=1,
               rollout_fragment_length=10)
    with pytest.raises(RuntimeError, match="injected env failure"):
        r.sample()


def test_weights_round_trip_and_version_stamp():
    r = runner(num_envs=1, rollout_fragment_length=3)
    w = r.get_weights()
    w = {k: v + 1.0 for k, v in w.items()}
    r.set_weights(w, weights_version=7)
    np.testing.assert_allclose(r.get_weights()["pi_head.bias"], w["pi_head.bias"])
    assert all(c.weights_version == 7 for c in r.sample())


def test_async_vectorization_matches_sync_layout():
    r = runner(env_config={"length": 6}, num_envs=2, rollout_fragment_length=8, vectorize_mode="async")
    try:
        chunks = r.sample()
        assert sum(len(c) for c in chunks) == 16
        for c in chunks:
            c.validate()
            np.testing.assert_array_equal(c.obs[:, 0], np.arange(c.t_started, c.t_started + len(c) + 1))
        assert any(c.terminated and len(c) + c.t_started == 6 for c in chunks)
    finally:
        r.stop()


def test_async_seeds_once_so_later_episodes_differ():
    """An evaluator resets for every round (``sample(num_episodes=n)``): reseeding each time would play
    the very same episodes every round. The seed applies to the first reset; later ones go on from it."""
    r = EnvRunner(EnvRunnerSettings(env_creator=lambda ctx: gym.make("CartPole-v1"), num_envs=2, seed=0,
                                    vectorize_mode="async"), worker_index=1)
    try:
        first = [c.obs[0] for c in r.sample(num_episodes=2, explore=False)]
        second = [c.obs[0] for c in r.sample(num_episodes=2, explore=False)]
        assert not any(np.array_equal(a, b) for a in first for b in second)
    finally:
        r.stop()


class BothFlagsEnv(CountingEnv):
    """Reports terminated and truncated together at the last step, as gymnasium allows."""

    def step(self, action):
        obs, reward, terminated, _, info = super().step(action)
        return obs, reward, terminated, terminated, info


def test_terminal_wins_when_an_env_reports_both_flags():
    r = runner(BothFlagsEnv, env_config={"length": 3}, num_envs=1, rollout_fragment_length=6)
    done = [c for c in r.sample() if c.is_done]
    assert done and all(c.terminated and not c.truncated for c in done)
    for c in done:
        c.validate()
