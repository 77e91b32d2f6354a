"""Recurrent modules (``use_lstm``) under central inference: the runners keep their sub-envs' states and send them
with each request, the server steps its LSTM from them and answers the next ones (it keeps none itself, so a
restarted server serves on). In-process: the server's answers equal the module stepped by hand, and requests
whose states do not fit are refused. With Ray: the same seeds and weights give the same actions, log-probabilities
and chunk states with central and with local inference, and PPO trains."""
import gymnasium as gym
import numpy as np
import pytest
import torch

from actors.env import EnvRunnerSettings
from actors.inference.client import RemoteActing
from actors.inference.directory import InferenceDirectory
from actors.inference.server import InferenceServer
from actors.inference.settings import InferenceClientSettings, InferenceSettings
from actors.metrics import MetricsLogger
from actors.modules import ActorCriticModule
from pipeline import PPOConfig
from protocols import inference as wire
from protocols.codec import decode
from protocols.errors import ProtocolError
from tests.envs import StatelessCartPole

OBS, ACT = gym.spaces.Box(-1, 1, (2,), np.float32), gym.spaces.Discrete(2)
CELL = 8
MODEL = {"use_lstm": True, "lstm_cell_size": CELL, "max_seq_len": 10, "fcnet_hiddens": [16]}


@pytest.fixture
def served():
    server = InferenceServer(EnvRunnerSettings(env_creator=None, observation_space=OBS, action_space=ACT,
                                               model_config=dict(MODEL), seed=0), InferenceSettings("central"))
    directory = InferenceDirectory()
    directory.publish(0, server.address())
    clients = []

    def client(worker_index: int, state_size: int | None = CELL) -> RemoteActing:
        clients.append(RemoteActing(InferenceClientSettings(1, directory, state_size=state_size), worker_index))
        return clients[-1]

    yield server, client
    for c in clients:
        c.close()
    server.stop()


def test_the_server_steps_each_runners_states_as_the_module_does(served):
    server, client = served
    torch.manual_seed(5)
    module = ActorCriticModule(OBS, ACT, dict(MODEL), inference_only=True)
    server.set_weights(module.get_state(), 1)
    runners = [client(1), client(2)]
    rng = np.random.default_rng(0)
    by_hand = [torch.zeros(3, 2, CELL), torch.zeros(3, 2, CELL)]
    for step in range(12):
        for i, runner in enumerate(runners):
            obs = rng.uniform(-1, 1, (3, 2)).astype(np.float32)
            _, _, inputs, version = runner.act(obs, False, step)
            with torch.no_grad():
                out = module.forward_inference(torch.from_numpy(obs), by_hand[i])
            by_hand[i] = out["state_out"]
            assert version == 1
            np.testing.assert_allclose(inputs, out["action_dist_inputs"].numpy(), atol=1e-5)
            np.testing.assert_allclose(runner.state, by_hand[i].numpy(), atol=1e-5)
        if step == 5:  # an episode starts in sub-env 1 of runner 0: its state starts afresh, the others run on
            runners[0].reset_states([1])
            by_hand[0][1] = 0.0
    assert np.abs(runners[1].state).max() > 0
    saved = runners[0].get_state()
    runners[0].reset_states(None)
    runners[0].set_state(saved)  # a restored runner remembers on where it was
    np.testing.assert_array_equal(runners[0].state, saved["recurrent_state"])


def ask(server: InferenceServer, frame: bytes) -> dict:
    import zmq

    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.linger = 0
    sock.connect(server.address())
    try:
        sock.send(frame)
        assert sock.poll(10_000), "no answer"
        return decode(sock.recv(), limits=wire.LIMITS)
    finally:
        sock.close()
        ctx.term()


@pytest.mark.parametrize("state, message", [
    (None, "each request carries its rows' states"),
    (np.zeros((3, 2, CELL + 1), np.float32), "lstm_cell_size=8"),
    (np.zeros((2, 2, CELL), np.float32), r"float32 array \[3, 2, cell\]"),
    (np.zeros((3, 2, CELL), np.float64), "must be a float32 array"),
    (np.full((3, 2, CELL), np.nan, np.float32), "NaN"),
])
def test_requests_whose_states_do_not_fit_are_refused_and_serving_goes_on(served, state, message):
    import re

    server, client = served
    obs = np.zeros((3, 2), np.float32)
    reply = ask(server, wire.act_request(9, 1, obs, True, 0, state=state))
    assert reply["op"] == "error" and reply["code"] == "bad_request" and re.search(message, reply["message"]), reply
    actions, logp, inputs, _ = client(1).act(obs, True, 0)  # the server serves on
    assert actions.shape == (3,) and np.isfinite(logp).all()


def test_a_plain_module_refuses_states():
    server = InferenceServer(EnvRunnerSettings(env_creator=None, observation_space=OBS, action_space=ACT,
                                               model_config={"fcnet_hiddens": [16]}), InferenceSettings("central"))
    try:
        reply = ask(server, wire.act_request(9, 1, np.zeros((3, 2), np.float32), True, 0,
                                             state=np.zeros((3, 2, CELL), np.float32)))
        assert reply["code"] == "bad_request" and "not recurrent" in reply["message"]
    finally:
        server.stop()


def test_a_reply_without_states_is_an_error_for_a_recurrent_runner():
    frame = wire.actions_reply(1, 0, np.zeros(3, np.int64), np.zeros(3, np.float32), np.zeros((3, 2), np.float32))
    assert wire.read_reply(frame).state_out is None
    bad = wire.actions_reply(1, 0, np.zeros(3, np.int64), np.zeros(3, np.float32), np.zeros((3, 2), np.float32),
                             np.zeros((2, 2, CELL), np.float32))
    with pytest.raises(ProtocolError, match="state_out"):
        wire.read_reply(bad)


def stateless(runners: int = 2, seed: int = 3):
    return (PPOConfig().environment(StatelessCartPole)
            .env_runners(num_env_runners=runners, num_envs_per_env_runner=3, rollout_fragment_length=25)
            .rl_module(model_config=dict(MODEL)).debugging(seed=seed))


@pytest.mark.slow
def test_same_seed_and_weights_give_the_same_actions_and_states_with_central_and_local_inference(ray_cluster):
    def sample_twice(config):
        algo = config.build(logdir=None)
        try:
            return [c for _ in range(2) for c in algo.env_runner_group.sample(300, MetricsLogger())]
        finally:
            algo.stop()

    local = sample_twice(stateless())
    central = sample_twice(stateless().inference(mode="central"))
    assert len(local) == len(central) > 8
    for a, b in zip(local, central):
        assert (a.env_runner_index, a.env_index, a.chunk_index, len(a)) == (b.env_runner_index, b.env_index,
                                                                            b.chunk_index, len(b))
        np.testing.assert_array_equal(a.actions, b.actions)
        np.testing.assert_allclose(a.extra["action_logp"], b.extra["action_logp"], rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(a.state_in, b.state_in, atol=1e-5)
    assert any(np.abs(c.state_in).max() > 0 for c in central)  # states carried across chunks, not zeros
    assert len({int(a) for c in central for a in c.actions}) == 2


@pytest.mark.slow
def test_ppo_trains_a_recurrent_module_through_a_central_server(ray_cluster):
    algo = (stateless(seed=0).training(train_batch_size_per_learner=300, minibatch_size=100, num_epochs=2)
            .inference(mode="central").build(logdir=None))
    try:
        from tests.inference_probes import torch_loaded

        assert algo.foreach_env_runner(torch_loaded, local_env_runner=False) == [False, False]  # thin runners
        for _ in range(3):
            result = algo.train()
        learner = result["learners"]["default_policy"]
        assert np.isfinite(learner["total_loss"]) and learner["num_module_steps_trained"] > 0
        assert result["num_env_steps_sampled_lifetime"] >= 900
    finally:
        algo.stop()
