"""Chunk streams over ZeroMQ (protocols/transport.py, actors/learner/loader.py, actors/env/streaming.py):
round trip, bad frames, back-pressure, runner streaming.

Everything runs in this process (no Ray): a ChunkSender or a local EnvRunner pushes to a
ChunkReceiver over TCP on loopback. Waits poll for a condition with a deadline; nothing is timed.
"""
import dataclasses
import logging
import threading
import time

import gymnasium as gym
import numpy as np
import pytest
import zmq

from actors.env import EnvRunner, EnvRunnerSettings
from actors.learner import ChunkBatch
from actors.learner.loader import ChunkReceiver
from protocols import EpisodeChunk, ProtocolError, encode
from protocols.schema import ChunkSchema
from protocols.transport import ChunkSender
from tests.envs import CountingEnv, DictObsEnv, FlakyEnv

OBS_SPACE = gym.spaces.Box(0, 1e6, (1,), np.float32)
ACT_SPACE = gym.spaces.Discrete(2)


def wait_for(cond, timeout=20.0, what="condition"):
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.01)


def counting_chunks(num_envs=3, fragments=4, length=7, fragment_len=5):
    settings = EnvRunnerSettings(env_creator=lambda ctx: CountingEnv(ctx), env_config={"length": length},
                                 num_envs=num_envs, rollout_fragment_length=fragment_len, seed=0)
    r = EnvRunner(settings, worker_index=1)
    return [r.sample() for _ in range(fragments)]


@pytest.fixture
def receiver():
    rec = ChunkReceiver(OBS_SPACE, ACT_SPACE, batch_size=12, queue_size=64, hwm=8, host="127.0.0.1").start()
    yield rec
    rec.close()


@pytest.fixture
def sender(receiver):
    s = ChunkSender(receiver.address, "env-runner-7", hwm=8)
    yield s
    s.close()


def drain(rec, n_steps, timeout=20.0):
    got, steps = [], 0
    deadline = time.monotonic() + timeout
    while steps < n_steps:
        b = rec.get_batch(timeout=0.1)
        if b is not None:
            got.append(b)
            steps += b.num_steps
        assert time.monotonic() < deadline, f"only {steps} of {n_steps} steps arrived"
    return got


def glue(parts):
    """The pieces of one chunk split across batches (same episode_id and chunk_index, consecutive t_started)."""
    for a, b in zip(parts, parts[1:]):
        assert (b.episode_id, b.chunk_index, b.t_started) == (a.episode_id, a.chunk_index, a.t_started + len(a))
        assert not a.is_done
        np.testing.assert_array_equal(a.obs[-1], b.obs[0])
    last = parts[-1]
    return EpisodeChunk(parts[0].episode_id, parts[0].chunk_index,
                        obs=np.concatenate([parts[0].obs] + [p.obs[1:] for p in parts[1:]]),
                        actions=np.concatenate([p.actions for p in parts]),
                        rewards=np.concatenate([p.rewards for p in parts]),
                        terminated=last.terminated, truncated=last.truncated,
                        extra={"action_logp": np.concatenate([p.extra["action_logp"] for p in parts])},
                        t_started=parts[0].t_started, weights_version=parts[0].weights_version,
                        env_runner_index=parts[0].env_runner_index)


def test_round_trip_keeps_chunks_intact_and_cuts_exact_batches(receiver, sender):
    fragments = counting_chunks()
    for k, frag in enumerate(fragments):
        for c in frag:
            c.weights_version = 100 + k
        assert sender.send(frag)
    sent = [c for frag in fragments for c in frag]
    total = sum(len(c) for c in sent)  # 4 fragments * 3 envs * 5 steps = 60 = 5 batches of 12
    batches = drain(receiver, total)
    assert [b.num_steps for b in batches] == [12] * 5
    received = [c for b in batches for c in b]
    # chunks split at batch boundaries glue back into exactly what was sent, in order
    glued, i = [], 0
    for c in sent:
        parts, n = [], 0
        while n < len(c):
            parts.append(received[i])
            n += len(received[i])
            i += 1
        assert n == len(c)
        glued.append(glue(parts))
    assert i == len(received)
    for a, b in zip(sent, glued):
        assert (a.episode_id, a.chunk_index, a.t_started, a.terminated, a.truncated) == \
               (b.episode_id, b.chunk_index, b.t_started, b.terminated, b.truncated)
        assert b.weights_version == a.weights_version and b.env_runner_index == 1
        np.testing.assert_array_equal(a.obs, b.obs)
        np.testing.assert_array_equal(a.actions, b.actions)
        np.testing.assert_array_equal(a.rewards, b.rewards)
        np.testing.assert_array_equal(a.extra["action_logp"], b.extra["action_logp"])
    # the loader laid each batch out for the learner already
    b0 = batches[0]
    assert isinstance(b0, ChunkBatch) and b0.batch is not None and len(b0.batch) == 12
    np.testing.assert_array_equal(b0.batch.weights_versions, np.repeat([c.weights_version for c in b0], [len(c) for c in b0]))
    s = receiver.stats()
    assert s["num_frames_received"] == 4 and s["num_env_steps_received"] == 60
    assert s["num_frames_dropped_decode_error"] == s["num_chunks_dropped_invalid"] == 0


def test_chunks_older_than_max_weights_lag_are_dropped_and_counted():
    """The consumer at version 10 with max_weights_lag=3: fragments of versions 5 and 6 are dropped and
    counted, 7 and 8 batched; with no bound (the default) nothing is dropped."""
    fragments = counting_chunks()  # 4 fragments of 3 envs x 5 steps
    for bound, kept_versions in ((3, [7, 8]), (None, [5, 6, 7, 8])):
        rec = ChunkReceiver(OBS_SPACE, ACT_SPACE, batch_size=15, queue_size=8, hwm=8, host="127.0.0.1",
                            max_weights_lag=bound).start()
        sender = ChunkSender(rec.address, "env-runner-1", hwm=8)
        try:
            rec.set_weights_version(10)
            for k, frag in enumerate(fragments):
                for c in frag:
                    c.weights_version = 5 + k
                assert sender.send(frag)
            batches = drain(rec, 15 * len(kept_versions))
            # the receiver has read every frame once it counted them all; nothing more is batched after
            wait_for(lambda: rec.stats()["num_frames_received"] == 4, what="all four frames read")
            assert rec.get_batch(timeout=0) is None
            assert sorted({c.weights_version for b in batches for c in b}) == kept_versions
            s = rec.stats()
            stale = [c for frag in fragments for c in frag if c.weights_version not in kept_versions]
            assert s["num_chunks_dropped_stale"] == len(stale)
            assert s["num_env_steps_dropped_stale"] == sum(len(c) for c in stale) == 15 * (4 - len(kept_versions))
        finally:
            sender.close()
            rec.close()
    with pytest.raises(ValueError, match=r"max_weights_lag must be None or an int >= 0, got -1"):
        ChunkReceiver(OBS_SPACE, ACT_SPACE, batch_size=15, max_weights_lag=-1)


def test_bad_frames_are_counted_dropped_and_logged_once_naming_the_sender(receiver, caplog):
    good = counting_chunks(fragments=1)[0]  # 15 steps
    frame = encode(good)
    wrong_version = bytearray(frame)
    wrong_version[4] = 99  # header: magic (4 bytes), then the version byte
    bad_shape = EpisodeChunk("ep-x", 0, obs=np.zeros((4, 3), np.float32), actions=np.zeros(3, np.int64),
                             rewards=np.ones(3, np.float32), extra={"action_logp": np.zeros(3, np.float32)})
    no_logp = EpisodeChunk("ep-y", 0, obs=np.zeros((4, 1), np.float32), actions=np.zeros(3, np.int64),
                           rewards=np.ones(3, np.float32))
    ctx = zmq.Context()
    push = ctx.socket(zmq.DEALER)
    push.connect(receiver.address)
    seq = (1).to_bytes(8, "little")
    try:
        with caplog.at_level(logging.WARNING, logger="protocols.transport"):
            push.send_multipart([b"env-runner-3", seq, b"\x00garbage" * 10])  # corrupt
            push.send_multipart([b"env-runner-4", seq, bytes(wrong_version)])  # wrong codec version
            push.send_multipart([b"env-runner-5", seq, encode([bad_shape] + good[:1])])  # one chunk of two wrong
            push.send_multipart([b"env-runner-6", seq, encode(no_logp)])  # lacks the behaviour log-probs
            push.send_multipart([b"only-one-part"])  # no [sender, seq, frame] envelope
            push.send_multipart([b"env-runner-7", b"\x01", frame])  # a seq of the wrong width
            push.send_multipart([b"env-runner-8", seq, encode({"hello": 1})])  # a message, not chunks
            push.send_multipart([b"env-runner-9", seq, frame])  # the loader goes on: this one arrives
            wait_for(lambda: receiver.counters["num_frames_received"] == 8, what="8 frames")
    finally:
        push.close(linger=0)
        ctx.term()
    s = receiver.stats()
    assert s["num_frames_dropped_decode_error"] == 2
    assert s["num_chunks_dropped_invalid"] == 2
    assert s["num_frames_dropped_bad_envelope"] == 2
    assert s["num_frames_dropped_not_chunks"] == 1
    assert s["num_env_steps_dropped"] == 6
    assert s["num_env_steps_received"] == len(good[0]) + 15  # the good chunk beside the bad one, and the good frame
    lines = [r.getMessage() for r in caplog.records if r.name == "protocols.transport"]
    assert len(lines) == 7, lines
    for sender_id in ("env-runner-3", "env-runner-4", "env-runner-5", "env-runner-6", "only-one-part", "env-runner-7",
                      "env-runner-8"):
        assert sum(sender_id in line for line in lines) == 1, (sender_id, lines)
    assert any("version 99" in line for line in lines)
    assert any("shape (4, 3)" in line and "(4, 1)" in line for line in lines)
    assert any("action_logp" in line for line in lines)
    assert dict(receiver.dropped_by_sender)["env-runner-5"] == 1
    assert drain(receiver, 12)  # the good data still makes batches


def test_space_checker_nested_observations():
    env = DictObsEnv()
    checker = ChunkSchema.for_spaces(env.observation_space, env.action_space)
    settings = EnvRunnerSettings(env_creator=lambda ctx: DictObsEnv(ctx), num_envs=2, rollout_fragment_length=4, seed=0)
    chunks = EnvRunner(settings, worker_index=1).sample()
    for c in chunks:
        checker.check(c)
    c = chunks[0]
    c.obs = {k: v for k, v in c.obs.items() if k != "noise"}
    with pytest.raises(ProtocolError, match="keys"):
        checker.check(c)


def rss_bytes():
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    return 0


def test_stalled_consumer_blocks_the_sender_and_memory_stays_bounded():
    """The slow-learner case: nobody takes batches, the sender must block after a bounded number of frames."""
    frame_steps = 64
    obs_space = gym.spaces.Box(-np.inf, np.inf, (4096,), np.float32)  # ~1 MiB of random floats per frame
    rec = ChunkReceiver(obs_space, ACT_SPACE, batch_size=frame_steps, queue_size=1, hwm=2, rcvbuf=256 * 1024,
                        host="127.0.0.1").start()
    sender = ChunkSender(rec.address, "env-runner-1", hwm=2, sndbuf=256 * 1024, compress=False)
    rng = np.random.default_rng(0)
    chunk = EpisodeChunk("ep", 0, obs=rng.normal(size=(frame_steps + 1, 4096)).astype(np.float32),
                         actions=np.zeros(frame_steps, np.int64), rewards=np.ones(frame_steps, np.float32),
                         extra={"action_logp": np.zeros(frame_steps, np.float32)})
    stop = threading.Event()

    def produce():  # a fresh frame each time, as a runner encodes each fragment (zero-copy sends of one
        index = 0  # bytes object would hide any growth); the next chunk of the episode each time (a
        while not stop.is_set():  # repeated one is dropped as a duplicate)
            index += 1
            if not sender.send(dataclasses.replace(chunk, chunk_index=index), stop):
                return

    rss0 = rss_bytes()
    t = threading.Thread(target=produce, daemon=True)
    t.start()
    try:
        # the consumer stalls: the queue is full and the loader holds the next batch, reading nothing more;
        # then the sender finds every buffer on the way full and waits for room (it never would with an
        # unbounded buffer on the way: the wait times out)
        wait_for(lambda: rec.qsize() == 1 and rec.batches_waiting_for_room() == 1 and sender.waiting_for == "room",
                 timeout=30, what="the sender to block with the consumer stalled")
        stalled_at = sender.frames_sent
        # 1 queued batch + 1 batch waiting to be queued + 2 (DEALER hwm) + 2 (ROUTER hwm) + kernel buffers
        assert stalled_at <= 12, f"{stalled_at} frames in flight with a stalled consumer"
        growth = rss_bytes() - rss0
        assert growth < 48 * 2**20, f"RSS grew by {growth / 2**20:.0f} MiB"
        assert sender.blocked_s > 0
        # the consumer resumes: frames flow again
        for _ in range(3):
            assert rec.get_batch(timeout=10) is not None
        wait_for(lambda: sender.frames_sent > stalled_at, what="the sender to resume")
    finally:
        stop.set()
        t.join(10)
        sender.close()
        rec.close()
    assert not t.is_alive()


def numbered_chunk(index, steps=8):
    return EpisodeChunk("ep", index, obs=np.arange(steps + 1, dtype=np.float32)[:, None],
                        actions=np.zeros(steps, np.int64), rewards=np.ones(steps, np.float32),
                        extra={"action_logp": np.zeros(steps, np.float32)})


class Producer:
    """Sends the next chunk of one episode, frame after frame, from a thread of its own (as a runner's
    stream does) until stopped."""

    def __init__(self, sender):
        self.sender, self.stop = sender, threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self):
        index = 0
        while self.sender.send([numbered_chunk(index)], self.stop):
            index += 1

    def close(self):
        self.stop.set()
        self.thread.join(10)
        assert not self.thread.is_alive()


def test_a_stalled_consumer_stops_a_windowed_sender_after_exactly_its_window_of_frames():
    """Credit-based flow control: with one batch per frame, a queue of one and a window of 3 the sender
    stops at 1 (queued) + 1 (batched, waiting for room) + 3 (sent, not read) frames, whatever the buffers."""
    rec = ChunkReceiver(OBS_SPACE, ACT_SPACE, batch_size=8, queue_size=1, hwm=64, host="127.0.0.1").start()
    sender = ChunkSender(rec.address, "env-runner-1", hwm=64, window=3)
    producer = Producer(sender)
    try:
        wait_for(lambda: sender.waiting_for == "credit" and sender.frames_sent == 5, what="the sender to wait for credit")
        assert sender.frames_unacknowledged == 3
        assert rec.stats()["num_frames_received"] == 2 and rec.qsize() == 1
        for expected in range(3):  # each batch taken lets the loader read one frame, which frees one credit
            batch = rec.get_batch(timeout=10)
            assert batch is not None and batch.num_steps == 8
            wait_for(lambda: sender.frames_sent == 6 + expected and sender.waiting_for == "credit",
                     what=f"frame {6 + expected} sent after a batch was taken")
        assert sender.counters()["num_credit_resets"] == 0 and sender.blocked_s > 0
    finally:
        producer.close()
        sender.close()
        rec.close()


def test_acknowledgments_free_credits_and_a_forged_one_lends_none():
    """A bare ROUTER stands in for the receiver: the sender waits after its window, an ack of seq 1 frees
    one frame, and an ack naming a seq never sent frees only what was sent."""
    ctx = zmq.Context()
    router = ctx.socket(zmq.ROUTER)
    port = router.bind_to_random_port("tcp://127.0.0.1")
    sender = ChunkSender(f"tcp://127.0.0.1:{port}", "env-runner-2", window=2)
    producer = Producer(sender)
    try:
        wait_for(lambda: sender.waiting_for == "credit" and sender.frames_sent == 2, what="a full window")
        peer, sender_id, seq, _frame = router.recv_multipart()
        assert sender_id == b"env-runner-2" and int.from_bytes(seq, "little") == 1
        router.send_multipart([peer, seq])
        wait_for(lambda: sender.frames_sent == 3 and sender.waiting_for == "credit", what="one frame more")
        router.send_multipart([peer, (10**6).to_bytes(8, "little")])  # acknowledges 3 frames at most
        wait_for(lambda: sender.frames_sent == 5 and sender.waiting_for == "credit", what="two frames more")
        assert sender.frames_unacknowledged == 2
        router.send_multipart([peer, b"not a seq"])  # ignored
        router.send_multipart([peer, (2).to_bytes(8, "little")])  # older than what was acknowledged: no credit
        router.send_multipart([peer, (4).to_bytes(8, "little")])  # frees one; read after the two above, in order
        wait_for(lambda: sender.frames_sent >= 6 and sender.waiting_for == "credit", what="one frame more")
        assert sender.frames_sent == 6 and sender.frames_unacknowledged == 2
    finally:
        producer.close()
        sender.close()
        router.close(linger=0)
        ctx.term()


def test_a_sender_that_hears_no_acknowledgment_takes_its_credits_back_and_says_so(caplog):
    ctx = zmq.Context()
    router = ctx.socket(zmq.ROUTER)  # never reads: as if the connection had dropped the frames
    port = router.bind_to_random_port("tcp://127.0.0.1")
    sender = ChunkSender(f"tcp://127.0.0.1:{port}", "env-runner-3", window=1, ack_timeout_s=0.2)
    with caplog.at_level(logging.WARNING, logger="protocols.transport"):
        producer = Producer(sender)
        try:
            wait_for(lambda: sender.counters()["num_credit_resets"] >= 2, what="two credit resets")
            assert sender.frames_sent >= 3
        finally:
            producer.close()
            sender.close()
            router.close(linger=0)
            ctx.term()
    lines = [r.getMessage() for r in caplog.records if "no acknowledgment" in r.getMessage()]
    assert len(lines) == 1 and "env-runner-3" in lines[0] and "1 frame(s) unacknowledged" in lines[0], lines
    with pytest.raises(ValueError, match=r"window must be None or an int >= 1 .* got 0"):
        ChunkSender(f"tcp://127.0.0.1:{port}", "x", window=0)


def local_runner(env_cls=CountingEnv, env_config=None, num_envs=2, fragment=10):
    settings = EnvRunnerSettings(env_creator=lambda ctx: env_cls(ctx), env_config=env_config or {"length": 25},
                                 num_envs=num_envs, rollout_fragment_length=fragment, seed=0)
    return EnvRunner(settings, worker_index=1)


def test_runner_streams_applies_weights_between_fragments_and_stops():
    r = local_runner()
    rec = ChunkReceiver(r.observation_space, r.action_space, batch_size=20, queue_size=2, hwm=2, host="127.0.0.1").start()
    try:
        weights = r.get_weights()
        r.start_streaming(rec.address, hwm=2)
        assert r.is_streaming()
        assert rec.get_batch(timeout=20) is not None
        r.set_weights(weights, 5)  # while streaming: applied before the next fragment
        # every batch is one fragment of one weights version: soon they are all version 5. The
        # episode statistics are read below, so wait for a chunk that ends an episode too: a runner
        # logs an episode before its last chunk leaves (on a busy machine the version-5 batch can
        # come before any 25-step episode has ended)
        deadline = time.monotonic() + 20
        seen_new_weights = seen_an_end = False
        while not (seen_new_weights and seen_an_end):
            b = rec.get_batch(timeout=5)
            if b is not None:
                seen_new_weights |= all(c.weights_version == 5 for c in b)
                seen_an_end |= any(c.is_done for c in b)
            assert time.monotonic() < deadline, "new weights or an episode's end never reached the chunks"
        m = r.get_metrics()
        assert m["weights_version"]["value"] == 5 and m["num_weight_updates_applied"]["value"] == 1
        assert m["stream/runner_num_frames_sent"]["value"] >= 2 and m["num_env_steps_sampled_lifetime"]["value"] >= 40
        assert all(x == 25.0 for x in m["episode_return_mean"]["values"])
        assert r.stop_streaming(timeout_s=10)  # even though the sender is blocked on a full queue
        assert not r.is_streaming()
        assert not [t for t in threading.enumerate() if t.name.startswith("runnel-stream")]
    finally:
        r.stop_streaming()
        rec.close()
    assert not [t for t in threading.enumerate() if t.name.startswith("runnel-chunk-loader")]


def test_a_runner_streams_at_most_its_window_of_fragments_ahead_of_what_the_receiver_read():
    """A runner's stream passes its window on: with 20-step fragments and batches, a queue of one and a window
    of one, it stops at 3 frames (queued, batched and waiting, sent and unread); each batch taken lets one
    more frame through, and at no point has it sent more than one frame beyond what the receiver read."""
    r = local_runner()  # 2 envs x 10 steps
    rec = ChunkReceiver(r.observation_space, r.action_space, batch_size=20, queue_size=1, hwm=8, host="127.0.0.1").start()
    sent = [0]

    def frames_sent():  # the runner's exported counter is a delta since its last export
        sent[0] += r.get_metrics().get("stream/runner_num_frames_sent", {}).get("value", 0)
        return sent[0]

    try:
        r.start_streaming(rec.address, hwm=8, window=1)
        wait_for(lambda: frames_sent() == 3, what="three frames sent")
        for taken in range(1, 6):
            ahead = frames_sent() - rec.stats()["num_frames_received"]  # sent first: read, it can only grow
            assert ahead <= 1, f"{ahead} frames sent beyond what the receiver read"
            assert rec.get_batch(timeout=10) is not None
            wait_for(lambda: frames_sent() == 3 + taken, what=f"frame {3 + taken}")
        assert r.stop_streaming(timeout_s=10)  # while it waits for credit
    finally:
        r.stop_streaming()
        rec.close()


def test_runner_stream_reports_a_failed_env():
    r = local_runner(FlakyEnv, {"fail_on_runners": [1], "fail_at_steps": [30]}, num_envs=1, fragment=10)
    rec = ChunkReceiver(r.observation_space, r.action_space, batch_size=10, queue_size=8, host="127.0.0.1").start()
    try:
        r.start_streaming(rec.address)
        wait_for(lambda: not r.is_streaming(), what="the sampling thread to die")
        with pytest.raises(RuntimeError, match="injected env failure"):
            r.get_metrics()
    finally:
        r.stop_streaming()
        rec.close()
