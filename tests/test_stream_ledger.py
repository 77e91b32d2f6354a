"""The chunk stream's accounting (protocols/stream_ledger.py, through ChunkPuller and ChunkReceiver):
a chunk received twice is dropped and counted, skipped chunk indices are counted, a lost sender's open
episodes are counted as cut, and every step received is batched once or still pending.

No Ray: a ChunkSender pushes to a ChunkReceiver over TCP on loopback, as in tests/test_stream.py."""
import time

import gymnasium as gym
import numpy as np
import pytest

from actors.learner.loader import ChunkReceiver
from protocols import EpisodeChunk
from protocols.stream_ledger import StreamLedger
from protocols.transport import ChunkSender

OBS_SPACE = gym.spaces.Box(-10, 10, (2,), np.float32)
ACT_SPACE = gym.spaces.Discrete(2)


def chunk(episode, index, steps=3, done=False):
    return EpisodeChunk(episode_id=episode, chunk_index=index, obs=np.zeros((steps + 1, 2), np.float32),
                        actions=np.zeros(steps, np.int64), rewards=np.ones(steps, np.float32), terminated=done,
                        extra={"action_logp": np.zeros(steps, np.float32)})


def test_a_chunk_seen_before_is_a_duplicate_and_a_skipped_index_is_counted_missing():
    ledger = StreamLedger()
    assert ledger.admit("a", chunk("e1", 0)) and ledger.admit("a", chunk("e1", 1))
    assert not ledger.admit("a", chunk("e1", 1))  # resent
    assert not ledger.admit("a", chunk("e1", 0))
    assert ledger.admit("a", chunk("e1", 4))  # 2 and 3 never came: kept, counted
    assert ledger.admit("a", chunk("e1", 5, done=True))
    assert not ledger.admit("a", chunk("e1", 5, done=True))  # a late copy of a finished episode's chunk
    assert ledger.admit("b", chunk("e9", 7))  # a stream joined mid-episode: nothing missing
    c = ledger.counters
    assert (c["num_chunks_dropped_duplicate"], c["num_chunks_missing"]) == (3, 2)
    assert ledger.num_open() == 1  # e9; e1 ended


def test_a_lost_sender_has_its_open_episodes_counted_as_cut():
    ledger = StreamLedger()
    for e in ("e1", "e2", "e3"):
        ledger.admit("runner-1", chunk(e, 0))
    ledger.admit("runner-1", chunk("e3", 1, done=True))
    ledger.admit("runner-2", chunk("f1", 0))
    assert ledger.sender_lost("runner-1") == 2
    assert ledger.counters["num_episodes_cut"] == 2 and ledger.counters["num_fragments_lost"] == 1
    assert not ledger.admit("runner-1", chunk("e1", 0))  # what it sent stays known: no second copy
    assert ledger.num_open() == 1  # runner 2's episode goes on


def test_open_episodes_are_capped_per_sender_and_forget_accepts_everything_again():
    ledger = StreamLedger(max_open=2)
    for e in ("e1", "e2", "e3"):
        ledger.admit("a", chunk(e, 0))
    assert ledger.num_open() == 2 and ledger.counters["num_episodes_forgotten"] == 1
    ledger.forget()
    assert ledger.num_open() == 0 and ledger.admit("a", chunk("e2", 0))
    with pytest.raises(ValueError, match="max_open must be >= 1"):
        StreamLedger(max_open=0)


def stats_when(rec, cond, timeout=20.0):
    deadline = time.monotonic() + timeout
    while True:
        s = rec.stats()
        if cond(s):
            return s
        assert time.monotonic() < deadline, f"receiver stats never got there: {s}"
        time.sleep(0.01)


def test_a_frame_sent_twice_is_received_once_and_every_step_is_batched_or_pending():
    rec = ChunkReceiver(OBS_SPACE, ACT_SPACE, batch_size=4, queue_size=16, hwm=8, host="127.0.0.1").start()
    sender = ChunkSender(rec.address, "env-runner-3", hwm=8)
    try:
        first = [chunk("e1", 0), chunk("e2", 0)]
        sender.send(first)
        sender.send(first)  # a resend: must not be trained twice
        sender.send([chunk("e1", 1, done=True)])
        s = stats_when(rec, lambda s: s["num_frames_received"] == 3)
        assert s["num_chunks_dropped_duplicate"] == 2
        assert s["num_chunks_received"] == 3 and s["num_env_steps_received"] == 9
        assert s["num_env_steps_received"] == s["num_env_steps_batched"] + s["num_env_steps_pending"]
        assert s["num_env_steps_batched"] == 8  # two batches of 4, one step pending
        assert rec.dropped_by_sender["env-runner-3"] == 1
        assert rec.sender_lost("env-runner-3") == 1  # e2 was open
        assert rec.stats()["num_episodes_cut"] == 1
    finally:
        sender.close()
        rec.close()
