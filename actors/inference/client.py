"""RemoteActing: an env runner's acting piece under central inference -- observations out, actions back.

The runner's sampling loop calls ``act(obs, explore, timestep)`` once per step, as it calls the local
module otherwise (``actors.env.acting.LocalActing``); this sends the step's observations to the
runner's inference server (``protocols.inference``, one codec frame over a ZeroMQ DEALER socket) and
returns its answer: the module's actions, their log-probabilities, the distribution inputs and the
weights version that acted. Everything else in the runner -- stepping, cutting chunks, counting --
is unchanged, so chunks look the same with either piece.

A runner on its server's node passes large observation blocks through shared memory
(``actors.inference.shared_obs``; ``InferenceSettings.shared_memory``), other runners inline in the frame.

No answer within ``resend_after_s`` (the server died, or is slow): the runner looks its server up in
the directory (``actors.inference.directory``), reconnects if the address changed, and sends the same
request again under the same number. An answer to an older number is dropped, so a step is acted on
exactly once and no chunk is lost or doubled. After ``reply_timeout_s`` without any answer the runner
raises and its group recreates it. An ``error`` answer (the server could not serve the request)
raises at once, naming the server's message.

Torch-free on purpose: a runner under central inference never imports torch.
"""
from __future__ import annotations

import contextlib
import logging
import time
from typing import Any

import numpy as np
import zmq

from actors.inference.directory import lookup_address
from actors.inference.settings import InferenceClientSettings
from actors.inference.shared_obs import MIN_BYTES, ObsSegment, shared_memory_available
from actors.network import node_address
from protocols import inference as wire
from protocols.errors import ProtocolError

log = logging.getLogger("runnel")


class RemoteActing:
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
        self.segment: ObsSegment | None = None
        """Where observations go when the server shares this node (None: inline)."""
        self._shm_refusals = 0
        self._shm_wanted = settings.shared_memory and shared_memory_available()
        self._connect(self._wait_for_address(time.monotonic() + settings.reply_timeout_s))

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
        if self.segment is not None:  # a new server: it knows no segment of ours yet
            self.segment.close()
            self.segment = None
        if self._shm_wanted and _host(address) in _local_hosts():
            self.segment = ObsSegment(self.worker_index)

    def session(self) -> contextlib.AbstractContextManager:
        """What the runner holds around a sampling run (the local piece: torch's inference mode)."""
        return contextlib.nullcontext()

    def act(self, obs: Any, explore: bool, timestep: int) -> tuple[np.ndarray, np.ndarray, np.ndarray, int]:
        """(module actions, their log-probabilities, distribution inputs, weights version) for one step."""
        self.seq += 1
        frame = self._request(obs, explore, timestep)
        sock = self._sock
        sock.send(frame, copy=False)
        started = last_sent = time.monotonic()
        while True:
            wait_ms = int(max(0.0, last_sent + self.s.resend_after_s - time.monotonic()) * 1000)
            if sock.poll(wait_ms, zmq.POLLIN):
                reply = self._read(sock.recv())
                if reply == "resend":  # the server could not open our segment: a new one, or inline
                    frame = self._request(obs, explore, timestep)
                    sock.send(frame, copy=False)
                    last_sent = time.monotonic()
                    continue
                if reply is not None:
                    if self.segment is not None:
                        self.segment.answered()
                    self.weights_version = reply.weights_version
                    return reply.actions, reply.logp, reply.dist_inputs, reply.weights_version
                continue
            now = time.monotonic()
            if now - started >= self.s.reply_timeout_s:
                raise RuntimeError(f"env runner {self.worker_index}: no answer from inference server {self.server} "
                                   f"at {self.address} for {now - started:.0f} s (reply_timeout_s="
                                   f"{self.s.reply_timeout_s}); request {self.seq} was sent {self.num_resends} times")
            address = lookup_address(self.s, self.server, timeout_s=min(5.0, self.s.resend_after_s))
            if address is not None and address != self.address:
                log.warning("env runner %d: inference server %d moved from %s to %s; resending request %d",
                            self.worker_index, self.server, self.address, address, self.seq)
                self._connect(address)
                self.num_reconnects += 1
                sock = self._sock
                frame = self._request(obs, explore, timestep)  # a new server: a new segment too
            sock.send(frame, copy=False)
            self.num_resends += 1
            last_sent = time.monotonic()

    def _request(self, obs: Any, explore: bool, timestep: int) -> bytes:
        segment = self.segment
        if segment is not None and type(obs) is np.ndarray and obs.nbytes >= MIN_BYTES:
            try:
                shared = segment.write(obs)
            except OSError as err:  # /dev/shm full or gone: inline from now on
                log.warning("env runner %d: no room for observations in shared memory (%s); sending them inline",
                            self.worker_index, err)
                segment.close()
                self.segment, self._shm_wanted = None, False
            else:
                return wire.act_request(self.worker_index, self.seq, None, explore, timestep, shared)
        return wire.act_request(self.worker_index, self.seq, obs, explore, timestep)

    def _read(self, frame: bytes) -> wire.ActReply | str | None:
        """The awaited reply, None for a stale one (an answer to a request resent since), or "resend"."""
        try:
            reply = wire.read_reply(frame)
        except ProtocolError as err:
            raise RuntimeError(f"env runner {self.worker_index}: a malformed answer from inference server "
                               f"{self.server} at {self.address}: {err}") from None
        if isinstance(reply, wire.ServerError):
            if reply.code == "shm_unavailable" and reply.seq != self.seq:
                return None  # about a request resent since
            if reply.code == "shm_unavailable" and self.segment is not None:
                self._shm_refusals += 1
                if self._shm_refusals >= 2:  # twice: this server cannot see our /dev/shm; inline from now on
                    log.warning("env runner %d: inference server %d at %s cannot open shared memory (%s); sending "
                                "observations inline", self.worker_index, self.server, self.address, reply.message)
                    self.segment.close()
                    self.segment, self._shm_wanted = None, False
                else:
                    self.segment.renew()
                return "resend"
            raise RuntimeError(f"env runner {self.worker_index}: inference server {self.server} at {self.address} "
                               f"refused request {self.seq}: {reply}")
        if reply.seq != self.seq:
            return None
        self._shm_refusals = 0
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
        return {}  # exploration state lives in the server (per runner)

    def set_state(self, state: dict[str, Any]) -> None:
        pass

    def close(self) -> None:
        if self.segment is not None:
            self.segment.close()
            self.segment = None
        if self._sock is not None:
            self._sock.close(linger=0)
            self._sock = None
        self._ctx.term()


def _host(address: str) -> str:
    return address.rsplit(":", 1)[0].split("//", 1)[-1]


def _local_hosts() -> set[str]:
    """The addresses this node answers on: a server bound to one of them shares our /dev/shm."""
    return {"127.0.0.1", "localhost", node_address()}
