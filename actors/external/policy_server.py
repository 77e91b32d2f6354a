"""PolicyServer: external clients act and send experience through it, in an env runner's place.

One ZeroMQ ROUTER endpoint serves many clients (``protocols.client.PolicyClient``, or any program
that speaks ``protocols/EXTERNAL.md``). A server thread owns the socket:

* **remote inference** -- ``act`` requests of all clients are gathered as they arrive and answered
  from one batched forward pass (up to ``max_batch`` rows; ``batch_wait_s`` > 0 waits that long
  for a fuller batch, 0 runs as soon as no more requests are queued);
* **local inference** -- ``weights`` requests get the policy exported for numpy
  (``actors.modules.export``), cached per weights version;
* **experience** -- ``chunks`` messages are decoded with bounds, checked against the spaces,
  deduplicated by ``(episode_id, chunk_index)`` and held until the algorithm takes them.

The server implements the env runner role, so an ``EnvRunnerGroup`` hosts servers in its runner
slots (in the driver, or as Ray actors managed like any runner) and an algorithm's plan samples
from them unchanged: ``sample_encoded`` hands on the chunks clients sent (waiting at most
``sample_wait_s`` for them). The driver asking again means it has the previous answer, so that
is when the previous chunks are *committed*: their ids are written to the commit journal
(``actors.external.journal``) and acknowledged to the clients, which then drop them from their
spools. A recreated server is told by its group which chunks its predecessor handed on last
(``confirm_delivered``), so a kill between hand-off and acknowledgement duplicates nothing.

Hostile or broken clients get error replies (see ``protocols.external``) and never reach the
algorithm: frames over ``max_frame_bytes`` make ZeroMQ drop the connection, every body is decoded
with the codec's bounds, and a client past ``max_protocol_errors`` is banned. Each connection may
hold ``max_open_episodes`` episodes and ``max_requests_in_flight`` act requests.
"""
from __future__ import annotations

import dataclasses
import logging
import os
import tempfile
import threading
import time
import uuid
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, Callable
from urllib.parse import urlsplit

import numpy as np
import torch
import zmq

from actors.external.journal import CommitJournal, Key
from actors.core import EnvRunnerRole
from actors.env.actions import EnvActions
from actors.env.process import set_log_level
from actors.env.settings import EnvRunnerSettings
from actors.env.exploration import make_exploration
from actors.external.security import ServerSecurity
from actors.metrics import MetricsLogger
from actors.modules import to_torch
from protocols import external as wire
from protocols import nested
from actors.offline.recorder import Recorder
from protocols.codec import Limits, decode, encode
from protocols.episode import EpisodeChunk
from protocols.errors import ProtocolError
from protocols.numpy_policy import NumpyPolicy
from protocols.schema import ChunkSchema
from protocols.spaces import space_from_dict, space_to_dict

log = logging.getLogger("runnel")

REQUIRED_EXTRA = ("action_logp", "action_dist_inputs")
"""What every chunk carries besides obs/actions/rewards: the behaviour policy's outputs."""
QUIET_LOG_S = 30.0
"""How often a server that receives no experience says so."""
_NOBLOCK, _EVENTS, _POLLIN, _RCVMORE = int(zmq.NOBLOCK), int(zmq.EVENTS), int(zmq.POLLIN), int(zmq.RCVMORE)
_MORE_NOBLOCK = int(zmq.SNDMORE) | _NOBLOCK
"""Plain ints: pyzmq's enum flags cost a conversion on every call of the hot path."""
MAX_PARTS = 3
"""No client message has more parts (route, header, body); the rest of a longer one is read and dropped."""
COUNTS = ("num_actions_served", "num_inference_batches", "num_connects", "num_protocol_errors", "num_bad_chunks",
          "num_busy_replies", "num_duplicate_chunks", "num_chunks_received", "num_replies_dropped", "num_banned")
"""Counters the server thread keeps; ``get_metrics`` reports them under ``external/``."""


@dataclass
class ExternalSettings:
    """How a policy server listens and what it allows (``config.external_clients(...)``)."""

    address: str = "tcp://127.0.0.1:9900"
    """Where runner slot 1 (or the in-driver server) binds; slot ``i`` binds port + i - 1."""
    inference_mode: str = "remote"
    """What clients that do not choose get: "remote" (the server acts) or "local" (they act with exported weights)."""
    max_batch: int = 256
    """Most act requests answered by one forward pass."""
    batch_wait_s: float = 0.0
    """How long the first queued act request may wait for more to batch with (0: answer as soon as none are queued)."""
    spin_s: float = 0.0
    """After a message, poll this long without sleeping before blocking (lower latency for clients acting
    in a loop, at the cost of a busy core while they do; 0: always block)."""
    inference_backend: str = "auto"
    """Remote inference with "numpy" (the exported policy: far less per-call overhead than torch for
    small MLPs), "torch", or "auto" (numpy for exportable MLP policies, torch for CNNs and the rest)."""
    sample_wait_s: float = 5.0
    """How long one ``sample`` call waits for clients' chunks before returning what it has."""
    max_pending_steps: int = 200_000
    """Env steps of received, not yet handed-on chunks the server holds; beyond it clients are told "busy"."""
    server_secret_key: str | None = None
    """Path of the server's ``.key_secret`` (``runnel keys server``): turns on CURVE encryption."""
    allowed_client_keys: Any = None
    """With CURVE: the clients' public keys -- a directory of ``.key`` files, or a list of files / z85 keys."""
    allow_plaintext: bool = False
    """Serve unencrypted on a non-loopback address (a warning is logged)."""
    max_clients: int = 1024
    """Connections served at once."""
    max_open_episodes: int = 1024
    """Episodes one connection may have started and not ended (remote inference)."""
    max_requests_in_flight: int = 256
    """Act requests of one connection waiting for their answer."""
    max_frame_bytes: int = 64 << 20
    """Largest message part; ZeroMQ disconnects a peer that sends a bigger one."""
    max_chunk_steps: int = 100_000
    """Longest chunk accepted."""
    max_protocol_errors: int = 100
    """Malformed messages one connection may send before it is banned."""
    idle_timeout_s: float = 300.0
    """A connection silent this long is forgotten (its open episodes with it)."""
    journal_dir: str | None = None
    """Where the commit journal lives (default: the temp dir's ``runnel-journal``); "" disables it."""
    fragment_length: int = 200
    """Steps per chunk a client cuts (from ``rollout_fragment_length``)."""

    def address_for(self, slot: int) -> str:
        """The address of runner slot ``slot`` (0 = the in-driver server, like slot 1)."""
        if slot <= 1:
            return self.address
        parts = urlsplit(self.address)
        return f"{parts.scheme}://{parts.hostname}:{parts.port + slot - 1}"


@dataclass
class _Conn:
    name: str
    mode: str
    last_seen: float
    episodes: set = dataclasses.field(default_factory=set)
    in_flight: int = 0
    errors: int = 0


_NO_ACTION = [None]  # the one row of an act request without a client-chosen action (read only)


@dataclass
class _Act:
    route: bytes
    rid: int
    obs: list  # one observation per row (a batched request has several)
    given: list  # per row: the action the client took (log_action), or None
    explore: bool
    batched: bool  # reply with lists


class PolicyServer(EnvRunnerRole):
    def __init__(self, settings: EnvRunnerSettings, worker_index: int = 0, recreated: bool = False,
                 external: ExternalSettings | None = None) -> None:
        self.s, self.x = settings, external or ExternalSettings()
        self.worker_index = worker_index
        if worker_index > 0:
            torch.set_num_threads(settings.torch_threads)
            set_log_level(settings.log_level)
        self.address = self.x.address_for(worker_index)
        self.server_id = uuid.uuid4().hex[:12]
        self.observation_space, self.action_space = settings.observation_space, settings.action_space
        self.module = settings.module_class(self.observation_space, self.action_space, settings.model_config,
                                            inference_only=True, **settings.module_kwargs)
        self.module.eval()
        self.exploration = make_exploration(settings.exploration_config, self.module.dist_spec)
        self.env_actions = EnvActions(self.action_space, settings.normalize_actions, settings.clip_actions)
        self.recorder = Recorder(settings.recording, f"server{worker_index:03d}") if settings.recording else None
        self.box_actions = self.env_actions.box
        self.schema = ChunkSchema.for_spaces(self.observation_space, self.action_space, ("action_logp",))
        self.dist_dim = self.module.dist_spec.input_dim
        self.spaces = {"observation_space": space_to_dict(self.observation_space),
                       "action_space": space_to_dict(self.action_space)}
        self.act_limits = Limits(max_frame_bytes=8 << 20, max_decoded_bytes=16 << 20, max_buffer_size=1 << 20,
                                 max_array_len=4096, max_map_len=256, max_depth=16)
        self.chunk_limits = Limits(max_frame_bytes=self.x.max_frame_bytes, max_decoded_bytes=4 * self.x.max_frame_bytes,
                                   max_buffer_size=min(self.x.max_frame_bytes, 64 << 20))
        self.metrics = MetricsLogger()
        self.weights_version = 0
        self.num_env_steps_served = 0
        self._timestep_offset = 0
        self._lock = threading.Condition()  # pending chunks, delivered/committed ids, metrics
        self._module_lock = threading.Lock()
        self._export_error = ""
        self._pending: list[tuple[Key, EpisodeChunk]] = []
        self._pending_keys: set[Key] = set()
        self._pending_steps = 0
        self._owner: dict[Key, bytes] = {}  # who to acknowledge a chunk to (the latest connection that sent it)
        # episode id -> [next chunk index it may hand in, highest index refused] for episodes with chunks
        # refused as busy: the rest wait their turn, so each episode reaches training in order (_on_chunks)
        self._gates: OrderedDict[str, list[int]] = OrderedDict()
        self._delivered: list[Key] = []  # handed on by the last sample call, not yet confirmed
        self._delivered_keys: set[Key] = set()
        self._counts: dict[str, int] = dict.fromkeys(COUNTS, 0)  # the server thread's counters
        self._counts_reported: dict[str, int] = dict.fromkeys(COUNTS, 0)
        self._outbox: list[tuple[bytes, dict]] = []  # messages other threads ask the server thread to send
        self._returns: OrderedDict[str, list] = OrderedDict()  # episode id -> [return, length] so far
        self._export: tuple[int, bytes] | None = None
        self._rng = np.random.default_rng(None if settings.seed is None else settings.seed + 7919 * worker_index)
        self._desc: dict | None = None  # the exported policy (local clients; numpy inference)
        self._numpy: NumpyPolicy | None = None
        self._refresh_export()
        journal_dir = self.x.journal_dir if self.x.journal_dir is not None else os.path.join(
            tempfile.gettempdir(), "runnel-journal")
        port = urlsplit(self.address).port
        self.journal = CommitJournal(os.path.join(journal_dir, f"policy-server-{port}.journal") if journal_dir else None)
        self._conns: dict[bytes, _Conn] = {}
        self._banned: set[bytes] = set()
        self._acts: list[_Act] = []
        self._rows = 0  # observations in self._acts
        self._first_act_at = 0.0
        self._quiet_logged = 0.0
        self._pack = wire.header_packer()  # the server thread's own: a packer is not thread-safe
        self._ctx = zmq.Context()
        self.security = ServerSecurity(self._ctx, self.address, self.x.server_secret_key, self.x.allowed_client_keys,
                                       self.x.allow_plaintext)
        self._sock = self._bind()
        self._wake_addr = f"inproc://runnel-server-wake-{id(self)}"
        self._wake_rx = self._ctx.socket(zmq.PULL)
        self._wake_rx.bind(self._wake_addr)
        self._wake_tx = self._ctx.socket(zmq.PUSH)
        self._wake_tx.connect(self._wake_addr)
        self._wake_tx_lock = threading.Lock()
        self._stopping = threading.Event()
        self.error: BaseException | None = None
        self._thread = threading.Thread(target=self._serve, name=f"runnel-policy-server-{worker_index}", daemon=True)
        self._thread.start()
        log.info("policy server %s listening on %s (%s)", self.server_id, self.address,
                 "CURVE" if self.security.curve else "plaintext")

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

    # --- the server thread ----------------------------------------------------------------------
    def _serve(self) -> None:
        poller = zmq.Poller()
        poller.register(self._sock, zmq.POLLIN)
        poller.register(self._wake_rx, zmq.POLLIN)
        last_sweep = time.monotonic()
        try:
            while not self._stopping.is_set():
                timeout = 100
                if self._acts:
                    timeout = max(0, int((self._first_act_at + self.x.batch_wait_s - time.monotonic()) * 1000))
                parts = self._spin() if self.x.spin_s > 0 and not self._acts else None
                if parts is None:
                    events = dict(poller.poll(timeout))
                    if self._wake_rx in events:
                        while self._wake_rx.poll(0):
                            self._wake_rx.recv()
                else:
                    self._on_message(parts)
                sock, recv = self._sock, self._recv
                for _ in range(4 * self.x.max_batch):  # bounded, so queued acts and commits go out
                    # asking the socket first: a raised zmq.Again costs more than the whole check
                    if not sock.getsockopt(_EVENTS) & _POLLIN:
                        break
                    self._on_message(recv())
                    if self._rows >= self.x.max_batch:
                        self._infer()
                if self._acts and time.monotonic() >= self._first_act_at + self.x.batch_wait_s:
                    self._infer()
                self._flush_outbox()
                if time.monotonic() - last_sweep > 1.0:
                    last_sweep = time.monotonic()
                    self._sweep_idle()
            self._flush_outbox()
        except BaseException as err:  # noqa: BLE001 - reported by get_metrics/sample (the group recreates us)
            self.error = err
            log.exception("policy server thread failed")

    def _spin(self) -> list[bytes] | None:
        """Poll without sleeping for up to ``spin_s``: a client acting in a loop sends its next
        request within that, and waking a sleeping thread costs more than the whole request."""
        end = time.perf_counter() + self.x.spin_s
        sock = self._sock
        while time.perf_counter() < end:
            if sock.getsockopt(_EVENTS) & _POLLIN:
                return self._recv()
        return None

    def _recv(self) -> list[bytes]:
        """One message's parts (at most ``MAX_PARTS``, plus an empty marker part if it had more)."""
        sock = self._sock
        parts = [sock.recv(_NOBLOCK)]
        while sock.getsockopt(_RCVMORE):
            part = sock.recv(_NOBLOCK)
            if len(parts) < MAX_PARTS:
                parts.append(part)
            elif len(parts) == MAX_PARTS:
                parts.append(b"")  # too many parts: the checks refuse the message by its part count
        return parts

    def _send(self, route: bytes, header: dict, body: bytes | None = None) -> None:
        sock = self._sock
        try:  # part by part with plain-int flags; copying small parts is cheaper than zero-copy tracking
            sock.send(route, _MORE_NOBLOCK)
            if body is None:
                sock.send(self._pack(header), _NOBLOCK)
            else:
                sock.send(self._pack(header), _MORE_NOBLOCK)
                sock.send(body, _NOBLOCK, copy=len(body) < 65536)
        except zmq.Again:  # the peer's queue is full: it is not reading; it will resend what matters
            self._counts["num_replies_dropped"] += 1

    def _flush_outbox(self) -> None:
        with self._lock:
            out, self._outbox = self._outbox, []
        for route, header in out:
            self._send(route, header)

    def _sweep_idle(self) -> None:
        now = time.monotonic()
        for route in [r for r, c in self._conns.items() if now - c.last_seen > self.x.idle_timeout_s]:
            del self._conns[route]

    def _on_message(self, parts: list[bytes]) -> None:
        route = parts[0]
        if route in self._banned:
            return
        conn = self._conns.get(route)
        rid = 0
        try:
            if len(parts) < 2:
                raise ProtocolError("a message needs a header part")
            header = wire.unpack_header(parts[1])
            rid = header.get("id", 0)
            op = header["op"]
            if op == wire.ACT and conn is not None and len(parts) == 2 and self._act_one(route, conn, rid, header):
                return
            wire.check_request(header, len(parts) - 1)
            if conn is None:
                if op == wire.HELLO:
                    self._hello(route, rid, header)
                elif op != wire.BYE:
                    self._send(route, {**wire.error(rid, wire.HELLO_FIRST, "say hello first: this connection is new "
                                                    "to the server (it may have restarted)"),
                                       **({"ids": header["ids"]} if op == wire.CHUNKS else {})})
                return
            conn.last_seen = time.monotonic()
            if op == wire.ACT:
                self._on_act(route, conn, rid, header, parts[2] if len(parts) > 2 else None)
            elif op == wire.CHUNKS:
                self._on_chunks(route, rid, header, parts[2])
            elif op == wire.START:
                self._on_start(route, conn, rid, header["episode_id"])
            elif op == wire.END:
                conn.episodes.discard(header["episode_id"])
            elif op == wire.WEIGHTS:
                self._on_weights(route, rid, header["have"])
            elif op == wire.PING:
                self._send(route, {"op": wire.PONG, "id": rid, "server_id": self.server_id})
            elif op == wire.HELLO:
                self._hello(route, rid, header)
            elif op == wire.BYE:
                self._conns.pop(route, None)
        except ProtocolError as err:
            self._protocol_error(route, conn, rid, str(err))

    def _protocol_error(self, route: bytes, conn: _Conn | None, rid: int, message: str) -> None:
        self._counts["num_protocol_errors"] += 1
        errors = 1 if conn is None else conn.errors + 1
        if conn is not None:
            conn.errors = errors
        if conn is not None and errors > self.x.max_protocol_errors:
            self._banned.add(route)
            self._counts["num_banned"] += 1
            if len(self._banned) > 100_000:  # routing ids are per connection: old ones never return
                self._banned.pop()
            self._conns.pop(route, None)
            self._send(route, wire.error(rid, wire.BANNED, f"more than {self.x.max_protocol_errors} malformed "
                                         f"messages; this connection is ignored from now on", fatal=True))
            log.warning("policy server banned connection %s (%s) after %d malformed messages", route.hex(),
                        conn.name, errors)
            return
        self._send(route, wire.error(rid, wire.BAD_MESSAGE, message))

    def _hello(self, route: bytes, rid: int, h: dict) -> None:
        if h["protocol"] != wire.PROTOCOL or h["version"] != wire.VERSION:
            self._send(route, wire.error(rid, wire.VERSION_MISMATCH, f"this server speaks {wire.PROTOCOL} version "
                                         f"{wire.VERSION}, not {h['protocol']!r} version {h['version']}", fatal=True))
            return
        mode = h["inference_mode"] or self.x.inference_mode
        if mode not in ("remote", "local"):
            self._send(route, wire.error(rid, wire.BAD_MODE, f"inference_mode {mode!r}: use 'remote' or 'local'",
                                         fatal=True))
            return
        for key in ("observation_space", "action_space"):
            if key in h and not self._same_space(h[key], key):
                self._send(route, wire.error(rid, wire.SPACES_MISMATCH, f"the client's {key} {h[key]!r:.300} is not "
                                             f"the server's {self.spaces[key]!r:.300}", fatal=True))
                return
        if route not in self._conns and len(self._conns) >= self.x.max_clients:
            self._send(route, wire.error(rid, wire.SERVER_FULL, f"{self.x.max_clients} clients are connected; "
                                         f"try another server or later", fatal=True))
            return
        name = h.get("name") if isinstance(h.get("name"), str) else ""
        self._conns[route] = _Conn(name[:64], mode, time.monotonic())
        self._send(route, {
            "op": wire.WELCOME, "id": rid, "server_id": self.server_id, "protocol": wire.PROTOCOL,
            "version": wire.VERSION, "inference_mode": mode, **self.spaces,
            "fragment_length": self.x.fragment_length, "explore": self.s.explore,
            "weights_version": self.weights_version, "action_mapping": self._action_mapping(),
            "required_extra": list(REQUIRED_EXTRA),
            "limits": {"max_frame_bytes": self.x.max_frame_bytes, "max_open_episodes": self.x.max_open_episodes,
                       "max_requests_in_flight": self.x.max_requests_in_flight,
                       "max_chunk_steps": self.x.max_chunk_steps}})
        self._counts["num_connects"] += 1

    def _same_space(self, desc: Any, key: str) -> bool:
        try:
            return space_from_dict(desc) == getattr(self, key)
        except ProtocolError:
            return False

    def _action_mapping(self) -> dict:
        space = self.action_space
        if not self.box_actions:
            return {"kind": "cast", "dtype": str(np.dtype(space.dtype))}
        return {"kind": "box", "low": space.low.astype(np.float64).ravel().tolist(),
                "high": space.high.astype(np.float64).ravel().tolist(), "normalize": bool(self.s.normalize_actions),
                "clip": bool(self.s.clip_actions), "dtype": str(np.dtype(space.dtype))}

    def _on_start(self, route: bytes, conn: _Conn, rid: int, eid: str) -> None:
        if eid not in conn.episodes and len(conn.episodes) >= self.x.max_open_episodes:
            self._send(route, wire.error(rid, wire.TOO_MANY_EPISODES, f"{len(conn.episodes)} episodes are open on "
                                         f"this connection (limit {self.x.max_open_episodes}); end some first"))
            return
        conn.episodes.add(eid)
        self._send(route, {"op": wire.STARTED, "id": rid, "episode_id": eid})

    def _act_one(self, route: bytes, conn: _Conn, rid: int, h: dict) -> bool:
        """The common request -- one started episode, its observation in the header -- taken without
        the general checks (an id in ``conn.episodes`` passed them at 'start'); False: not that request."""
        eid = h.get("episode_id")
        if (type(eid) is not str or eid not in conn.episodes or "action" in h or "obs" not in h
                or conn.in_flight >= self.x.max_requests_in_flight):
            return False
        try:
            row = self.schema.observation_from_plain(h["obs"])
        except ProtocolError as err:
            self._send(route, wire.error(rid, wire.BAD_OBSERVATION, str(err)))
            return True
        conn.last_seen = time.monotonic()
        self._queue(conn, _Act(route, rid, [row], _NO_ACTION, bool(h.get("explore", self.s.explore)), False))
        return True

    def _queue(self, conn: _Conn, act: _Act) -> None:
        """An act request waits for the next forward pass."""
        if not self._acts:
            self._first_act_at = time.monotonic()
        conn.in_flight += 1
        self._acts.append(act)
        self._rows += len(act.obs)

    def _on_act(self, route: bytes, conn: _Conn, rid: int, h: dict, body: bytes | None) -> None:
        if body is None:  # small observations travel in the header as plain msgpack
            msg = h
        else:
            msg = decode(body, limits=self.act_limits)
            if not isinstance(msg, dict) or "obs" not in msg:
                raise ProtocolError("an act body must be a map with 'obs' (and optionally 'action')")
        batched = "episode_ids" in h
        if batched:  # several episodes' observations in one request (a vectorized client)
            eids, obs, given = h["episode_ids"], msg["obs"], msg.get("action")
            if (not isinstance(eids, list) or not 0 < len(eids) <= self.x.max_batch or not isinstance(obs, list)
                    or len(obs) != len(eids) or not (given is None or isinstance(given, list) and len(given) == len(eids))):
                raise ProtocolError(f"a batched act needs 'episode_ids' (1 to {self.x.max_batch}) and as many 'obs' "
                                    f"(and 'action', if given)")
            for eid in eids:
                wire.check_episode_id(eid)
            given = given or [None] * len(eids)
        else:
            eids, obs, given = [h["episode_id"]], [msg["obs"]], [msg.get("action")]
        unknown = [eid for eid in eids if eid not in conn.episodes]
        if unknown:
            self._send(route, wire.error(rid, wire.UNKNOWN_EPISODE, f"episode {unknown[0]!r} was not started on "
                                         f"this connection; send 'start' first"))
            return
        if conn.in_flight >= self.x.max_requests_in_flight:
            self._send(route, wire.error(rid, wire.TOO_MANY_REQUESTS, f"{conn.in_flight} act requests of this "
                                         f"connection are unanswered (limit {self.x.max_requests_in_flight})"))
            return
        try:
            rows = [self.schema.observation_from_plain(o) for o in obs]
            given = [None if g is None else self._to_module_action(self.schema.action_from_plain(g)) for g in given]
        except ProtocolError as err:
            self._send(route, wire.error(rid, wire.BAD_OBSERVATION, str(err)))
            return
        self._queue(conn, _Act(route, rid, rows, given, bool(h.get("explore", self.s.explore)), batched))

    def _to_module_action(self, action: np.ndarray) -> np.ndarray:
        """An action the client took, in env units -> the module's (Box: [-1, 1] when normalized)."""
        if not (self.box_actions and self.s.normalize_actions):
            return action
        low, high = self.action_space.low, self.action_space.high
        return (2.0 * (action - low) / (high - low) - 1.0).astype(np.float32)

    def _infer(self) -> None:
        acts, self._acts = self._acts, []
        self._rows = 0
        if len(acts) == 1 and len(acts[0].obs) == 1:  # one client acting alone: no gathering, no stacking
            rows = acts[0].obs
            obs = rows[0][None] if isinstance(rows[0], np.ndarray) else nested.stack(rows)
            explore = [acts[0].explore]
            given = {} if acts[0].given[0] is None else {0: acts[0].given[0]}
        else:
            rows = [o for a in acts for o in a.obs]
            obs = np.stack(rows) if isinstance(rows[0], np.ndarray) else nested.stack(rows)
            explore = [a.explore for a in acts for _ in a.obs]
            given = {i: g for i, g in enumerate(g for a in acts for g in a.given) if g is not None}
        n = len(rows)
        with self._module_lock:
            module_actions, logp, dists = self._compute(obs, explore, given)
            version = self.weights_version
        env_list, logp_list, dist_list = self.env_actions(module_actions).tolist(), logp.tolist(), dists.tolist()
        raw_list = module_actions.tolist() if self.box_actions else None
        conns, send, i = self._conns, self._send, 0
        for a in acts:
            k = len(a.obs)
            if a.batched:
                reply = {"op": wire.ACTION, "id": a.rid, "weights_version": version, "action": env_list[i:i + k],
                         "logp": logp_list[i:i + k], "dist": dist_list[i:i + k]}
                if raw_list is not None:
                    reply["module_action"] = raw_list[i:i + k]
            else:
                reply = {"op": wire.ACTION, "id": a.rid, "weights_version": version, "action": env_list[i],
                         "logp": logp_list[i], "dist": dist_list[i]}
                if raw_list is not None:
                    reply["module_action"] = raw_list[i]
            send(a.route, reply)
            i += k
            conn = conns.get(a.route)
            if conn is not None:
                conn.in_flight -= 1
        self.num_env_steps_served += n
        self._counts["num_actions_served"] += n
        self._counts["num_inference_batches"] += 1

    def _refresh_export(self) -> None:
        """Export the current weights and exploration (after every weights update; under the module lock)."""
        from actors.modules.export import export_policy

        try:
            self._desc = export_policy(self.module, self.exploration, self.timestep)
        except ValueError as err:
            self._desc, self._export_error = None, str(err)
            if self.x.inference_backend == "numpy":
                raise ValueError(f"inference_backend='numpy': {err}") from None
        backend = self.x.inference_backend
        if backend == "auto" and self._desc is not None:  # torch convolves images faster than numpy can
            backend = "torch" if any(op.get("op") == "conv2d" for op in self._desc["layers"]) else "numpy"
        self._numpy = NumpyPolicy(self._desc) if self._desc is not None and backend == "numpy" else None

    def _compute(self, obs: Any, explore: list[bool], given: dict[int, np.ndarray]
                 ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """A batch of observations -> (module actions, their log-probabilities, distribution inputs)."""
        policy = self._numpy
        if policy is None:
            return self._compute_torch(obs, explore, given)
        inputs = policy.dist_inputs(obs)
        if not given and all(explore):
            actions, logp = policy.choose_with_logp(inputs, True, self._rng)
            return actions, logp, inputs
        actions = policy.choose(inputs, True, self._rng)
        if not all(explore):
            keep = np.asarray(explore).reshape(len(explore), *([1] * (actions.ndim - 1)))
            actions = np.where(keep, actions, policy.greedy(inputs))
        for i, action in given.items():
            actions[i] = action
        return actions, policy.logp(inputs, actions), inputs

    @torch.inference_mode()
    def _compute_torch(self, obs: Any, explore: list[bool], given: dict[int, np.ndarray]
                       ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        n = len(explore)
        dist_inputs = self.module.forward_exploration(to_torch(obs))["action_dist_inputs"]
        dist = self.module.dist_spec.build(dist_inputs)
        actions = self.exploration.actions(dist, True, self.timestep)
        if not all(explore):
            keep = torch.tensor(explore).view(n, *([1] * (actions.dim() - 1)))
            actions = torch.where(keep, actions, dist.deterministic())
        for i, action in given.items():
            actions[i] = torch.as_tensor(action, dtype=actions.dtype)
        return actions.numpy(), dist.logp(actions).numpy(), dist_inputs.numpy()

    def _on_weights(self, route: bytes, rid: int, have: int) -> None:
        version = self.weights_version
        if have == version:
            self._send(route, {"op": wire.POLICY, "id": rid, "changed": False, "weights_version": version})
            return
        if self._export is None or self._export[0] != version:
            with self._module_lock:
                desc = self._desc
            if desc is None:
                self._send(route, wire.error(rid, wire.NOT_SUPPORTED, f"this policy cannot run in the client: "
                                             f"{self._export_error}"))
                return
            self._export = (version, encode(desc, compress=True))
        self._send(route, {"op": wire.POLICY, "id": rid, "changed": True, "weights_version": version},
                   self._export[1])

    def _on_chunks(self, route: bytes, rid: int, h: dict, body: bytes) -> None:
        ids = wire.chunk_ids(h["ids"], limit=4096)
        chunks = decode(body, limits=self.chunk_limits)
        if isinstance(chunks, EpisodeChunk):
            chunks = [chunks]
        if not isinstance(chunks, list) or len(chunks) != len(ids) or not all(isinstance(c, EpisodeChunk) for c in chunks):
            raise ProtocolError(f"a chunks body must be a list of {len(ids)} episode chunks, one per id")
        accepted, committed, busy, bad = [], [], [], []
        with self._lock:
            for key, chunk in zip(ids, chunks):
                gate = self._gates.get(key[0])
                if (chunk.episode_id, chunk.chunk_index) != key:
                    bad.append((key, f"chunk {(chunk.episode_id, chunk.chunk_index)} sent under id {key}"))
                elif key in self.journal:
                    committed.append(list(key))
                elif key in self._pending_keys or key in self._delivered_keys:
                    self._owner[key] = route  # acknowledge to the connection that sent it last
                    accepted.append(list(key))
                    self._counts["num_duplicate_chunks"] += 1
                elif self._pending_steps >= self.x.max_pending_steps or (gate is not None and key[1] > gate[0]):
                    # Busy. An episode with a refused chunk hands in the rest in order, room or not: taken
                    # out of order, its chunks would reach the replay as separate pieces (n-step returns stop
                    # at every cut) and its return would be reported without the late chunks' rewards.
                    busy.append(list(key))
                    if gate is None:
                        self._gates[key[0]] = [key[1], key[1]]
                        if len(self._gates) > 100_000:  # episodes whose clients never came back
                            self._gates.popitem(last=False)
                    else:
                        gate[1] = max(gate[1], key[1])
                    continue
                else:
                    problem = self._check_chunk(chunk)
                    if problem:
                        bad.append((key, problem))
                        self._pass_gate(gate, key)  # the client drops it: the episode goes on without it
                        continue
                    chunk.env_runner_index = self.worker_index
                    self._pending.append((key, chunk))
                    self._pending_keys.add(key)
                    self._pending_steps += len(chunk)
                    self._owner[key] = route
                    accepted.append(list(key))
                    self._counts["num_chunks_received"] += 1
                self._pass_gate(gate, key)
            self._counts["num_duplicate_chunks"] += len(committed)
            if accepted:
                self._lock.notify_all()
        if accepted or committed:
            self._send(route, {"op": wire.RECEIVED, "id": rid, "ids": accepted, "committed": committed})
        if busy:
            self._counts["num_busy_replies"] += 1
            self._send(route, {**wire.error(rid, wire.BUSY, f"the server holds {self._pending_steps} env steps "
                                            f"not yet trained on; resend later"), "ids": busy})
        for key, problem in bad:
            self._counts["num_bad_chunks"] += 1
            self._send(route, {**wire.error(rid, wire.BAD_CHUNK, problem), "ids": [list(key)]})

    def _pass_gate(self, gate: list[int] | None, key: Key) -> None:
        """Chunk ``key`` is through (taken, or known): its episode's next chunk may come -- the next
        one the server does not hold yet (one taken before the gate closed is never sent again)."""
        if gate is None or key[1] != gate[0]:
            return
        gate[0] += 1
        while gate[0] <= gate[1] and self._holds((key[0], gate[0])):
            gate[0] += 1
        if gate[0] > gate[1]:
            del self._gates[key[0]]

    def _holds(self, key: Key) -> bool:
        return key in self._pending_keys or key in self._delivered_keys or key in self.journal

    def _check_chunk(self, chunk: EpisodeChunk) -> str | None:
        try:
            chunk.validate()
            if len(chunk) == 0 or len(chunk) > self.x.max_chunk_steps:
                raise ProtocolError(f"a chunk must have 1 to {self.x.max_chunk_steps} steps, got {len(chunk)}")
            self.schema.check(chunk)
            dists = chunk.extra.get("action_dist_inputs")
            if not isinstance(dists, np.ndarray) or dists.shape != (len(chunk), self.dist_dim) or dists.dtype.kind != "f":
                raise ProtocolError(f"extra['action_dist_inputs'] must be a float array of shape "
                                    f"({len(chunk)}, {self.dist_dim}), got {getattr(dists, 'shape', type(dists).__name__)}")
        except ProtocolError as err:
            return str(err)
        return None

    # --- the env runner role ------------------------------------------------------------------
    @property
    def timestep(self) -> int:
        return self.num_env_steps_served + self._timestep_offset

    def _commit(self, keys: list[Key]) -> None:
        """``keys`` were handed on: journal them, then acknowledge them to their senders."""
        if not keys:
            return
        self.journal.add(keys)
        if keys is self._delivered:
            self._delivered, self._delivered_keys = [], set()
        by_route: dict[bytes, list] = {}
        for key in keys:
            route = self._owner.pop(key, None)
            if route is not None:
                by_route.setdefault(route, []).append(list(key))
        self._outbox.extend((route, {"op": wire.COMMITTED, "id": 0, "ids": ids}) for route, ids in by_route.items())
        self.metrics.log_value("external/num_chunks_committed", len(keys), reduce="lifetime_sum")
        self._wake()

    def _wake(self) -> None:
        with self._wake_tx_lock:
            try:
                self._wake_tx.send(b"", zmq.NOBLOCK)
            except zmq.Again:
                pass

    def confirm_delivered(self, keys: list) -> None:
        """The group received these chunks from this slot's previous server, which died before it
        acknowledged them: record them as committed so clients' resends are dropped."""
        with self._lock:
            self._commit([(str(k[0]), int(k[1])) for k in keys])

    def sample(self, num_timesteps: int | None = None, num_episodes: int | None = None,
               explore: bool | None = None) -> list[EpisodeChunk]:
        """Chunks clients sent, at least ``num_timesteps`` steps of them (less if ``sample_wait_s``
        passes first; at most one chunk more than needed), committing what the previous call handed on."""
        if self.error is not None:
            raise RuntimeError(f"policy server thread failed: {self.error!r}")
        want = num_timesteps or 1
        deadline = time.monotonic() + self.x.sample_wait_s
        with self._lock:
            self._commit(self._delivered)
            while self._pending_steps < want and not self._stopping.is_set():
                left = deadline - time.monotonic()
                if left <= 0:
                    break
                self._lock.wait(left)
            # whole chunks in arrival order until the request is covered (like a runner's round: a replay
            # ratio or a train batch sized for it stays right); the rest waits for the next call
            count = steps = 0
            for _, chunk in self._pending:
                if steps >= want:
                    break
                count, steps = count + 1, steps + len(chunk)
            taken, self._pending = self._pending[:count], self._pending[count:]
            self._pending_keys.difference_update(key for key, _ in taken)
            self._pending_steps -= steps
            self._delivered = [key for key, _ in taken]
            self._delivered_keys = set(self._delivered)
            if not taken and time.monotonic() - self._quiet_logged > QUIET_LOG_S:
                self._quiet_logged = time.monotonic()
                log.warning("policy server %s at %s: no experience arrived for %.0f s (%d client(s) connected); "
                            "training waits for clients", self.server_id, self.address, self.x.sample_wait_s,
                            len(self._conns))
            chunks = [c for _, c in taken]
            self._log_chunks(chunks)
        if self.recorder is not None:  # written before the driver has them: a later crash cannot lose them
            self.recorder.record(chunks)
            self.recorder.flush()
        return chunks

    def _log_chunks(self, chunks: list[EpisodeChunk]) -> None:
        m, w = self.metrics, self.s.metrics_window
        steps = sum(len(c) for c in chunks)
        m.log_value("num_env_steps_sampled", steps, reduce="sum")
        m.log_value("num_env_steps_sampled_lifetime", steps, reduce="lifetime_sum")
        returns, lengths = [], []
        for c in chunks:
            acc = self._returns.setdefault(c.episode_id, [0.0, 0])
            acc[0] += c.ret
            acc[1] += len(c)
            if c.is_done:
                ret, length = self._returns.pop(c.episode_id)
                returns.append(ret)
                lengths.append(length)
        while len(self._returns) > 100_000:  # episodes their clients abandoned
            self._returns.popitem(last=False)
        if returns:
            m.log_values("episode_return_mean", returns, window=w)
            m.log_values("episode_return_min", returns, reduce="min", window=w)
            m.log_values("episode_return_max", returns, reduce="max", window=w)
            m.log_values("episode_len_mean", lengths, window=w)
        m.log_value("num_episodes", len(returns), reduce="sum")
        m.log_value("num_episodes_lifetime", len(returns), reduce="lifetime_sum")

    def sample_encoded(self, num_timesteps: int | None = None, explore: bool | None = None,
                       compress: bool = False) -> tuple[bytes, dict[str, Any]]:
        chunks = self.sample(num_timesteps, explore=explore)
        return encode(chunks, compress=compress), self.get_metrics()

    def set_weights(self, weights: dict[str, Any], weights_version: int = 0, timestep: int | None = None) -> None:
        with self._module_lock:
            self.module.set_state(weights)
            self.weights_version = weights_version
            if timestep is not None:
                self._timestep_offset = max(0, timestep - self.num_env_steps_served)
            self._refresh_export()
        self.metrics.log_value("weights_version", weights_version, reduce="max")

    def get_weights(self) -> dict[str, Any]:
        with self._module_lock:
            return self.module.get_state()

    def get_metrics(self) -> dict[str, Any]:
        if self.error is not None:
            raise RuntimeError(f"policy server thread failed: {self.error!r}")
        m = self.metrics
        counts = dict(self._counts)  # a snapshot: the server thread keeps counting
        delta = {k: counts[k] - self._counts_reported[k] for k in COUNTS}
        self._counts_reported = counts
        for key, value in delta.items():
            m.log_value(f"external/{key}", value, reduce="lifetime_sum")
        if delta["num_inference_batches"]:
            m.log_value("external/inference_batch_size_mean",
                        delta["num_actions_served"] / delta["num_inference_batches"])
        m.log_value("external/num_clients", len(self._conns), reduce="max")
        m.log_value("external/num_refused_keys", self.security.refused, reduce="max")
        m.log_value("external/num_pending_env_steps", self._pending_steps, reduce="max")
        if self.recorder is not None:
            self.recorder.log_metrics(m)
        return m.export()

    def get_state(self) -> dict[str, Any]:
        return {"weights": self.get_weights(), "weights_version": self.weights_version,
                "num_env_steps_sampled_lifetime": self.num_env_steps_served, "timestep_offset": self._timestep_offset,
                "exploration": self.exploration.get_state()}

    def set_state(self, state: dict[str, Any]) -> None:
        self.set_weights(state["weights"], state.get("weights_version", 0))
        self.num_env_steps_served = state.get("num_env_steps_sampled_lifetime", 0)
        self._timestep_offset = state.get("timestep_offset", 0)
        self.exploration.set_state(state.get("exploration", {}))

    def ping(self) -> str:
        return "ok"

    def apply(self, fn: Callable[["PolicyServer"], Any]) -> Any:
        return fn(self)

    def start_streaming(self, address: str, hwm: int = 4, compress: bool = True, sndbuf: int = 0,
                        stall_timeout_s: float = 60.0) -> None:
        raise RuntimeError("policy servers feed synchronous plans (PPO; DQN/SAC with the in-process replay); "
                           "streaming plans (IMPALA, APPO, remote replay) cannot use external clients yet")

    def stop_streaming(self, timeout_s: float = 10.0) -> bool:
        return True

    def is_streaming(self) -> bool:
        return False

    def stop(self) -> None:
        """Acknowledge what the driver already has, then close the socket."""
        if self._stopping.is_set():
            return
        with self._lock:
            self._commit(self._delivered)
            self._stopping.set()
            self._lock.notify_all()
        self._wake()
        self._thread.join(timeout=10.0)
        if self.recorder is not None:
            self.recorder.close()
        self._sock.close(linger=500)
        self._wake_rx.close()
        self._wake_tx.close()
        self.security.stop()
        self.journal.close()
        self._ctx.term()
