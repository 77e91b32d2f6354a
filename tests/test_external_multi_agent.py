"""External clients play multi-agent episodes (EXTERNAL.md section 10): the wire's checks, the
episodes the server records from them, the Python client, and PPO training two policies from clients.

The server under test is a real ``PolicyServer`` on a loopback port, spoken to with raw msgpack
(``SpecClient``) where a test is about the wire and with ``PolicyClient`` where it is about the
client. Module ``p1`` observes a 2-number Box and ``p0`` CartPole's 4 numbers, so a check against
"the agent's module's space" is seen to pick the right space.
"""
from __future__ import annotations

import multiprocessing
import subprocess
import threading
import time
from typing import Any

import gymnasium as gym
import numpy as np
import pytest

from actors.env.multi_agent_runner_parts import chunks_by_module
from actors.env.settings import EnvRunnerSettings
from actors.external.policy_server import PolicyServer
from actors.external.settings import ExternalSettings
from actors.modules import ModuleSpec
from protocols import external as wire
from protocols.client import PolicyClient
from protocols.client_multi_agent import run_multi_agent_env
from protocols.external_agents import AgentError, agent_ids, done_flags, reward_pairs
from tests.spec_client import SpecClient
from tests.pieces import by_str_or_int_agent as by_agent
from tests.test_external import free_port

CARTPOLE = gym.make("CartPole-v1")
SMALL = gym.spaces.Box(-1.0, 1.0, (2,), np.float32)
O4 = [0.01, -0.02, 0.03, 0.04]
O2 = [0.5, -0.5]


def make_server(tmp_path, obs1: gym.Space = SMALL, **kwargs: Any) -> PolicyServer:
    settings = EnvRunnerSettings(env_creator=None, observation_space=CARTPOLE.observation_space,
                                 action_space=CARTPOLE.action_space)
    specs = {"p0": ModuleSpec(CARTPOLE.observation_space, CARTPOLE.action_space, {"fcnet_hiddens": [8]}),
             "p1": ModuleSpec(obs1, CARTPOLE.action_space, {"fcnet_hiddens": [8]})}
    kwargs = {"address": f"tcp://127.0.0.1:{free_port()}", "journal_dir": str(tmp_path / "journal"),
              "fragment_length": 5, "sample_wait_s": 0.5, **kwargs}
    return PolicyServer(settings, 0, external=ExternalSettings(**kwargs), module_specs=specs,
                        policy_mapping_fn=by_agent)


@pytest.fixture
def server(tmp_path):
    srv = make_server(tmp_path, max_agents=3)
    yield srv
    srv.stop()


@pytest.fixture
def spec(server):
    client = SpecClient(server.address)
    welcome, _ = client.request({"op": "hello", "protocol": wire.PROTOCOL, "version": 2, "inference_mode": ""})
    assert welcome["op"] == wire.WELCOME and welcome["multi_agent"] and welcome["version"] == 2
    assert sorted(welcome["modules"]) == ["p0", "p1"] and welcome["limits"]["max_agents"] == 3
    yield client
    client.close()


def ask(spec: SpecClient, op: str, **fields: Any) -> dict:
    return spec.request({"op": op, **fields})[0]


def started(spec: SpecClient, eid: str = "e") -> str:
    assert ask(spec, wire.MA_START, episode_id=eid)["op"] == wire.STARTED
    assert ask(spec, wire.MA_ACT, episode_id=eid, agents=[0, 1], obs=[O4, O2])["agents"] == [0, 1]
    return eid


def refused(reply: dict, code: str, agent: Any) -> None:
    assert reply["op"] == wire.ERROR and reply["code"] == code and not reply["fatal"], reply
    assert reply["agent_id"] == agent and (agent is None or repr(agent) in reply["message"]), reply


# --- agent lists, checked alike by server and client -------------------------------------------------
def test_agent_ids_are_str_or_int_each_once_and_never_all():
    assert agent_ids([0, "a", -5], 3) == [0, "a", -5]
    for bad, code in (([True], wire.BAD_AGENT), ([1.0], wire.BAD_AGENT), ([None], wire.BAD_AGENT),
                      (["x" * 65], wire.BAD_AGENT), (["\n"], wire.BAD_AGENT), (["__all__"], wire.BAD_AGENT),
                      ([1, 1], wire.BAD_AGENT), ([1, "1"], wire.BAD_AGENT), ([1 << 63], wire.BAD_AGENT),
                      ([0, 1, 2, 3], wire.TOO_MANY_AGENTS)):
        with pytest.raises(AgentError) as err:
            agent_ids(bad, 3)
        assert err.value.code == code, bad
    assert reward_pairs([[0, 1], ["a", 0.5]], 3) == {0: 1.0, "a": 0.5}
    with pytest.raises(AgentError):
        reward_pairs([[0, float("inf")]], 3)
    assert done_flags(["__all__", 2], 3, "terminated", allow_all=True) == ([2], True)
    with pytest.raises(AgentError):
        done_flags(["__all__"], 3, "terminated", allow_all=False)


# --- the server's refusals: each names the agent, records nothing, and the server serves on -------------
def test_a_bad_agent_id_is_answered_with_the_agent_and_the_episode_goes_on(server, spec):
    started(spec)
    for agents in ([True, 1], [0.5], ["x" * 80], [0, 0]):
        reply = ask(spec, wire.MA_ACT, episode_id="e", agents=agents, obs=[O4] * len(agents))
        assert reply["code"] == wire.BAD_AGENT and reply["episode_id"] == "e", reply
    reply = ask(spec, wire.MA_ACT, episode_id="e", agents=[0, 1], obs=[O4, O2], rewards=[[0, 1.0], [1, 1.0]])
    assert reply["op"] == wire.MA_ACTION and reply["agents"] == [0, 1]
    assert server.get_metrics()["external/num_protocol_errors"]["value"] == 0  # values, not malformed messages


def test_each_observation_is_checked_against_its_agents_module_space(server, spec):
    started(spec)
    refused(ask(spec, wire.MA_ACT, episode_id="e", agents=[0, 1], obs=[O4, O4]), wire.BAD_OBSERVATION, 1)
    refused(ask(spec, wire.MA_ACT, episode_id="e", agents=[0, 1], obs=[O2, O2]), wire.BAD_OBSERVATION, 0)
    reply = ask(spec, wire.MA_ACT, episode_id="e", agents=[0, 1], obs=[O4, [0.1, float("nan")]])
    refused(reply, wire.BAD_VALUE, 1)
    assert reply["field"] == "obs"
    assert ask(spec, wire.MA_ACT, episode_id="e", agents=[0, 1], obs=[O4, O2])["op"] == wire.MA_ACTION


def test_unknown_agents_too_many_agents_and_rewards_for_agents_that_never_acted_are_refused(server, spec):
    assert ask(spec, wire.MA_START, episode_id="e")["op"] == wire.STARTED
    refused(ask(spec, wire.MA_ACT, episode_id="e", agents=[0], obs=[O4], rewards=[[0, 1.0]]),
            wire.UNKNOWN_AGENT, 0)  # the reset: nobody acted yet
    reply = ask(spec, wire.MA_ACT, episode_id="e", agents=[0, 1, 2, 3], obs=[O4] * 4)
    assert reply["code"] == wire.TOO_MANY_AGENTS and reply["limit"] == 3
    refused(ask(spec, wire.MA_ACT, episode_id="e", agents=[7], obs=[O4]), wire.UNKNOWN_AGENT, 7)  # maps to "p7"
    assert ask(spec, wire.MA_ACT, episode_id="e", agents=[0], obs=[O4])["agents"] == [0]
    refused(ask(spec, wire.MA_ACT, episode_id="e", agents=[0], obs=[O4], rewards=[[1, 1.0]]), wire.UNKNOWN_AGENT, 1)
    refused(ask(spec, wire.MA_ACT, episode_id="e", agents=[0], obs=[O4], terminated=["b"]), wire.UNKNOWN_AGENT, "b")
    refused(ask(spec, wire.MA_ACT, episode_id="e", agents=[0, 1, "a", "b"], obs=[O4, O2, O4, O2]),
            wire.TOO_MANY_AGENTS, None)
    # joining agents count toward the episode's limit: 0 holds one place, 1 and "a" fill it
    assert ask(spec, wire.MA_ACT, episode_id="e", agents=[0, 1, "a"], obs=[O4, O2, O4],
               rewards=[[0, 1.0]])["agents"] == [0, 1, "a"]
    refused(ask(spec, wire.MA_ACT, episode_id="e", agents=["b"], obs=[O2]), wire.TOO_MANY_AGENTS, "b")
    reply = ask(spec, wire.MA_ACT, episode_id="e", agents=[0], obs=[O4], rewards=[[0, 1.0], [1, 2.0]],
                terminated=[0])
    assert reply["op"] == wire.MA_ACTION and reply["agents"] == []  # 0 finished; 1 and "a" wait for observations
    refused(ask(spec, wire.MA_ACT, episode_id="e", agents=[1], obs=[O2], rewards=[[0, 1.0]]), wire.UNKNOWN_AGENT, 0)
    assert ask(spec, wire.MA_END, episode_id="e", rewards=[[1, 1.0], ["a", 0.5]])["op"] == wire.ENDED
    assert server.get_metrics()["external/num_protocol_errors"]["value"] == 0


def test_a_connection_s_open_episodes_hold_a_bounded_number_of_agents(tmp_path):
    """Each agent may hold fragment_length steps before a cut: 20 pending steps / 5 = 4 agent places."""
    server = make_server(tmp_path, max_pending_steps=20, fragment_length=5)
    spec = SpecClient(server.address)
    try:
        spec.request({"op": "hello", "protocol": wire.PROTOCOL, "version": 2, "inference_mode": "remote"})
        started(spec, "e1")
        started(spec, "e2")
        assert ask(spec, wire.MA_START, episode_id="e3")["op"] == wire.STARTED  # no agent yet: holds nothing
        reply = ask(spec, wire.MA_ACT, episode_id="e3", agents=[0], obs=[O4])
        refused(reply, wire.TOO_MANY_AGENTS, 0)
        assert reply["limit"] == 4
        other = SpecClient(server.address)  # the bound is per connection
        other.request({"op": "hello", "protocol": wire.PROTOCOL, "version": 2, "inference_mode": "remote"})
        started(other, "e1")
        other.close()
        assert ask(spec, wire.MA_END, episode_id="e1")["op"] == wire.ENDED
        assert ask(spec, wire.MA_ACT, episode_id="e3", agents=[0], obs=[O4])["agents"] == [0]
    finally:
        spec.close()
        server.stop()


def test_the_episode_and_the_connection_rules(server, spec):
    reply = ask(spec, wire.MA_ACT, episode_id="nope", agents=[0], obs=[O4])
    assert reply["code"] == wire.UNKNOWN_EPISODE
    started(spec)
    for broken in ({"agents": [0, 1], "obs": [O4]}, {"agents": [0], "obs": [O4], "rewards": [[0]]},
                   {"agents": [0], "obs": [O4], "rewards": [[0, "x"]]}, {"agents": [], "obs": []}):
        assert ask(spec, wire.MA_ACT, episode_id="e", **broken)["code"] == wire.BAD_MESSAGE, broken
    assert ask(spec, wire.ACT, episode_id="e", obs=O4)["code"] == wire.BAD_MESSAGE  # single-agent ops: refused
    assert ask(spec, wire.WEIGHTS, have=-1)["code"] == wire.NOT_SUPPORTED
    reply, _ = spec.request({"op": wire.CHUNKS, "ids": [["e", 0]]}, b"not read")
    assert reply["code"] == wire.NOT_SUPPORTED and reply["ids"] == [["e", 0]]  # the server records episodes itself
    old = SpecClient(server.address)
    try:
        assert old.hello()["version"] == 1  # a version 1 client is served, without section 10
        assert ask(old, wire.MA_START, episode_id="e")["code"] == wire.BAD_MESSAGE
        reply = ask(old, wire.HELLO, protocol=wire.PROTOCOL, version=2, inference_mode="local")
        assert reply["code"] == wire.BAD_MODE and reply["fatal"]
    finally:
        old.close()
    assert ask(spec, wire.MA_ACT, episode_id="e", agents=[0, 1], obs=[O4, O2])["op"] == wire.MA_ACTION


def test_the_python_client_says_version_1_to_a_server_that_speaks_only_that(tmp_path, monkeypatch):
    from tests.test_external import make_server as make_single_agent_server

    monkeypatch.setattr(wire, "VERSIONS", (1,))  # a server from before version 2
    server = make_single_agent_server(tmp_path)
    try:
        client = PolicyClient(server.address, "remote", timeout_s=20)
        assert client.welcome["version"] == 1 and not client.multi_agent
        eid = client.start_episode()
        assert client.get_action(eid, O4) in (0, 1)
        client.end_episode(eid, O4)
        assert [len(c) for c in server.sample(1)] == [1]
        client.close(flush=False)
    finally:
        server.stop()


# --- what the server records ----------------------------------------------------------------------------
def test_the_server_records_per_agent_chunks_with_waiting_agents_and_hanging_rewards(tmp_path):
    server = make_server(tmp_path, obs1=CARTPOLE.observation_space)
    spec = SpecClient(server.address)
    try:
        spec.request({"op": "hello", "protocol": wire.PROTOCOL, "version": 2, "inference_mode": "remote"})
        ask(spec, wire.MA_START, episode_id="e")
        ask(spec, wire.MA_ACT, episode_id="e", agents=[0, 1], obs=[O4, O4])
        for _ in range(6):  # agent 1 waits, paid every step: one step of its own worth 6
            ask(spec, wire.MA_ACT, episode_id="e", agents=[0], obs=[O4], rewards=[[0, 1.0], [1, 1.0]])
        ask(spec, wire.MA_END, episode_id="e", agents=[0, 1], obs=[O4, O4], rewards=[[0, 1.0], [1, 0.5]],
            terminated=["__all__"])
        chunks = server.sample(1000)
        by_module = chunks_by_module(chunks)
        assert sorted(by_module) == ["p0", "p1"]
        zero, one = by_module["p0"], by_module["p1"]
        assert [len(c) for c in zero] == [5, 2] and [c.chunk_index for c in zero] == [0, 1]
        assert {c.agent_id for c in zero} == {"0"} and {c.agent_id for c in one} == {"1"}
        assert zero[0].episode_id == zero[1].episode_id != one[0].episode_id  # "<episode>.<n>" per agent
        np.testing.assert_array_equal(zero[0].obs[-1], zero[1].obs[0])  # chunks share their boundary row
        assert [len(c) for c in one] == [1] and one[0].rewards.tolist() == [6.5] and one[0].terminated
        assert zero[-1].terminated and sum(float(c.rewards.sum()) for c in zero) == 7.0
        for c in chunks:
            assert c.extra["action_logp"].shape == (len(c),) and c.extra["action_dist_inputs"].shape == (len(c), 2)
        m = server.get_metrics()
        assert m["num_env_steps_sampled"]["value"] == 7 and m["num_agent_steps_sampled"]["value"] == 8
        assert m["episode_return_mean"]["values"] == [13.5] and m["episode_len_mean"]["values"] == [7]
        assert m["env_runners/agent_episode_returns_mean/1"]["values"] == [6.5]
    finally:
        spec.close()
        server.stop()


def test_the_python_client_plays_multi_agent_cartpole_through_the_server(tmp_path):
    from actors.env.multi_agent_env import make_multi_agent

    server = make_server(tmp_path, obs1=CARTPOLE.observation_space, fragment_length=20)
    env = make_multi_agent("CartPole-v1")({"num_agents": 2})
    try:
        with PolicyClient(server.address, timeout_s=30) as client:
            assert client.multi_agent
            returns = run_multi_agent_env(client, env, num_episodes=3, seed=0)
            eid = client.start_episode()
            actions = client.get_action(eid, {0: np.array(O4, np.float32), 1: np.array(O4, np.float32)})
            assert sorted(actions) == [0, 1] and all(a in (0, 1) for a in actions.values())
            with pytest.raises(ValueError, match="agent 5"):
                client.log_returns(eid, {5: 1.0})  # never acted: refused at the call
            with pytest.raises(wire.ServerError, match="bad_observation"):
                client.get_action(eid, {0: O4[:2]})
            client.log_returns(eid, {0: 1.0, 1: 1.0}, terminateds={1: True})
            assert list(client.get_action(eid, {0: O4, 1: O4})) == [0]  # agent 1 finished
            client.end_episode(eid, {0: O4}, truncated=True)
        chunks = server.sample(10_000)
        returned = sum(float(c.rewards.sum()) for c in chunks)
        assert returned == sum(returns) + 1.0 + 1.0  # the fourth episode's rewards
        assert {(c.agent_id, c.module_id) for c in chunks} == {("0", "p0"), ("1", "p1")}
        assert all(len(c) <= 20 for c in chunks)
        assert server.get_metrics()["num_episodes"]["value"] == 4
    finally:
        server.stop()


def test_the_c_client_plays_two_agent_episodes(tmp_path):
    """The C client in multi-agent mode (examples/c_client, ``[agents]`` > 1): each of its CartPoles
    finishes on its own, and the server records every agent's steps with its final observation."""
    from tests.test_external_c_client import build

    command = build(str(tmp_path / "cartpole_client"))
    server = make_server(tmp_path, obs1=CARTPOLE.observation_space, fragment_length=500)
    try:
        run = subprocess.run(command + [server.address, "3", "2"], capture_output=True, text=True, timeout=120)
        assert run.returncode == 0, run.stdout + run.stderr
        env_steps = sum(int(line.split()[-2]) for line in run.stdout.splitlines() if line.startswith("episode "))
        chunks = server.sample(10_000)
        assert {(c.agent_id, c.module_id) for c in chunks} == {("0", "p0"), ("1", "p1")}
        assert len(chunks) == 6 and all(c.terminated for c in chunks)  # one chunk per agent and episode
        for c in chunks:
            assert c.obs.shape == (len(c) + 1, 4) and float(c.rewards.sum()) == len(c)
        m = server.get_metrics()
        assert m["num_episodes"]["value"] == 3 and m["num_env_steps_sampled"]["value"] == env_steps
        assert max(len(c) for c in chunks) <= env_steps
    finally:
        server.stop()


# --- training ---------------------------------------------------------------------------------------
def play_cartpoles(address: str, stop: Any, seed: int, stateless: bool = False) -> None:
    """A client process: two-agent CartPole episodes (``stateless``: Stateless CartPole's) until told to stop."""
    from actors.env.multi_agent_env import make_multi_agent

    if stateless:
        from tests.test_multi_agent_recurrent import TwoAgents

        env = TwoAgents({"num_agents": 2})
    else:
        env = make_multi_agent("CartPole-v1")({"num_agents": 2})
    client = PolicyClient(address, timeout_s=120)
    episode = 0
    while not stop.is_set():
        run_multi_agent_env(client, env, num_episodes=1, seed=seed * 1_000_000 + episode)
        episode += 1
    client.close(flush=False)


def agent_to_module(agent_id: Any, episode: Any, **kwargs: Any) -> str:
    return f"p{agent_id}"


def two_agent_config(address: str) -> Any:
    from pipeline import PPOConfig, make_multi_agent

    return (PPOConfig().environment(make_multi_agent("CartPole-v1"), env_config={"num_agents": 2})
            .multi_agent(policies={"p0", "p1"}, policy_mapping_fn=agent_to_module)
            .training(train_batch_size_per_learner=2000, minibatch_size=500, num_epochs=8)
            .reporting(metrics_num_episodes_for_smoothing=20)
            .env_runners(num_env_runners=0).external_clients(address=address, journal_dir="")
            .debugging(seed=0))


@pytest.mark.slow
def test_a_policy_server_in_a_ray_runner_slot_trains_both_modules(ray_cluster):
    """The run's modules and mapping fn reach a server hosted as a Ray actor; one iteration trains both."""
    from actors.env.multi_agent_env import make_multi_agent

    address = f"tcp://127.0.0.1:{free_port()}"
    algo = (two_agent_config(address).env_runners(num_env_runners=1)
            .training(train_batch_size_per_learner=400, minibatch_size=200, num_epochs=1).build(logdir=None))
    stop = threading.Event()

    def play() -> None:
        env = make_multi_agent("CartPole-v1")({"num_agents": 2})
        with PolicyClient(address, timeout_s=120) as client:
            while not stop.is_set():
                run_multi_agent_env(client, env, num_episodes=1)

    player = threading.Thread(target=play, daemon=True)
    player.start()
    try:
        r = algo.train()
    finally:
        stop.set()
        player.join()
        algo.stop()
    assert r["num_env_steps_sampled_lifetime"] >= 400
    assert set(r["learners"]) >= {"p0", "p1"}
    assert set(r["env_runners"]["module_episode_returns_mean"]) == {"p0", "p1"}


@pytest.mark.slow
def test_two_appo_learners_train_both_modules_from_the_clients_of_two_server_slots(ray_cluster):
    """Multi-agent APPO with 2 learner actors and 2 policy server slots: server slot i streams to learner i mod 2,
    each learner cuts each module's steps into batches of their own, and both train both modules in step."""
    from actors.env.multi_agent_env import make_multi_agent
    from pipeline import APPOConfig
    from tests.test_external import free_ports

    port = free_ports(2)
    algo = (APPOConfig().environment(make_multi_agent("CartPole-v1"), env_config={"num_agents": 2})
            .multi_agent(policies={"p0", "p1"}, policy_mapping_fn=agent_to_module)
            .training(train_batch_size_per_learner=200, minibatch_size=100)
            .env_runners(num_env_runners=2).learners(num_learners=2)
            .external_clients(address=f"tcp://127.0.0.1:{port}", journal_dir="", sample_wait_s=1.0)
            .reporting(min_time_s_per_iteration=0.5).debugging(seed=0).build(logdir=None))
    stop = threading.Event()

    def play(address: str) -> None:
        env = make_multi_agent("CartPole-v1")({"num_agents": 2})
        with PolicyClient(address, timeout_s=120) as client:
            while not stop.is_set():
                run_multi_agent_env(client, env, num_episodes=1)

    initial = algo.learner_group.foreach_learner(lambda learner: learner.get_weights())[0]
    players = [threading.Thread(target=play, args=(f"tcp://127.0.0.1:{port + k}",), daemon=True) for k in range(2)]
    for p in players:
        p.start()
    try:
        results = [algo.train()]
        deadline = time.monotonic() + 180  # clients connect and fill batches on their own time on a loaded machine
        while algo.weights_version < 3 and time.monotonic() < deadline:
            results.append(algo.train())
        weights = algo.learner_group.foreach_learner(lambda learner: learner.get_weights())
    finally:
        stop.set()
        for p in players:
            p.join(timeout=120)
        algo.stop()
    assert algo.weights_version >= 3, algo.weights_version
    for k in weights[0]:
        np.testing.assert_array_equal(weights[0][k], weights[1][k])
    for mid in ("p0", "p1"):  # both modules trained
        assert any(not np.array_equal(weights[0][k], initial[k]) for k in initial if k.startswith(f"{mid}/")), mid
    assert results[-1]["stream"]["num_chunks_dropped_invalid"] == 0


@pytest.mark.learning
def test_ppo_trains_two_policies_from_two_external_clients():
    """Summed return (both agents) of 400 within 200k env steps, from two client processes playing
    two-agent CartPole against one policy server."""
    address = f"tcp://127.0.0.1:{free_port()}"
    algo = two_agent_config(address).build(logdir=None)
    ctx = multiprocessing.get_context("spawn")
    stop = ctx.Event()
    players = [ctx.Process(target=play_cartpoles, args=(address, stop, i), daemon=True) for i in range(2)]
    for p in players:
        p.start()
    try:
        t0, best, r = time.perf_counter(), float("-inf"), {}
        while best < 400 and r.get("num_env_steps_sampled_lifetime", 0) < 200_000:
            r = algo.train()
            best = max(best, r["env_runners"].get("episode_return_mean") or float("-inf"))
        print(f"summed return {best:.0f} after {r['num_env_steps_sampled_lifetime']} env steps, "
              f"{time.perf_counter() - t0:.0f} s")
        assert best >= 400, f"summed return {best:.0f} after {r['num_env_steps_sampled_lifetime']} env steps"
        assert set(r["learners"]) >= {"p0", "p1"}
        module_means = r["env_runners"]["module_episode_returns_mean"]
        assert min(module_means.values()) >= 100, f"one policy lags: {module_means}"  # random play: ~22
    finally:
        stop.set()
        for p in players:
            p.kill()
            p.join()
        algo.stop()
