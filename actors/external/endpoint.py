"""ServerEndpoint: the policy server's ROUTER socket -- binding it, reading and writing messages part
by part -- and the wake-up pair other threads use to rouse the server thread; ``Conn``, what that
thread knows of one connection on it.

The raw I/O of the hot path (plain-int flags, part limits) apart from the loop that decides what a
message means; only the server thread uses the socket, any thread may ``wake`` it.
"""
from __future__ import annotations

import dataclasses
import threading
import time
from dataclasses import dataclass

import zmq

from actors.external.security import ServerSecurity
from actors.external.settings import ExternalSettings
from protocols import external as wire

NOBLOCK, EVENTS, POLLIN = int(zmq.NOBLOCK), int(zmq.EVENTS), int(zmq.POLLIN)
MORE_NOBLOCK = int(zmq.SNDMORE) | NOBLOCK
"""Plain ints: pyzmq's enum flags cost a conversion on every call of the hot path."""
MAX_PARTS = 3
"""No client message has more parts (route, header, body); the rest of a longer one is read and dropped."""


@dataclass
class Conn:
    """One client connection as the server thread knows it (no other thread touches it)."""

    name: str
    mode: str
    last_seen: float
    episodes: set = dataclasses.field(default_factory=set)
    in_flight: int = 0
    errors: int = 0
    version: int = 1
    """The protocol version its hello said (2: it may send the multi-agent ops)."""
    ma_episodes: dict = dataclasses.field(default_factory=dict)
    """Multi-agent episodes it started, by its episode id (``actors.external.multi_agent_acts``)."""


class ServerEndpoint:
    def __init__(self, ctx: zmq.Context, address: str, external: ExternalSettings, security: ServerSecurity,
                 counts: dict[str, int]) -> None:
        """``counts``: the server thread's counters (a reply the peer cannot take is counted there)."""
        self.address, self.x, self.security = address, external, security
        self._counts = counts
        self._ctx = ctx
        self._pack = wire.header_packer()  # the server thread's own: a packer is not thread-safe
        self.sock = self._bind()
        self._wake_addr = f"inproc://runnel-server-wake-{id(self)}"
        self.wake_rx = self._ctx.socket(zmq.PULL)
        self.wake_rx.bind(self._wake_addr)
        self._wake_tx = self._ctx.socket(zmq.PUSH)
        self._wake_tx.connect(self._wake_addr)
        self._wake_tx_lock = threading.Lock()

    def _bind(self) -> zmq.Socket:
        sock = self._ctx.socket(zmq.ROUTER)
        for opt, value in ((zmq.LINGER, 0), (zmq.MAXMSGSIZE, self.x.max_frame_bytes), (zmq.SNDHWM, 100_000),
                           (zmq.RCVHWM, 100_000), (zmq.HEARTBEAT_IVL, 2000), (zmq.HEARTBEAT_TIMEOUT, 10_000),
                           (zmq.HEARTBEAT_TTL, 20_000), (zmq.ROUTER_MANDATORY, 0)):
            sock.setsockopt(opt, value)
        self.security.apply(sock)
        try:
            sock.bind(self.address)
        except zmq.ZMQError as err:
            sock.close()
            self.security.stop()
            raise RuntimeError(f"policy server cannot listen on {self.address}: {err} (is another server "
                               f"using the port? set config.external_clients(address=...))") from None
        return sock

    def spin(self) -> list[bytes] | None:
        """Poll without sleeping for up to ``spin_s``: a client acting in a loop sends its next
        request within that, and waking a sleeping thread costs more than the whole request."""
        end = time.perf_counter() + self.x.spin_s
        sock = self.sock
        while time.perf_counter() < end:
            if sock.getsockopt(EVENTS) & POLLIN:
                return self.recv()
        return None

    def recv(self) -> list[bytes]:
        """One message's parts (at most ``MAX_PARTS``, plus an empty marker part if it had more)."""
        sock = self.sock
        # frames, not bytes: a frame knows whether more parts follow, where asking the socket
        # (RCVMORE) costs a microsecond a part
        frame = sock.recv(NOBLOCK, copy=False)
        parts = [frame.bytes]
        while frame.more:
            frame = sock.recv(NOBLOCK, copy=False)
            if len(parts) < MAX_PARTS:
                parts.append(frame.bytes)
            elif len(parts) == MAX_PARTS:
                parts.append(b"")  # too many parts: the checks refuse the message by its part count
        return parts

    def send(self, route: bytes, header: dict, body: bytes | None = None) -> None:
        sock = self.sock
        try:  # part by part with plain-int flags; copying small parts is cheaper than zero-copy tracking
            sock.send(route, MORE_NOBLOCK)
            if body is None:
                sock.send(self._pack(header), NOBLOCK)
            else:
                sock.send(self._pack(header), MORE_NOBLOCK)
                sock.send(body, NOBLOCK, copy=len(body) < 65536)
        except zmq.Again:  # the peer's queue is full: it is not reading; it will resend what matters
            self._counts["num_replies_dropped"] += 1

    def wake(self) -> None:
        with self._wake_tx_lock:
            try:
                self._wake_tx.send(b"", zmq.NOBLOCK)
            except zmq.Again:
                pass

    def close(self) -> None:
        self.sock.close(linger=500)
        self.wake_rx.close()
        self._wake_tx.close()
