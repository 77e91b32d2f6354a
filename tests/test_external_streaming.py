"""External clients feed the streaming plans: IMPALA, APPO, and DQN with the replay as a Ray actor.

A streaming policy server pushes what its clients send over the chunk stream env runners use
(``actors.external.stream``), commits each frame once it is pushed, blocks -- and its clients hear
``busy`` -- when the receiver falls behind, and stops and restarts like a streaming env runner.
Checked here: every chunk a client had acknowledged reached the receiver exactly once, metrics and
weights versions, stop/restart, a server actor killed and recreated, the config checks; and (learning)
APPO and IMPALA to CartPole-v1 450 from 4 client processes.
"""
from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter

import gymnasium as gym
import numpy as np
import pytest

from pipeline import APPOConfig, DQNConfig, IMPALAConfig
from pipeline.config.base import ConfigError
from protocols.client import PolicyClient, run_env
from protocols.schema import ChunkSchema
from protocols.transport import ChunkPuller
from tests.pieces import RecordTrainedChunks
from tests.test_external import free_port, free_ports, ids, make_server
from tests.test_external_faults import SPACES, Clients
from tests.test_learner_recovery import RecordTrainedToFiles, fault_tolerance, kill_learner, trained_dir, trained_pieces

CARTPOLE = gym.make("CartPole-v1")
SCHEMA = ChunkSchema.for_spaces(CARTPOLE.observation_space, CARTPOLE.action_space, ("action_logp",))
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def stream_threads() -> list[str]:
    return [t.name for t in threading.enumerate() if t.name.startswith("runnel-")]


def receive_until(puller: ChunkPuller, done, timeout_s: float = 60.0) -> list:
    """Chunks off ``puller`` until ``done(received)`` holds (raises after ``timeout_s``)."""
    got: list = []
    deadline = time.monotonic() + timeout_s
    while not done(got):
        assert time.monotonic() < deadline, f"gave up after receiving {len(got)} chunks"
        if puller.poll(50):
            got += puller.receive() or []
    return got


def acknowledged_all(client: PolicyClient, timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while client.unacknowledged:  # the client's background thread reads the acknowledgements
        assert time.monotonic() < deadline, f"{client.unacknowledged} chunks still unacknowledged"
        time.sleep(0.05)


def check_exactly_once(received: list, committed: set, spooled: set = frozenset()) -> None:
    """Nothing arrived twice; everything acknowledged arrived; what arrived unacknowledged, the client
    still holds (its acknowledgement was under way when the client closed)."""
    duplicates = [k for k, n in Counter(received).items() if n > 1]
    assert not duplicates, f"pushed twice: {duplicates[:5]}"
    assert committed <= set(received) <= committed | spooled


# --- the server's stream, without an algorithm ---------------------------------------------------
def test_a_streaming_server_pushes_what_clients_send_and_commits_it_once_pushed(tmp_path):
    server = make_server(tmp_path)
    puller = ChunkPuller("127.0.0.1", SCHEMA)
    client = PolicyClient(server.address, "remote", timeout_s=30)
    try:
        server.start_streaming(puller.address, compress=False)
        server.start_streaming(puller.address, compress=False)  # the same receiver: kept as it is
        assert server.is_streaming() and stream_threads().count("runnel-stream-0") == 1
        returns = run_env(client, gym.make("CartPole-v1"), num_episodes=3, seed=0)
        acknowledged_all(client)
        received = receive_until(puller, lambda got: set(ids(got)) >= set(client.committed))
        check_exactly_once(ids(received), set(client.committed))
        assert sum(len(c) for c in received) == sum(returns)  # CartPole: one reward per step
        m = server.metrics
        assert m.peek("num_env_steps_sampled_lifetime") == sum(returns)
        assert m.peek("num_episodes_lifetime") == 3 and m.peek("episode_return_mean") == pytest.approx(sum(returns) / 3)
        export = server.get_metrics()
        assert export["stream/runner_num_frames_sent"]["value"] >= 1
        assert export["external/num_chunks_committed"]["value"] == len(received)
        with pytest.raises(RuntimeError, match="stop_streaming"):
            server.sample(1)  # one taker at a time

        assert server.stop_streaming() and not server.is_streaming()
        assert "runnel-stream-0" not in stream_threads()
        server.start_streaming(puller.address, compress=False)  # again, as a group restarts a stream
        run_env(client, gym.make("CartPole-v1"), num_episodes=2, seed=10)
        acknowledged_all(client)
        more = receive_until(puller, lambda got: set(ids(received + got)) >= set(client.committed))
        check_exactly_once(ids(received + more), set(client.committed))
    finally:
        client.close(flush=False)
        server.stop()
        puller.close()
    assert not server.is_streaming() and "runnel-stream-0" not in stream_threads()


def test_a_receiver_that_falls_behind_blocks_the_stream_and_clients_hear_busy(tmp_path):
    server = make_server(tmp_path, max_pending_steps=60)
    puller = ChunkPuller("127.0.0.1", SCHEMA, hwm=1, rcvbuf=4096)  # read only later: back-pressure
    client = PolicyClient(server.address, "remote", timeout_s=120, resend_after_s=1.0)
    errors: list = []

    def play() -> None:
        try:
            run_env(client, gym.make("CartPole-v1"), num_episodes=150, seed=0)
        except BaseException as err:  # noqa: BLE001 - reported by the test
            errors.append(err)

    player = threading.Thread(target=play)
    try:
        server.start_streaming(puller.address, hwm=1, sndbuf=4096, compress=False)
        player.start()
        deadline = time.monotonic() + 60
        while server.get_metrics().get("external/num_busy_replies", {}).get("value", 0) == 0:
            assert time.monotonic() < deadline and not errors, ("no busy reply", errors)
            time.sleep(0.05)
        # memory stays bounded: the bound, plus a chunk accepted just under it, plus the stream's frame
        assert server.chunks.pending_steps <= 60 + 2 * server.x.fragment_length
        assert server.stop_streaming(timeout_s=10)  # the blocked send gives up; its chunks wait here again
        assert not server.is_streaming() and client.unacknowledged > 0
        # Committed so far: what ZeroMQ took. The frames its socket still queued went with it (the
        # stream's documented window, as for an env runner's stream); nothing else may be missing.
        # (the spool first: when an ack comes the client moves the id from its spool to its committed list
        # under the lock ``spooled_ids`` takes; read the other way round, an id moved between the two reads
        # would be in neither, and its frame, dropped with the stopped socket, would be waited for in vain)
        spooled = set(client.spooled_ids())
        committed_at_stop = {k for k in spooled | set(client.committed) if k in server.journal}
        server.start_streaming(puller.address, compress=False)
        received: list = []  # read now: the stream, then the client, go on
        deadline = time.monotonic() + 120
        while player.is_alive() or client.unacknowledged:
            assert time.monotonic() < deadline and not errors, (len(received), client.unacknowledged, errors)
            if puller.poll(50):
                received += puller.receive() or []
        assert not errors, errors
        committed = set(client.committed)
        received += receive_until(puller, lambda got: committed - committed_at_stop <= set(ids(received + got)))
        duplicates = [k for k, n in Counter(ids(received)).items() if n > 1]
        assert not duplicates, f"pushed twice: {duplicates[:5]}"
        assert set(ids(received)) <= committed
        assert committed - set(ids(received)) <= committed_at_stop
        assert len(set(ids(received)) - committed_at_stop) > 0  # the untaken frame and the rest came through
    finally:
        player.join(timeout=120)
        client.close(flush=False)
        server.stop()
        puller.close()
    assert "runnel-stream-0" not in stream_threads()


def test_a_frame_the_stream_could_not_push_goes_back_first_in_line_uncommitted(tmp_path):
    server = make_server(tmp_path)
    client = PolicyClient(server.address, "remote", timeout_s=30)
    try:
        steps = int(sum(run_env(client, gym.make("CartPole-v1"), num_episodes=4, seed=0)))
        deadline = time.monotonic() + 30
        while server.chunks.pending_steps < steps:  # every chunk arrived
            assert time.monotonic() < deadline
            time.sleep(0.05)
        frame = server.take_for_stream(threading.Event())
        frame_steps = sum(len(c) for c in frame)
        assert frame and server.chunks.pending_steps == steps - frame_steps
        server.not_pushed(frame)  # the stream was stopped while the receiver had no room
        assert server.chunks.pending_steps == steps
        assert ids(server.sample(frame_steps)) == ids(frame)  # first in line again
        assert not set(ids(frame)) & set(client.committed)  # and never acknowledged
        stopped = threading.Event()
        stopped.set()
        assert server.take_for_stream(stopped) == []  # a stopped stream takes nothing
    finally:
        client.close(flush=False)
        server.stop()


# --- algorithms -----------------------------------------------------------------------------------
def external(config, address: str, journal: str, **kwargs):
    return (config.environment(**SPACES)
            .external_clients(address=address, journal_dir=journal, sample_wait_s=1.0, **kwargs)
            .reporting(min_time_s_per_iteration=0.5).debugging(seed=0))


def record_received(algo) -> list:
    """Wrap the learner-side receiver to record the id of every chunk it takes off the stream."""
    received: list = []
    puller = algo.plan.receiver.puller
    receive = puller.receive

    def recording():
        chunks = receive()
        received.extend((c.episode_id, c.chunk_index) for c in chunks or ())
        return chunks

    puller.receive = recording
    return received


def train_until(algo, done, max_iterations: int) -> dict:
    """``algo.train()`` until ``done(result)`` or ``max_iterations`` results; the last result."""
    for _ in range(max_iterations):
        result = algo.train()
        if done(result):
            break
    return result


@pytest.mark.slow
def test_appo_trains_from_a_client_of_the_in_driver_server(ray_cluster, tmp_path):
    address = f"tcp://127.0.0.1:{free_port()}"
    algo = external(APPOConfig().env_runners(num_env_runners=0), address, str(tmp_path)).build()
    received = record_received(algo)
    clients = Clients(address, 1)
    try:
        versions, results = [], []
        # until the client acts with broadcast weights and a newer version reached it -- bounded by time, not by
        # a count of iterations: on a loaded machine many iterations may pass before the client's first chunks
        # make a train batch (a fresh clone's suite once saw no update in 40)
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline:
            if len(results) >= 3 and versions[-1] > versions[0] > 0:
                break
            if versions and versions[0] == 0:  # count from the first iteration the client had weights in
                versions, results = [], []
            results.append(algo.train())
            versions.append(clients.clients[0].weights_version)
        last = results[-1]
        assert algo.env_runner_group.local.is_streaming()
        # summed: on a loaded machine the last 1-s iteration may end before the client's next batch is complete
        assert sum(r["num_learner_updates"] for r in results) > 0 and last["num_env_steps_trained_lifetime"] > 0
        assert last["num_env_steps_sampled_lifetime"] > 0 and last["env_runners"]["num_episodes_lifetime"] > 0
        assert last["env_runners"]["episode_return_mean"] > 0
        assert last["stream"]["runner_num_frames_sent"] > 0 and last["stream"]["num_frames_dropped_decode_error"] == 0
        assert 0 <= last["stream"]["weights_lag_mean"] <= last["stream"]["weights_lag_max"]
        assert versions[-1] > versions[0] > 0  # the client acts with the weights the learner broadcast
        assert len(clients.clients[0].committed) > 0
    finally:
        committed, spooled = clients.finish()
        # what the client holds acknowledged was pushed: let the learner side take it off the stream
        deadline = time.monotonic() + 60
        while not committed <= set(received) and time.monotonic() < deadline:
            algo.train()
        algo.stop()
    check_exactly_once(received, committed, spooled)
    assert not committed & spooled
    assert stream_threads() == []


@pytest.mark.slow
def test_impala_trains_from_clients_of_a_server_actor(ray_cluster, tmp_path):
    address = f"tcp://127.0.0.1:{free_port()}"
    algo = external(IMPALAConfig().env_runners(num_env_runners=1), address, str(tmp_path)).build()
    clients = Clients(address, 2)
    try:
        result = algo.train()
        deadline = time.monotonic() + 120
        # an iteration ends on time whether or not the clients have connected yet (a loaded machine)
        while result["num_learner_updates"] == 0 and time.monotonic() < deadline:
            result = algo.train()
        assert algo.env_runner_group.foreach_env_runner(lambda server: server.is_streaming()) == [True]
        assert result["num_learner_updates"] > 0 and result["num_env_steps_sampled_lifetime"] > 0
        assert result["fault_tolerance"]["num_healthy_workers"] == 1
        result = algo.train()
        assert result["env_runners"]["num_episodes_lifetime"] > 0
        assert result["stream"]["runner_num_frames_sent"] > 0
        assert result["stream"]["runner_weights_versions"]["1"] > 0  # broadcasts reach the server
        assert all(c.weights_version > 0 for c in clients.clients)
    finally:
        clients.finish()
        algo.stop()
    assert stream_threads() == []


@pytest.mark.slow
def test_a_killed_server_actor_is_recreated_and_streams_again(ray_cluster, tmp_path):
    address = f"tcp://127.0.0.1:{free_port()}"
    config = external(APPOConfig().env_runners(num_env_runners=1), address, str(tmp_path))
    algo = config.fault_tolerance(delay_between_env_runner_restarts_s=0.1).build()
    clients = Clients(address, 2)
    try:
        sampled = algo.train()["num_env_steps_sampled_lifetime"]
        pid = algo.env_runner_group.foreach_env_runner(lambda server: os.getpid())[0]
        os.kill(pid, signal.SIGKILL)
        result = train_until(algo, lambda r: r["fault_tolerance"]["num_remote_worker_restarts"] >= 1, 60)
        assert result["fault_tolerance"]["num_remote_worker_restarts"] == 1
        sampled = result["num_env_steps_sampled_lifetime"]
        version = algo.weights_version
        # the clients find the new server (reconnect, hello, resend) and go on
        result = train_until(algo, lambda r: r["num_env_steps_sampled_lifetime"] > sampled, 120)
        assert result["num_env_steps_sampled_lifetime"] > sampled
        assert algo.env_runner_group.foreach_env_runner(lambda server: server.is_streaming()) == [True]
        assert algo.env_runner_group.foreach_env_runner(lambda server: server.weights_version)[0] >= version
    finally:
        clients.finish()
        algo.stop()
    assert stream_threads() == []


def test_dqn_with_the_replay_actor_trains_from_a_client(ray_cluster, tmp_path):
    address = f"tcp://127.0.0.1:{free_port()}"
    config = (DQNConfig().env_runners(num_env_runners=0)
              .training(replay_buffer_config={"remote": True, "capacity": 10_000}, train_batch_size_per_learner=32,
                        num_steps_sampled_before_learning_starts=200, training_intensity=1.0))
    algo = external(config, address, str(tmp_path)).build()
    clients = Clients(address, 1)
    try:
        # the sampled count comes with the replay actor's metrics (every env_runner_metrics_interval_s), which
        # on a loaded machine can come after the first updates: wait for both
        result = train_until(algo, lambda r: r["num_learner_updates"] > 0 and r["num_env_steps_sampled_lifetime"] >= 200,
                             40)
        assert algo.env_runner_group.local.is_streaming()
        assert result["num_learner_updates"] > 0
        assert result["num_env_steps_sampled_lifetime"] >= 200  # counted as the replay actor inserts them
        assert result["env_runners"]["num_episodes_lifetime"] > 0
        assert len(clients.clients[0].committed) > 0
    finally:
        clients.finish()
        algo.stop()
    assert stream_threads() == []


def test_streaming_configs_take_external_clients():
    IMPALAConfig().environment(**SPACES).external_clients().validate()
    APPOConfig().environment(**SPACES).external_clients().env_runners(num_env_runners=2).validate()
    remote = {"replay_buffer_config": {"remote": True}}
    DQNConfig().environment(**SPACES).external_clients().training(**remote).env_runners(num_env_runners=0).validate()
    with pytest.raises(ConfigError, match="remote=True needs num_env_runners"):  # env runners still need actors
        DQNConfig().environment("CartPole-v1").training(**remote).env_runners(num_env_runners=0).validate()
    # remote learners: policy server slot i feeds learner i mod n, as env runner i would
    APPOConfig().environment(**SPACES).external_clients().env_runners(num_env_runners=2).learners(num_learners=2).validate()
    IMPALAConfig().environment(**SPACES).external_clients().env_runners(num_env_runners=0).learners(num_learners=1).validate()
    with pytest.raises(ConfigError, match=r"num_learners=2 needs num_env_runners >= 2.*own policy server slots"):
        APPOConfig().environment(**SPACES).external_clients().env_runners(num_env_runners=1).learners(num_learners=2).validate()


# --- remote learners: each policy server slot feeds its own learner ---------------------------------
def two_servers_two_learners(tmp_path, callbacks, **fault_tolerance):
    """IMPALA with 2 policy server slots and 2 learner actors, and 2 client threads on each server."""
    port = free_ports(2)
    config = external(IMPALAConfig().env_runners(num_env_runners=2).learners(num_learners=2)
                      .training(train_batch_size_per_learner=200, minibatch_size=100).callbacks(callbacks),
                      f"tcp://127.0.0.1:{port}", str(tmp_path))
    algo = config.fault_tolerance(**fault_tolerance).build()
    return algo, [Clients(f"tcp://127.0.0.1:{port + k}", 2) for k in range(2)]


def finish_all(clients: list) -> list[tuple[set, set]]:
    """Every server's clients stopped, all of them even if one raises: (acknowledged, spooled) per server."""
    out, errors = [], []
    for c in clients:
        try:
            out.append(c.finish())
        except BaseException as err:  # noqa: BLE001 - raised below, once all are stopped
            errors.append(err)
    if errors:
        raise errors[0]
    return out


@pytest.mark.slow
def test_two_impala_learners_each_train_their_own_servers_clients_chunks_once(ray_cluster, tmp_path):
    algo, clients = two_servers_two_learners(tmp_path, RecordTrainedChunks)
    try:
        results = [algo.train()]
        deadline = time.monotonic() + 180  # clients connect and fill batches on their own time on a loaded machine
        while algo.weights_version < 5 and time.monotonic() < deadline:
            results.append(algo.train())
        trained = algo.learner_group.foreach_learner(lambda l: l.callbacks.trained)
        weights = algo.learner_group.foreach_learner(lambda l: l.get_weights())
        versions = [c.weights_version for cs in clients for c in cs.clients]
    finally:
        acknowledged = finish_all(clients)
        algo.stop()
    assert algo.weights_version >= 5, algo.weights_version
    for k in weights[0]:  # gradients averaged every minibatch
        np.testing.assert_array_equal(weights[0][k], weights[1][k])
    assert min(versions) > 0  # learner 0's broadcasts reach both servers' clients
    # server slot i streams to learner i mod 2: learner 0 trains slot 2's clients' chunks, learner 1 slot 1's
    for rank, pieces in enumerate(trained):
        assert pieces and {p[4] for p in pieces} == {2 - rank}, (rank, {p[4] for p in pieces})
        committed, spooled = acknowledged[1 - rank]  # slot 2 - rank's clients
        assert {p[:2] for p in pieces} <= committed | spooled  # a chunk trains only once pushed, which commits it
    pieces = [p for ps in trained for p in ps]
    assert len({p[:3] for p in pieces}) == len(pieces)  # no piece of a chunk twice, across the learners
    steps = [sum(p[3] for p in ps) for ps in trained]
    assert steps[0] == steps[1] == 200 * algo.weights_version  # each learner its batch of 200 per update
    assert results[-1]["num_env_steps_trained_lifetime"] == sum(steps)
    assert results[-1]["stream"]["num_chunks_dropped_invalid"] == 0
    assert stream_threads() == []


@pytest.mark.slow
def test_a_killed_learner_is_rebuilt_and_its_policy_server_repointed(ray_cluster, tmp_path):
    shutil.rmtree(trained_dir(), ignore_errors=True)
    algo, clients = two_servers_two_learners(tmp_path, RecordTrainedToFiles)
    try:
        result = algo.train()
        deadline = time.monotonic() + 180
        while algo.weights_version < 2 and time.monotonic() < deadline:
            result = algo.train()
        assert algo.weights_version >= 2, algo.weights_version
        old_address = algo.plan.feeds.addresses[1]
        kill_learner(algo, 1)
        deadline = time.monotonic() + 180
        while fault_tolerance(result)["num_learner_recoveries"] == 0 and time.monotonic() < deadline:
            result = algo.train()
        version = algo.weights_version
        deadline = time.monotonic() + 180
        while algo.weights_version <= version and time.monotonic() < deadline:  # the new learner gets batches
            result = algo.train()
        assert algo.weights_version > version
        ft = fault_tolerance(result)
        assert ft["num_learner_recoveries"] == 1 and ft["num_learner_restarts"] == 1
        # what server slot 1 had pushed to the dead learner and it never trained: counted from the server's totals
        assert ft["num_env_steps_lost_with_learners"] > 0
        new_address = algo.plan.feeds.addresses[1]
        assert new_address != old_address
        totals = algo.env_runner_group.foreach_env_runner(lambda server: server.stream_totals())
        assert totals[0][old_address] > 0 and totals[0][new_address] > 0 and old_address not in totals[1]
        pids = algo.learner_group.foreach_learner(lambda learner: os.getpid())
    finally:
        finish_all(clients)
        algo.stop()
    pieces = trained_pieces()
    (dead,) = [key for key in pieces if key[0] == 1 and key[1] != pids[1]]
    new, survivor = pieces[1, pids[1]], pieces[0, pids[0]]
    # no piece trained by two learners, the dead one and its replacement included; each its own server's
    assert new and pieces[dead] and not new & pieces[dead] and not survivor & (new | pieces[dead])
    assert {p[3] for p in new | pieces[dead]} == {"1"} and {p[3] for p in survivor} == {"2"}
    assert stream_threads() == []


# --- learning: 4 client processes ------------------------------------------------------------------
CLIENT_SCRIPT = """
import sys
import gymnasium as gym
from protocols.client import PolicyClient, run_env
address, index, seed = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
env = gym.make("CartPole-v1")
client = PolicyClient(address, "remote", timeout_s=600, seed=seed * 100 + index)
episode = 0
while True:
    run_env(client, env, num_episodes=1, seed=seed * 100_000 + index * 10_000 + episode)
    episode += 1
"""


class ClientProcesses:
    """``n`` OS processes, each playing CartPole through its own ``PolicyClient`` (remote inference)
    until the ``with`` block ends; then they are killed, whatever happened."""

    def __init__(self, address: str, n: int = 4, seed: int = 0) -> None:
        self.address, self.n, self.seed = address, n, seed
        self.procs: list[subprocess.Popen] = []
        self.logs: list = []

    def __enter__(self) -> "ClientProcesses":
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (ROOT, os.environ.get("PYTHONPATH")) if p)}
        try:
            for i in range(self.n):
                log = tempfile.TemporaryFile()
                self.logs.append(log)
                self.procs.append(subprocess.Popen(
                    [sys.executable, "-c", CLIENT_SCRIPT, self.address, str(i), str(self.seed)],
                    stdout=log, stderr=subprocess.STDOUT, env=env, cwd=ROOT))
        except BaseException:
            self.__exit__()
            raise
        return self

    def check(self) -> None:
        """Raise if a client process ended (they play until killed), with what it printed."""
        for p, log in zip(self.procs, self.logs):
            if p.poll() is not None:
                log.seek(0)
                raise RuntimeError(f"client process {p.pid} exited with {p.returncode}:\n"
                                   f"{log.read().decode(errors='replace')[-3000:]}")

    def __exit__(self, *exc) -> None:
        for p in self.procs:
            if p.poll() is None:
                p.kill()
        for p in self.procs:
            p.wait(timeout=60)
        for log in self.logs:
            log.close()


def train_to(algo, clients: ClientProcesses, target: float, max_steps: int) -> dict:
    """Train until the mean return reaches ``target`` or ``max_steps`` env steps were sampled.

    Prints a line per iteration: pytest shows the captured lines when the test fails, a timeout
    included, so a slow run can be told from one that does not learn."""
    t0 = last = time.monotonic()
    while True:
        result = algo.train()
        clients.check()
        ret = result["env_runners"].get("episode_return_mean", 0)
        done = ret >= target or result["num_env_steps_sampled_lifetime"] >= max_steps
        if done or time.monotonic() - last >= 5:  # a line every 5 s keeps a long run's record short
            last = time.monotonic()
            print(f"{last - t0:7.1f} s  {result['num_env_steps_sampled_lifetime']:>9} env steps  "
                  f"return {ret:6.1f}", flush=True)
        if done:
            return result


@pytest.mark.learning
@pytest.mark.parametrize("config_cls", [APPOConfig, pytest.param(IMPALAConfig, marks=pytest.mark.seeds)],
                         ids=["APPO", "IMPALA"])
def test_cartpole_reaches_450_from_4_client_processes(ray_cluster, tmp_path, config_cls):
    address = f"tcp://127.0.0.1:{free_port()}"
    algo = external(config_cls().env_runners(num_env_runners=1), address, str(tmp_path)).build()
    try:
        with ClientProcesses(address, 4, seed=0) as clients:
            result = train_to(algo, clients, 450, 1_500_000)
    finally:
        algo.stop()
    assert result["env_runners"]["episode_return_mean"] >= 450, \
        f"mean return {result['env_runners']['episode_return_mean']} after {result['num_env_steps_sampled_lifetime']} steps"
    assert result["stream"]["num_chunks_dropped_invalid"] == 0
    assert stream_threads() == []
