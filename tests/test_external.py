"""External clients: the policy server and client in one process -- the protocol, acknowledgements,
deduplication across a server restart, error replies, spooling and local inference (limits, CURVE, keys and
the config group: ``test_external_security.py``)."""
from __future__ import annotations

import os
import socket
import threading

import gymnasium as gym
import msgpack
import numpy as np
import pytest
import zmq

from actors.env import EnvRunnerSettings
from actors.external.policy_server import ExternalSettings, PolicyServer
from protocols import external as wire
from protocols.client import PolicyClient, run_env
from protocols.codec import encode
from protocols.episode import EpisodeBuilder
from tests.spec_client import SpecClient

CARTPOLE = gym.make("CartPole-v1")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def free_ports(n: int) -> int:
    """The first of ``n`` consecutive free ports (policy server slot i binds the base port + i - 1)."""
    for _ in range(100):
        base = free_port()
        if base + n - 1 > 65535:
            continue
        sockets = []
        try:
            for port in range(base, base + n):
                s = socket.socket()
                sockets.append(s)
                s.bind(("127.0.0.1", port))
            return base
        except OSError:
            continue
        finally:
            for s in sockets:
                s.close()
    raise RuntimeError(f"found no {n} consecutive free ports")


def make_server(tmp_path, **kwargs) -> PolicyServer:
    settings = EnvRunnerSettings(env_creator=None, observation_space=CARTPOLE.observation_space,
                                 action_space=CARTPOLE.action_space)
    kwargs.setdefault("address", f"tcp://127.0.0.1:{free_port()}")
    kwargs.setdefault("journal_dir", str(tmp_path / "journal"))
    kwargs.setdefault("fragment_length", 20)
    kwargs.setdefault("sample_wait_s", 2.0)
    return PolicyServer(settings, 0, external=ExternalSettings(**kwargs))


@pytest.fixture
def server(tmp_path):
    srv = make_server(tmp_path)
    yield srv
    srv.stop()


def ids(chunks) -> list[tuple[str, int]]:
    return [(c.episode_id, c.chunk_index) for c in chunks]


def test_remote_inference_episodes_reach_the_algorithm_and_are_acknowledged(server):
    with PolicyClient(server.address, "remote", timeout_s=20) as client:
        returns = run_env(client, gym.make("CartPole-v1"), num_episodes=3, seed=0)
        steps = int(sum(returns))
        got = server.sample(steps)
        assert sum(len(c) for c in got) == steps
        assert {c.episode_id for c in got if c.is_done} == {c.episode_id for c in got}  # every episode ended
        assert all(len(c) <= 20 for c in got)
        for c in got:
            assert c.extra["action_logp"].shape == (len(c),)
            assert c.extra["action_dist_inputs"].shape == (len(c), 2)
            assert np.all(c.extra["action_logp"] <= 0)
        assert client.unacknowledged == len(got)  # held until the algorithm asks again
        server.sample(1)  # the driver asking again means it has the previous chunks: they are committed
        client.flush(timeout_s=10)
        assert sorted(client.committed) == sorted(ids(got))
        metrics = server.get_metrics()
        assert metrics["external/num_actions_served"]["value"] >= steps


def test_chunk_boundaries_share_observations(server):
    with PolicyClient(server.address, "remote", timeout_s=20) as client:
        steps = int(sum(run_env(client, gym.make("CartPole-v1"), num_episodes=1, seed=3)))
        chunks = sorted(server.sample(steps), key=lambda c: c.chunk_index)  # waits for the last chunk too
        assert sum(len(c) for c in chunks) == steps
        for a, b in zip(chunks, chunks[1:]):
            np.testing.assert_array_equal(a.obs[-1], b.obs[0])
            assert b.t_started == a.t_started + len(a)
        server.commit()  # so closing the client (which waits for its acknowledgements) returns at once


def test_a_client_written_from_the_spec_alone_plays_and_uploads(server):
    spec = SpecClient(server.address)
    try:
        welcome = spec.hello()
        assert welcome["op"] == "welcome" and welcome["fragment_length"] == 20
        assert spec.request({"op": "start", "episode_id": "spec-1"})[0]["op"] == "started"
        env = gym.make("CartPole-v1")
        obs, _ = env.reset(seed=1)
        rows, actions, rewards, logps, dists, version = [list(map(float, obs))], [], [], [], [], 0
        for _ in range(10):
            action, logp, dist, version = spec.act("spec-1", list(map(float, obs)))
            obs, reward, terminated, truncated, _ = env.step(action)
            rows.append(list(map(float, obs)))
            actions.append(action)
            rewards.append(float(reward))
            logps.append(logp)
            dists.append(dist)
            if terminated:
                break
        assert spec.act_with_frame("spec-1", list(map(float, obs)))["action"] in (0, 1)
        reply = spec.send_chunk("spec-1", 0, rows, actions, rewards, logps, dists, bool(terminated), 0, version)
        assert reply["op"] == "received" and reply["ids"] == [["spec-1", 0]]
        got = server.sample(1)
        assert ids(got) == [("spec-1", 0)]
        np.testing.assert_allclose(got[0].obs[0], rows[0])
        np.testing.assert_array_equal(got[0].actions, actions)
        server.commit()
        assert spec.wait_committed(["spec-1", 0])
    finally:
        spec.close()


def _chunk_frame(eid: str, index: int, steps: int = 5, obs_dim: int = 4):
    b = EpisodeBuilder(eid)
    b.add_reset(np.zeros(obs_dim, np.float32))
    for t in range(steps):
        b.add_step(np.int64(t % 2), 1.0, np.full(obs_dim, t, np.float32),
                   extra={"action_logp": np.float32(-0.7), "action_dist_inputs": np.zeros(2, np.float32)})
    chunk = b.cut()
    chunk.chunk_index = index  # stands for a later chunk of the episode: only its id matters here
    return encode([chunk], compress=False)


def test_copies_of_a_chunk_are_dropped_before_and_after_commit(server):
    spec = SpecClient(server.address)
    try:
        spec.hello()
        frame = _chunk_frame("dup", 0)
        first, _ = spec.request({"op": "chunks", "ids": [["dup", 0]]}, frame)
        again, _ = spec.request({"op": "chunks", "ids": [["dup", 0]]}, frame)
        assert first["ids"] == again["ids"] == [["dup", 0]]
        assert ids(server.sample(1)) == [("dup", 0)]  # once, though sent twice
        while_delivered, _ = spec.request({"op": "chunks", "ids": [["dup", 0]]}, frame)
        assert while_delivered["ids"] == [["dup", 0]]
        assert server.sample(1) == []  # commits ("dup", 0); the copy sent meanwhile is not handed on again
        after, _ = spec.request({"op": "chunks", "ids": [["dup", 0]]}, frame)
        assert after["op"] == "received" and after["ids"] == [] and after["committed"] == [["dup", 0]]
        assert server.sample(1) == []
        assert server.get_metrics()["external/num_duplicate_chunks"]["value"] == 3
    finally:
        spec.close()


def test_the_journal_remembers_committed_ids_across_a_server_restart(tmp_path):
    address = f"tcp://127.0.0.1:{free_port()}"
    first = make_server(tmp_path, address=address)
    spec = SpecClient(address)
    try:
        spec.hello()
        spec.request({"op": "chunks", "ids": [["j", 0]]}, _chunk_frame("j", 0))
        assert ids(first.sample(1)) == [("j", 0)]
        first.commit()  # committed and journaled; the spec client never reads the acknowledgement
        first.stop()
        second = make_server(tmp_path, address=address)
        try:
            reply, _ = spec.request({"op": "chunks", "ids": [["j", 0]]}, _chunk_frame("j", 0))
            assert reply["code"] == wire.HELLO_FIRST  # a new server: the connection must say hello again
            spec.hello()
            reply, _ = spec.request({"op": "chunks", "ids": [["j", 0]]}, _chunk_frame("j", 0))
            assert reply["committed"] == [["j", 0]] and reply["ids"] == []
            assert second.sample(1) == []
        finally:
            second.stop()
    finally:
        spec.close()


def test_a_client_resends_to_a_restarted_server_and_nothing_is_handed_on_twice(tmp_path):
    address = f"tcp://127.0.0.1:{free_port()}"
    first = make_server(tmp_path, address=address)
    client = PolicyClient(address, "remote", timeout_s=30, resend_after_s=1.0)
    try:
        run_env(client, gym.make("CartPole-v1"), num_episodes=2, seed=5)
        handed_on = ids(first.sample(1))
        first.stop()  # commits what the driver took; the acknowledgements may or may not reach the client
        second = make_server(tmp_path, address=address)
        try:
            run_env(client, gym.make("CartPole-v1"), num_episodes=2, seed=7)
            later = []
            for _ in range(30):  # whatever the client still holds is sent again; the journal drops the old
                later += ids(second.sample(1))
                if client.unacknowledged == 0:
                    break
            assert client.unacknowledged == 0
            assert not set(later) & set(handed_on)
            assert len(later) == len(set(later))
            assert set(client.committed) == set(handed_on) | set(later)
        finally:
            second.stop()
    finally:
        client.close(flush=False)


def test_a_recreated_server_is_told_what_its_predecessor_handed_on(tmp_path):
    server = make_server(tmp_path, journal_dir="")  # no journal: only the group's word
    try:
        spec = SpecClient(server.address)
        spec.hello()
        server.confirm_delivered([["gone", 0]])
        reply, _ = spec.request({"op": "chunks", "ids": [["gone", 0]]}, _chunk_frame("gone", 0))
        assert reply["committed"] == [["gone", 0]]
        assert server.sample(1) == []
        spec.close()
    finally:
        server.stop()


def test_errors_are_replies_and_the_server_keeps_serving(server):
    good = PolicyClient(server.address, "remote", timeout_s=20)
    ctx = zmq.Context()
    bad = ctx.socket(zmq.DEALER)
    bad.linger = 0
    bad.connect(server.address)

    def ask(*parts: bytes) -> dict:
        bad.send_multipart(list(parts))
        assert bad.poll(10_000), "the server did not answer"
        return msgpack.unpackb(bad.recv_multipart()[0], raw=False)

    try:
        hello = msgpack.packb({"op": "hello", "id": 1, "protocol": "runnel-external", "version": 1,
                               "inference_mode": "remote"})
        assert ask(msgpack.packb({"op": "act", "id": 2, "episode_id": "x"}), b"")["code"] == wire.HELLO_FIRST
        assert ask(b"\xc1garbage")["code"] == wire.BAD_MESSAGE
        assert ask(hello)["op"] == "welcome"
        assert ask(msgpack.packb([1, 2, 3]))["code"] == wire.BAD_MESSAGE
        assert ask(msgpack.packb({"op": "launch_missiles", "id": 3}))["code"] == wire.BAD_MESSAGE
        assert ask(msgpack.packb({"op": "start", "id": 4, "episode_id": 12}))["code"] == wire.BAD_MESSAGE
        assert ask(msgpack.packb({"op": "act", "id": 5, "episode_id": "never-started"}),
                   encode({"obs": np.zeros(4, np.float32)}))["code"] == wire.UNKNOWN_EPISODE
        assert ask(msgpack.packb({"op": "start", "id": 6, "episode_id": "e"}))["op"] == "started"
        assert ask(msgpack.packb({"op": "act", "id": 7, "episode_id": "e"}),
                   encode({"obs": np.zeros(7, np.float32)}))["code"] == wire.BAD_OBSERVATION
        assert ask(msgpack.packb({"op": "act", "id": 7, "episode_id": "e", "obs": [1, 2]}))["code"] == \
            wire.BAD_OBSERVATION
        assert ask(msgpack.packb({"op": "act", "id": 7, "episode_id": "e", "obs": ["a", "b", "c", "d"]}))["code"] == \
            wire.BAD_OBSERVATION
        assert ask(msgpack.packb({"op": "act", "id": 7, "episode_id": "e", "obs": [0.0] * 4}))["op"] == "action"
        many = ask(msgpack.packb({"op": "act", "id": 7, "episode_id": "e", "obs": [0.0] * 4}), *[b"x"] * 50)
        assert many["code"] == wire.BAD_MESSAGE and "part" in many["message"]
        assert ask(msgpack.packb({"op": "act", "id": 7, "episode_id": ["e"], "obs": [0.0] * 4}))["code"] == \
            wire.BAD_MESSAGE
        assert ask(msgpack.packb({"op": "act", "id": 8, "episode_id": "e"}), b"RNNL" + b"\xff" * 40)["code"] == \
            wire.BAD_MESSAGE
        wrong_id = ask(msgpack.packb({"op": "chunks", "id": 9, "ids": [["other", 0]]}), _chunk_frame("mine", 0))
        assert wrong_id["code"] == wire.BAD_CHUNK
        wrong_shape = ask(msgpack.packb({"op": "chunks", "id": 10, "ids": [["w", 0]]}), _chunk_frame("w", 0, obs_dim=3))
        assert wrong_shape["code"] == wire.BAD_CHUNK and "shape" in wrong_shape["message"]
        spaces = msgpack.packb({"op": "hello", "id": 11, "protocol": "runnel-external", "version": 1,
                                "inference_mode": "remote", "observation_space": {"type": "Discrete", "n": 3}})
        assert ask(spaces)["code"] == wire.SPACES_MISMATCH
        old = msgpack.packb({"op": "hello", "id": 12, "protocol": "runnel-external", "version": 99,
                             "inference_mode": "remote"})
        assert ask(old)["code"] == wire.VERSION_MISMATCH
        # a flood of garbage: the well-behaved client is served all the while
        eid = good.start_episode()
        stop = threading.Event()
        served = []

        def play() -> None:
            obs = np.zeros(4, np.float32)
            while not stop.is_set():
                served.append(good.get_action(eid, obs))

        player = threading.Thread(target=play)
        player.start()
        for i in range(300):
            bad.send_multipart([b"\x92\x01"])  # a msgpack array, not a map
        replies = 0
        while replies < 101 and bad.poll(10_000):
            reply = msgpack.unpackb(bad.recv_multipart()[0], raw=False)
            replies += 1
            if reply["code"] == wire.BANNED:
                break
        assert reply["code"] == wire.BANNED and reply["fatal"]
        assert not bad.poll(300)  # ignored from now on
        stop.set()
        player.join()
        assert len(served) > 0 and good.get_action(eid, np.zeros(4, np.float32)) in (0, 1)
        assert server.error is None
    finally:
        bad.close()
        ctx.term()
        good.close(flush=False)


def test_a_spool_directory_carries_unacknowledged_chunks_over_a_client_crash(server, tmp_path):
    spool = str(tmp_path / "spool")
    first = PolicyClient(server.address, "remote", timeout_s=20, spool_dir=spool)
    steps = int(sum(run_env(first, gym.make("CartPole-v1"), num_episodes=2, seed=11)))
    sent = {(c.episode_id, c.chunk_index) for c in server.sample(steps)}  # held by the driver, not acknowledged
    assert len(os.listdir(spool)) == len(sent) > 0
    first.close(flush=False)  # as good as a crash: the acknowledgements never reach this process
    second = PolicyClient(server.address, "remote", timeout_s=20, spool_dir=spool)
    try:
        assert set(second.spooled_ids()) == sent
        assert server.sample(1) == []  # commits the first batch; the copies the second client sent are dropped
        second.flush(timeout_s=10)
        assert os.listdir(spool) == [] and set(second.committed) == sent
    finally:
        second.close(flush=False)


def test_local_inference_acts_without_the_server_and_follows_new_weights(server):
    with PolicyClient(server.address, "local", timeout_s=20, update_interval=3600) as client:
        assert client.inference_mode == "local"
        steps = int(sum(run_env(client, gym.make("CartPole-v1"), num_episodes=2, seed=2)))
        assert server.get_metrics()["external/num_actions_served"]["value"] == 0  # every action computed here
        got = server.sample(steps)
        assert sum(len(c) for c in got) == steps
        assert all(c.extra["action_dist_inputs"].shape == (len(c), 2) for c in got)
        weights = {k: v + 0.5 for k, v in server.get_weights().items()}
        server.set_weights(weights, weights_version=7)
        client.update_policy_weights()
        assert client.weights_version == 7
        eid = client.start_episode()
        obs = np.array([0.02, 0.1, -0.03, 0.2], np.float32)
        for _ in range(5):
            client.get_action(eid, obs)
        client.end_episode(eid, obs)
        chunk = server.sample(5)[-1]
        assert chunk.weights_version == 7
        server.commit()


@pytest.mark.parametrize("mode", ["remote", "local"])
def test_one_request_acts_for_several_episodes(server, mode):
    with PolicyClient(server.address, mode, timeout_s=20) as client:
        envs = [gym.make("CartPole-v1") for _ in range(3)]
        eids = [client.start_episode() for _ in envs]
        obs = [env.reset(seed=i)[0] for i, env in enumerate(envs)]
        for _ in range(8):
            actions = client.get_actions(eids, obs)
            assert len(actions) == 3 and all(a in (0, 1) for a in actions)
            obs = [env.step(a)[0] for env, a in zip(envs, actions)]
            for eid in eids:
                client.log_returns(eid, 1.0)
        for eid, o in zip(eids, obs):
            client.end_episode(eid, o, truncated=True)
        got = server.sample(24)
        assert sorted({c.episode_id for c in got}) == sorted(eids) and sum(len(c) for c in got) == 24
        served = server.get_metrics()["external/num_actions_served"]["value"]
        assert served == (24 if mode == "remote" else 0)
        server.commit()


def test_spinning_client_and_server_play_and_deliver_as_blocking_ones_do(tmp_path):
    """spin_s changes only how each side waits for a message: episodes play, chunks arrive whole and
    are acknowledged, and a client's other traffic (commit notices) still reaches it."""
    srv = make_server(tmp_path, spin_s=0.002)
    try:
        with PolicyClient(srv.address, "remote", timeout_s=20, spin_s=0.002) as client:
            steps = int(sum(run_env(client, gym.make("CartPole-v1"), num_episodes=3, seed=1)))
            got = srv.sample(steps)
            assert sum(len(c) for c in got) == steps
            assert {c.episode_id for c in got if c.is_done} == {c.episode_id for c in got}
            srv.commit()
            client.flush(timeout_s=10)
            assert sorted(client.committed) == sorted(ids(got))
            assert srv.get_metrics()["external/num_actions_served"]["value"] >= steps
    finally:
        srv.stop()
    with pytest.raises(ValueError, match="spin_s=-1"):
        PolicyClient("tcp://127.0.0.1:1", spin_s=-1)


@pytest.mark.parametrize("mode", ["remote", "local"])
def test_requests_sent_first_and_received_later_play_many_episodes(server, mode):
    """send_action/receive_action: several clients each with several episodes in flight at once;
    each episode's chunks arrive whole, with the extras a training step needs."""
    clients = [PolicyClient(server.address, mode, timeout_s=20) for _ in range(2)]
    try:
        games = [(c, c.start_episode(), gym.make("CartPole-v1")) for c in clients for _ in range(3)]
        obs = [env.reset(seed=i)[0] for i, (_, _, env) in enumerate(games)]
        for _ in range(6):
            for (c, eid, _), o in zip(games, obs):
                c.send_action(eid, o)
            actions = [c.receive_action(eid) for c, eid, _ in games]
            assert all(a in (0, 1) for a in actions)
            obs = [env.step(a)[0] for (_, _, env), a in zip(games, actions)]
            for c, eid, _ in games:
                c.log_returns(eid, 1.0)
        c, eid, _ = games[0]
        c.send_action(eid, obs[0])
        for misuse in (lambda: c.send_action(eid, obs[0]), lambda: c.get_action(eid, obs[0]),
                       lambda: c.end_episode(eid, obs[0])):
            with pytest.raises(ValueError, match="receive_action"):
                misuse()
        c.receive_action(eid)
        with pytest.raises(ValueError, match="send_action"):
            c.receive_action(eid)
        obs[0] = games[0][2].step(0)[0]
        for (c, eid, _), o in zip(games, obs):
            c.end_episode(eid, o, truncated=True)
        got = server.sample(37)
        assert sorted({ch.episode_id for ch in got}) == sorted(eid for _, eid, _ in games)
        assert sum(len(ch) for ch in got) == 37 and all(ch.is_done for ch in got)
        assert all(ch.extra["action_logp"].shape == (len(ch),) and np.all(ch.extra["action_logp"] <= 0) for ch in got)
        served = server.get_metrics()["external/num_actions_served"]["value"]
        assert served == (37 if mode == "remote" else 0)
        server.commit()
        for c in clients:
            c.flush(timeout_s=10)
    finally:
        for c in clients:
            c.close(flush=False)


def test_an_episode_with_a_busy_chunk_hands_on_the_rest_in_order(tmp_path):
    """The replay joins an episode only from consecutive chunks, and returns add up chunk by chunk:
    once one of an episode's chunks is refused as busy, its later ones wait their turn."""
    server = make_server(tmp_path, max_pending_steps=1)
    spec = SpecClient(server.address)
    try:
        spec.hello()

        def send(eid: str, i: int) -> dict:
            return spec.request({"op": "chunks", "ids": [[eid, i]]}, _chunk_frame(eid, i))[0]

        assert send("other", 0)["op"] == "received"  # fills the server
        assert send("ep", 0)["code"] == "busy"
        assert ids(server.sample(1)) == [("other", 0)]  # room again
        assert send("ep", 1)["code"] == "busy"  # room, but ("ep", 0) comes first
        assert send("other", 1)["op"] == "received"  # other episodes are not held up
        assert ids(server.sample(1)) == [("other", 1)]
        assert send("ep", 0)["op"] == "received"
        assert send("ep", 2)["code"] == "busy"  # full again, and ("ep", 1) is still owed
        assert ids(server.sample(1)) == [("ep", 0)]
        assert send("ep", 2)["code"] == "busy"  # room, but ("ep", 1) comes first
        assert send("ep", 1)["op"] == "received"
        assert ids(server.sample(1)) == [("ep", 1)]
        assert send("ep", 2)["op"] == "received"
        assert ids(server.sample(1)) == [("ep", 2)]
        assert send("ep", 3)["op"] == "received"  # in order again: nothing held
        assert ids(server.sample(1)) == [("ep", 3)]
        # a chunk the server took before the gate closed (its predecessor was lost with a connection
        # and came back later) is never sent again: the gate does not wait for it
        assert send("late", 1)["op"] == "received"
        assert send("late", 0)["code"] == "busy"
        assert ids(server.sample(1)) == [("late", 1)]
        assert send("late", 2)["code"] == "busy"  # ("late", 0) is owed
        assert send("late", 0)["op"] == "received"
        assert ids(server.sample(1)) == [("late", 0)]
        assert send("late", 2)["op"] == "received"
        assert ids(server.sample(1)) == [("late", 2)]
    finally:
        spec.close()
        server.stop()
