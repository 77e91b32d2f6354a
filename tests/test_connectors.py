"""Env-to-module connectors: running statistics merged across runners, flattening, frame-stacking views
rebuilt from chunks, the pipeline in the runners and the driver, checkpoints, and the errors users meet."""
from __future__ import annotations

import gymnasium as gym
import numpy as np
import pytest

from actors.connectors import (ConnectorPipeline, ConnectorV2, FlattenObservations, FrameStackingEnvToModule,
                               MeanStdFilter, RunningStats, build_pipeline)
from actors.env import EnvRunner, EnvRunnerSettings
from pipeline import Algorithm, ConfigError, PPOConfig
from protocols.codec import decode, encode
from protocols.episode import EpisodeChunk
from protocols.errors import ProtocolError
from protocols.schema import ChunkSchema
from tests.pieces import mean_std, stack4

BOX = gym.spaces.Box(-np.inf, np.inf, (3,), np.float32)
ACT = gym.spaces.Discrete(2)


# --- running statistics ---------------------------------------------------------------------------
def test_running_stats_merged_in_pieces_equal_the_whole():
    rng = np.random.default_rng(0)
    data = rng.normal(5.0, 3.0, (1000, 3)) * np.array([1.0, 100.0, 0.01])
    whole = RunningStats.empty((3,))
    whole.add_batch(data)
    parts = [RunningStats.empty((3,)) for _ in range(4)]
    for i, cut in enumerate(np.array_split(data, 7)):
        parts[i % 4].add_batch(cut)
    merged = RunningStats.empty((3,))
    for p in parts:
        merged.merge(p)
    assert merged.count == whole.count == 1000
    np.testing.assert_allclose(merged.mean, data.mean(0), rtol=1e-10)
    np.testing.assert_allclose(merged.std, data.std(0), rtol=1e-10)
    np.testing.assert_allclose(merged.m2, whole.m2, rtol=1e-10)


def test_mean_std_filter_runner_copies_and_the_driver_agree_with_one_filter_that_saw_everything():
    driver = build_pipeline(lambda env: MeanStdFilter(clip=None), BOX, ACT)
    runners = [build_pipeline(lambda env: MeanStdFilter(clip=None), BOX, ACT) for _ in range(3)]
    rng = np.random.default_rng(1)
    everything = []
    for _ in range(4):  # four iterations: sample, pop, absorb, sync
        for r in runners:
            batch = rng.normal([1.0, -2.0, 50.0], [1.0, 0.1, 10.0], (8, 3)).astype(np.float32)
            everything.append(batch)
            r.record(batch, np.zeros(8, bool), update=True)
        driver.absorb([r.pop_deltas() for r in runners])
        for r in runners:
            r.sync(driver.get_state())
    state = driver.get_state()[0]["state"]
    allx = np.concatenate(everything).astype(np.float64)
    assert state["count"] == len(allx)
    np.testing.assert_allclose(state["mean"], allx.mean(0), rtol=1e-9)
    np.testing.assert_allclose(np.sqrt(state["m2"] / state["count"]), allx.std(0), rtol=1e-9)
    x = np.array([[1.0, -2.0, 50.0]], np.float32)
    want = (x - allx.mean(0)) / (allx.std(0) + 1e-8)
    for r in runners:  # every copy normalises alike once synced
        np.testing.assert_allclose(r.record(x, np.zeros(1, bool), update=False), want, rtol=1e-5)


def test_mean_std_filter_keeps_what_it_gathered_after_its_delta_was_taken():
    f = MeanStdFilter()
    f.recompute_output_observation_space(BOX, ACT)
    f(np.ones((4, 3), np.float32), episode_starts=np.zeros(4, bool), update=True)
    delta = f.pop_delta()
    f(np.full((2, 3), 3.0, np.float32), episode_starts=np.zeros(2, bool), update=True)  # after the pop
    driver = MeanStdFilter()
    driver.absorb([delta])
    f.sync(driver.get_state())
    assert f.get_state()["count"] == 6  # the synced 4 and the 2 gathered since
    assert f.pop_delta()["count"] == 2
    assert f.pop_delta() is None  # nothing new


def test_mean_std_filter_clips_and_does_not_learn_when_told_not_to():
    f = MeanStdFilter(clip=2.0)
    f.recompute_output_observation_space(BOX, ACT)
    f(np.random.default_rng(0).normal(0, 1, (100, 3)).astype(np.float32), episode_starts=np.zeros(100, bool),
      update=True)
    before = f.get_state()
    out = f(np.full((1, 3), 1e6, np.float32), episode_starts=np.zeros(1, bool), update=False)
    assert np.all(out == 2.0) and out.dtype == np.float32
    after = f.get_state()
    assert after["count"] == before["count"] and np.array_equal(after["mean"], before["mean"])


def test_mean_std_filter_refuses_what_it_cannot_normalise():
    with pytest.raises(ValueError, match="FlattenObservations"):
        build_pipeline(lambda env: MeanStdFilter(), gym.spaces.Dict({"a": BOX}), ACT)
    with pytest.raises(ValueError, match="clip"):
        MeanStdFilter(clip=0)
    f = MeanStdFilter()
    f.recompute_output_observation_space(BOX, ACT)
    with pytest.raises(ValueError, match="shape"):
        f.set_state({"count": 3.0, "mean": np.zeros(5), "m2": np.zeros(5)})


# --- flattening -------------------------------------------------------------------------------------
def test_flatten_observations_lays_out_a_batch_as_gymnasium_flattens_each_row():
    space = gym.spaces.Dict({"pos": gym.spaces.Box(-1, 1, (2, 2), np.float32), "mode": gym.spaces.Discrete(3, start=1),
                             "bits": gym.spaces.MultiDiscrete([2, 3])})
    space.seed(0)
    rows = [space.sample() for _ in range(5)]
    batch = {k: np.stack([r[k] for r in rows]) for k in space.spaces}
    pipe = build_pipeline(lambda env: FlattenObservations(), space, ACT)
    out = pipe.record(batch, np.zeros(5, bool), update=True)
    want = np.stack([gym.spaces.flatten(space, r) for r in rows]).astype(np.float32)
    np.testing.assert_array_equal(out, want)
    assert pipe.observation_space.shape == (want.shape[1],) and pipe.observation_space.contains(out[0])


def test_pipeline_order_spaces_and_factory_errors():
    space = gym.spaces.Dict({"a": BOX, "b": gym.spaces.Discrete(2)})
    pipe = build_pipeline(lambda env: [FlattenObservations(), MeanStdFilter()], space, ACT)
    assert pipe.observation_space.shape == (5,) and pipe.stateful
    assert build_pipeline(None, BOX, ACT) is None
    with pytest.raises(TypeError, match="lambda env"):
        build_pipeline(MeanStdFilter(), BOX, ACT)
    with pytest.raises(TypeError, match="ConnectorV2"):
        build_pipeline(lambda env: [object()], BOX, ACT)
    with pytest.raises(ValueError, match="put views last"):
        build_pipeline(lambda env: [FrameStackingEnvToModule(num_frames=2), MeanStdFilter()], BOX, ACT)
    with pytest.raises(ValueError, match="saved connector pipeline"):
        pipe.set_state([{"piece": "MeanStdFilter", "state": {}}])
    seen = []
    build_pipeline(lambda env, spaces, device: seen.append(env.observation_space) or [], BOX, ACT)
    assert seen == [BOX]  # RLlib's three-argument factories are called too


# --- frame stacking: a view rebuilt from chunks ------------------------------------------------------
def test_frame_stacking_rebuilds_from_a_chunk_and_its_look_back_what_the_runner_stacked():
    k = 3
    piece = FrameStackingEnvToModule(num_frames=k)
    space = piece.recompute_output_observation_space(gym.spaces.Box(0, 255, (2, 2, 1), np.uint8), ACT)
    assert space.shape == (2, 2, 3)
    frames = np.arange(10 * 2 * 2, dtype=np.uint8).reshape(10, 1, 2, 2, 1)  # one env, 10 steps
    seen = [piece(frames[0], episode_starts=np.ones(1, bool), update=True)[0]]
    look_back = None
    for t in range(1, 10):
        if t == 4:
            look_back = piece.recent()[0]  # a chunk starts at frame 3
        seen.append(piece(frames[t], episode_starts=np.zeros(1, bool), update=True)[0])
    rows = frames[3:, 0]
    rebuilt = piece.view_of(rows, look_back)
    np.testing.assert_array_equal(rebuilt, np.stack(seen[3:]))
    # an episode's first frame fills the stack
    first = piece.view_of(frames[:2, 0], np.repeat(frames[:1, 0], k - 1, axis=0))
    np.testing.assert_array_equal(first[0], np.concatenate([frames[0, 0]] * k, axis=-1))


class _Recording:
    """Wraps a runner's acting piece: keeps every batch of observations its module acted on."""

    def __init__(self, acting):
        self.inner, self.seen = acting, []

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def act(self, obs, explore, timestep):
        self.seen.append(np.array(obs))
        return self.inner.act(obs, explore, timestep)


def test_runner_chunks_carry_one_frame_per_step_and_the_look_back_to_rebuild_the_stacks():
    k, n = 4, 3
    settings = EnvRunnerSettings(env_creator=lambda ctx: gym.make("CartPole-v1"), num_envs=n, rollout_fragment_length=7,
                                 seed=3, env_to_module=lambda env: FrameStackingEnvToModule(num_frames=k))
    runner = EnvRunner(settings)
    assert runner.observation_space.shape == (4 * k,)
    runner.sampler.acting = rec = _Recording(runner.acting)
    chunks = []
    for _ in range(6):  # several fragments: chunks that start mid-episode and episodes that start mid-fragment
        chunks += runner.sample()
    seen = np.stack(rec.seen)  # [T, n, 4k]
    assert any(c.t_started > 0 for c in chunks) and any(c.t_started == 0 and c.chunk_index == 0 for c in chunks)
    # walk each env's chunks in order: their steps follow one another in the acting record
    for j in range(n):
        mine = [c for c in chunks if c.env_index == j]
        t = 0
        for c in mine:
            assert c.obs.shape[1:] == (4,) and c.look_back.shape == (k - 1, 4)  # one frame per stored row
            stacks = FrameStackingEnvToModule(num_frames=k).view_of(c.obs, c.look_back)
            np.testing.assert_array_equal(stacks[:-1], seen[t : t + len(c), j])
            t += len(c)
        assert t == len(seen)
    # the look-back travels: codec round trip, slices, and the schema's check
    c = next(c for c in chunks if len(c) > 3 and c.t_started > 0)
    back = decode(encode([c]))[0]
    np.testing.assert_array_equal(back.look_back, c.look_back)
    part = c.slice(2, len(c))
    np.testing.assert_array_equal(FrameStackingEnvToModule(num_frames=k).view_of(part.obs, part.look_back),
                                  FrameStackingEnvToModule(num_frames=k).view_of(c.obs, c.look_back)[2:])
    schema = ChunkSchema.for_spaces(gym.spaces.Box(-np.inf, np.inf, (4,), np.float32), ACT)
    schema.check(c)
    bad = EpisodeChunk(c.episode_id, c.chunk_index, c.obs, c.actions, c.rewards, extra=dict(c.extra),
                       look_back=np.zeros((k - 1, 5), np.float32))
    with pytest.raises(ProtocolError, match="look_back"):
        bad.validate()
    runner.stop()


def test_chunks_without_look_back_keep_the_old_wire_layout():
    from protocols.codec_values import chunk_to_list

    from protocols.codec_arrays import ArrayPacker

    c = EpisodeChunk("e" * 8, 0, np.zeros((3, 2), np.float32), np.zeros(2, np.int64), np.zeros(2, np.float32))
    assert len(chunk_to_list(c, ArrayPacker())) == 15  # what peers that predate look_back read
    assert decode(encode([c], compress=False))[0].look_back is None


# --- in the algorithm -----------------------------------------------------------------------------
def _ppo(**runners):
    return (PPOConfig().environment("CartPole-v1")
            .env_runners(num_envs_per_env_runner=4, env_to_module_connector=mean_std, **runners)
            .training(train_batch_size_per_learner=512, minibatch_size=128, num_epochs=2).debugging(seed=0))


@pytest.mark.slow
def test_runners_normalise_with_the_merged_statistics_and_a_checkpoint_restores_them_bit_for_bit(ray_cluster, tmp_path):
    algo = _ppo(num_env_runners=2).evaluation(evaluation_interval=1, evaluation_num_env_runners=1,
                                              evaluation_duration=2).build()
    try:
        for _ in range(3):
            result = algo.train()
        state = algo.connector.get_state()[0]["state"]
        assert state["count"] >= result["num_env_steps_sampled_lifetime"]  # every step's observation, and resets
        for runner_state in algo.foreach_env_runner(lambda r: r.connector.get_state(), local_env_runner=False):
            s = runner_state[0]["state"]
            assert s["count"] >= state["count"]  # the merged statistics, and what came since the sync
        evaluator = algo.eval_env_runner_group.foreach_env_runner(lambda r: r.connector.get_state(), local=False)[0]
        assert evaluator[0]["state"]["count"] > 0  # evaluators normalise with the training statistics
        path = algo.save(str(tmp_path / "ck")).checkpoint.path
    finally:
        algo.stop()
    restored = Algorithm.from_checkpoint(path)
    try:
        got = restored.connector.get_state()[0]["state"]
        assert got["count"] == state["count"]
        for key in ("mean", "m2"):
            assert got[key].dtype == np.float64 and got[key].tobytes() == state[key].tobytes()
        for runner_state in restored.foreach_env_runner(lambda r: r.connector.get_state(), local_env_runner=False):
            assert runner_state[0]["state"]["mean"].tobytes() == state["mean"].tobytes()
        x = np.array([0.01, -0.2, 0.03, 0.1], np.float32)
        assert restored.compute_single_action(x, explore=False) in (0, 1)
    finally:
        restored.stop()


def test_streaming_runners_share_their_statistics_too(ray_cluster):
    from pipeline import APPOConfig

    c = (APPOConfig().environment("CartPole-v1")
         .env_runners(num_env_runners=2, num_envs_per_env_runner=4, env_to_module_connector=lambda env: MeanStdFilter())
         .training(train_batch_size_per_learner=500).debugging(seed=0))
    algo = c.build()
    try:
        counts = []
        while len(counts) < 3 or counts[-1] <= counts[0]:
            algo.train()
            counts.append(algo.connector.get_state()[0]["state"]["count"])
        assert counts == sorted(counts) and counts[-1] > 0
    finally:
        algo.stop()


def test_connector_settings_that_cannot_work_are_config_errors():
    with pytest.raises(ConfigError, match="env_to_module_connector"):
        (PPOConfig().environment("CartPole-v1")
         .env_runners(num_env_runners=0, env_to_module_connector=lambda env: FrameStackingEnvToModule(num_frames=0))
         .build())
    from pipeline import DQNConfig

    with pytest.raises(ConfigError, match="recurrent module's replay"):
        (DQNConfig().environment("CartPole-v1").rl_module(model_config={"use_lstm": True, "max_seq_len": 4})
         .env_runners(num_env_runners=0, env_to_module_connector=lambda env: FrameStackingEnvToModule(num_frames=4))
         .build())
    with pytest.raises(ConfigError, match="clients"):
        (PPOConfig().environment(observation_space=BOX, action_space=ACT)
         .external_clients(address="tcp://127.0.0.1:0")
         .env_runners(num_env_runners=0, env_to_module_connector=lambda env: MeanStdFilter()).build())


class _Shift(ConnectorV2):
    """A user's piece: adds a constant to every observation."""

    def __call__(self, obs, *, episode_starts, update):
        return np.asarray(obs, np.float32) + 100.0


def test_a_users_piece_changes_what_the_module_sees_and_what_chunks_store():
    settings = EnvRunnerSettings(env_creator=lambda ctx: gym.make("CartPole-v1"), num_envs=2, rollout_fragment_length=5,
                                 seed=0, env_to_module=lambda env: _Shift())
    runner = EnvRunner(settings)
    chunks = runner.sample()
    assert all(np.all(np.abs(c.obs) > 50) for c in chunks)
    runner.stop()
    assert isinstance(build_pipeline(lambda env: _Shift(), BOX, ACT), ConnectorPipeline)


# --- frame stacking end to end: the learners rebuild the stacks ----------------------------------
@pytest.mark.slow
@pytest.mark.parametrize("algo_name", ["PPO", "APPO"])
def test_learners_train_on_stacks_rebuilt_from_one_frame_per_step(ray_cluster, algo_name):
    from pipeline import APPOConfig

    cls = PPOConfig if algo_name == "PPO" else APPOConfig
    c = (cls().environment("CartPole-v1")
         .env_runners(num_env_runners=2, num_envs_per_env_runner=4, env_to_module_connector=stack4)
         .training(train_batch_size_per_learner=500, minibatch_size=100).debugging(seed=0))
    algo = c.build(logdir=None)
    try:
        assert algo.observation_space.shape == (16,) and algo.chunk_observation_space.shape == (4,)
        trained = 0
        while trained < 3000:
            result = algo.train()
            trained = result["num_env_steps_trained_lifetime"]
            learner = result["learners"]["default_policy"]
            assert learner.get("num_batches_refused", 0) == 0
        stream = result.get("stream", {})
        assert stream.get("num_chunks_dropped_invalid", 0) == 0
        with pytest.raises(ValueError, match="stacked observations"):
            algo.compute_single_action(np.zeros(4, np.float32))
    finally:
        algo.stop()


def test_a_stacked_step_ships_as_one_frame():
    """Chunks of a stacking runner store one frame per step; on the wire the stacks cost only each chunk's
    look-back rows (3 here), not 4 frames per step."""
    import dataclasses

    settings = EnvRunnerSettings(env_creator=lambda ctx: gym.make("CartPole-v1"), num_envs=4,
                                 rollout_fragment_length=64, seed=0, env_to_module=stack4)
    runner = EnvRunner(settings)
    chunks = runner.sample() + runner.sample()
    runner.stop()
    frame_bytes = 4 * 4  # CartPole: 4 float32
    assert all(c.obs.nbytes == (len(c) + 1) * frame_bytes for c in chunks)
    shipped = len(encode(chunks, compress=False))
    without_look_back = len(encode([dataclasses.replace(c, look_back=None) for c in chunks], compress=False))
    per_chunk = (shipped - without_look_back) / len(chunks)
    assert 3 * frame_bytes <= per_chunk <= 3 * frame_bytes + 128  # the rows and one array's framing
    stacked = [dataclasses.replace(c, obs=FrameStackingEnvToModule(num_frames=4).view_of(c.obs, c.look_back),
                                   look_back=None) for c in chunks]
    assert len(encode(stacked, compress=False)) > shipped + 2 * sum(len(c) for c in chunks) * frame_bytes


# --- learning: the filter makes a badly scaled task learnable --------------------------------------
def _scaled_run(filtered: bool, budget: int) -> tuple[float, int]:
    from pipeline.connectors import mean_std_filter
    from tests.envs import ScaledCartPole
    from tests.helpers import train_until

    algo = (PPOConfig().environment(ScaledCartPole)
            .env_runners(num_env_runners=0, num_envs_per_env_runner=8,
                         env_to_module_connector=mean_std_filter if filtered else None)
            .debugging(seed=0).build(logdir=None))
    try:
        best, result = train_until(algo, 450, budget)
    finally:
        algo.stop()
    return best, result["num_env_steps_sampled_lifetime"]


@pytest.mark.learning
def test_mean_std_filter_learns_a_badly_scaled_cartpole_that_raw_observations_do_not():
    """Observations shifted by hundreds and scaled up to 400x (tests.envs.ScaledCartPole): PPO's defaults reach
    450 with the filter (seed 0: 114k steps), and stay far below without it (seed 0: 109 after 300k)."""
    best, steps = _scaled_run(True, 400_000)
    assert best >= 450, f"with the filter: {best} after {steps} steps"
    best, steps = _scaled_run(False, 150_000)
    assert best < 250, f"without the filter PPO learned the scaled task anyway ({best} after {steps} steps)"
