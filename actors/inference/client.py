"""RemoteActing: an env runner's acting piece under central inference -- observations out, actions back.

The runner's sampling loop calls ``act(obs, explore, timestep)`` once per step, as it calls the local
module otherwise (``actors.env.acting.LocalActing``); this sends the step's observations to the
runner's inference server (``protocols.inference``, one codec frame over a ZeroMQ DEALER socket) and
returns its answer: the module's actions, their log-probabilities, the distribution inputs and the
weights version that acted. Everything else in the runner -- stepping, cutting chunks, counting --
is unchanged, so chunks look the same with either piece.

A runner on its server's node passes large observation blocks through shared memory
(``actors.inference.shared_obs``; ``InferenceSettings.shared_memory``), other runners inline in the frame.

Double buffering (``InferenceSettings.double_buffer``, ``actors.env.split_sampling``): the runner keeps two
requests out at once, one per half of its sub-envs, on two lanes (``send``/``receive``), and steps one half
while the server infers the other's actions. Each lane has its own segment and request number.

No answer within ``resend_after_s`` (the server died, or is slow): the runner looks its server up in
the directory (``actors.inference.directory``), reconnects if the address changed, and sends every
request still out again under its number. An answer to an older number is dropped, so a step is acted on
exactly once and no chunk is lost or doubled. After ``reply_timeout_s`` without any answer the runner
raises and its group recreates it. An ``error`` answer (the server could not serve the request)
raises at once, naming the server's message.

Torch-free on purpose: a runner under central inference never imports torch.
"""
from __future__ import annotations

import contextlib
import logging
import time
from dataclasses import dataclass
from typing import Any

import numpy as np
import zmq

from actors.inference.directory import lookup_address
from actors.inference.recurrent_states import KeepsSubEnvStates, SubEnvStates
from actors.inference.settings import InferenceClientSettings
from actors.inference.shared_obs import MIN_BYTES, ObsSegment, shared_memory_available
from actors.network import node_address
from protocols import inference as wire
from protocols.errors import ProtocolError
from protocols.nested import first_leaf as nested_first

log = logging.getLogger("runnel")


@dataclass
class Lane:
    """One of a runner's requests out at once: its segment, and the request waiting for an answer."""

    index: int
    segment: ObsSegment | None = None
    seq: int = 0
    """The number of the request out on this lane (0: none)."""
    request: tuple[Any, bool, int] | None = None
    """(observations, explore, timestep) of that request, to send again."""
    reply: wire.ActReply | None = None
    """Its answer, once it came (while the runner waited on another lane)."""


class RemoteActing(KeepsSubEnvStates):
    module = None  # no module in this process: the server holds it
    exploration = None
    holds_weights = False

    def __init__(self, settings: InferenceClientSettings, worker_index: int) -> None:
        self.s = settings
        self.worker_index = worker_index
        self.server = settings.server_of(worker_index)
        self.weights_version = 0
        """The version that answered the latest request."""
        self.seq = 0
        self.num_resends = 0
        self.num_reconnects = 0
        self._logged = {"num_resends": 0, "num_reconnects": 0}
        self._ctx = zmq.Context()
        self._sock: zmq.Socket | None = None
        self.address: str | None = None
        self.lanes = [Lane(i) for i in range(max(1, settings.lanes))]
        """Requests this runner may keep out at once (``send``/``receive``; ``act`` uses lane 0)."""
        self._shm_refusals = 0
        self._shm_wanted = settings.shared_memory and shared_memory_available()
        self._last_sent = 0.0  # when a request last went out (resends are due resend_after_s later)
        self.recurrent = settings.state_size is not None
        """The module carries a state from step to step: kept here, sent with each request (``states``)."""
        self._states = SubEnvStates(settings.state_size or 0)
        self.max_seq_len = settings.max_seq_len
        """A recurrent module's longest sequence: the runner cuts chunks to it."""
        self._connect(self._wait_for_address(time.monotonic() + settings.reply_timeout_s))

    @property
    def segment(self) -> ObsSegment | None:
        """Lane 0's shared-memory segment (None: observations go inline)."""
        return self.lanes[0].segment

    def _wait_for_address(self, deadline: float) -> str:
        while True:
            address = lookup_address(self.s, self.server, timeout_s=max(0.1, min(5.0, deadline - time.monotonic())))
            if address is not None:
                return address
            if time.monotonic() >= deadline:
                raise RuntimeError(f"env runner {self.worker_index}: inference server {self.server} has no address "
                                   f"in the directory after reply_timeout_s={self.s.reply_timeout_s}")
            time.sleep(0.2)  # the driver is recreating the server; its address comes with it

    def _connect(self, address: str) -> None:
        if self._sock is not None:
            self._sock.close(linger=0)
        sock = self._ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(address)
        self._sock, self.address = sock, address
        local = self._shm_wanted and _host(address) in _local_hosts()
        for lane in self.lanes:
            if lane.segment is not None:  # a new server: it knows no segment of ours yet
                lane.segment.close()
                lane.segment = None
            if local:
                lane.segment = ObsSegment(self.worker_index)

    def session(self) -> contextlib.AbstractContextManager:
        """What the runner holds around a sampling run (the local piece: torch's inference mode)."""
        return contextlib.nullcontext()

    def act(self, obs: Any, explore: bool, timestep: int) -> tuple[np.ndarray, np.ndarray, np.ndarray, int]:
        """(module actions, their log-probabilities, distribution inputs, weights version) for one step."""
        self.send(0, obs, explore, timestep)
        return self.receive(0)

    def send(self, lane: int, obs: Any, explore: bool, timestep: int) -> None:
        """Ask for the actions of ``obs`` on ``lane`` and return at once (double buffering: the runner steps
        its other sub-envs meanwhile); ``receive(lane)`` gets them. One request per lane at a time: a request
        still out there (a sampling run that raised midway) is abandoned, its answer dropped when it comes."""
        out = self.lanes[lane]
        self.seq += 1
        state = self.states(len(nested_first(obs))).copy() if self.recurrent else None  # kept for a resend
        out.seq, out.request, out.reply = self.seq, (obs, explore, timestep, state), None
        self._sock.send(self._frame(out), copy=False)
        self._last_sent = time.monotonic()

    def receive(self, lane: int) -> tuple[np.ndarray, np.ndarray, np.ndarray, int]:
        """The answer to ``lane``'s request (answers to other lanes that come first are kept for them)."""
        out = self.lanes[lane]
        if out.request is None:
            raise RuntimeError(f"env runner {self.worker_index}: lane {lane} has no request out")
        started = time.monotonic()
        while out.reply is None:
            wait_ms = int(max(0.0, self._last_sent + self.s.resend_after_s - time.monotonic()) * 1000)
            if self._sock.poll(wait_ms, zmq.POLLIN):
                self._take(self._sock.recv())
                continue
            now = time.monotonic()
            if now - started >= self.s.reply_timeout_s:
                raise RuntimeError(f"env runner {self.worker_index}: no answer from inference server {self.server} "
                                   f"at {self.address} for {now - started:.0f} s (reply_timeout_s="
                                   f"{self.s.reply_timeout_s}); request {out.seq} was sent {self.num_resends} times")
            self._resend_all()
        reply, out.reply, out.request = out.reply, None, None
        if out.segment is not None:
            out.segment.answered()
        self.weights_version = reply.weights_version
        if self.recurrent:
            if reply.state_out is None or reply.state_out.shape != self.state.shape:
                raise RuntimeError(f"env runner {self.worker_index}: inference server {self.server} answered without "
                                   f"the recurrent states {self.state.shape} (a server for another model config?)")
            self.state = reply.state_out.copy()  # decoded frames are read-only; reset_states writes rows
        return reply.actions, reply.logp, reply.dist_inputs, reply.weights_version

    def _take(self, frame: bytes) -> None:
        """File an answer with the lane that waits for it (a stale one is dropped; a refused segment resent)."""
        reply = self._read(frame)
        if reply is None:
            return
        lane = next((x for x in self.lanes if x.request is not None and x.seq == reply.seq), None)
        if lane is None or lane.reply is not None:
            return  # about a request resent since, or answered twice (a resend crossed the first answer)
        if isinstance(reply, wire.ServerError):  # "shm_unavailable": a new segment, or inline
            self._refused_segment(lane, reply)
            self._sock.send(self._frame(lane), copy=False)
            self._last_sent = time.monotonic()
            return
        self._shm_refusals = 0
        lane.reply = reply

    def _resend_all(self) -> None:
        """No answer for ``resend_after_s``: look the server up (it may have moved) and send every request still
        out again, under its number."""
        address = lookup_address(self.s, self.server, timeout_s=min(5.0, self.s.resend_after_s))
        if address is not None and address != self.address:
            log.warning("env runner %d: inference server %d moved from %s to %s; resending request(s) %s",
                        self.worker_index, self.server, self.address, address,
                        [x.seq for x in self.lanes if x.request is not None and x.reply is None])
            self._connect(address)  # a new server: new segments too
            self.num_reconnects += 1
        for lane in self.lanes:
            if lane.request is not None and lane.reply is None:
                self._sock.send(self._frame(lane), copy=False)
                self.num_resends += 1
        self._last_sent = time.monotonic()

    def _frame(self, lane: Lane) -> bytes:
        obs, explore, timestep, state = lane.request
        segment = lane.segment
        if segment is not None and type(obs) is np.ndarray and obs.nbytes >= MIN_BYTES:
            try:
                shared = segment.write(obs)
            except OSError as err:  # /dev/shm full or gone: inline from now on
                log.warning("env runner %d: no room for observations in shared memory (%s); sending them inline",
                            self.worker_index, err)
                self._inline_from_now_on()
            else:
                return wire.act_request(self.worker_index, lane.seq, None, explore, timestep, shared, lane.index, state)
        return wire.act_request(self.worker_index, lane.seq, obs, explore, timestep, lane=lane.index, state=state)

    def _inline_from_now_on(self) -> None:
        for lane in self.lanes:
            if lane.segment is not None:
                lane.segment.close()
                lane.segment = None
        self._shm_wanted = False

    def _refused_segment(self, lane: Lane, err: wire.ServerError) -> None:
        if lane.segment is None:
            return
        self._shm_refusals += 1
        if self._shm_refusals >= 2:  # twice: this server cannot see our /dev/shm; inline from now on
            log.warning("env runner %d: inference server %d at %s cannot open shared memory (%s); sending "
                        "observations inline", self.worker_index, self.server, self.address, err.message)
            self._inline_from_now_on()
        else:
            lane.segment.renew()

    def _read(self, frame: bytes) -> wire.ActReply | wire.ServerError | None:
        """A reply, a "shm_unavailable" refusal to send again, or None for one to drop."""
        try:
            reply = wire.read_reply(frame)
        except ProtocolError as err:
            raise RuntimeError(f"env runner {self.worker_index}: a malformed answer from inference server "
                               f"{self.server} at {self.address}: {err}") from None
        if isinstance(reply, wire.ServerError):
            waiting = any(x.request is not None and x.seq == reply.seq for x in self.lanes)
            if reply.code == "shm_unavailable":
                return reply if waiting else None  # else about a request resent since
            raise RuntimeError(f"env runner {self.worker_index}: inference server {self.server} at {self.address} "
                               f"refused request {reply.seq}: {reply}")
        return reply

    # --- what the runner asks of any acting piece ----------------------------------------------
    def log_metrics(self, metrics: Any) -> None:
        """Resends and reconnects since the last call, as ``inference/runner_...`` sums."""
        for key in ("num_resends", "num_reconnects"):
            now = getattr(self, key)
            delta, self._logged[key] = now - self._logged[key], now
            metrics.log_value(f"inference/runner_{key}", delta, reduce="lifetime_sum")

    def set_weights(self, weights: Any, weights_version: int) -> None:
        """Weights go to the servers, not here (the driver sends none)."""

    def get_weights(self) -> dict[str, np.ndarray]:
        raise RuntimeError(f"env runner {self.worker_index} acts through inference server {self.server} (central "
                           f"inference) and holds no weights: use algo.get_weights() or algo.get_module()")

    def get_state(self) -> dict[str, Any]:
        """A recurrent module's states (exploration state lives in the server, per runner)."""
        return {} if self.state is None else {"recurrent_state": self.state.copy()}

    def set_state(self, state: dict[str, Any]) -> None:
        if self.recurrent and state.get("recurrent_state") is not None:
            self.state = np.array(state["recurrent_state"], np.float32)

    def close(self) -> None:
        for lane in self.lanes:
            if lane.segment is not None:
                lane.segment.close()
                lane.segment = None
        if self._sock is not None:
            self._sock.close(linger=0)
            self._sock = None
        self._ctx.term()


def _host(address: str) -> str:
    return address.rsplit(":", 1)[0].split("//", 1)[-1]


def _local_hosts() -> set[str]:
    """The addresses this node answers on: a server bound to one of them shares our /dev/shm."""
    return {"127.0.0.1", "localhost", node_address()}
