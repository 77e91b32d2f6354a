"""Recurrent policies (``use_lstm``) with external clients: the clients act with the exported cell in local
inference, carry each episode's state, and every chunk they cut carries the state its first step acted from
(``state_in``), which the server checks and the learners unroll from (EXTERNAL.md 9.8)."""
from __future__ import annotations

import gymnasium as gym
import numpy as np
import pytest
import torch

from actors.env.settings import EnvRunnerSettings
from actors.external.policy_server import PolicyServer
from actors.external.settings import ExternalSettings
from actors.modules import ActorCriticModule
from actors.modules.q_module import QModule
from actors.modules.export import acting_plan, export_policy
from actors.env.exploration import StochasticSampling
from pipeline.algorithms.ppo.config import PPOConfig
from pipeline.config.checks import ConfigError
from protocols import external as wire
from protocols.client import PolicyClient, run_env
from protocols.episode import EpisodeChunk
from protocols.errors import ProtocolError
from protocols.numpy_policy import NumpyPolicy
from protocols.codec import encode
from tests.spec_client import SpecClient
from tests.test_external import free_port

CELL, SEQ = 8, 6
MODEL = {"use_lstm": True, "lstm_cell_size": CELL, "max_seq_len": SEQ}
CARTPOLE = gym.make("CartPole-v1")


def recurrent_server(tmp_path, **kwargs) -> PolicyServer:
    settings = EnvRunnerSettings(env_creator=None, observation_space=CARTPOLE.observation_space,
                                 action_space=CARTPOLE.action_space, model_config=dict(MODEL), seed=0)
    kwargs.setdefault("address", f"tcp://127.0.0.1:{free_port()}")
    kwargs.setdefault("journal_dir", str(tmp_path / "journal"))
    kwargs.setdefault("fragment_length", SEQ)
    kwargs.setdefault("sample_wait_s", 2.0)
    kwargs.setdefault("inference_mode", "local")
    return PolicyServer(settings, 0, external=ExternalSettings(**kwargs))


def module() -> ActorCriticModule:
    torch.manual_seed(3)
    return ActorCriticModule(CARTPOLE.observation_space, CARTPOLE.action_space, dict(MODEL), inference_only=True)


def q_module(dueling: bool) -> QModule:
    torch.manual_seed(4)
    return QModule(CARTPOLE.observation_space, CARTPOLE.action_space, dict(MODEL), inference_only=True,
                   dueling=dueling)


@pytest.mark.parametrize("make, head", [(module, "linear"), (lambda: q_module(False), "linear"),
                                        (lambda: q_module(True), "dueling")])
def test_the_numpy_cell_steps_as_the_torch_module_does(make, head):
    m = make()
    desc = export_policy(m)
    assert desc["version"] == 2 and [op["op"] for op in desc["layers"]][-2:] == ["lstm", head]
    policy = NumpyPolicy(desc)
    assert policy.recurrent
    rng = np.random.default_rng(0)
    state, t_state = policy.initial_state(5), torch.zeros(5, 2, CELL)
    for _ in range(25):
        obs = rng.normal(size=(5, 4)).astype(np.float32)
        inputs, state = policy.step(obs, state)
        with torch.no_grad():
            out = m.forward_inference(torch.from_numpy(obs), t_state)
        t_state = out["state_out"]
        np.testing.assert_allclose(inputs, out["action_dist_inputs"].numpy(), atol=1e-5)
        np.testing.assert_allclose(state, t_state.numpy(), atol=1e-5)
    # a policy without a cell stays version 1, which readers from before the cell read
    plain = ActorCriticModule(CARTPOLE.observation_space, CARTPOLE.action_space, {}, inference_only=True)
    assert export_policy(plain)["version"] == 1


def test_an_evaluator_written_from_the_spec_steps_as_runnel_does():
    """tests/spec_policy.py follows EXTERNAL.md 9.3's lstm op and 9.8 alone (float64): the same distribution
    inputs and states as the client's NumpyPolicy, step after step."""
    from tests.spec_policy import SpecPolicy

    desc = export_policy(module())
    spec, policy = SpecPolicy(desc), NumpyPolicy(desc)
    rng = np.random.default_rng(1)
    spec_state, state = None, policy.initial_state(3)
    for _ in range(20):
        obs = rng.normal(size=(3, 4)).astype(np.float32)
        want, state = policy.step(obs, state)
        got, spec_state = spec.step(list(obs), spec_state)
        np.testing.assert_allclose(got, want, atol=1e-5)
        np.testing.assert_allclose(spec_state, state, atol=1e-5)
    with pytest.raises(ValueError, match="version"):
        SpecPolicy({**desc, "version": 3})


def test_a_recurrent_policy_must_be_given_states_and_runners_get_its_sequence_length():
    m = module()
    policy = NumpyPolicy(export_policy(m))
    with pytest.raises(ValueError, match="recurrent: act with act_recurrent"):
        policy.dist_inputs(np.zeros((1, 4), np.float32))
    with pytest.raises(ValueError, match=r"float32 \(2, 2, 8\)"):
        policy.step(np.zeros((2, 4), np.float32), np.zeros((2, 8), np.float32))
    plan = acting_plan(m, StochasticSampling(m.dist_spec))  # runners act with it (tests/test_numpy_acting.py)
    assert plan["max_seq_len"] == SEQ and plan["policy"]["version"] == 2


@pytest.mark.parametrize("mend, message", [
    (lambda d: d.update(version=1), "the 'lstm' op is version 2's"),
    (lambda d: d["layers"].insert(-1, {**d["layers"][-2], "weight_ih": np.zeros((4 * CELL, CELL), np.float32)}),
     "at most one"),
    (lambda d: d["layers"][-2].update(weight_hh=np.zeros((4 * CELL, CELL + 1), np.float32)), "weight_hh has shape"),
    (lambda d: d["layers"][-2].update(weight_ih=np.zeros((30, 64), np.float32)), "4 x its cell size"),
    (lambda d: d["layers"][-2].update(bias_ih=np.zeros(4 * CELL, np.float64)), "bias_ih must be a float32"),
])
def test_hostile_cells_are_refused(mend, message):
    desc = export_policy(module())
    mend(desc)
    with pytest.raises(ProtocolError, match=message):
        NumpyPolicy(desc)


def unrolled(m: ActorCriticModule, chunks: list[EpisodeChunk]) -> tuple[list[np.ndarray], list[np.ndarray]]:
    """The torch module stepped over one episode's chunks from zeros: the state at each chunk's start and the
    log-probabilities of the actions taken."""
    starts, logps = [], []
    state = torch.zeros(1, 2, CELL)
    with torch.no_grad():
        for c in chunks:
            starts.append(state[0].numpy().copy())
            for t in range(len(c)):
                out = m.forward_inference(torch.from_numpy(c.obs[t:t + 1]), state)
                state = out["state_out"]
                dist = m.action_dist(out["action_dist_inputs"])
                logps.append(float(dist.logp(torch.as_tensor(c.actions[t:t + 1]))[0]))
    return starts, logps


def test_a_local_client_carries_the_state_across_chunks_and_the_server_keeps_it(tmp_path):
    server = recurrent_server(tmp_path)
    try:
        with PolicyClient(server.address, None, timeout_s=20) as client:
            returns = run_env(client, CARTPOLE, num_episodes=3, seed=0)
            steps = int(sum(returns))
            got = server.sample(steps)
            client.close(flush=False)  # committed only at the driver's next sample: not waited for here
        assert sum(len(c) for c in got) == steps
        assert all(len(c) <= SEQ for c in got)
        m = server.policy.module
        episodes = {c.episode_id for c in got}
        assert len(got) >= 2 * len(episodes)  # several chunks an episode: the state crosses their boundaries
        for eid in episodes:
            chunks = sorted((c for c in got if c.episode_id == eid), key=lambda c: c.chunk_index)
            starts, logps = unrolled(m, chunks)
            for chunk, start in zip(chunks, starts):
                assert chunk.state_in.shape == (2, CELL) and chunk.state_in.dtype == np.float32
                np.testing.assert_allclose(chunk.state_in, start, atol=1e-5)
            assert np.abs(chunks[-1].state_in).max() > 0  # not zeros: a real carried state
            recorded = np.concatenate([c.extra["action_logp"] for c in chunks])
            np.testing.assert_allclose(recorded, logps, atol=1e-4)  # the learner's ratio starts at 1
    finally:
        server.stop()


def hello(raw: SpecClient, mode: str) -> dict:
    return raw.request({"op": wire.HELLO, "protocol": wire.PROTOCOL, "version": 1, "inference_mode": mode})[0]


def send(raw: SpecClient, chunk: EpisodeChunk) -> dict:
    ids = [[chunk.episode_id, chunk.chunk_index]]
    return raw.request({"op": wire.CHUNKS, "ids": ids}, encode([chunk], compress=False))[0]


def test_remote_inference_is_refused_for_a_recurrent_policy(tmp_path):
    server = recurrent_server(tmp_path)
    raw = SpecClient(server.address)
    try:
        reply = hello(raw, "remote")
        assert reply["op"] == wire.ERROR and reply["code"] == wire.BAD_MODE and reply["fatal"]
        assert "recurrent" in reply["message"] and "'local'" in reply["message"]
        welcome = hello(raw, "")
        assert welcome["op"] == wire.WELCOME and welcome["inference_mode"] == "local"
        assert welcome["fragment_length"] == SEQ
    finally:
        raw.close()
        server.stop()


def chunk_with(state_in) -> EpisodeChunk:
    return EpisodeChunk(episode_id="e1", chunk_index=0, obs=np.zeros((3, 4), np.float32),
                        actions=np.zeros(2, np.int64), rewards=np.ones(2, np.float32), terminated=False,
                        truncated=False, extra={"action_logp": np.full(2, -0.69, np.float32),
                                                "action_dist_inputs": np.zeros((2, 2), np.float32)},
                        state_in=state_in)


@pytest.mark.parametrize("state_in, message", [
    (None, "state_in missing"),
    (np.zeros((2, CELL + 1), np.float32), "state_in of shape"),
    (np.full((2, CELL), 1.5, np.float32), "must lie in \\[-1, 1\\]"),
])
def test_the_server_refuses_chunks_without_a_fitting_state(tmp_path, state_in, message):
    server = recurrent_server(tmp_path)
    raw = SpecClient(server.address)
    try:
        assert hello(raw, "local")["op"] == wire.WELCOME
        reply = send(raw, chunk_with(state_in))
        assert reply["op"] == wire.ERROR and reply["code"] == wire.BAD_CHUNK, reply
        assert reply["field"] == "state_in" if "field" in reply else True
        import re
        assert re.search(message, reply["message"]), reply["message"]
        fine = np.zeros((2, CELL), np.float32)
        fine[1] = 3.0  # the cell state is unbounded; only the hidden half is an LSTM's output
        assert send(raw, chunk_with(fine))["op"] == wire.RECEIVED
    finally:
        raw.close()
        server.stop()


def test_a_plain_policy_refuses_chunks_that_carry_a_state(tmp_path):
    from tests.test_external import make_server

    server = make_server(tmp_path)
    raw = SpecClient(server.address)
    try:
        assert hello(raw, "remote")["op"] == wire.WELCOME
        reply = send(raw, chunk_with(np.zeros((2, 4), np.float32)))
        assert reply["op"] == wire.ERROR and reply["code"] == wire.BAD_CHUNK and "not recurrent" in reply["message"]
    finally:
        raw.close()
        server.stop()


def test_config_takes_local_inference_and_the_sequence_length_for_recurrent_clients(tmp_path):
    from pipeline.config.external import external_settings

    spaces = {"observation_space": CARTPOLE.observation_space, "action_space": CARTPOLE.action_space}
    config = (PPOConfig().environment(**spaces).env_runners(num_env_runners=0, rollout_fragment_length=50)
              .rl_module(model_config=dict(MODEL)).external_clients(address=f"tcp://127.0.0.1:{free_port()}"))
    x = external_settings(config)
    assert x.inference_mode == "local" and x.fragment_length == SEQ
    config.external_clients(address=f"tcp://127.0.0.1:{free_port()}", inference_mode="remote")
    with pytest.raises(ConfigError, match="inference_mode='local'"):
        config.build(logdir=None)


@pytest.mark.parametrize("algo_name", ["PPO", "DQN"])
def test_an_algorithm_trains_on_a_recurrent_local_client(tmp_path, algo_name):
    """End to end: the algorithm's own server, a client in this process, a few training iterations (DQN: R2D2's
    sequence replay of the client's chunks, epsilon-greedy in the client)."""
    import threading

    from pipeline import DQNConfig

    address = f"tcp://127.0.0.1:{free_port()}"
    spaces = {"observation_space": CARTPOLE.observation_space, "action_space": CARTPOLE.action_space}
    if algo_name == "PPO":
        config = PPOConfig().training(train_batch_size_per_learner=200, minibatch_size=50, num_epochs=2)
    else:
        config = DQNConfig().env_runners(rollout_fragment_length=SEQ).training(
            num_steps_sampled_before_learning_starts=200)
    algo = (config.environment(**spaces).env_runners(num_env_runners=0).rl_module(model_config=dict(MODEL))
            .external_clients(address=address, journal_dir=str(tmp_path / "j")).debugging(seed=0).build(logdir=None))
    stop = threading.Event()

    def play() -> None:  # never waits for commits: it stops as soon as the test is done
        with PolicyClient(address, None, timeout_s=60, throttle=False, spool_chunks=1_000_000) as client:
            episode = 0
            while not stop.is_set():
                run_env(client, gym.make("CartPole-v1"), num_episodes=1, seed=episode)
                episode += 1
            client.close(flush=False)

    player = threading.Thread(target=play, daemon=True)
    player.start()
    try:
        for _ in range(3):
            result = algo.train()
        learner = result["learners"]["default_policy"]
        assert result["num_env_steps_sampled_lifetime"] >= 400
        loss = learner["total_loss" if algo_name == "PPO" else "qf_loss"]
        assert np.isfinite(loss) and learner["num_module_steps_trained"] > 0
    finally:
        stop.set()
        player.join(timeout=60)
        algo.stop()
