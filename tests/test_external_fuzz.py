"""Fuzzing the policy server with what EXTERNAL.md says a client may send, and what it may not.

Several raw DEALER sockets (threads) send messages drawn from the protocol's own schemas
(``tests/external_fuzz_model.py``: every client op, every field missing, mistyped, out of range,
NaN, oversize, extra; garbage, truncated and corrupt bodies; chunks breaking section 3's rules) to
one in-process PolicyServer, while a well-behaved PolicyClient plays CartPole beside them. Every
request gets exactly the replies the spec promises -- code, ``fatal``, the ids and fields the code
promises -- and nothing more (a ping after each message is answered next); the server thread never
dies; the good client is served throughout: every act answered with a valid action, every chunk it
sent handed on once and acknowledged, no error for it.
"""
from __future__ import annotations

import logging
import threading
from collections import Counter

import gymnasium as gym
import msgpack
import pytest
import zmq
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from protocols import external as wire
from protocols.client import PolicyClient
from tests import external_fuzz_bodies as bodies
from tests import external_fuzz_model as model
from tests.external_fuzz_model import FATAL, FRAGMENT, MAX_BATCH, MAX_OPEN, Conn, Reply, Step, prelude
from tests.test_external import make_server

CLIENTS = 3
"""Raw sockets fuzzing at once."""
REPLY_TIMEOUT_MS = 20_000
GENERATORS = {"hello": model.gen_hello, "start": model.gen_start, "end": model.gen_end, "weights": model.gen_weights,
              "ping": model.gen_ping, "bye": model.gen_bye, "unknown op": model.gen_unknown_op,
              "unreadable": model.gen_unreadable, "act": bodies.gen_act, "act body": bodies.gen_act_body,
              "batched act": bodies.gen_act_batch, "chunks": bodies.gen_chunks}
KINDS = [kind for kind, weight in (("chunks", 4), ("act", 3), ("act body", 2), ("batched act", 2), ("start", 2),
                                   ("hello", 1), ("end", 1), ("weights", 1), ("ping", 1), ("bye", 1), ("unknown op", 1),
                                   ("unreadable", 1)) for _ in range(weight)]
"""The ops a script draws from, the richer ones more often."""


class GoodClient:
    """A PolicyClient playing CartPole episodes on its own thread until stopped."""

    def __init__(self, address: str) -> None:
        self.client = PolicyClient(address, "remote", timeout_s=60)
        self.steps: dict[str, int] = {}  # episode id -> steps played (finished episodes only)
        self.errors: list[BaseException] = []
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._play, name="good-client")
        self.thread.start()

    def _play(self) -> None:
        env, n = gym.make("CartPole-v1"), 0
        try:
            while not self.stop.is_set():
                obs, _ = env.reset(seed=n)
                n += 1
                eid, steps, done = self.client.start_episode(), 0, False
                while not done:
                    action = self.client.get_action(eid, obs)
                    assert action in (0, 1), f"the good client got action {action!r}"
                    obs, reward, terminated, truncated, _ = env.step(action)
                    self.client.log_returns(eid, float(reward))
                    steps += 1
                    done = terminated or truncated
                self.client.end_episode(eid, obs, truncated=bool(truncated and not terminated))
                self.steps[eid] = steps
        except BaseException as err:  # noqa: BLE001 - reported by the test
            self.errors.append(err)


class Sampler:
    """The algorithm's side: samples the server until stopped (each call commits the previous one)."""

    def __init__(self, server) -> None:
        self.server = server
        self.taken: list[tuple[str, int, int]] = []  # (episode id, chunk index, steps)
        self.errors: list[BaseException] = []
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, name="sampler")
        self.thread.start()

    def _run(self) -> None:
        try:
            while not self.stop.is_set():
                self.taken += [(c.episode_id, c.chunk_index, len(c)) for c in self.server.sample(64)]
        except BaseException as err:  # noqa: BLE001 - reported by the test
            self.errors.append(err)


class Records(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)


def check_reply(got: dict, body: list, want: Reply, rid: int) -> None:
    assert got["op"] == want.op, f"expected {want.code or want.op}"
    assert got["id"] == want.fields.get("id", rid)
    if want.op == wire.ERROR:
        assert got["code"] == want.code, f"expected code {want.code}"
        assert got["fatal"] is (want.code in FATAL)
        assert isinstance(got["message"], str) and got["message"]
        assert want.mentions is None or want.mentions in got["message"], f"the message does not name {want.mentions!r}"
        assert got.get("unparsed", False) is want.fields.get("unparsed", False)
    for key, value in want.fields.items():
        assert got.get(key) == value, f"expected {key} = {value!r}"
    if want.check is not None:
        want.check(got, body)


def play_script(ctx: zmq.Context, address: str, steps: list[Step], probes: list[int], failures: list) -> None:
    """Send each step's message, read exactly its replies, then a ping's (so nothing else came)."""
    sock = ctx.socket(zmq.DEALER)
    sock.linger = 0
    sock.connect(address)

    def receive() -> tuple[dict, list]:
        while True:
            assert sock.poll(REPLY_TIMEOUT_MS), "no reply"
            parts = sock.recv_multipart()
            header = msgpack.unpackb(parts[0], raw=False)
            if not (header.get("op") == wire.COMMITTED and header.get("id") == 0):  # chunks training took
                return header, parts[1:]

    got: dict = {}
    try:
        for step, probe in zip(steps, probes):
            got = {}
            sock.send_multipart(step.parts)
            for want in step.replies:
                got, body = receive()
                check_reply(got, body, want, step.rid)
            sock.send_multipart([msgpack.packb({"op": "ping", "id": probe})])
            got, body = receive()
            check_reply(got, body, Reply(wire.PONG) if step.hello_after else Reply(wire.ERROR, wire.HELLO_FIRST), probe)
    except BaseException as err:  # noqa: BLE001 - reported by the test's thread
        failures.append(f"{step.what}: {type(err).__name__}: {err} -- got {str(got)[:400]}")
    finally:
        sock.close()


def fuzz_round(data: st.DataObject, server, ctx: zmq.Context) -> None:
    scripts = []
    for i in range(CLIENTS):
        conn = Conn()
        steps = prelude(data, conn)
        for _ in range(data.draw(st.integers(1, 12), label=f"client {i} messages")):
            kind = data.draw(st.sampled_from(KINDS), label="op")
            steps.append(GENERATORS[kind](data, conn))
        scripts.append((steps, [conn.rid() for _ in steps]))
    failures: list[str] = []
    threads = [threading.Thread(target=play_script, args=(ctx, server.address, steps, probes, failures))
               for steps, probes in scripts]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert server.error is None, f"the server thread died: {server.error!r}"
    assert not failures, "\n".join(failures)


@pytest.mark.slow
def test_fuzzed_messages_get_the_spec_replies_and_a_good_client_is_served_throughout(tmp_path):
    server = make_server(tmp_path, fragment_length=FRAGMENT, max_batch=MAX_BATCH, max_open_episodes=MAX_OPEN,
                         sample_wait_s=0.2)
    records = Records()
    logging.getLogger("runnel.client").addHandler(records)
    ctx = zmq.Context()
    good = GoodClient(server.address)
    sampler = Sampler(server)
    try:
        @settings(max_examples=300, derandomize=True, database=None, deadline=None,
                  suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
        @given(st.data())
        def fuzz(data: st.DataObject) -> None:
            fuzz_round(data, server, ctx)

        fuzz()
        good.stop.set()
        good.thread.join(timeout=60)
        assert not good.errors, good.errors
        good.client.flush(timeout_s=30)  # every chunk it sent committed: the sampler keeps committing
    finally:
        good.stop.set()
        sampler.stop.set()
        sampler.thread.join(timeout=30)
        good.client.close(flush=False)
        logging.getLogger("runnel.client").removeHandler(records)
        ctx.term()
        server.stop()
    assert not sampler.errors, sampler.errors
    assert server.error is None
    # the good client: every act answered, every chunk handed on exactly once and acknowledged, no error
    assert sum(good.steps.values()) > 0 and good.client.rejected == []
    assert not records.records, [r.getMessage() for r in records.records]
    mine = [(eid, index, steps) for eid, index, steps in sampler.taken if eid in good.steps]
    assert not [k for k, n in Counter((e, i) for e, i, _ in mine).items() if n > 1], "a chunk handed on twice"
    assert sorted(good.client.committed) == sorted((e, i) for e, i, _ in mine)
    taken_steps = Counter()
    for eid, _, steps in mine:
        taken_steps[eid] += steps
    assert dict(taken_steps) == good.steps, "episodes handed on incomplete"
    assert good.client.unacknowledged == 0


if __name__ == "__main__":
    pytest.main([__file__, "-q"])
