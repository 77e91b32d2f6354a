"""The central inference stage in-process: the batching engine (cut by size and by wait, across
runners), weights swapped between batches without losing a request, the version stamped on every
answer, exploration per runner, bad requests answered and survived, and the protocol's checks."""
import sys
import threading

import gymnasium as gym
import numpy as np
import pytest
import torch
import zmq

from actors.env import EnvRunnerSettings
from actors.inference.batching import RequestQueue, gather_blocks, row_slices, stack_blocks
from actors.inference.client import RemoteActing
from actors.inference.directory import InferenceDirectory
from actors.inference.server import InferenceServer
from actors.inference.settings import InferenceClientSettings, InferenceSettings
from actors.modules import ActorCriticModule
from protocols import inference as wire
from protocols.errors import ProtocolError

OBS, ACT = gym.spaces.Box(-1, 1, (4,), np.float32), gym.spaces.Discrete(2)


def settings(**kw):
    return EnvRunnerSettings(env_creator=None, observation_space=OBS, action_space=ACT,
                             model_config={"fcnet_hiddens": [16]}, **kw)


def weights(seed):
    torch.manual_seed(seed)
    return ActorCriticModule(OBS, ACT, {"fcnet_hiddens": [16]}, inference_only=True).get_state()


def logits(w, obs):
    module = ActorCriticModule(OBS, ACT, {"fcnet_hiddens": [16]}, inference_only=True)
    module.set_state(w)
    with torch.no_grad():
        return module.forward_inference(torch.as_tensor(obs))["action_dist_inputs"].numpy()


class Served:
    """A server and runner-side clients reaching it through a directory, as runners do."""

    def __init__(self, max_batch=256, max_wait_s=0.0, seed=None, **kw):
        self.server = InferenceServer(settings(seed=seed, **kw), InferenceSettings("central", max_batch=max_batch,
                                                                                    max_wait_s=max_wait_s))
        self.directory = InferenceDirectory()
        self.directory.publish(0, self.server.address())
        self.clients = []

    def client(self, worker_index, resend_after_s=5.0):
        c = RemoteActing(InferenceClientSettings(1, self.directory, resend_after_s=resend_after_s), worker_index)
        self.clients.append(c)
        return c

    def close(self):
        for c in self.clients:
            c.close()
        self.server.stop()


@pytest.fixture
def served():
    made = []

    def make(**kw):
        made.append(Served(**kw))
        return made[-1]

    yield make
    for s in made:
        s.close()


def value(metrics, key):
    """A figure of a stage's ``get_metrics()`` export (a sum's value, a mean's sum over its count)."""
    stat = metrics[key]
    return stat["value"] if "value" in stat else stat["sum"] / stat["count"]


def rows(n, start=0.0):
    return (np.arange(n * 4, dtype=np.float32).reshape(n, 4) / 100 + start).astype(np.float32)


# --- the engine -------------------------------------------------------------------------------------
def test_queue_cuts_at_max_batch_rows_keeping_each_request_whole():
    q = RequestQueue(max_batch=8, max_wait_s=60.0)
    for name, n in (("a", 4), ("b", 3), ("c", 4)):
        q.add(name, n)
    assert q.full() and q.due(q.first_at) and q.wait_ms(q.first_at, 100) == 0
    assert q.take() == ["a", "b"]  # 7 rows; c's 4 would pass 8
    assert q.rows == 4 and not q.full() and not q.due(q.first_at)
    assert q.take() == ["c"] and q.rows == 0 and len(q) == 0
    q.add("huge", 20)  # larger than max_batch: served alone, never split
    assert q.take() == ["huge"]


def test_queue_is_due_once_the_oldest_request_waited_max_wait_s():
    q = RequestQueue(max_batch=100, max_wait_s=0.5)
    assert q.wait_ms(0.0, 100) == 100 and not q.due(1e9)  # nothing queued: nothing due, the idle poll
    q.add("a", 1)
    assert not q.due(q.first_at + 0.49) and q.due(q.first_at + 0.5)
    assert 0 < q.wait_ms(q.first_at, 1000) <= 501
    with pytest.raises(ValueError, match="max_batch must be an int >= 1, got 0"):
        RequestQueue(0, 0.0)
    with pytest.raises(ValueError, match="max_wait_s must be a number >= 0"):
        RequestQueue(1, -1)


def test_blocks_stack_into_one_batch_and_slices_split_it_back():
    a, b = rows(2), rows(3, 1.0)
    batch = stack_blocks([a, b])
    assert batch.shape == (5, 4) and [batch[s].tolist() for s in row_slices([2, 3])] == [a.tolist(), b.tolist()]
    nested = stack_blocks([{"x": a, "y": a[:, :1]}, {"x": b, "y": b[:, :1]}])
    assert nested["x"].shape == (5, 4) and nested["y"].shape == (5, 1)
    assert stack_blocks([[a[0]]]).shape == (1, 4)  # one single observation
    assert stack_blocks([[a[0], a[1]], [b[0]]]).shape == (3, 4)


def test_blocks_gather_into_the_callers_buffer_with_one_copy_each():
    a, b = rows(2), rows(3, 1.0)
    a.flags.writeable = False  # as a decoded frame's or a segment's view is
    kept = np.full((8, 4), -1.0, np.float32)
    asked = []

    def out(shape, dtype):
        asked.append((shape, dtype))
        return kept[:shape[0]]

    batch = gather_blocks([a, b], out)
    assert asked == [((5, 4), np.float32)] and np.shares_memory(batch, kept)
    assert batch.tolist() == stack_blocks([a, b]).tolist() and kept[5:].min() == -1.0  # rows past the batch untouched
    # not one dtype, or not arrays: stacked as stack_blocks does, the buffer not asked for
    mixed = gather_blocks([a, b.astype(np.float64)], out)
    assert mixed.dtype == np.float64 and mixed.shape == (5, 4) and len(asked) == 1
    nested = gather_blocks([{"x": a}, {"x": b}], out)
    assert nested["x"].shape == (5, 4) and len(asked) == 1


# --- the server ----------------------------------------------------------------------------------
def test_two_runners_are_answered_from_one_forward_pass_with_their_own_rows(served):
    s = served(max_batch=7, max_wait_s=60.0)  # only a full batch runs: both requests must be in it
    w = weights(1)
    s.server.set_weights(w, 3)
    one, two = s.client(1), s.client(2)
    answers = {}
    threads = [threading.Thread(target=lambda c, o: answers.__setitem__(c.worker_index, c.act(o, True, 0)),
                                args=(c, o)) for c, o in ((one, rows(4)), (two, rows(3, 0.5)))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    for c, o in ((one, rows(4)), (two, rows(3, 0.5))):
        actions, logp, dist_inputs, version = answers[c.worker_index]
        assert version == 3 and actions.shape == (len(o),) and logp.shape == (len(o),)
        np.testing.assert_allclose(dist_inputs, logits(w, o), rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(logp, np.log(np.exp(dist_inputs)[np.arange(len(o)), actions]
                                                / np.exp(dist_inputs).sum(-1)), rtol=1e-5, atol=1e-6)
    m = s.server.get_metrics()
    assert value(m, "inference/num_batches") == 1 and value(m, "inference/num_actions") == 7
    assert value(m, "inference/batch_size_mean") == 7


def test_a_lone_request_is_served_once_it_waited_max_wait_s(served):
    s = served(max_batch=1000, max_wait_s=0.05)
    actions, _, _, _ = s.client(1).act(rows(4), True, 0)
    assert actions.shape == (4,)
    assert value(s.server.get_metrics(), "inference/num_batches") == 1


def test_weights_swap_between_batches_answers_every_request_with_the_version_that_acted(served):
    s = served(max_batch=4, max_wait_s=0.0)
    versions = {v: weights(v) for v in range(1, 6)}
    s.server.set_weights(versions[1], 1)
    obs = rows(4)
    expected = {v: logits(w, obs) for v, w in versions.items()}
    seen, stop = {1: [], 2: []}, threading.Event()

    def swap():
        for v in range(2, 6):
            s.server.set_weights(versions[v], v)

    def act(client):
        while not stop.is_set():
            seen[client.worker_index].append(client.act(obs, False, 0))

    clients = [s.client(i) for i in (1, 2)]
    actors = [threading.Thread(target=act, args=(c,)) for c in clients]
    for t in actors:
        t.start()
    swap()
    stop.set()
    for t in actors:
        t.join(30)
    assert all(seen.values()) and all(not t.is_alive() for t in actors)
    for answers in seen.values():
        for actions, _, dist_inputs, version in answers:  # every answer computed by the weights it names
            np.testing.assert_allclose(dist_inputs, expected[version], rtol=1e-5, atol=1e-6)
            np.testing.assert_array_equal(actions, expected[version].argmax(-1))  # explore=False: greedy
        got = [version for *_, version in answers]
        assert got == sorted(got)  # a runner never gets older weights after newer ones
    # (a thread's last answer may predate the last swap: it can be appended after swap() returned)
    assert s.server.weights_version == 5
    assert [c.act(obs, False, 0)[3] for c in clients] == [5, 5]  # after set_weights returned, only the new act


def test_set_weights_refuses_weights_of_another_model():
    server = InferenceServer(settings(), InferenceSettings("central"))
    try:
        with pytest.raises(ValueError, match="weights lack"):
            server.set_weights({"encoder.nothing": np.zeros(1)}, 1)
    finally:
        server.stop()


def test_seeded_exploration_draws_each_runners_own_stream(served):
    """Runner 1's sampled actions do not depend on runner 2 asking in between (each has its own stream)."""
    obs = np.zeros((64, 4), np.float32)  # logits near 0: sampled actions are coin flips
    alone = served(seed=5)
    alone.server.set_weights(weights(1), 1)
    a = alone.client(1)
    first = [a.act(obs, True, 0)[0] for _ in range(3)]
    mixed = served(seed=5)
    mixed.server.set_weights(weights(1), 1)
    b, other = mixed.client(1), mixed.client(2)
    second = []
    for _ in range(3):
        other.act(obs, True, 0)
        second.append(b.act(obs, True, 0)[0])
    for x, y in zip(first, second):
        np.testing.assert_array_equal(x, y)
    assert any((x != first[0]).any() for x in first[1:])  # draws move on from step to step


def test_bad_requests_get_an_error_answer_and_serving_goes_on(served):
    s = served()
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(s.server.address())
    try:
        sock.send(b"not a frame")
        assert sock.poll(30_000)
        assert "bad request" in str(wire.read_reply(sock.recv()))
        sock.send(wire.act_request(1, 7, np.zeros((2, 5), np.float32), True, 0))  # 5 features, the space has 4
        assert sock.poll(30_000)
        message = str(wire.read_reply(sock.recv()))
        assert message.startswith("seq 7:") and "shape (2, 5)" in message
        sock.send_multipart([b"a", b"b"])  # a DEALER's two parts reach the ROUTER as three: counted, dropped
        # the server reads one peer's messages in order: the answer to this request means it counted the last
        sock.send(wire.act_request(1, 8, rows(2), True, 0))
        assert sock.poll(30_000)
        reply = wire.read_reply(sock.recv())
        assert isinstance(reply, wire.ActReply) and reply.seq == 8
        actions, _, _, _ = s.client(1).act(rows(2), True, 0)  # and the server still serves other runners
        assert actions.shape == (2,)
        m = s.server.get_metrics()
        assert value(m, "inference/num_bad_requests") == 3 and value(m, "inference/num_actions") == 4
    finally:
        sock.close()
        ctx.term()


def test_client_raises_naming_the_server_message_when_refused(served):
    s = served()
    with pytest.raises(RuntimeError, match="inference server 0 .* refused request 1: .*bad request"):
        s.client(1).act(np.zeros((2, 3), np.float32), True, 0)


def test_client_resends_to_the_address_the_directory_now_names(served):
    """A server that went away: after resend_after_s the client looks up the new address and resends
    the same request, which the new server answers."""
    first = served()
    client = first.client(1, resend_after_s=0.2)
    assert client.act(rows(2), True, 0)[0].shape == (2,)
    first.server.stop()  # gone without an answer to what comes next
    second = served()
    second.server.set_weights(weights(2), 9)
    first.directory.publish(0, second.server.address())
    actions, _, _, version = client.act(rows(2), True, 0)
    assert version == 9 and actions.shape == (2,)
    assert client.num_resends >= 1 and client.num_reconnects == 1


def test_protocol_refuses_malformed_messages():
    with pytest.raises(ProtocolError, match="expected an 'act' message, got 'actions'"):
        wire.read_request(wire.actions_reply(1, 0, np.zeros(1), np.zeros(1), np.zeros((1, 2))))
    with pytest.raises(ProtocolError, match="a runner sent an 'error' message"):
        wire.read_request(wire.error_reply(1, "x"))
    frame = wire.act_request(1, 2, {"a": np.zeros((2, 1)), "b": np.zeros((3, 1))}, True, 0)
    with pytest.raises(ProtocolError, match="different numbers of rows"):
        wire.read_request(frame)
    with pytest.raises(ProtocolError, match="'seq' must be int, got bool"):
        wire.read_request(wire.encode({"op": "act", "runner": 1, "seq": True, "explore": True, "timestep": 0,
                                       "obs": np.zeros((1, 4))}, compress=False))
    reply = wire.read_reply(wire.actions_reply(3, 4, np.zeros(2, np.int64), np.zeros(2), np.zeros((2, 2))))
    assert (reply.seq, reply.weights_version, reply.actions.shape) == (3, 4, (2,))


# --- the GPU path ---------------------------------------------------------------------------------
def test_gpu_server_without_cuda_is_a_clear_error():
    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    with pytest.raises(RuntimeError, match="num_gpus_per_inference_server=1 but torch sees no CUDA device"):
        InferenceServer(settings(), InferenceSettings("central", num_gpus_per_inference_server=1))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("precision", ["float32", "bfloat16"])
def test_cuda_server_answers_as_the_cpu_module_does(precision):
    """Observations through the pinned buffers (growing with the batch), the pass on the GPU (replayed CUDA
    graphs), answers on the CPU: the same logits as the module on the CPU, for batches of several sizes,
    before and after new weights (in bfloat16: within its rounding)."""
    tol = {"rtol": 1e-4, "atol": 1e-5} if precision == "float32" else {"rtol": 0.03, "atol": 0.03}
    server = InferenceServer(settings(), InferenceSettings("central", num_gpus_per_inference_server=1,
                                                           precision=precision))
    directory = InferenceDirectory()
    directory.publish(0, server.address())
    client = RemoteActing(InferenceClientSettings(1, directory), 1)
    try:
        w = weights(4)
        server.set_weights(w, 2)
        for n in (4, 100, 7):
            obs = rows(n)
            actions, _, dist_inputs, version = client.act(obs, False, 0)
            assert version == 2 and actions.shape == (n,)
            np.testing.assert_allclose(dist_inputs, logits(w, obs), **tol)
        # new weights after the passes were captured as CUDA graphs: the replays act with them
        w = weights(5)
        server.set_weights(w, 3)
        for n, explore in ((4, False), (100, False), (7, True), (300, True)):
            obs = rows(n, start=0.5)
            _, _, dist_inputs, version = client.act(obs, explore, 0)
            assert version == 3
            np.testing.assert_allclose(dist_inputs, logits(w, obs), **tol)
        assert server.forward.graphs and server.forward.num_graphs >= 4
    finally:
        client.close()
        server.stop()


class _Uniform:
    """A forward pass whose choice is one uniform draw per row from torch's CPU generator."""

    def choose(self, inputs, exploration, explore, timestep):
        u = torch.rand(len(inputs))
        return u, u


def test_two_servers_in_one_process_draw_their_runners_streams_as_if_alone():
    """In-process servers (num_env_runners=0, two servers) serve from two threads of one process; each runner's
    seeded stream must come out as it does when one server draws alone."""
    from actors.env.exploration import Exploration
    from actors.inference.streams import RunnerStreams

    def streams(seed):
        return RunnerStreams(lambda: Exploration(None), lambda: torch.nn.Linear(4, 4), seed)

    def draw(s, runner, calls, out):
        inputs = torch.zeros(64, 1)
        for _ in range(calls):
            out.append(s.choose(_Uniform(), runner, inputs, True, 0)[0])

    calls = 400
    alone = {}
    for seed in (1, 2):
        alone[seed] = []
        draw(streams(seed), 0, calls, alone[seed])
    together = {1: [], 2: []}
    start = threading.Barrier(2)

    def serve(seed):
        s = streams(seed)
        start.wait()
        draw(s, 0, calls, together[seed])

    threads = [threading.Thread(target=serve, args=(seed,)) for seed in (1, 2)]
    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)  # the threads take turns within every call, not every few hundred calls
    try:
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    finally:
        sys.setswitchinterval(interval)
    for seed in (1, 2):
        np.testing.assert_array_equal(np.stack(alone[seed]), np.stack(together[seed]))
