"""The PolicyClient's connection to a policy server: one DEALER socket, requests matched to replies.

Apart from ``protocols.client`` because this is the wire side alone: request ids, the hello on
every (re)connect, retries the server's errors ask for, and routing what arrives. What a reply
means for episodes, the spool and the welcome it leaves to the client, through the hooks it is
built with. Not locked by itself: it runs under the client's lock, like the client's own state.
"""
from __future__ import annotations

import itertools
import logging
import os
import threading
import time
import warnings
from typing import Any, Callable

import zmq

from protocols import external as wire
from protocols.errors import ProtocolError
from protocols.external import ServerError

log = logging.getLogger("runnel.client")

_NOBLOCK, _EVENTS, _POLLIN = int(zmq.NOBLOCK), int(zmq.EVENTS), int(zmq.POLLIN)
"""Plain ints: pyzmq's enum flags cost a conversion on every call of the hot path."""
_HANDSHAKE_FAILED = (zmq.EVENT_HANDSHAKE_FAILED_AUTH | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
                     | zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL)


class Connection:
    """Requests and replies over one socket to ``address``; every method but ``send`` runs under ``lock``."""

    def __init__(self, address: str, curve: list[tuple[int, bytes]], lock: threading.RLock, *, timeout_s: float,
                 spin_s: float, hello: Callable[[], dict[str, Any]], on_welcome: Callable[[dict], None],
                 restart_episodes: Callable[[list[str]], bool], on_chunks: Callable[[dict], None]) -> None:
        """``hello`` gives the fields this client introduces itself with. ``on_welcome`` gets
        every server's welcome; ``restart_episodes`` starts again episodes a restarted server forgot
        (False: not all of them are running any more); ``on_chunks`` gets the acknowledgements of chunks."""
        self.address = address
        self.timeout_s = timeout_s
        self.spin_s = spin_s
        self._hello_fields = hello
        self._on_welcome = on_welcome
        self._restart_episodes = restart_episodes
        self._on_chunks = on_chunks
        self._lock = lock
        self._ids = itertools.count(1)
        self._replies: dict[int, tuple[dict, list]] = {}
        self._awaiting: set[int] = set()  # request ids whose replies a caller waits for
        self._last_heard = 0.0
        self._in_hello = False
        self._epoch = 0  # connections said hello on: a request sent before the latest hello is sent again
        self.version = wire.VERSION
        """The protocol version said in hello: this client's, or 1 for a server that speaks only that."""
        # one context (one ZeroMQ I/O thread) for all clients of this process: a simulator hosting many
        # clients wakes one thread per burst of replies, not one per client
        self._ctx = zmq.Context.instance()
        self._curve = curve
        self._sock = self._connect()

    def _connect(self) -> zmq.Socket:
        sock = self._ctx.socket(zmq.DEALER)
        for opt, value in ((zmq.LINGER, 0), (zmq.RECONNECT_IVL, 100), (zmq.RECONNECT_IVL_MAX, 2000),
                           (zmq.HEARTBEAT_IVL, 1000), (zmq.HEARTBEAT_TIMEOUT, 5000), (zmq.HEARTBEAT_TTL, 10000),
                           (zmq.SNDHWM, 10000), (zmq.RCVHWM, 10000)):
            sock.setsockopt(opt, value)
        for opt, value in self._curve:
            sock.setsockopt(opt, value)
        # with CURVE, a refused key looks like a dead server (nothing reaches the server's socket);
        # the socket monitor tells the two apart, so hello can say which it is
        self._monitor = sock.get_monitor_socket(_HANDSHAKE_FAILED) if self._curve else None
        sock.connect(self.address)
        self._poller = zmq.Poller()
        self._poller.register(sock, zmq.POLLIN)
        return sock

    def _refused(self) -> str | None:
        """Why the server refused the CURVE handshake, if it did (read from the socket monitor)."""
        monitor = self._monitor
        while monitor is not None and monitor.poll(0):
            from zmq.utils.monitor import recv_monitor_message

            event = recv_monitor_message(monitor)["event"]
            if event == zmq.EVENT_HANDSHAKE_FAILED_AUTH:
                return ("the policy server refused this client's CURVE key: its allowed_client_keys do not list "
                        "this client's public key (copy NAME.key from `runnel keys NAME` into the server's list)")
            return ("the CURVE handshake with the policy server failed: is server_public_key the server's public key, "
                    "and does the server use CURVE?")
        return None

    def hello(self) -> None:
        self._in_hello = True
        try:
            self._say_hello()
        finally:
            self._in_hello = False

    def _say_hello(self) -> None:
        header = {"op": wire.HELLO, "protocol": wire.PROTOCOL, "version": self.version, **self._hello_fields()}
        try:
            welcome, _ = self.request(header, hello=True)
        except ServerError as err:
            if err.code != wire.VERSION_MISMATCH or self.version == 1:
                raise
            self.version = 1  # a server from before version 2: version 1 is every single-agent call
            welcome, _ = self.request({**header, "version": 1}, hello=True)
        self._epoch += 1
        self._on_welcome(welcome)

    def rehello(self) -> None:
        """Say hello on a connection the server does not know (once, however many replies say so)."""
        if not self._in_hello:
            self.hello()

    def send(self, header: dict, body: bytes | None = None) -> None:
        """Queue a message for the server. A socket with no connection to send on (none yet, or the CURVE
        handshake refused this client and ZeroMQ dropped it) would block for good: it waits at most
        ``timeout_s`` and raises ``ConnectionRefusedError`` (refused key) or ``TimeoutError``."""
        with self._lock:
            parts = [wire.pack(header)] if body is None else [wire.pack(header), body]
            copy = body is None or len(body) < 65536
            deadline = None
            while True:
                try:
                    self._sock.send_multipart(parts, _NOBLOCK, copy=copy)
                    return
                except zmq.Again:
                    pass
                refused = self._refused() if self._monitor is not None else None
                if refused is not None:
                    raise ConnectionRefusedError(f"{self.address}: {refused}")
                now = time.monotonic()
                deadline = deadline or now + self.timeout_s
                if now > deadline:
                    raise TimeoutError(f"could not send {header.get('op')!r} to the policy server at {self.address} "
                                       f"within {self.timeout_s:.0f} s: no connection; is it running, and is the "
                                       "address (and CURVE key) right?")
                self._sock.poll(100, zmq.POLLOUT)

    def send_chunk(self, key: tuple[str, int], frame: bytes) -> None:
        """Offer one spooled chunk without blocking (``zmq.Again``: the pipe is full)."""
        header = {"op": wire.CHUNKS, "id": next(self._ids), "ids": [list(key)]}
        self._sock.send_multipart([wire.pack(header), frame], zmq.NOBLOCK, copy=False)

    def request(self, header: dict, body: bytes | None = None, *, hello: bool = False,
                retry_unknown_episode: str | list[str] | None = None) -> tuple[dict, list]:
        """Send and wait for the reply with the same id; re-hello and retry when the server does
        not know this connection; ``TimeoutError`` when no reply comes within ``timeout_s``."""
        deadline = time.monotonic() + self.timeout_s
        with self._lock:
            rid, epoch = self.issue(header, body)
            return self.complete(rid, epoch, header, body, deadline, hello, retry_unknown_episode)

    def issue(self, header: dict, body: bytes | None) -> tuple[int, int]:
        """Send a request under a new id (under the lock); its reply is kept for ``complete``."""
        rid = next(self._ids)
        header["id"] = rid
        self._awaiting.add(rid)
        try:
            self.send(header, body)
        except BaseException:
            self._awaiting.discard(rid)
            raise
        return rid, self._epoch

    def complete(self, rid: int, epoch: int, header: dict, body: bytes | None, deadline: float, hello: bool = False,
                 retry_unknown_episode: str | list[str] | None = None) -> tuple[dict, list]:
        """The reply to an issued request (under the lock), sending it again as the errors ask."""
        while True:
            try:
                reply = self._await(rid, deadline, header["op"], epoch)
            finally:
                self._awaiting.discard(rid)
                self._replies.pop(rid, None)
            if reply is not None:  # None: reconnected meanwhile, so the server never saw the request
                h, parts = reply
                if h.get("op") != wire.ERROR:
                    return reply
                code = h.get("code")
                restart = ([retry_unknown_episode] if isinstance(retry_unknown_episode, str)
                           else retry_unknown_episode or [])
                if code == wire.HELLO_FIRST and not hello:
                    self.hello()
                elif code == wire.UNKNOWN_EPISODE and restart and self._restart_episodes(restart):
                    pass  # the server restarted mid-episode: the client started them again
                elif code == wire.BUSY and time.monotonic() < deadline:
                    self.pump(0.01)
                else:
                    raise ServerError(str(code), str(h.get("message")), bool(h.get("fatal")))
            rid, epoch = self.issue(header, body)

    def _await(self, rid: int, deadline: float, what: str, epoch: int) -> tuple[dict, list] | None:
        """The reply to request ``rid``; None if the client said hello again meanwhile."""
        resent_at = time.monotonic()
        while rid not in self._replies:
            if self._epoch != epoch and what != wire.HELLO:
                return None
            now = time.monotonic()
            if what == wire.HELLO and self._monitor is not None:
                refused = self._refused()
                if refused is not None:
                    raise ConnectionRefusedError(f"{self.address}: {refused}")
            if now > deadline:
                raise TimeoutError(f"no answer to {what!r} from the policy server at {self.address} within "
                                   f"{self.timeout_s:.0f} s; is it running, and is the address (and CURVE key) right?")
            self.pump(min(deadline - now, 0.25))
            if rid not in self._replies and time.monotonic() - resent_at > 2.0 and what != wire.HELLO:
                # a silent server may be a new one that never saw this request: ask who is there
                resent_at = time.monotonic()
                self.send({"op": wire.PING, "id": 0})
        return self._replies.pop(rid)

    def pump(self, timeout_s: float) -> None:
        """Receive and dispatch everything that arrives within ``timeout_s`` (at least one poll)."""
        sock = self._sock
        if not sock.getsockopt(_EVENTS) & _POLLIN:
            if self.spin_s > 0.0 and timeout_s > 0.0:
                end = time.perf_counter() + min(self.spin_s, timeout_s)
                while not sock.getsockopt(_EVENTS) & _POLLIN and time.perf_counter() < end:
                    pass
            if not sock.getsockopt(_EVENTS) & _POLLIN and not self._poller.poll(int(timeout_s * 1000)):
                return
        # asking the socket before each read: a raised zmq.Again costs more than a small reply's handling
        while sock.getsockopt(_EVENTS) & _POLLIN:
            frame = sock.recv(_NOBLOCK, copy=False)  # a frame knows if more parts follow (no RCVMORE call)
            parts = [frame.bytes]
            while frame.more:
                frame = sock.recv(_NOBLOCK, copy=False)
                parts.append(frame.bytes)
            self._last_heard = time.monotonic()
            try:
                header = wire.unpack_header(parts[0])
            except ProtocolError as err:
                log.warning("dropped a malformed message from the server: %s", err)
                continue
            self._dispatch(header, parts[1:])

    def _dispatch(self, header: dict, parts: list) -> None:
        op, rid = header["op"], header.get("id", 0)
        if op == wire.COMMITTED or op == wire.RECEIVED or (op == wire.ERROR and header.get("ids")):
            self._on_chunks(header)  # about chunks: nothing waits for these
        elif rid in self._awaiting:
            self._replies[rid] = (header, parts)
        elif op == wire.ERROR and header.get("code") != wire.HELLO_FIRST:
            log.warning("policy server: %s [%s]", header.get("message"), header.get("code"))
        elif op == wire.ERROR and header.get("code") == wire.HELLO_FIRST:  # to a ping: a new connection
            self.rehello()

    def ping_if_quiet(self, now: float, heartbeat_s: float) -> None:
        """Ping a server not heard from for ``heartbeat_s`` (one ping per interval)."""
        if now - self._last_heard > heartbeat_s:
            self.send({"op": wire.PING, "id": 0})
            self._last_heard = now  # one ping per interval

    def close(self) -> None:
        """Say goodbye and release the socket (under the lock)."""
        try:
            self._sock.send(wire.pack({"op": wire.BYE, "id": 0}), zmq.NOBLOCK)
        except zmq.ZMQError:
            pass
        if self._monitor is not None:
            self._sock.disable_monitor()
            self._monitor.close(linger=0)
        self._sock.close(linger=100)


def curve_options(server_public_key: Any, client_key: Any) -> list[tuple[int, bytes]]:
    if server_public_key is None:
        if client_key is not None:
            warnings.warn("client_key given without server_public_key: the connection is not encrypted", stacklevel=3)
        return []
    server = _read_key(server_public_key, secret=False)[0]
    if client_key is None:
        raise ValueError("CURVE needs this client's key pair too: client_key='path/to/client.key_secret' "
                         "(make one with `runnel keys NAME`) or client_key=(public, secret)")
    public, secret = (client_key if isinstance(client_key, tuple) else _read_key(client_key, secret=True))
    return [(zmq.CURVE_SERVERKEY, _b(server)), (zmq.CURVE_PUBLICKEY, _b(public)), (zmq.CURVE_SECRETKEY, _b(secret))]


def _b(key: Any) -> bytes:
    return key.encode("ascii") if isinstance(key, str) else bytes(key)


def _read_key(value: Any, secret: bool) -> tuple[bytes, bytes | None]:
    """A z85 key as given, or the keys of a ZeroMQ certificate file (``.key`` / ``.key_secret``)."""
    if isinstance(value, (bytes, str)) and len(value) == 40 and not os.path.exists(value):
        return _b(value), None
    import zmq.auth

    try:
        public, private = zmq.auth.load_certificate(value)
    except (OSError, ValueError) as err:
        raise ValueError(f"cannot read a CURVE key from {value!r}: {err}") from None
    if secret and private is None:
        raise ValueError(f"{value!r} holds no secret key: give the '.key_secret' file `runnel keys` wrote")
    return public, private
