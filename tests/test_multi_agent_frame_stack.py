"""Frame stacking in multi-agent runs: each agent acts on a stack of its own observations, its chunks store
one frame per step plus the look-back rows, and its module's learner rebuilds exactly what the module saw.

``TurnTaking`` agents act in turns ("b" joins one env step late) and observe ``[agent index, env step]``, so
a stack says whose frames it holds and from which steps.
"""
from __future__ import annotations

from typing import Any

import gymnasium as gym
import numpy as np
import pytest
import torch

from actors.connectors import FrameStackingEnvToModule, MeanStdFilter
from actors.env.multi_agent_sampler import MultiAgentSampler
from pipeline import APPOConfig, DQNConfig, PPOConfig
from protocols.multi_agent_episode import MultiAgentEpisode
from tests.envs import PlainAndScaledCartPoles
from tests.test_multi_agent_offpolicy import EPISODE_STEPS, TurnTaking
from tests.pieces import by_agent, stack3

FRAMES = 3


def turn_taking(config_cls: type = PPOConfig, fragment: int = 3) -> Any:
    return (config_cls().environment(TurnTaking)
            .env_runners(num_env_runners=0, num_envs_per_env_runner=2, rollout_fragment_length=fragment,
                         env_to_module_connector=stack3)
            .multi_agent(policies={"pa", "pb"}, policy_mapping_fn=by_agent)
            .training(train_batch_size_per_learner=64, minibatch_size=32, num_epochs=1).debugging(seed=0))


def expected_stacks(frames: np.ndarray) -> np.ndarray:
    """Row t: frames t-2, t-1, t side by side, the first frame standing in before the agent's first."""
    padded = np.concatenate([np.repeat(frames[:1], FRAMES - 1, axis=0), frames])
    return np.concatenate([padded[i: i + len(frames)] for i in range(FRAMES)], axis=-1)


# --- the episode ----------------------------------------------------------------------------------
def test_an_episode_hands_each_agent_its_own_rows_before_every_chunk():
    ep = MultiAgentEpisode(by_agent, look_back={"pa": 2})  # "pb" has no view: its chunks carry nothing
    frame = {aid: [] for aid in "ab"}

    def obs(aid: str, t: int) -> np.ndarray:
        frame[aid].append(np.array([ord(aid), t], np.float32))
        return frame[aid][-1]

    ep.add_reset({"a": obs("a", 0), "b": obs("b", 0)})
    assert [r.tolist() for r in ep.recent_rows("a")] == [[97, 0]] * 3  # the first frame fills the stack
    assert [r.tolist() for r in ep.recent_rows("b")] == [[98, 0]]
    for t in range(1, 6):
        ep.add_actions({aid: 0 for aid in ep.agents_to_act()})
        ep.add_step({"a": obs("a", t), "b": obs("b", t)} if t % 2 else {"a": obs("a", t)},
                    {"a": 1.0, "b": 1.0} if t % 2 else {"a": 1.0, "b": 0.0}, {"__all__": False}, {"__all__": False})
        if t in (2, 3):  # chunks of one and two steps: the look-back spans the cuts
            ep.cut()
    assert [r[1] for r in ep.recent_rows("a")] == [3, 4, 5]
    ep.cut()
    chunks = ep.take_chunks()
    a_chunks = chunks["pa"]
    assert [len(c) for c in a_chunks] == [2, 1, 2]
    seq = np.stack(frame["a"])
    for c in a_chunks:
        start = c.t_started
        want = np.stack([seq[max(start - k, 0)] for k in (2, 1)])
        np.testing.assert_array_equal(c.look_back, want)
        np.testing.assert_array_equal(c.obs, seq[start: start + len(c) + 1])  # one frame per row
    assert all(c.look_back is None for c in chunks["pb"])
    with pytest.raises(ValueError, match="look_back"):
        MultiAgentEpisode(by_agent, look_back={"pa": -1})


# --- runners and learners ---------------------------------------------------------------------------
def test_each_agent_acts_on_its_own_stack_and_its_learner_rebuilds_what_it_saw():
    algo = turn_taking().build(logdir=None)
    try:
        runner = algo.env_runner_group.local
        assert isinstance(runner.sampler, MultiAgentSampler)  # lockstep rows hold no per-agent look-back
        chunks = runner.sample(num_timesteps=40)
        views = {mid: algo.learner_group.local.learners[mid].observation_view for mid in ("pa", "pb")}
        by_episode: dict[str, list] = {}
        for c in chunks:
            by_episode.setdefault(c.episode_id, []).append(c)
        whole = 0
        for episode_chunks in by_episode.values():
            episode_chunks.sort(key=lambda c: c.chunk_index)
            if episode_chunks[0].chunk_index != 0:
                continue
            whole += 1
            mid = episode_chunks[0].module_id
            frames = np.concatenate([episode_chunks[0].obs] + [c.obs[1:] for c in episode_chunks[1:]])
            assert frames.shape[1:] == (2,) and (frames[:, 0] == (mid == "pb")).all()  # one frame per step, its own
            stacks = expected_stacks(frames)
            module = algo.get_module(mid)
            for c in episode_chunks:
                assert c.look_back.shape == (FRAMES - 1, 2)
                rebuilt = views[mid].rebuild([c])[0].obs
                np.testing.assert_array_equal(rebuilt, stacks[c.t_started: c.t_started + len(c) + 1])
                with torch.no_grad():  # the runner's module (the learner's initial weights) acted on these rows
                    out = module.forward_inference(torch.from_numpy(rebuilt[:len(c)]))["action_dist_inputs"]
                np.testing.assert_allclose(out.numpy(), c.extra["action_dist_inputs"], rtol=1e-5, atol=1e-6)
        assert whole >= 4
        assert algo.get_module("pa").observation_space.shape == (2 * FRAMES,)
    finally:
        algo.stop()


@pytest.mark.parametrize("config_cls", [PPOConfig, APPOConfig], ids=["PPO", "APPO"])
def test_ppo_and_appo_learners_train_every_module_on_the_rebuilt_stacks(config_cls):
    config = (config_cls().environment(PlainAndScaledCartPoles)
              .env_runners(num_env_runners=0, num_envs_per_env_runner=2, rollout_fragment_length=16,
                           env_to_module_connector=lambda env: [MeanStdFilter(),
                                                                FrameStackingEnvToModule(num_frames=4)])
              .multi_agent(policies={"p0", "p1"}, policy_mapping_fn=by_agent)
              .rl_module(model_config={"fcnet_hiddens": [16]})
              .training(train_batch_size_per_learner=64, minibatch_size=32, num_epochs=1)
              .reporting(min_time_s_per_iteration=0.3).debugging(seed=0))
    algo = config.build(logdir=None)
    try:
        before = {mid: [p.detach().clone() for p in algo.get_module(mid).parameters()] for mid in ("p0", "p1")}
        while algo.weights_version < 3:
            result = algo.train()
        for mid in ("p0", "p1"):
            stats = result["learners"][mid]
            assert "num_batches_refused" not in stats, stats
            assert algo.get_module(mid).observation_space.shape == (16,)
            after = list(algo.get_module(mid).parameters())
            assert any(not torch.equal(a, b) for a, b in zip(before[mid], after)), mid
        if config_cls is APPOConfig:  # the driver's stream loader rebuilt each module's share
            assert algo.plan.receiver.num_chunks_without_look_back == 0
            assert algo.plan.receiver.stats()["num_chunks_dropped_invalid"] == 0
        with pytest.raises(ValueError, match="FrameStackingEnvToModule.*one observation"):
            algo.compute_single_action(np.zeros(4, np.float32), policy_id="p0")
    finally:
        algo.stop()


def test_dqn_buffers_store_each_agents_frames_once_and_draw_its_stacks():
    """Each module's replay buffer stores one frame per agent step and rebuilds the agent's stacks at the draw:
    "a" observes at env steps 0, 2, 4 .., "b" at 1, 3 .. (and both at the end)."""
    config = (DQNConfig().environment(TurnTaking)
              .env_runners(num_env_runners=0, num_envs_per_env_runner=2, rollout_fragment_length=4,
                           env_to_module_connector=stack3)
              .multi_agent(policies={"pa", "pb"}, policy_mapping_fn=by_agent)
              # sampling only in train(): one update round is made below, by hand
              .training(num_steps_sampled_before_learning_starts=40_000, train_batch_size_per_learner=16, n_step=(1, 3))
              .debugging(seed=0))
    algo = config.build(logdir=None)
    try:
        replay = algo.plan.multi.replay
        while min(len(replay.buffer(mid)) for mid in ("pa", "pb")) < 64:
            algo.train()
        assert algo.get_module("pa").observation_space.shape == (2 * FRAMES,)
        before = [p.detach().clone() for p in algo.get_module("pb").parameters()]
        algo.plan.multi.update_round(["pa", "pb"], timestep=0)  # both modules train on drawn stacks
        assert any(not torch.equal(a, b) for a, b in zip(before, algo.get_module("pb").parameters()))
        for mid, index in (("pa", 0), ("pb", 1)):
            buffer = algo.plan.multi.replay.buffer(mid)
            assert buffer.storage.obs[0].shape[1:] == (2,)  # one frame a row
            batch = buffer.sample(64)
            obs = batch["obs"].reshape(64, FRAMES, 2)
            nxt = batch["next_obs"].reshape(64, FRAMES, 2)
            assert (obs[..., 0] == index).all() and (nxt[..., 0] == index).all()  # the agent's own frames
            newest = obs[:, -1, 1]
            for k in range(FRAMES - 1):  # each frame its turn before the next, the first repeated before it
                np.testing.assert_array_equal(obs[:, k, 1], np.maximum(newest - 2 * (FRAMES - 1 - k), index))
            assert (np.diff(nxt[..., 1], axis=1) >= 0).all()
            np.testing.assert_array_equal(nxt[:, -1, 1], np.minimum(newest + 2 * batch["n_steps"], EPISODE_STEPS))
    finally:
        algo.stop()


def test_a_view_comes_last_in_each_modules_pipeline():
    from actors.connectors.multi_agent import ModuleConnectors

    space, act = gym.spaces.Box(-1.0, 1.0, (2,), np.float32), gym.spaces.Discrete(2)
    conns = ModuleConnectors.build(lambda env: [MeanStdFilter(), FrameStackingEnvToModule(num_frames=4)],
                                   {"a": (space, act)})
    assert conns.look_back == {"a": 3}
    assert conns.recorded_space("a") == gym.spaces.Box(-10.0, 10.0, (2,), np.float32)  # the filter's output
    assert conns.observation_space("a").shape == (8,)
    with pytest.raises(ValueError, match="put views last"):
        ModuleConnectors.build(lambda env: [FrameStackingEnvToModule(num_frames=4), MeanStdFilter()],
                               {"a": (space, act)})


@pytest.mark.slow
def test_ray_runners_stack_each_agents_frames_and_the_learners_train_on_them(ray_cluster):
    algo = turn_taking(fragment=8).env_runners(num_env_runners=1).build(logdir=None)
    try:
        shapes = algo.foreach_env_runner(
            lambda r: sorted({(c.module_id, c.obs.shape[1:], c.look_back.shape) for c in r.sample(num_timesteps=16)}))
        assert shapes[0] == [("pa", (2,), (FRAMES - 1, 2)), ("pb", (2,), (FRAMES - 1, 2))]
        while algo.weights_version < 2:
            result = algo.train()
        for mid in ("pa", "pb"):
            assert "num_batches_refused" not in result["learners"][mid], result["learners"][mid]
    finally:
        algo.stop()


def test_a_batch_of_agents_gets_the_stacks_one_agent_at_a_time_would():
    from actors.connectors import ConnectorV2

    piece = FrameStackingEnvToModule(num_frames=4)
    frames = np.random.default_rng(0).integers(0, 255, (5, 4, 6, 6, 1), dtype=np.uint8)
    batched = piece.view_rows(frames)
    assert batched.shape == (5, 6, 6, 4) and batched.dtype == np.uint8
    np.testing.assert_array_equal(batched, ConnectorV2.view_rows(piece, frames))  # view_of, agent by agent
