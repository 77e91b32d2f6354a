"""Double-buffered sampling under central inference (``actors/env/split_sampling.py``): a runner keeps a request
out per half of its sub-envs (lanes), each answered with its own rows' actions, through its own shared-memory
segment; a vector env steps half its sub-envs as it steps all of them; a runner sampling deterministically
gets the same chunks double-buffered as one request at a time; seeded runs repeat exactly; what the loop
cannot split falls back to stepping every sub-env at once. (A server killed under a double-buffered runner:
``tests/test_central_inference.py``.)"""
import os
import types

import gymnasium as gym
import numpy as np
import pytest
import torch

from actors.env import EnvRunnerSettings
from actors.env.split_sampling import split_problem
from actors.env.vector_env import SyncVectorEnv
from actors.inference.client import RemoteActing
from actors.inference.directory import InferenceDirectory
from actors.inference.server import InferenceServer
from actors.inference.settings import InferenceClientSettings, InferenceSettings
from actors.modules import ActorCriticModule
from pipeline import PPOConfig
from protocols import inference as wire
from protocols.errors import ProtocolError

ACT = gym.spaces.Discrete(3)


def serve(obs_space):
    settings = EnvRunnerSettings(env_creator=None, observation_space=obs_space, action_space=ACT,
                                 model_config={"fcnet_hiddens": [8]})
    server = InferenceServer(settings, InferenceSettings("central"))
    directory = InferenceDirectory()
    directory.publish(0, server.address())
    torch.manual_seed(0)
    w = ActorCriticModule(obs_space, ACT, {"fcnet_hiddens": [8]}, inference_only=True).get_state()
    server.set_weights(w, 3)
    return server, directory, w


def logits(obs_space, w, obs):
    module = ActorCriticModule(obs_space, ACT, {"fcnet_hiddens": [8]}, inference_only=True)
    module.set_state(w)
    with torch.no_grad():
        return module.forward_inference(torch.as_tensor(obs))["action_dist_inputs"].numpy()


@pytest.mark.parametrize("features", [4, 8192])  # inline frames; 32 kB rows: through shared memory
def test_two_requests_out_each_answered_with_its_own_rows(features):
    space = gym.spaces.Box(-1, 1, (features,), np.float32)
    server, directory, w = serve(space)
    client = RemoteActing(InferenceClientSettings(1, directory, double_buffer=True), 1)
    try:
        assert len(client.lanes) == 2
        rng = np.random.default_rng(0)
        for step in range(3):
            halves = [rng.uniform(-1, 1, (n, features)).astype(np.float32) for n in (2, 3)]
            for lane, obs in enumerate(halves):
                client.send(lane, obs, False, step)
            for lane in (1, 0):  # the second half's answer first: the first half's is kept meanwhile
                actions, _, dist_inputs, version = client.receive(lane)
                np.testing.assert_allclose(dist_inputs, logits(space, w, halves[lane]), rtol=1e-5, atol=1e-6)
                np.testing.assert_array_equal(actions, dist_inputs.argmax(1))
                assert version == 3
        # get_metrics waits for a batch in progress: its counts are complete once the last answer was read
        exported = server.get_metrics()
        counts = {k: exported[f"inference/{k}"]["value"] for k in ("num_requests", "num_actions", "num_bad_requests",
                                                                   "num_shm_requests")}
        assert counts["num_requests"] == 6 and counts["num_actions"] == 15 and counts["num_bad_requests"] == 0
        if features == 8192:  # each lane through its own segment, each name gone once answered
            assert counts["num_shm_requests"] == 6
            paths = [lane.segment.path for lane in client.lanes]
            assert len(set(paths)) == 2 and not any(os.path.exists(p) for p in paths)
        else:
            assert counts["num_shm_requests"] == 0
    finally:
        client.close()
        server.stop()


def test_a_request_abandoned_midway_is_superseded():
    """A sampling run that raised left a request out: the lane's next request replaces it, and the late answer
    to the old one is dropped rather than taken for the new one's."""
    space = gym.spaces.Box(-1, 1, (4,), np.float32)
    server, directory, w = serve(space)
    client = RemoteActing(InferenceClientSettings(1, directory, double_buffer=True), 1)
    try:
        old, new = np.full((2, 4), 0.9, np.float32), np.full((2, 4), -0.9, np.float32)
        client.send(0, old, False, 0)
        client.send(0, new, False, 1)
        _, _, dist_inputs, _ = client.receive(0)
        np.testing.assert_allclose(dist_inputs, logits(space, w, new), rtol=1e-5, atol=1e-6)
    finally:
        client.close()
        server.stop()


def test_the_protocol_carries_a_lane_and_refuses_a_bad_one():
    obs = np.zeros((2, 4), np.float32)
    assert wire.read_request(wire.act_request(1, 2, obs, True, 0)).lane == 0
    assert wire.read_request(wire.act_request(1, 2, obs, True, 0, lane=1)).lane == 1
    for lane in (wire.MAX_LANES, -1, True, "1"):
        frame = wire.encode({"op": "act", "runner": 1, "seq": 2, "explore": True, "timestep": 0, "obs": obs,
                             "lane": lane}, compress=False)
        with pytest.raises(ProtocolError, match="'lane' must be an int in"):
            wire.read_request(frame)


def test_stepping_halves_is_stepping_all():
    """The same seeded sub-envs stepped whole or as two halves in turn: the same observations, rewards, ends
    and final observations (indexed by sub-env)."""
    def make():
        env = SyncVectorEnv(lambda ctx: gym.make("CartPole-v1"), {}, 5, 1, 1, seed=4, restart_failed=False)
        return env, env.reset()

    (whole, a), (halves, b) = make(), make()
    np.testing.assert_array_equal(a, b)
    rng = np.random.default_rng(1)
    ended = 0
    for _ in range(60):
        actions = rng.integers(0, 2, 5)
        r = whole.step(actions)
        h0, h1 = halves.step_rows(0, 2, actions[:2]), halves.step_rows(2, 5, actions[2:])
        np.testing.assert_array_equal(r.obs, np.concatenate([h0.obs, h1.obs]))
        np.testing.assert_array_equal(r.rewards, np.concatenate([h0.rewards, h1.rewards]))
        np.testing.assert_array_equal(r.terminated, np.concatenate([h0.terminated, h1.terminated]))
        assert r.final_obs.keys() == {**h0.final_obs, **h1.final_obs}.keys()
        for i, o in r.final_obs.items():
            np.testing.assert_array_equal(o, {**h0.final_obs, **h1.final_obs}[i])
        ended += len(r.final_obs)
    assert ended > 0  # episodes ended (and reset) within a half


# --- a runner in the driver's process, servers as threads -------------------------------------------------
def central(double_buffer, seed=0, envs=4, **runner_kw):
    return (PPOConfig().environment("CartPole-v1")
            .env_runners(num_env_runners=0, num_envs_per_env_runner=envs, gym_env_vectorize_mode="sync",
                         rollout_fragment_length=20, **runner_kw)
            .inference(mode="central", double_buffer=double_buffer).debugging(seed=seed))


def chunks_of(config, calls=3, explore=True):
    algo = config.build(logdir=None)
    try:
        runner = algo.env_runner_group.local
        out = [c for _ in range(calls) for c in runner.sample(explore=explore)]
        buffered = runner.sampler.double_buffered()
        served = algo.env_runner_group.inference.manager.foreach_actor("get_metrics")[0].value
        return out, buffered, served["inference/num_requests"]["value"]
    finally:
        algo.stop()


def test_deterministic_sampling_is_the_same_double_buffered_or_not():
    """explore=False (the policy's argmax): the same chunks -- observations, actions, rewards, episode
    boundaries -- from a runner that double-buffers (two requests a step) as from one that does not (one)."""
    split, buffered, split_requests = chunks_of(central(True), explore=False)
    whole, single, whole_requests = chunks_of(central(False), explore=False)
    assert buffered and not single
    assert split_requests == 2 * whole_requests == 2 * 3 * 20
    assert len(split) == len(whole) > 4
    for a, b in zip(sorted(split, key=lambda c: (c.env_index, c.chunk_index, len(c))),
                    sorted(whole, key=lambda c: (c.env_index, c.chunk_index, len(c)))):
        assert (a.env_index, a.chunk_index, len(a), a.terminated, a.truncated) == (
            b.env_index, b.chunk_index, len(b), b.terminated, b.truncated)
        np.testing.assert_array_equal(a.obs, b.obs)
        np.testing.assert_array_equal(a.actions, b.actions)
        np.testing.assert_array_equal(a.rewards, b.rewards)
        np.testing.assert_allclose(a.extra["action_dist_inputs"], b.extra["action_dist_inputs"], rtol=1e-5,
                                   atol=1e-6)


def test_seeded_double_buffered_runs_repeat_exactly():
    first, buffered, _ = chunks_of(central(True, seed=5))
    again, _, _ = chunks_of(central(True, seed=5))
    assert buffered and len(first) == len(again) > 4
    for a, b in zip(first, again):
        assert (a.env_index, a.chunk_index, len(a)) == (b.env_index, b.chunk_index, len(b))
        np.testing.assert_array_equal(a.actions, b.actions)
        np.testing.assert_array_equal(a.obs, b.obs)
        # the forward pass may run with another number of torch threads (set by earlier tests): last bits differ
        np.testing.assert_allclose(a.extra["action_logp"], b.extra["action_logp"], rtol=1e-5, atol=1e-6)
    assert len({int(x) for c in first for x in c.actions}) == 2  # sampled, not argmax: the draws matter


def test_what_cannot_be_split_steps_every_sub_env_at_once():
    """One sub-env, or a connector pipeline, kept infos, a recurrent module: the runner samples one request a step,
    and chunks come out as usual."""
    chunks, buffered, requests = chunks_of(central(True, envs=1), calls=2)
    assert not buffered and requests == 2 * 20 and sum(len(c) for c in chunks) == 40
    acting = types.SimpleNamespace(lanes=[0, 1], recurrent=False)
    env = SyncVectorEnv(lambda ctx: gym.make("CartPole-v1"), {}, 2, 1, 1, seed=None, restart_failed=False)
    fine = dict(acting=acting, env=env, num_envs=2, connector=None, module_to_env=None, hooks=None,
                with_infos=False)
    assert split_problem(types.SimpleNamespace(**fine)) is None
    for change, reason in [({"acting": types.SimpleNamespace(lanes=[0])}, "one request out at a time"),
                           ({"env": object()}, "steps all its sub-envs at once"),
                           ({"connector": object()}, "a connector pipeline"),
                           ({"with_infos": True}, "kept infos"),
                           ({"acting": types.SimpleNamespace(lanes=[0, 1], recurrent=True)}, "a recurrent module")]:
        assert reason in split_problem(types.SimpleNamespace(**{**fine, **change}))
    env.close()
