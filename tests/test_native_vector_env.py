"""An env's own vector implementation in env runners (``actors.env.native_vector_env``).

CartPole's ``CartPoleVectorEnv`` resets a sub-env on the step *after* its episode ended (the reset step
ignores its action and pays 0); the runner must keep those cells out of every chunk and count. CartPole
makes that checkable: every real step pays 1, every episode starts within +-0.05 and ends out of bounds
or at step 500.
"""
from __future__ import annotations

import gymnasium as gym
import numpy as np
import pytest
from gymnasium.envs.classic_control import CartPoleEnv
from gymnasium.vector import AutoresetMode, VectorEnv

from actors.callbacks import RLlibCallback
from actors.env import EnvRunner, EnvRunnerSettings
from actors.env.creators import ClassMaker, GymMaker
from actors.env.native_vector_env import NativeVectorEnv, native_vector_id
from actors.env.vector_env import SyncVectorEnv
from actors.env.vector_modes import make_vector_env
from pipeline import PPOConfig
from pipeline.config.base import ConfigError
from pipeline.groups.env_runners import vectorize_mode

X_LIMIT, THETA_LIMIT = 2.4, 12 * 2 * np.pi / 360

try:
    import envpool  # noqa: F401 - the optional extra runnel-rl[envpool]
    HAVE_ENVPOOL = True
except ImportError:
    HAVE_ENVPOOL = False
MODES = ["auto", pytest.param("envpool", marks=pytest.mark.skipif(not HAVE_ENVPOOL, reason="needs runnel-rl[envpool]"))]
"""The CartPole checks below run on gymnasium's vector implementation and on EnvPool's, which resets the same way."""


def runner(num_envs=8, mode="auto", seed=0, fragment=64, **kw):
    settings = EnvRunnerSettings(env_creator=GymMaker("CartPole-v1"), num_envs=num_envs, vectorize_mode=mode,
                                 rollout_fragment_length=fragment, seed=seed, **kw)
    return EnvRunner(settings, worker_index=1)


def episodes(chunks):
    out: dict[str, list] = {}
    for c in chunks:
        out.setdefault(c.episode_id, []).append(c)
    for parts in out.values():
        assert [p.chunk_index for p in parts] == list(range(len(parts)))
    return out


def test_auto_picks_the_native_vector_env_for_cartpole_and_sync_otherwise():
    assert native_vector_id(GymMaker("CartPole-v1")) == "CartPole-v1"
    assert native_vector_id(GymMaker("Pendulum-v1")) is None  # no vector_entry_point
    assert native_vector_id(ClassMaker(CartPoleEnv)) is None
    r = runner()
    assert isinstance(r.env, NativeVectorEnv) and r.env.next_step
    kw = dict(env_config={}, num_envs=2, worker_index=1, num_workers=1, seed=0, restart_failed=False)
    assert isinstance(make_vector_env("auto", creator=GymMaker("Pendulum-v1"), **kw), SyncVectorEnv)
    assert isinstance(make_vector_env("sync", creator=GymMaker("CartPole-v1"), **kw), SyncVectorEnv)
    with pytest.raises(ValueError, match="vector_entry_point.*Pendulum-v1.*'auto'"):
        make_vector_env("vector_entry_point", creator=GymMaker("Pendulum-v1"), **kw)
    with pytest.raises(ValueError, match="not one of"):
        make_vector_env("threads", creator=GymMaker("CartPole-v1"), **kw)


@pytest.mark.parametrize("mode", MODES)
def test_reset_steps_are_in_no_chunk_and_no_step_count(mode):
    r = runner(num_envs=8, fragment=100, mode=mode)
    chunks = []
    for _ in range(12):  # ~ 9600 env steps, a few hundred random-policy episodes
        chunks.extend(r.sample())
    eps = episodes(chunks)
    ended = 0
    for parts in eps.values():
        obs = np.concatenate([p.obs[:-1] for p in parts] + [parts[-1].obs[-1:]])
        rewards = np.concatenate([p.rewards for p in parts])
        assert len(obs) == len(rewards) + 1
        assert np.all(rewards == 1.0), "a reset step (reward 0) got into a chunk"
        if parts[0].chunk_index == 0 and parts[0].t_started == 0:
            assert np.all(np.abs(obs[0]) <= 0.05), f"episode starts at {obs[0]}, not a reset state"
        assert np.all(np.abs(obs[:-1, 0]) <= X_LIMIT) and np.all(np.abs(obs[:-1, 2]) <= THETA_LIMIT)
        last = parts[-1]
        if last.terminated:
            ended += 1
            assert abs(obs[-1, 0]) > X_LIMIT or abs(obs[-1, 2]) > THETA_LIMIT
        elif last.truncated:
            ended += 1
            assert len(rewards) == 500
    assert ended > 100
    total = sum(len(c) for c in chunks)
    assert r.num_env_steps_sampled_lifetime == total
    assert total < 12 * 100 * 8  # the reset cells are not counted


@pytest.mark.parametrize("mode", MODES)
def test_a_requested_count_is_of_env_steps_and_reset_only_steps_are_reported(mode):
    r = runner(num_envs=8, mode=mode)
    for _ in range(5):
        chunks = r.sample(num_timesteps=1000)
        assert 1000 <= sum(len(c) for c in chunks) < 1000 + 8  # at most one more step of every sub-env
    m = r.get_metrics()
    reset_only = m["num_env_steps_reset_only_lifetime"]["value"]
    assert reset_only > 0
    assert m["num_env_steps_sampled_lifetime"]["value"] == r.num_env_steps_sampled_lifetime
    # no count asked (a streaming runner's loop): one fragment of 64 steps per sub-env, whatever resets it held
    r2 = runner(num_envs=8, fragment=64, mode=mode)
    assert sum(len(c) for c in r2.sample()) == 64 * 8 - r2.get_metrics()["num_env_steps_reset_only_lifetime"]["value"]


@pytest.mark.parametrize("mode", MODES)
def test_episode_returns_and_lengths_match_their_chunks(mode):
    r = runner(num_envs=4, fragment=50, mode=mode)
    r.slots.ended_log = []
    chunks = [c for _ in range(10) for c in r.sample()]
    whole = {k: v for k, v in episodes(chunks).items() if v[0].t_started == 0 and (v[-1].terminated or v[-1].truncated)}
    logged = sorted(r.slots.ended_log)
    from_chunks = sorted((float(sum(p.rewards.sum() for p in v)), sum(len(p) for p in v)) for v in whole.values())
    assert len(whole) > 20 and logged == from_chunks


@pytest.mark.parametrize("mode", MODES)
def test_same_seed_same_chunks_and_sample_episodes(mode):
    a = runner(seed=3, mode=mode)
    ca = a.sample()
    b = runner(seed=3, mode=mode)  # seeds this process's torch generator again, as a's did
    cb = b.sample()
    assert len(ca) == len(cb)
    for x, y in zip(ca, cb):
        np.testing.assert_array_equal(x.obs, y.obs)
        np.testing.assert_array_equal(x.actions, y.actions)
    # whole episodes on demand (what evaluators ask for): exactly that many, each a real CartPole episode
    done = a.sample(num_episodes=5)
    assert len(done) == 5 and all(c.terminated or c.truncated for c in done)
    assert all(np.all(np.abs(c.obs[0]) <= 0.05) and np.all(c.rewards == 1.0) for c in done)
    # and a later call draws new episodes, not the same ones again
    again = a.sample(num_episodes=5)
    assert [len(c) for c in again] != [len(c) for c in done] or not all(
        np.array_equal(x.obs, y.obs) for x, y in zip(again, done))


@pytest.mark.parametrize("mode", MODES)
def test_a_restored_runner_starts_fresh_episodes(mode):
    r = runner(mode=mode)
    before = {c.episode_id for c in r.sample()}
    state = r.get_state()
    assert state["env"] is None and state["slots"] is None  # nothing to carry a running episode on with
    fresh = runner(mode=mode)
    fresh.set_state(state)
    chunks = fresh.sample()
    assert all(c.t_started == 0 and c.chunk_index == 0 and c.episode_id not in before for c in chunks)
    assert fresh.num_env_steps_sampled_lifetime == state["num_env_steps_sampled_lifetime"] + sum(map(len, chunks))


class EpisodeCounter(RLlibCallback):
    def on_episode_end(self, *, episode, **kwargs):
        pass


def test_hooks_and_curriculum_keep_separate_sub_envs():
    from actors.callbacks import CallbacksSpec

    r = runner(callbacks=CallbacksSpec((EpisodeCounter,)))
    assert isinstance(r.env, SyncVectorEnv)
    with pytest.raises(ValueError, match="on_episode_.*'auto' or 'sync'"):
        runner(mode="vector_entry_point", callbacks=CallbacksSpec((EpisodeCounter,)))
    c = PPOConfig().environment("CartPole-v1")
    assert vectorize_mode(c) == "auto"
    c.environment("CartPole-v1", env_task_fn=lambda results, env, ctx: 0)
    assert vectorize_mode(c) == "sync"
    with pytest.raises(RuntimeError, match="gym_env_vectorize_mode='sync'"):
        runner().foreach_env(lambda env: env)


def test_config_accepts_the_modes_and_gymnasiums_enum():
    for mode in ("auto", "sync", "async", "vector_entry_point", "envpool", gym.VectorizeMode.SYNC):
        PPOConfig().environment("CartPole-v1").env_runners(gym_env_vectorize_mode=mode).validate()
    with pytest.raises(ConfigError, match="gym_env_vectorize_mode='threads' is not one of"):
        PPOConfig().environment("CartPole-v1").env_runners(gym_env_vectorize_mode="threads").validate()


# --- a same-step vector env, and one that fails -------------------------------------------------------
class CounterVectorEnv(VectorEnv):
    """Each sub-env counts 0, 1, 2... and ends after ``length`` steps (sub-env i: length + i), resetting on
    the same step like gymnasium's SAME_STEP mode; ``fail_at``: the step that raises."""

    metadata = {"autoreset_mode": AutoresetMode.SAME_STEP}

    def __init__(self, num_envs=1, length=5, fail_at=None):
        self.num_envs, self.length, self.fail_at = num_envs, length, fail_at
        self.single_observation_space = gym.spaces.Box(0, 1000, (1,), np.float32)
        self.single_action_space = gym.spaces.Discrete(2)
        self.t = np.zeros(num_envs, np.int64)
        self.calls = 0

    def reset(self, *, seed=None, options=None):
        self.t[:] = 0
        return self.t[:, None].astype(np.float32), {}

    def step(self, actions):
        self.calls += 1
        if self.fail_at is not None and self.calls == self.fail_at:
            raise RuntimeError("simulated crash")
        self.t += 1
        obs = self.t[:, None].astype(np.float32)
        ended = self.t >= self.length + np.arange(self.num_envs)
        info = {}
        if ended.any():
            info = {"final_obs": obs.copy(), "_final_obs": ended}
            self.t[ended] = 0
            obs = self.t[:, None].astype(np.float32)
        return obs, np.ones(self.num_envs, np.float32), ended, np.zeros(self.num_envs, bool), info


gym.register("RunnelCounterVec-v0", entry_point=None, vector_entry_point=CounterVectorEnv)


def test_a_same_step_vector_env_passes_through():
    r = EnvRunner(EnvRunnerSettings(env_creator=GymMaker("RunnelCounterVec-v0"), num_envs=3, seed=0,
                                    vectorize_mode="vector_entry_point", rollout_fragment_length=20), worker_index=1)
    assert not r.env.next_step
    chunks = [c for _ in range(3) for c in r.sample()]
    for c in chunks:
        if c.chunk_index == 0 and c.terminated:  # a whole episode: 0, 1, ..., length
            n = len(c)
            np.testing.assert_array_equal(c.obs[:, 0], np.arange(n + 1))
            assert n == 5 + c.env_index
    assert r.num_env_steps_sampled_lifetime == 3 * 20 * 3 == sum(len(c) for c in chunks)


def test_a_failing_vector_env_is_recreated_and_its_episodes_truncated():
    settings = EnvRunnerSettings(env_creator=GymMaker("RunnelCounterVec-v0"), num_envs=2, seed=0,
                                 env_config={"length": 50, "fail_at": 7}, vectorize_mode="vector_entry_point",
                                 rollout_fragment_length=10, restart_failed_sub_environments=True)
    r = EnvRunner(settings, worker_index=1)
    chunks = r.sample()
    cut = [c for c in chunks if c.truncated]
    assert len(cut) == 2 and all(len(c) == 7 for c in cut)  # 6 real steps + the failed one, closed as truncated
    assert r.env.num_restarts == 2
    settings.restart_failed_sub_environments = False
    with pytest.raises(RuntimeError, match="simulated crash"):
        EnvRunner(settings, worker_index=1).sample()


def test_envpool_mode_says_what_is_missing(monkeypatch):
    """``gym_env_vectorize_mode="envpool"`` is asked for by name; without the extra, or for an id EnvPool does not
    offer, the error names the fix. ``auto`` never picks EnvPool (a seeded run must not change with what is
    installed)."""
    kw = dict(env_config={}, num_envs=2, worker_index=1, num_workers=1, seed=0, restart_failed=False)
    with monkeypatch.context() as m:
        m.setitem(__import__("sys").modules, "envpool", None)  # as if not installed
        with pytest.raises(ValueError, match=r"needs EnvPool.*runnel-rl\[envpool\]"):
            make_vector_env("envpool", creator=GymMaker("CartPole-v1"), **kw)
    assert not isinstance(make_vector_env("auto", creator=GymMaker("Pendulum-v1"), **kw), NativeVectorEnv)
    if HAVE_ENVPOOL:
        with pytest.raises(ValueError, match="an env id that EnvPool offers.*'auto' or 'sync'"):
            make_vector_env("envpool", creator=ClassMaker(CartPoleEnv), **kw)
        for own in ("batch_size", "num_threads"):  # each runner sets these itself
            with pytest.raises(ValueError, match=rf"EnvPool's \['{own}'\].*num_cpus_per_env_runner"):
                make_vector_env("envpool", creator=GymMaker("CartPole-v1"), **{**kw, "env_config": {own: 1}})


@pytest.mark.skipif(not HAVE_ENVPOOL, reason="needs runnel-rl[envpool]")
def test_envpool_steps_a_box_action_env_with_checked_observations():
    """Pendulum has no gymnasium vector implementation; EnvPool's runs its sub-envs in C++. Its episodes are
    truncated at 200 steps, and every observation lies in the space the driver read from gymnasium's env."""
    settings = EnvRunnerSettings(env_creator=GymMaker("Pendulum-v1"), num_envs=4, vectorize_mode="envpool",
                                 rollout_fragment_length=100, seed=0)
    r = EnvRunner(settings, worker_index=1)
    assert isinstance(r.env, NativeVectorEnv) and r.env.backend == "envpool"
    chunks = [c for _ in range(6) for c in r.sample()]
    space = gym.make("Pendulum-v1").observation_space
    whole = [v for v in episodes(chunks).values() if v[0].t_started == 0 and v[-1].truncated]
    assert len(whole) >= 4 and all(sum(len(p) for p in v) == 200 for v in whole)
    assert all(space.contains(o) for c in chunks for o in c.obs)
    assert all(np.all((c.rewards <= 0) & (c.rewards >= -16.3)) for c in chunks)


@pytest.mark.skipif(not HAVE_ENVPOOL, reason="needs runnel-rl[envpool]")
def test_envpool_runners_are_seeded_each_their_own_and_unseeded_runs_differ():
    """EnvPool ignores reset(seed=...): the seed goes in when it is made, one per runner, so two runners of a seeded
    run do not step the same episodes, and an unseeded run is not EnvPool's fixed default."""
    def first_obs(seed, worker_index):
        settings = EnvRunnerSettings(env_creator=GymMaker("CartPole-v1"), num_envs=4, vectorize_mode="envpool",
                                     rollout_fragment_length=10, seed=seed)
        r = EnvRunner(settings, worker_index=worker_index)
        return np.stack([c.obs[0] for c in r.sample() if c.t_started == 0])
    np.testing.assert_array_equal(first_obs(5, 1), first_obs(5, 1))
    assert not np.array_equal(first_obs(5, 1), first_obs(5, 2))
    assert not np.array_equal(first_obs(5, 1), first_obs(6, 1))
    assert not np.array_equal(first_obs(None, 1), first_obs(None, 1))
