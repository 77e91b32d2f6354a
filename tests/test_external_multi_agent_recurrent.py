"""Recurrent modules behind a multi-agent policy server: the server acts for its clients (remote inference) and
records their episodes, so it keeps each agent's LSTM state itself -- zeros when the agent joins, carried from
action to action -- and cuts that agent's chunks into ``max_seq_len`` sequences, each with the state its first
step acted from (``state_in``), as a multi-agent runner does. Stateless modules of the same run are untouched."""
from __future__ import annotations

import multiprocessing
from typing import Any, Callable

import gymnasium as gym
import numpy as np
import pytest
import torch

from actors.env.multi_agent_env import make_multi_agent
from actors.env.settings import EnvRunnerSettings
from actors.external.policy_server import PolicyServer
from actors.external.settings import ExternalSettings
from actors.modules import ModuleSpec
from protocols.client import PolicyClient
from protocols.client_multi_agent import run_multi_agent_env
from tests.pieces import by_str_or_int_agent
from tests.test_external import free_port
from tests.test_external_multi_agent import play_cartpoles

CARTPOLE = gym.make("CartPole-v1")
CELL, SEQ = 8, 7


def recurrent_server(tmp_path) -> PolicyServer:
    settings = EnvRunnerSettings(env_creator=None, observation_space=CARTPOLE.observation_space,
                                 action_space=CARTPOLE.action_space, seed=0)
    lstm = {"fcnet_hiddens": [8], "use_lstm": True, "lstm_cell_size": CELL, "max_seq_len": SEQ}
    specs = {"p0": ModuleSpec(CARTPOLE.observation_space, CARTPOLE.action_space, lstm),
             "p1": ModuleSpec(CARTPOLE.observation_space, CARTPOLE.action_space, {"fcnet_hiddens": [8]})}
    external = ExternalSettings(address=f"tcp://127.0.0.1:{free_port()}", journal_dir=str(tmp_path / "journal"),
                                fragment_length=20, sample_wait_s=0.5)
    return PolicyServer(settings, 0, external=external, module_specs=specs, policy_mapping_fn=by_str_or_int_agent)


def test_the_server_keeps_each_agents_state_and_cuts_sequences_a_learner_unrolls(tmp_path):
    server = recurrent_server(tmp_path)
    try:
        with PolicyClient(server.address, timeout_s=30) as client:
            assert client.multi_agent  # remote inference: the server acts, with its own record of the states
            run_multi_agent_env(client, make_multi_agent("CartPole-v1")({"num_agents": 2}), num_episodes=4, seed=0)
        chunks = server.sample(10_000)
        module = server.policies["p0"].module
    finally:
        server.stop()
    p0 = [c for c in chunks if c.module_id == "p0"]
    assert p0 and all(c.state_in is None for c in chunks if c.module_id == "p1")
    assert all(c.state_in.shape == (2, CELL) and c.state_in.dtype == np.float32 and len(c) <= SEQ for c in p0)
    assert any(len(c) == SEQ for c in p0) and "state_in" not in p0[0].extra
    by_episode: dict[str, list] = {}
    for c in p0:
        by_episode.setdefault(c.episode_id, []).append(c)
    assert len(by_episode) == 4
    for pieces in by_episode.values():
        pieces.sort(key=lambda c: c.chunk_index)
        assert [c.chunk_index for c in pieces] == list(range(len(pieces))) and pieces[-1].is_done
        assert not pieces[0].state_in.any()  # the agent joined: zeros
        state = torch.from_numpy(pieces[0].state_in)[None]
        for c in pieces:  # the module unrolled from each piece's state_in gives what the server acted with
            np.testing.assert_allclose(c.state_in, state[0].numpy(), atol=1e-5)
            with torch.no_grad():
                out = module.forward_sequences(torch.from_numpy(c.obs[:-1])[None], state)
                dist = out["action_dist_inputs"][0].numpy()
                for t in range(len(c)):  # the state after each step, one step at a time
                    state = module.forward_inference(torch.from_numpy(c.obs[t : t + 1]), state)["state_out"]
            np.testing.assert_allclose(dist, c.extra["action_dist_inputs"], rtol=1e-4, atol=1e-5)


def lstm_config(address: str, **training):
    from pipeline import PPOConfig
    from tests.test_multi_agent_recurrent import TwoAgents

    training = {"train_batch_size_per_learner": 400, "minibatch_size": 100, "num_epochs": 2} | training
    return (PPOConfig().environment(TwoAgents, env_config={"num_agents": 2})
            .multi_agent(policies={"p0", "p1"}, policy_mapping_fn=by_str_or_int_agent)
            .rl_module(model_config={"use_lstm": True, "lstm_cell_size": CELL, "max_seq_len": SEQ,
                                     "fcnet_hiddens": [16]})
            .env_runners(num_env_runners=0).external_clients(address=address, journal_dir="")
            .training(**training).debugging(seed=0))


def train_with_clients(algo: Any, address: str, until: Callable[[dict], bool], clients: int = 1) -> dict:
    ctx = multiprocessing.get_context("spawn")
    stop = ctx.Event()
    players = [ctx.Process(target=play_cartpoles, args=(address, stop, i, True), daemon=True) for i in range(clients)]
    for p in players:
        p.start()
    try:
        result: dict = {}
        while not until(result):
            result = algo.train()
        return result
    finally:
        stop.set()
        for p in players:
            p.kill()
            p.join()


@pytest.mark.slow
def test_ppo_trains_recurrent_modules_from_a_multi_agent_client():
    address = f"tcp://127.0.0.1:{free_port()}"
    algo = lstm_config(address).build(logdir=None)
    try:
        result = train_with_clients(algo, address, lambda r: r.get("training_iteration", 0) >= 2)
        for m in ("p0", "p1"):
            learner = result["learners"][m]
            assert np.isfinite(learner["total_loss"]) and learner["num_module_steps_trained"] > 0
    finally:
        algo.stop()


@pytest.mark.long
def test_two_recurrent_policies_learn_stateless_cartpole_from_a_multi_agent_client():
    """PPO with two LSTM policies (the in-runner test's settings but the observation filter, which external
    clients do not run) from two client processes on two-agent Stateless CartPole: a summed return of 400
    (random play: ~40) within 1M env steps -- which needs each agent's state carried right by the server."""
    address = f"tcp://127.0.0.1:{free_port()}"
    algo = (lstm_config(address, train_batch_size_per_learner=2000, minibatch_size=500, lr=3e-4, num_epochs=6,
                        vf_loss_coeff=0.05)
            .rl_module(model_config={"use_lstm": True, "lstm_cell_size": 64, "max_seq_len": 20, "fcnet_hiddens": [64]})
            .reporting(metrics_num_episodes_for_smoothing=20).build(logdir=None))
    best = [float("-inf")]

    def done(r: dict) -> bool:
        best[0] = max(best[0], r.get("env_runners", {}).get("episode_return_mean") or float("-inf"))
        return best[0] >= 400 or r.get("num_env_steps_sampled_lifetime", 0) >= 1_000_000

    try:
        result = train_with_clients(algo, address, done, clients=2)
    finally:
        algo.stop()
    print(f"summed return {best[0]:.0f} after {result['num_env_steps_sampled_lifetime']} env steps")
    assert best[0] >= 400, f"summed return {best[0]} after {result['num_env_steps_sampled_lifetime']} env steps"
