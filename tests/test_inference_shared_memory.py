"""Observations through shared memory between a runner and its inference server on one node: the same
answers as inline observations, the segment's name gone from /dev/shm once the server answered from it,
a server that lost the segment (the runner writes a new one), a server that cannot open any (inline from
then on), forged paths and descriptors refused without stopping the server, and runners on the server's
node using it through Ray."""
import os

import gymnasium as gym
import numpy as np
import pytest
import torch
import zmq

from actors.env import EnvRunnerSettings
from actors.inference.client import RemoteActing
from actors.inference.directory import InferenceDirectory
from actors.inference.server import InferenceServer
from actors.inference.settings import InferenceClientSettings, InferenceSettings
from actors.inference.shared_obs import MIN_BYTES, PREFIX, SHM_DIR, SegmentUnavailable, shared_memory_available
from actors.modules import ActorCriticModule
from protocols import inference as wire
from protocols.errors import ProtocolError

pytestmark = pytest.mark.skipif(not shared_memory_available(), reason="needs a writable /dev/shm")

OBS, ACT = gym.spaces.Box(0, 255, (12_000,), np.uint8), gym.spaces.Discrete(3)
MODEL = {"fcnet_hiddens": [8]}


def frames(n, seed=0):
    return np.random.default_rng(seed).integers(0, 256, (n, *OBS.shape), dtype=np.uint8)


def value(metrics, key):
    return metrics[key]["value"]


class Served:
    def __init__(self):
        settings = EnvRunnerSettings(env_creator=None, observation_space=OBS, action_space=ACT, model_config=MODEL)
        self.server = InferenceServer(settings, InferenceSettings("central"))
        torch.manual_seed(3)
        self.server.set_weights(ActorCriticModule(OBS, ACT, MODEL, inference_only=True).get_state(), 5)
        self.directory = InferenceDirectory()
        self.directory.publish(0, self.server.address())
        self.clients = []

    def client(self, worker_index=1, shared_memory=True):
        c = RemoteActing(InferenceClientSettings(1, self.directory, resend_after_s=5.0, shared_memory=shared_memory),
                         worker_index)
        self.clients.append(c)
        return c

    def counts(self):
        m = self.server.get_metrics()
        return {k: value(m, f"inference/{k}") for k in ("num_requests", "num_shm_requests", "num_shm_unavailable",
                                                          "num_bad_requests")}

    def close(self):
        for c in self.clients:
            c.close()
        self.server.stop()


@pytest.fixture
def served():
    s = Served()
    yield s
    s.close()


def test_blocks_through_shared_memory_answer_as_inline_ones(served):
    shm, inline = served.client(1), served.client(2, shared_memory=False)
    assert frames(4).nbytes >= MIN_BYTES
    for n, seed in ((4, 0), (9, 1), (4, 2)):  # the segment grows for the larger block
        obs = frames(n, seed)
        a = shm.act(obs, False, 0)
        b = inline.act(obs, False, 0)
        np.testing.assert_array_equal(a[0], b[0])
        np.testing.assert_array_equal(a[2], b[2])
        assert a[3] == b[3] == 5
    small = frames(1)  # 12 kB: below MIN_BYTES, inline even with a segment
    assert shm.act(small, False, 0)[0].shape == (1,)
    counts = served.counts()
    assert counts["num_shm_requests"] == 3 and counts["num_requests"] == 7


def test_segment_name_is_gone_once_the_server_answered_and_nothing_is_left_after_close(served):
    client = served.client()
    pid_files = lambda: [f for f in os.listdir(SHM_DIR) if f.startswith(f"{PREFIX}{os.getpid()}-1-")]  # noqa: E731
    client.act(frames(4), True, 0)
    assert client.segment.path is not None and not os.path.exists(client.segment.path)
    assert pid_files() == []
    client.act(frames(20), True, 0)  # a bigger block: a new file, unlinked after its answer too
    assert pid_files() == []
    client.close()
    assert pid_files() == []


def test_a_server_that_lost_the_segment_is_sent_a_new_one(served):
    client = served.client()
    client.act(frames(4), True, 0)
    first = client.segment.path
    served.server.segments.close()  # as a server recreated at the same address would be: the name is gone
    actions, *_ = client.act(frames(4, 1), True, 0)
    assert actions.shape == (4,) and client.segment.path != first
    counts = served.counts()
    assert counts["num_shm_unavailable"] == 1 and counts["num_shm_requests"] == 2


def test_a_server_that_cannot_open_segments_gets_inline_observations(served):
    class NoSharedMemory:
        def view(self, runner, block, lane=0):
            raise SegmentUnavailable("another /dev/shm")

        def close(self):
            pass

    served.server.segments = NoSharedMemory()
    client = served.client()
    actions, *_ = client.act(frames(4), True, 0)  # refused twice, then inline
    assert actions.shape == (4,) and client.segment is None
    client.act(frames(4), True, 0)
    counts = served.counts()
    assert counts["num_shm_unavailable"] == 2 and counts["num_shm_requests"] == 0 and counts["num_requests"] == 2


def test_forged_shared_blocks_are_refused_and_serving_goes_on(served, tmp_path):
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(served.server.address())
    outside = tmp_path / f"{PREFIX}x"
    outside.write_bytes(b"\0" * 100_000)
    forged = [
        (wire.SharedBlock("/etc/passwd", (1, 12_000), np.dtype(np.uint8)), "must name a file /dev/shm/runnel-obs-"),
        (wire.SharedBlock(str(outside), (1, 12_000), np.dtype(np.uint8)), "must name a file /dev/shm/runnel-obs-"),
        (wire.SharedBlock(f"{SHM_DIR}/{PREFIX}../../etc/passwd", (1, 12_000), np.dtype(np.uint8)), "must name a file"),
        (wire.SharedBlock(f"{SHM_DIR}/{PREFIX}missing", (1, 12_000), np.dtype(np.uint8)), "cannot open"),
    ]
    try:
        for n, (block, message) in enumerate(forged):
            sock.send(wire.act_request(1, n, None, True, 0, block))
            assert sock.poll(30_000)
            reply = wire.read_reply(sock.recv())
            assert isinstance(reply, wire.ServerError) and message in reply.message, (block, reply)
        client = served.client()
        client.act(frames(4), True, 0)  # a real segment, then a block that claims more than the file holds
        block = wire.SharedBlock(client.segment.path, (1000, 12_000), np.dtype(np.uint8))
        sock.send(wire.act_request(1, 9, None, True, 0, block))
        assert sock.poll(30_000)
        assert "needs 12000000 bytes" in wire.read_reply(sock.recv()).message
        block = wire.SharedBlock(client.segment.path, (4, 6_000), np.dtype("<u2"))  # fits the file, not the space
        sock.send(wire.act_request(1, 10, None, True, 0, block))
        assert sock.poll(30_000)
        assert "bad request" in wire.read_reply(sock.recv()).message
        assert client.act(frames(4), True, 0)[0].shape == (4,)  # still serving
    finally:
        sock.close()
        ctx.term()


def test_protocol_checks_shared_block_descriptors():
    frame = wire.act_request(3, 4, None, True, 7, wire.SharedBlock(f"{SHM_DIR}/{PREFIX}a", (2, 5), np.dtype("<f4")))
    request = wire.read_request(frame)
    assert request.obs is None and request.rows == 2
    assert request.shared == wire.SharedBlock(f"{SHM_DIR}/{PREFIX}a", (2, 5), np.dtype("<f4"))
    bad = [({"path": "p", "shape": [2], "dtype": "|O"}, "numeric dtype"),
           ({"path": "p", "shape": [2], "dtype": "<f4", "x": 1}, "a map of 'path', 'shape' and 'dtype'"),
           ({"path": "p", "shape": [0, 3], "dtype": "<f4"}, "the first >= 1"),
           ({"path": "p", "shape": [True], "dtype": "<f4"}, "non-negative ints"),
           ({"path": "", "shape": [1], "dtype": "<f4"}, "non-empty str"),
           ({"path": "p", "shape": [1], "dtype": "not a dtype"}, "numeric dtype")]
    for ref, message in bad:
        msg = {"op": "act", "runner": 1, "seq": 1, "explore": True, "timestep": 0, "obs_shm": ref}
        with pytest.raises(ProtocolError, match=message):
            wire.read_request(wire.encode(msg, compress=False))
    both = {"op": "act", "runner": 1, "seq": 1, "explore": True, "timestep": 0, "obs": np.zeros((1, 2)),
            "obs_shm": {"path": "p", "shape": [1], "dtype": "<f4"}}
    with pytest.raises(ProtocolError, match="not both"):
        wire.read_request(wire.encode(both, compress=False))


def test_no_room_in_shared_memory_sends_observations_inline(served, monkeypatch):
    """/dev/shm full (a container's small tmpfs): the segment cannot be reserved, and the runner goes on
    inline instead of failing (or of a SIGBUS at its first write)."""
    def full(fd, offset, length):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "posix_fallocate", full)
    client = served.client()
    actions, *_ = client.act(frames(4), True, 0)
    assert actions.shape == (4,) and client.segment is None
    assert [f for f in os.listdir(SHM_DIR) if f.startswith(f"{PREFIX}{os.getpid()}-1-")] == []
    counts = served.counts()
    assert counts["num_shm_requests"] == 0 and counts["num_requests"] == 1
