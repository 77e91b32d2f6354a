"""Flow control between a policy server and its clients: the limits ``welcome`` announces, stale
experience refused, acts held while the driver trains, the reference client throttling itself --
and an unthrottled local-inference client training PPO as well as a throttled one."""
from __future__ import annotations

import contextlib
import multiprocessing
import threading
import time

import gymnasium as gym
import msgpack
import numpy as np
import pytest

from pipeline.algorithms.ppo.config import PPOConfig
from pipeline.config.external import external_settings
from protocols import external as wire
from protocols.client import PolicyClient, run_env
from tests.spec_client import SpecClient
from tests.test_external import _chunk_frame, free_port, ids, make_server

CARTPOLE = gym.make("CartPole-v1")
SPACES = {"observation_space": CARTPOLE.observation_space, "action_space": CARTPOLE.action_space}


def wait_until(condition, timeout_s: float = 30.0, what: str = "condition") -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.005)


def test_welcome_announces_every_limit_a_client_needs(tmp_path):
    server = make_server(tmp_path, max_batch=64, max_pending_steps=5000, max_unacked_steps=300, max_policy_lag=2)
    spec = SpecClient(server.address)
    try:
        welcome = spec.hello()
        assert welcome["fragment_length"] == 20
        limits = welcome["limits"]
        assert limits["max_batch"] == 64 and limits["max_pending_steps"] == 5000
        assert limits["max_unacked_steps"] == 300 and limits["max_policy_lag"] == 2
        assert limits["hold_acts_while_training"] is False
        assert limits["max_decoded_bytes"] >= limits["max_frame_bytes"]
        for key in ("max_frame_bytes", "max_open_episodes", "max_requests_in_flight", "max_chunk_steps",
                    "max_act_body_bytes"):
            assert isinstance(limits[key], int) and limits[key] > 0, key
    finally:
        spec.close()
        server.stop()


def test_the_reference_client_splits_batches_larger_than_max_batch(tmp_path):
    server = make_server(tmp_path, max_batch=4)
    try:
        with PolicyClient(server.address, "remote", timeout_s=20) as client:
            eids = [client.start_episode(training_enabled=False) for _ in range(10)]
            actions = client.get_actions(eids, [np.zeros(4, np.float32)] * 10)
            assert len(actions) == 10 and all(a in (0, 1) for a in actions)
            for eid in eids:
                client.end_episode(eid, np.zeros(4, np.float32))
        metrics = server.get_metrics()
        assert metrics["external/num_actions_served"]["value"] == 10
        assert metrics["external/num_protocol_errors"]["value"] == 0
    finally:
        server.stop()


def test_ppo_holds_clients_to_fresh_experience_by_default():
    ppo = PPOConfig().environment(**SPACES).env_runners(num_env_runners=0).training(
        train_batch_size_per_learner=1000).external_clients()
    x = external_settings(ppo)
    assert x.max_policy_lag == 1 and x.hold_acts_while_training is True
    assert x.max_unacked_steps == 1000 + x.fragment_length  # one batch per server, and the chunk that crosses it
    two = PPOConfig().environment(**SPACES).env_runners(num_env_runners=2).training(
        train_batch_size_per_learner=1000).external_clients()
    assert external_settings(two).max_unacked_steps == 500 + external_settings(two).fragment_length
    from pipeline.algorithms.dqn.config import DQNConfig

    dqn = external_settings(DQNConfig().environment(**SPACES).external_clients())
    assert dqn.max_policy_lag is None and dqn.hold_acts_while_training is False
    assert dqn.max_unacked_steps == dqn.max_pending_steps
    off = external_settings(PPOConfig().environment(**SPACES).external_clients(hold_acts_while_training=False,
                                                                                 max_policy_lag=3))
    assert off.hold_acts_while_training is False and off.max_policy_lag == 3
    with pytest.raises(Exception, match="max_policy_lag"):
        PPOConfig().environment(**SPACES).external_clients(max_policy_lag=-1).build()


def test_chunks_from_old_weights_are_refused_as_stale_and_the_client_drops_them(tmp_path):
    server = make_server(tmp_path, max_policy_lag=1)
    spec = SpecClient(server.address)
    try:
        spec.hello()
        server.set_weights(server.get_weights(), weights_version=5)
        old = _chunk_frame("old", 0)  # acted on by version 0
        reply, _ = spec.request({"op": "chunks", "ids": [["old", 0]]}, old)
        assert reply["op"] == "error" and reply["code"] == wire.STALE and reply["ids"] == [["old", 0]]
        assert reply["weights_version"] == 5 and not reply["fatal"]
        assert server.get_metrics()["external/num_stale_chunks"]["value"] == 1
        assert server.sample(1) == []
    finally:
        spec.close()
        server.stop()


def test_waiting_chunks_that_new_weights_made_stale_are_dropped_at_sampling(tmp_path):
    server = make_server(tmp_path, max_policy_lag=1)
    try:
        with PolicyClient(server.address, "local", timeout_s=20, update_interval=3600) as client:
            steps = int(sum(run_env(client, gym.make("CartPole-v1"), num_episodes=2, seed=1)))
            wait_until(lambda: server.chunks.pending_steps == steps, what="the server to hold every chunk")
            sent = client.spooled_ids()
            server.set_weights(server.get_weights(), weights_version=2)  # lag 2 > 1 for the waiting chunks
            assert server.sample(1) == []
            wait_until(lambda: client.unacknowledged == 0, what="the stale replies")
            assert client.committed == [] and client.rejected == []
            assert server.get_metrics()["external/num_stale_chunks"]["value"] == len(sent)
            # the client heard of version 2 in those replies: its next action uses it, unasked
            eid = client.start_episode()
            obs = np.zeros(4, np.float32)
            client.get_action(eid, obs)
            assert client.weights_version == 2
            client.end_episode(eid, obs)
            client.close(flush=False)
    finally:
        server.stop()


def recv_reply(spec: SpecClient, rid: int, timeout_ms: int = 10_000) -> dict:
    while True:
        assert spec.sock.poll(timeout_ms), f"no reply with id {rid}"
        reply = msgpack.unpackb(spec.sock.recv_multipart()[0], raw=False)
        if reply["id"] == rid:
            return reply


@contextlib.contextmanager
def training_server(tmp_path, max_act_hold_s: float):
    """A holding server whose driver just took a batch (acts are held from here), and a spec
    client with episode "e" started."""
    server = make_server(tmp_path, hold_acts_while_training=True, max_act_hold_s=max_act_hold_s)
    spec = SpecClient(server.address)
    try:
        spec.hello()
        spec.request({"op": "start", "episode_id": "e"})
        assert spec.act("e", [0.0] * 4)[3] == 0  # answered at once: nothing is being trained yet
        reply, _ = spec.request({"op": "chunks", "ids": [["c", 0]]}, _chunk_frame("c", 0))
        assert reply["op"] == "received"
        assert ids(server.sample(1)) == [("c", 0)]
        yield server, spec
    finally:
        spec.close()
        server.stop()


def send_held_act(server, spec: SpecClient, rid: int) -> None:
    """An act the server queues and holds (no reply while it waits in the queue)."""
    spec.sock.send_multipart([msgpack.packb({"op": "act", "id": rid, "episode_id": "e", "obs": [0.1, 0.0, 0.0, 0.0]})])
    wait_until(lambda: len(server.acts.requests) == 1, what="the act to be queued")
    assert not spec.sock.poll(0)


def test_acts_wait_while_the_driver_trains_and_get_the_new_weights(tmp_path):
    with training_server(tmp_path, max_act_hold_s=600.0) as (server, spec):
        send_held_act(server, spec, 99)
        server.set_weights(server.get_weights(), weights_version=3)
        action = recv_reply(spec, 99)
        assert action["op"] == "action" and action["weights_version"] == 3


def test_the_driver_asking_again_before_new_weights_releases_held_acts(tmp_path):
    """A round that took too little asks again before training: clients must act for it."""
    with training_server(tmp_path, max_act_hold_s=600.0) as (server, spec):
        send_held_act(server, spec, 7)
        asking = threading.Thread(target=server.sample, args=(1,))
        asking.start()
        reply = recv_reply(spec, 7)  # answered while the second call waits, long before max_act_hold_s
        assert reply["op"] == "action" and reply["weights_version"] == 0
        asking.join()


def test_held_acts_are_answered_after_max_act_hold_s_without_new_weights(tmp_path):
    with training_server(tmp_path, max_act_hold_s=0.2) as (_, spec):
        assert spec.act("e", [0.0] * 4)[3] == 0  # a driver that stopped training stalls no one


def test_the_reference_client_stops_collecting_past_max_unacked_steps(tmp_path):
    server = make_server(tmp_path, max_unacked_steps=40)  # two 20-step chunks; nothing is ever committed here
    try:
        with PolicyClient(server.address, "remote", timeout_s=1.0) as client:
            with pytest.raises(TimeoutError, match="wait for .* to commit"):
                run_env(client, gym.make("CartPole-v1"), max_steps=200, seed=0)
            wait_until(lambda: server.get_metrics()["external/num_chunks_received"]["value"] == client.unacknowledged,
                       what="the server to hold what the client sent")
            # the chunk that would have passed 40 steps waited for room: at most 40 sent, and more than
            # 40 - 20 (else a chunk of at most 20 steps would have fit)
            assert 20 < server.chunks.pending_steps <= 40
            client.close(flush=False)
        with PolicyClient(server.address, "remote", timeout_s=10.0, throttle=False) as client:
            run_env(client, gym.make("CartPole-v1"), max_steps=200, seed=0)  # never waits
            assert client.unacknowledged >= 10
            client.close(flush=False)
    finally:
        server.stop()


def _play(address: str, throttle: bool, stop) -> None:
    """A simulator process: CartPole episodes through a local-inference client until told to stop."""
    client = PolicyClient(address, "local", timeout_s=300, throttle=throttle,
                          spool_chunks=1024 if throttle else 1_000_000)  # unthrottled: never waits for room
    env, episode = gym.make("CartPole-v1"), 0
    while not stop.is_set():
        run_env(client, env, num_episodes=1, seed=episode)
        episode += 1
    client.close(flush=False)


def steps_to_return(throttle: bool, journal: str, target: float = 150.0, budget: int = 60_000) -> int:
    """Env steps PPO trained on until the clients' mean return reached ``target`` (fails past ``budget``)."""
    address = f"tcp://127.0.0.1:{free_port()}"
    algo = (PPOConfig().environment(**SPACES).env_runners(num_env_runners=0)
            .external_clients(address=address, inference_mode="local", journal_dir=journal).debugging(seed=0).build())
    ctx = multiprocessing.get_context("spawn")
    stop = ctx.Event()
    player = ctx.Process(target=_play, args=(address, throttle, stop), daemon=True)
    player.start()
    try:
        while True:
            result = algo.train()
            steps = result["num_env_steps_sampled_lifetime"]
            if (result["env_runners"].get("episode_return_mean") or 0.0) >= target:
                return steps
            assert steps < budget, f"return {result['env_runners'].get('episode_return_mean')} after {steps} steps"
    finally:
        stop.set()
        player.kill()
        player.join()
        algo.stop()


@pytest.mark.learning
def test_an_unthrottled_local_client_trains_ppo_within_the_budget_of_a_throttled_one(tmp_path):
    """A local-inference client that never waits floods the server with experience from old weights;
    the server drops it as stale and trains on the current weights' steps, so the flood costs no
    env steps of training (the issue: return stuck at 21 on stale data)."""
    throttled = steps_to_return(True, str(tmp_path / "a"))
    unthrottled = steps_to_return(False, str(tmp_path / "b"))
    assert throttled < 60_000 and unthrottled < 60_000
