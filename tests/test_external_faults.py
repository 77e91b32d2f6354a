"""External clients under faults: the server killed with SIGKILL mid-run (a Ray actor its group
recreates), and every TCP connection cut by a proxy. Afterwards each chunk a client sent was handed
to training exactly once, or is still in that client's spool to be sent again -- never lost,
never trained on twice."""
from __future__ import annotations

import os
import signal
import socket
import threading
from collections import Counter

import gymnasium as gym
import pytest

from pipeline.algorithms.ppo.config import PPOConfig
from protocols.client import PolicyClient, run_env
from tests.test_external import free_port

SPACES = {"observation_space": gym.make("CartPole-v1").observation_space,
          "action_space": gym.make("CartPole-v1").action_space}


class Clients:
    """Client threads playing CartPole through their own PolicyClient until stopped."""

    def __init__(self, address: str, n: int) -> None:
        # unthrottled: a throttled client waits for commits, and none come once the test stops training
        # (tests/test_external_flow.py covers throttling); the server's stale and busy rules still apply
        self.clients = [PolicyClient(address, "remote", timeout_s=120, resend_after_s=1.0, seed=i, throttle=False)
                        for i in range(n)]
        self.stop = threading.Event()
        self.errors: list[BaseException] = []
        self.threads = [threading.Thread(target=self._play, args=(c, i)) for i, c in enumerate(self.clients)]
        for t in self.threads:
            t.start()

    def _play(self, client: PolicyClient, i: int) -> None:
        env = gym.make("CartPole-v1")
        episode = 0
        try:
            while not self.stop.is_set():
                run_env(client, env, num_episodes=1, seed=10_000 * i + episode)
                episode += 1
        except BaseException as err:  # noqa: BLE001 - reported by the test
            self.errors.append(err)

    def finish(self) -> tuple[set, set]:
        """Stop playing; (ids acknowledged, ids still spooled) over all clients."""
        self.stop.set()
        for t in self.threads:
            t.join(timeout=120)
        assert not self.errors, self.errors
        committed, spooled = set(), set()
        for c in self.clients:
            c.close(flush=False)  # first: an acknowledgement arriving between the two reads would hide a chunk
            committed |= set(c.committed)
            spooled |= set(c.spooled_ids())
        return committed, spooled


def count_handed_on(algo) -> list:
    """Wrap the env runner group's ``sample`` to record the id of every chunk training received."""
    received: list = []
    sample = algo.env_runner_group.sample

    def counting(num_timesteps, metrics, explore=None):
        chunks = sample(num_timesteps, metrics, explore)
        received.extend((c.episode_id, c.chunk_index) for c in chunks)
        return chunks

    algo.env_runner_group.sample = counting
    return received


def check_exactly_once(received: list, committed: set, spooled: set) -> None:
    duplicates = [k for k, n in Counter(received).items() if n > 1]
    assert not duplicates, f"trained on twice: {duplicates[:5]}"
    assert committed <= set(received), "acknowledged chunks that training never received"
    assert not committed & spooled
    # everything a client no longer holds reached training; what it holds it will send again
    assert set(received) <= committed | spooled


def small_ppo(address: str, journal: str, **runners):
    return (PPOConfig().environment(**SPACES).env_runners(**runners)
            .training(train_batch_size_per_learner=400, minibatch_size=100, num_epochs=1)
            .fault_tolerance(delay_between_env_runner_restarts_s=0.1)
            # no lag limit: this module checks delivery, and a resent chunk the server refused as stale
            # (PPO's default limit, tests/test_external_flow.py) is dropped by design, neither trained nor spooled
            .external_clients(address=address, journal_dir=journal, fragment_length=40, sample_wait_s=1.0,
                              max_policy_lag=1_000_000)
            .debugging(seed=0))


@pytest.mark.slow
def test_server_killed_with_sigkill_mid_run(ray_cluster, tmp_path):
    address = f"tcp://127.0.0.1:{free_port()}"
    algo = small_ppo(address, str(tmp_path), num_env_runners=1).build()
    received = count_handed_on(algo)
    clients = Clients(address, 2)
    try:
        for _ in range(3):
            algo.train()
        pid = algo.env_runner_group.foreach_env_runner(lambda runner: os.getpid())[0]
        before = len(received)
        os.kill(pid, signal.SIGKILL)
        results = [algo.train() for _ in range(4)]
        assert results[-1]["fault_tolerance"]["num_remote_worker_restarts"] >= 1
        assert len(received) > before  # training went on with the recreated server
    finally:
        committed, spooled = clients.finish()
        algo.stop()
    check_exactly_once(received, committed, spooled)


class CuttingProxy:
    """A TCP proxy that can cut every connection through it at once (both directions, no goodbye)."""

    def __init__(self, upstream_port: int) -> None:
        self.upstream = upstream_port
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port = self.listener.getsockname()[1]
        self.lock = threading.Lock()
        self.conns: list[socket.socket] = []
        self.cuts = 0
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                down, _ = self.listener.accept()
            except OSError:
                return
            up = socket.create_connection(("127.0.0.1", self.upstream))
            with self.lock:
                self.conns += [down, up]
            for a, b in ((down, up), (up, down)):
                threading.Thread(target=self._pump, args=(a, b), daemon=True).start()

    @staticmethod
    def _pump(src: socket.socket, dst: socket.socket) -> None:
        try:
            while data := src.recv(65536):
                dst.sendall(data)
        except OSError:
            pass
        for s in (src, dst):
            try:
                s.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass

    def cut(self, count: bool = True) -> None:
        with self.lock:
            conns, self.conns = self.conns, []
            self.cuts += count
        for s in conns:
            try:
                s.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            s.close()

    def close(self) -> None:
        self.listener.close()
        self.cut(count=False)


@pytest.mark.slow
def test_connections_cut_by_a_proxy(tmp_path):
    port = free_port()
    algo = small_ppo(f"tcp://127.0.0.1:{port}", str(tmp_path), num_env_runners=0).build()
    received = count_handed_on(algo)
    proxy = CuttingProxy(port)
    clients = Clients(f"tcp://127.0.0.1:{proxy.port}", 2)
    try:
        for _ in range(2):
            algo.train()
        for _ in range(3):
            proxy.cut()
            before = len(received)
            algo.train()
            assert len(received) > before
        for _ in range(2):
            algo.train()
    finally:
        committed, spooled = clients.finish()
        algo.stop()
        proxy.close()
    assert proxy.cuts == 3
    check_exactly_once(received, committed, spooled)


if __name__ == "__main__":
    pytest.main([__file__, "-q"])


CLIENT_PROCESS = """
import json, os, sys
import gymnasium as gym
from protocols.client import PolicyClient, run_env
address, spool, log_path, stop_path, seed = sys.argv[1:6]
client = PolicyClient(address, "remote", spool_dir=spool, timeout_s=120, resend_after_s=1.0)
env, logged, episode = gym.make("CartPole-v1"), set(), 0
with open(log_path, "a") as log:  # every chunk id this process spooled, written as it goes
    while not os.path.exists(stop_path):
        run_env(client, env, num_episodes=1, seed=int(seed) * 1000 + episode)
        episode += 1
        new = (set(client.spooled_ids()) | set(client.committed)) - logged
        log.write("".join(json.dumps(list(k)) + "\\n" for k in sorted(new)))
        log.flush()
        logged |= new
client.close(flush=False)
"""


def test_client_killed_with_sigkill_and_restarted(tmp_path):
    import json
    import subprocess
    import sys

    from actors.external.journal import CommitJournal

    port = free_port()
    address = f"tcp://127.0.0.1:{port}"
    algo = small_ppo(address, str(tmp_path / "journal"), num_env_runners=0).build()
    received = count_handed_on(algo)
    spool, log, stop = tmp_path / "spool", tmp_path / "sent.log", tmp_path / "stop"

    def start(seed: int) -> subprocess.Popen:
        return subprocess.Popen([sys.executable, "-c", CLIENT_PROCESS, address, str(spool), str(log), str(stop),
                                 str(seed)], cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

    client = start(1)
    try:
        for _ in range(2):
            algo.train()
        client.send_signal(signal.SIGKILL)
        client.wait()
        client = start(2)  # picks up what the killed one left in the spool directory
        for _ in range(3):
            algo.train()
        stop.touch()
        client.wait(timeout=120)
    finally:
        if client.poll() is None:
            client.kill()
        algo.stop()
    sent = {tuple(json.loads(line)) for line in log.read_text().splitlines()}
    left = set()
    for name in os.listdir(spool):
        if not name.endswith(".chunk"):  # a .chunk.tmp the killed client was writing: never spooled, as its loader skips it
            continue
        stem, _, index = name.removesuffix(".chunk").rpartition("_")
        left.add((bytes.fromhex(stem).decode("ascii"), int(index)))
    duplicates = [k for k, n in Counter(received).items() if n > 1]
    assert not duplicates, f"trained on twice: {duplicates[:5]}"
    assert sent <= set(received) | left, "chunks neither trained on nor still spooled"
    journal = CommitJournal(str(tmp_path / "journal" / f"policy-server-{port}.journal"))
    assert all(k in journal for k in left & set(received)), "trained on, unacknowledged and not journaled"
    journal.close()
