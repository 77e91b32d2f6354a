"""InferenceServer: the central inference stage -- env runners' observations in, batched, actions out.

SEED RL's split: runners only step environments; one server per few runners holds the module (on
CUDA when given a GPU) and acts for all of them. A ZeroMQ ROUTER socket bound on the node's address
takes ``act`` requests (``protocols.inference``); a serving thread queues them in the shared batching
engine (``actors.inference.batching``), runs one forward pass once ``max_batch`` rows are queued or
the oldest request waited ``max_wait_s``, and answers each runner with its rows' actions,
log-probabilities, distribution inputs and the weights version that acted. Exploration is applied
here, per runner (``actors.inference.streams``): sampling for the policy-gradient algorithms,
epsilon-greedy for DQN, whatever ``exploration_config`` says.

Copies: a batch is gathered once into a host buffer kept for it (pinned on a GPU), each request's rows
straight from where they lie -- the decoded frame, or the runner's shared-memory segment -- and goes to
the device from there (``gather_blocks``): one host copy per observation, not three (into a buffer per
runner, stacked into a new array, into the pinned upload buffer).

Double buffering: ZeroMQ's I/O thread receives the next requests while a forward pass runs (torch
releases the GIL), so the batch after it is ready when it ends; each runner keeps stepping its envs
while the others' requests are inferred.

Weights (``set_weights``, from the driver's broadcast) are copied to the module's device in the
caller's thread, then swapped in by the serving thread between two batches -- the socket is never
paused for the copy -- and ``set_weights`` returns once they are in use. A request that cannot be
served (malformed, observations that do not fit the space, a forward pass that raises) gets an
``error`` answer and is counted; serving goes on. Hosted like every stage by an ``ActorManager``
(``pipeline.groups.inference_group``): in-process or as a Ray actor, recreated when it dies.
"""
from __future__ import annotations

import contextlib
import logging
import threading
import time
from typing import Any, Callable, Iterator

import numpy as np
import torch
import zmq

from actors.core import InferenceRole, call_user_fn
from actors.env.exploration import make_exploration
from actors.env.numpy_acting import NumpyChooser
from actors.env.settings import EnvRunnerSettings, module_class_of
from actors.inference.batching import RequestQueue, gather_blocks, row_slices
from actors.inference.forward import PolicyForward
from actors.inference.settings import InferenceSettings
from actors.inference.shared_obs import SegmentMaps, SegmentUnavailable
from actors.inference.streams import RunnerStreams
from actors.metrics import MetricsLogger
from actors.network import node_address
from protocols import inference as wire
from protocols.errors import ProtocolError
from protocols.numpy_policy import NumpyPolicy
from protocols.schema import ChunkSchema

log = logging.getLogger("runnel")

COUNTS = ("num_requests", "num_actions", "num_batches", "num_bad_requests", "num_failed_batches", "num_shm_requests",
          "num_shm_unavailable")


@contextlib.contextmanager
def single_threaded() -> Iterator[None]:
    """torch at one intra-op thread within (a server given several CPUs uses them for the forward pass)."""
    threads = torch.get_num_threads()
    if threads == 1:
        yield
        return
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


class InferenceServer(InferenceRole):
    def __init__(self, settings: EnvRunnerSettings, inference: InferenceSettings, server_index: int = 0,
                 torch_threads: int | None = None) -> None:
        """``torch_threads``: intra-op threads of the serving thread (a Ray actor: its CPUs); None: the caller's."""
        # the serving thread sets this for itself: OpenMP's thread count is per thread, and a new
        # thread would otherwise run one intra-op thread per core
        self._torch_threads = torch_threads or torch.get_num_threads()
        self._owns_process = bool(torch_threads)
        """A Ray actor of its own (else a thread of the driver's, whose torch settings it leaves alone)."""
        self.s, self.x, self.index = settings, inference, server_index
        device = "cpu"
        if inference.num_gpus_per_inference_server > 0:
            if not torch.cuda.is_available():
                raise RuntimeError(f"inference server {server_index}: num_gpus_per_inference_server="
                                   f"{inference.num_gpus_per_inference_server} but torch sees no CUDA device here; "
                                   f"set num_gpus_per_inference_server=0 or run on a GPU node")
            device = "cuda"
        cls = module_class_of(settings)
        obs_space, act_space = settings.observation_space, settings.action_space

        def build() -> Any:
            return cls(obs_space, act_space, settings.model_config, inference_only=True, **settings.module_kwargs)

        self.forward = PolicyForward(build(), device, graphs=inference.cuda_graphs,
                                     precision=inference.precision)
        lstm = getattr(self.forward.module, "lstm", None)
        self.state_size: int | None = None if lstm is None else int(lstm.hidden_size)
        """A recurrent module's cell size: each request carries its rows' states (the server keeps none)."""
        dist_spec = self.forward.dist_spec
        chooser = (NumpyChooser(NumpyPolicy(settings.numpy_policy["policy"]), settings.numpy_policy["exploration"])
                   if settings.numpy_policy is not None else None)  # only its choosing is used: weights need not match
        self.streams = RunnerStreams(lambda: make_exploration(settings.exploration_config, dist_spec), build,
                                     settings.seed, chooser)
        self.schema = ChunkSchema.for_spaces(obs_space, None)
        self.queue = RequestQueue(inference.max_batch, inference.max_wait_s)
        self.segments = SegmentMaps()  # runners on this node send their observations through shared memory
        self.weights_version = 0
        self.metrics = MetricsLogger()
        self.counts = dict.fromkeys(COUNTS, 0)
        self._reported = dict(self.counts)
        self._forward_s = 0.0  # time in forward passes since the last get_metrics
        self._lock = threading.Lock()  # the module, the streams, counts and pending weights
        self._pending: tuple[dict, int, list[threading.Event]] | None = None
        self._stopping = threading.Event()
        self.error: BaseException | None = None
        self._ctx = zmq.Context()
        self._sock = self._ctx.socket(zmq.ROUTER)
        self._sock.setsockopt(zmq.LINGER, 0)
        host = node_address()
        self._address = f"tcp://{host}:{self._sock.bind_to_random_port(f'tcp://{host}')}"
        self._wake_rx = self._ctx.socket(zmq.PAIR)
        self._wake_rx.bind(f"inproc://runnel-inference-wake-{id(self)}")
        self._wake_tx = self._ctx.socket(zmq.PAIR)
        self._wake_tx.connect(f"inproc://runnel-inference-wake-{id(self)}")
        self._wake_lock = threading.Lock()  # a ZeroMQ socket is not thread-safe: callers take turns
        self._thread = threading.Thread(target=self._serve, name=f"runnel-inference-{server_index}", daemon=True)
        self._thread.start()
        log.info("inference server %d listening on %s (%s)", server_index, self._address, device)

    # --- the serving thread ---------------------------------------------------------------------
    def _serve(self) -> None:
        torch.set_num_threads(self._torch_threads)
        sock, queue = self._sock, self.queue
        poller = zmq.Poller()
        poller.register(sock, zmq.POLLIN)
        poller.register(self._wake_rx, zmq.POLLIN)
        try:
            while not self._stopping.is_set():
                events = dict(poller.poll(queue.wait_ms(time.monotonic(), 100)))
                if self._wake_rx in events:
                    while self._wake_rx.poll(0):
                        self._wake_rx.recv()
                for _ in range(4 * self.x.max_batch):  # bounded: a flood of requests still gets its batches run
                    if not sock.getsockopt(zmq.EVENTS) & zmq.POLLIN:
                        break
                    self._receive(sock.recv_multipart())
                    if queue.full():
                        self._run_batch()
                self._apply_pending()
                while queue.due(time.monotonic()):
                    self._run_batch()
        except BaseException as err:  # noqa: BLE001 - reported by ping/get_metrics: the group recreates us
            self.error = err
            log.exception("inference server %d: serving thread failed", self.index)

    def _receive(self, parts: list[bytes]) -> None:
        if len(parts) != 2:
            self.counts["num_bad_requests"] += 1
            return
        route, frame = parts
        seq = 0  # the error answer to a frame without a readable number
        try:
            request = wire.read_request(frame)
            seq = request.seq
            if request.shared is not None:
                request.obs = self.segments.view(request.runner, request.shared, request.lane)
                self.counts["num_shm_requests"] += 1
            self.schema.check_observation_rows(request.obs, request.rows)
            self._check_state(request)
        except ProtocolError as err:
            self.counts["num_bad_requests"] += 1
            self._sock.send_multipart([route, wire.error_reply(seq, f"bad request: {err}", "bad_request")])
            return
        except SegmentUnavailable as err:
            self.counts["num_shm_unavailable"] += 1
            self._sock.send_multipart([route, wire.error_reply(seq, str(err), "shm_unavailable")])
            return
        self.counts["num_requests"] += 1
        self.queue.add((route, request), request.rows)

    def _check_state(self, request: wire.ActRequest) -> None:
        """A recurrent module's requests carry states of its cell size (``read_request`` checked their form);
        other modules' carry none."""
        st = request.state
        if self.state_size is None:
            if st is not None:
                raise ProtocolError("'state': this server's module is not recurrent")
        elif st is None or st.shape[2] != self.state_size:
            raise ProtocolError(f"'state': this server's module is recurrent (lstm_cell_size={self.state_size}): "
                                f"each request carries its rows' states [rows, 2, {self.state_size}], got "
                                f"{None if st is None else list(st.shape)}")

    def _apply_pending(self) -> None:
        """New weights, between two batches (the copy to the device happened in ``set_weights``)."""
        if self._pending is None:
            return
        with self._lock:
            (weights, version, waiting), self._pending = self._pending, None
            self.forward.load_weights(weights)
            self.weights_version = version
        for done in waiting:
            done.set()

    def _run_batch(self) -> None:
        self._apply_pending()
        batch = self.queue.take()
        started = time.perf_counter()
        with self._lock, torch.inference_mode():
            for explore in (True, False):
                group = [(route, r) for route, r in batch if r.explore is explore]
                if group:
                    self._answer(group, explore)
            self.counts["num_batches"] += 1
            self._forward_s += time.perf_counter() - started

    def _answer(self, group: list, explore: bool) -> None:
        send, version = self._sock.send_multipart, self.weights_version
        try:
            obs = gather_blocks([r.obs for _, r in group],
                                lambda shape, dtype: self.forward.host_array(("batch", explore), shape, dtype))
            if self.state_size is None:
                inputs, states = self.forward.dist_inputs(obs, explore), None
            else:
                states_in = np.concatenate([r.state for _, r in group]) if len(group) > 1 else group[0][1].state
                inputs, states = self.forward.recurrent_dist_inputs(obs, states_in, explore)
        except Exception as err:  # noqa: BLE001 - a bad batch must not stop serving every runner
            self._failed(group, err)
            return
        slices = row_slices([r.rows for _, r in group])
        # small ops, where an OpenMP region costs more than the work; in the driver's process the
        # thread setting is the learner's too, and stays alone
        small = single_threaded() if self._owns_process else contextlib.nullcontext()
        with small:
            if self.streams.batch_wide:  # one choice for the whole batch
                try:
                    actions, logp = self.streams.choose(self.forward, None, inputs, explore,
                                                        min(r.timestep for _, r in group))
                except Exception as err:  # noqa: BLE001
                    self._failed(group, err)
                    return
                chosen = [(actions[rows], logp[rows]) for rows in slices]
            else:
                chosen = [self._choose(route, r, inputs[rows], explore) for (route, r), rows in zip(group, slices)]
        for (route, r), rows, pair in zip(group, slices, chosen):
            if pair is None:
                continue
            actions, logp = pair
            send([route, wire.actions_reply(r.seq, version, actions, logp, inputs[rows].numpy(),
                                            None if states is None else states[rows])])
            self.counts["num_actions"] += r.rows

    def _choose(self, route: bytes, r: wire.ActRequest, inputs: torch.Tensor, explore: bool
                ) -> tuple[np.ndarray, np.ndarray] | None:
        """One runner's actions, drawn from its own stream (None: it failed and was answered so)."""
        try:
            return self.streams.choose(self.forward, r.runner, inputs, explore, r.timestep)
        except Exception as err:  # noqa: BLE001
            self._failed([(route, r)], err)
            return None

    def _failed(self, group: list, err: Exception) -> None:
        self.counts["num_failed_batches"] += 1
        log.exception("inference server %d: acting for %d request(s) failed; they get an error", self.index,
                      len(group))
        for route, r in group:
            self._sock.send_multipart([route, wire.error_reply(r.seq, f"{type(err).__name__}: {err}")])

    def _wake(self) -> None:
        with self._wake_lock:
            self._wake_tx.send(b"", zmq.NOBLOCK)

    # --- the role --------------------------------------------------------------------------------
    def address(self) -> str:
        return self._address

    def set_weights(self, weights: dict[str, Any], weights_version: int = 0, timestep: int | None = None,
                    timeout_s: float = 60.0) -> None:
        """Copy ``weights`` to the module's device here, then have the serving thread swap them in between
        two batches; returns once they act. ``timestep`` is the runners' business (each request carries it)."""
        self._check()
        own = self.forward.module.state_dict()
        missing = [k for k in own if k not in weights]
        if missing:
            raise ValueError(f"inference server {self.index}: weights lack {missing[:5]}: were they saved from "
                             f"another model config?")
        device = self.forward.device
        prepared = {k: torch.tensor(np.asarray(weights[k])).to(device=device, dtype=t.dtype) for k, t in own.items()}
        done = threading.Event()
        with self._lock:  # weights not applied yet are superseded: their callers return with these
            waiting = self._pending[2] if self._pending is not None else []
            self._pending = (prepared, int(weights_version), [*waiting, done])
        self._wake()
        deadline = time.monotonic() + timeout_s
        while not done.wait(0.1):
            self._check()
            if time.monotonic() > deadline:
                raise RuntimeError(f"inference server {self.index}: new weights not applied within {timeout_s} s")

    def get_weights(self) -> dict[str, Any]:
        with self._lock:
            return self.forward.get_state()

    def get_state(self) -> dict[str, Any]:
        with self._lock:
            return {"weights": self.forward.get_state(), "weights_version": self.weights_version,
                    "streams": self.streams.get_state()}

    def set_state(self, state: dict[str, Any]) -> None:
        self.set_weights(state["weights"], state.get("weights_version", 0))
        with self._lock:
            self.streams.set_state(state.get("streams", {}))

    def get_metrics(self) -> dict[str, Any]:
        self._check()
        m = self.metrics
        with self._lock:
            counts, forward_s, self._forward_s = dict(self.counts), self._forward_s, 0.0
        delta = {k: counts[k] - self._reported[k] for k in COUNTS}
        self._reported = counts
        for key, value in delta.items():
            m.log_value(f"inference/{key}", value, reduce="lifetime_sum")
        if delta["num_batches"]:
            m.log_value("inference/batch_size_mean", delta["num_actions"] / delta["num_batches"])
            m.log_value("inference/batch_ms_mean", 1000 * forward_s / delta["num_batches"])
        m.log_value("inference/weights_version", self.weights_version, reduce="max")
        return m.export()

    def _check(self) -> None:
        if self.error is not None:
            raise RuntimeError(f"inference server {self.index}: serving thread failed: {self.error!r}")
        if not self._thread.is_alive() and not self._stopping.is_set():
            raise RuntimeError(f"inference server {self.index}: serving thread is not running")

    def ping(self) -> str:
        self._check()
        return "ok"

    def apply(self, fn: Callable[["InferenceServer"], Any]) -> Any:
        return call_user_fn(fn, self)

    def stop(self) -> None:
        if self._stopping.is_set():
            return
        self._stopping.set()
        self._wake()
        self._thread.join(timeout=10.0)
        for sock in (self._sock, self._wake_rx, self._wake_tx):
            sock.close(linger=0)
        self.segments.close()
        self._ctx.term()

    def __repr__(self) -> str:  # how Ray names this actor in errors and logs
        return f"InferenceServer({getattr(self, 'index', '?')})"
