"""ServerLoop: the policy server's thread -- polling the socket, handing each message to its
handler, and the connections themselves (hello, episodes started, weights downloads, bans, idle sweep).

Apart from the env runner role (``PolicyServer``), which runs on the caller's thread: this thread
alone touches the socket, the connections and the act queue.
"""
from __future__ import annotations

import logging
import threading
import time
from collections import OrderedDict
from typing import Any

import zmq

from actors.env.settings import EnvRunnerSettings
from actors.external.acts import ActBatcher
from actors.external.chunks import ChunkIntake
from actors.external.endpoint import EVENTS, POLLIN, Conn, ServerEndpoint
from actors.external.inference import ServerPolicy
from actors.external.settings import ExternalSettings
from protocols import external as wire
from protocols.codec import encode
from protocols.errors import ProtocolError
from protocols.spaces import space_from_dict

log = logging.getLogger("runnel")

MAX_STRANGERS = 10_000
"""Connections that never said hello whose malformed messages are counted (the oldest are forgotten)."""
REQUIRED_EXTRA = ("action_logp", "action_dist_inputs")
"""What every chunk carries besides obs/actions/rewards: the behaviour policy's outputs."""


class ServerLoop:
    def __init__(self, endpoint: ServerEndpoint, acts: ActBatcher, chunks: ChunkIntake, policy: ServerPolicy, *,
                 conns: dict[bytes, Conn], counts: dict[str, int], stopping: threading.Event,
                 settings: EnvRunnerSettings, external: ExternalSettings, server_id: str, spaces: dict,
                 worker_index: int, modules: dict | None = None) -> None:
        """``conns`` (shared with ``acts``) and ``counts``: the server thread's; ``stopping`` ends the loop.
        ``modules``: in a multi-agent run, each module's spaces and action mapping (the welcome's)."""
        self.endpoint, self.acts, self.chunks, self.policy = endpoint, acts, chunks, policy
        self.s, self.x = settings, external
        self.server_id, self.spaces = server_id, spaces
        self.modules = modules
        self.conns = conns
        self._counts = counts
        self._stopping = stopping
        self._send = endpoint.send
        self._banned: set[bytes] = set()
        self._stranger_errors: OrderedDict[bytes, int] = OrderedDict()  # malformed messages of connections without hello
        self._export: tuple[int, bytes] | None = None
        self.error: BaseException | None = None
        self._thread = threading.Thread(target=self._serve, name=f"runnel-policy-server-{worker_index}", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def join(self, timeout: float) -> None:
        self._thread.join(timeout=timeout)

    def _serve(self) -> None:
        endpoint, acts, queue = self.endpoint, self.acts, self.acts.queue
        poller = zmq.Poller()
        poller.register(endpoint.sock, zmq.POLLIN)
        poller.register(endpoint.wake_rx, zmq.POLLIN)
        last_sweep = time.monotonic()
        try:
            while not self._stopping.is_set():
                timeout = 100
                held = acts.held()
                if queue.requests:
                    timeout = (min(100, int(held * 1000) + 1) if held else
                               max(0, int((queue.first_at + self.x.batch_wait_s - time.monotonic()) * 1000)))
                parts = endpoint.spin() if self.x.spin_s > 0 and not queue.requests else None
                if parts is None:
                    events = dict(poller.poll(timeout))
                    if endpoint.wake_rx in events:
                        while endpoint.wake_rx.poll(0):
                            endpoint.wake_rx.recv()
                else:
                    self._on_message(parts)
                sock, recv = endpoint.sock, endpoint.recv
                for _ in range(4 * self.x.max_batch):  # bounded, so queued acts and commits go out
                    # asking the socket first: a raised zmq.Again costs more than the whole check
                    if not sock.getsockopt(EVENTS) & POLLIN:
                        break
                    self._on_message(recv())
                    if queue.full() and not held:
                        acts.infer()
                if queue.requests and not acts.held():
                    if queue.due(time.monotonic()):
                        acts.infer()
                    while queue.full():  # a backlog left by a hold, max_batch rows a pass
                        acts.infer()
                self._flush_outbox()
                if time.monotonic() - last_sweep > 1.0:
                    last_sweep = time.monotonic()
                    self._sweep_idle()
            self._flush_outbox()
        except BaseException as err:  # noqa: BLE001 - reported by get_metrics/sample (the group recreates us)
            self.error = err
            log.exception("policy server thread failed")

    def _flush_outbox(self) -> None:
        for route, header in self.chunks.take_outbox():
            self._send(route, header)

    def _sweep_idle(self) -> None:
        now = time.monotonic()
        for route in [r for r, c in self.conns.items() if now - c.last_seen > self.x.idle_timeout_s]:
            del self.conns[route]

    def _on_message(self, parts: list[bytes]) -> None:
        route = parts[0]
        if route in self._banned:
            return
        conn = self.conns.get(route)
        try:
            header = wire.unpack_header(parts[1] if len(parts) > 1 else b"")
        except ProtocolError as err:  # no id to answer to: id 0, marked so the client can tell
            self._send(route, wire.error(0, wire.BAD_MESSAGE, str(err), unparsed=True))
            self._count_error(route, conn, 0, unparsed=True)
            return
        rid = header.get("id", 0)
        op = header["op"]
        try:
            if op == wire.ACT and conn is not None and len(parts) == 2 and self.acts.act_one(route, conn, rid, header):
                return
            if op == wire.CHUNKS:
                self._on_chunks(route, conn, rid, header, parts[2:])
                return
            wire.check_request(header, len(parts) - 1)
            if conn is None:
                if op == wire.HELLO:
                    self._hello(route, rid, header)
                elif op != wire.BYE:
                    self._send(route, self._hello_first(rid))
                return
            conn.last_seen = time.monotonic()
            if op == wire.ACT:
                self.acts.on_act(route, conn, rid, header, parts[2] if len(parts) > 2 else None)
            elif op == wire.START:
                self._on_start(route, conn, rid, header["episode_id"])
            elif op == wire.END:
                conn.episodes.discard(header["episode_id"])
            elif op in wire.MA_OPS:
                self.acts.on_multi_agent(route, conn, rid, header)
            elif op == wire.WEIGHTS:
                self._on_weights(route, rid, header["have"])
            elif op == wire.PING:
                self._send(route, {"op": wire.PONG, "id": rid, "server_id": self.server_id})
            elif op == wire.HELLO:
                self._hello(route, rid, header)
            elif op == wire.BYE:
                self.conns.pop(route, None)
        except ProtocolError as err:
            self._send(route, wire.error(rid, wire.BAD_MESSAGE, str(err)))
            self._count_error(route, conn, rid)

    @staticmethod
    def _hello_first(rid: int, **fields: object) -> dict:
        return wire.error(rid, wire.HELLO_FIRST, "say hello first: this connection is new to the server (it may "
                          "have restarted)", **fields)

    def _on_chunks(self, route: bytes, conn: Conn | None, rid: int, header: dict, bodies: list[bytes]) -> None:
        """Chunks: without usable ``ids`` a ``bad_message``; with them, every id gets its answer."""
        keys = wire.chunk_ids(header.get("ids"))
        if conn is None:
            self._send(route, self._hello_first(rid, ids=[list(k) for k in keys]))
            return
        conn.last_seen = time.monotonic()
        if self.modules is not None:
            self._send(route, wire.error(rid, wire.NOT_SUPPORTED, "this server records multi-agent episodes itself "
                                         "(ma_act/ma_end): it takes no chunks", ids=[list(k) for k in keys]))
            return
        if self.chunks.on_chunks(route, rid, keys, bodies):
            self._count_error(route, conn, rid)

    def _count_error(self, route: bytes, conn: Conn | None, rid: int, unparsed: bool = False) -> None:
        """A malformed message (its reply sent): past ``max_protocol_errors`` of them the connection is
        banned -- one that never said hello too, counted by its routing id, so a flood of garbage stops."""
        self._counts["num_protocol_errors"] += 1
        if conn is not None:
            conn.errors += 1
            errors = conn.errors
        else:
            errors = self._stranger_errors.pop(route, 0) + 1
            self._stranger_errors[route] = errors
            if len(self._stranger_errors) > MAX_STRANGERS:  # routing ids are per connection: old ones never return
                self._stranger_errors.popitem(last=False)
        if errors <= self.x.max_protocol_errors:
            return
        self._banned.add(route)
        self._counts["num_banned"] += 1
        if len(self._banned) > 100_000:
            self._banned.pop()
        self.conns.pop(route, None)
        self._stranger_errors.pop(route, None)
        self._send(route, wire.error(rid, wire.BANNED, f"more than max_protocol_errors = {self.x.max_protocol_errors} "
                                     f"malformed messages; this connection is ignored from now on",
                                     **({"unparsed": True} if unparsed else {})))
        log.warning("policy server banned connection %s (%s) after %d malformed messages", route.hex(),
                    conn.name if conn is not None else "no hello", errors)

    def _hello(self, route: bytes, rid: int, h: dict) -> None:
        if h["protocol"] != wire.PROTOCOL:
            self._send(route, wire.error(rid, wire.PROTOCOL_MISMATCH, f"protocol {h['protocol']!r:.80}: this server "
                                         f"speaks {wire.PROTOCOL!r}"))
            return
        if h["version"] not in wire.VERSIONS:
            self._send(route, wire.error(rid, wire.VERSION_MISMATCH, f"version {h['version']}: this server speaks "
                                         f"{wire.PROTOCOL} versions {' and '.join(map(str, wire.VERSIONS))}"))
            return
        # a single-agent recurrent policy's clients carry their states; a multi-agent server keeps its agents'
        recurrent = getattr(self.policy, "state_shape", None) is not None and self.modules is None
        mode = h["inference_mode"] or ("remote" if self.modules is not None else "local" if recurrent
                                       else self.x.inference_mode)
        if mode not in ("remote", "local") or (mode == "local" and self.modules is not None):
            self._send(route, wire.error(rid, wire.BAD_MODE, f"inference_mode {mode!r:.80}: use " + (
                "'remote' or '': a multi-agent server acts for its clients" if self.modules is not None else
                "'remote', 'local' or '' (the server's choice)")))
            return
        if mode == "remote" and recurrent:
            self._send(route, wire.error(rid, wire.BAD_MODE, "inference_mode 'remote': this policy is recurrent "
                                         "(use_lstm), and its clients act with its exported cell and carry their own "
                                         "states; use inference_mode 'local' or '' (EXTERNAL.md 9.8)"))
            return
        for key in ("observation_space", "action_space"):
            if key in h and not self._same_space(h[key], key):
                self._send(route, wire.error(rid, wire.SPACES_MISMATCH, f"the client's {key} {h[key]!r:.300} is not "
                                             f"the server's {self.spaces[key]!r:.300}"))
                return
        if route not in self.conns and len(self.conns) >= self.x.max_clients:
            self._send(route, wire.error(rid, wire.SERVER_FULL, f"max_clients = {self.x.max_clients} clients are "
                                         f"connected; try another server or later"))
            return
        errors = self.conns[route].errors if route in self.conns else self._stranger_errors.pop(route, 0)
        self.conns[route] = Conn(h.get("name", "")[:64], mode, time.monotonic(), errors=errors, version=h["version"])
        multi_agent = {} if self.modules is None else {"multi_agent": True, "modules": self.modules}
        self._send(route, {
            "op": wire.WELCOME, "id": rid, "server_id": self.server_id, "protocol": wire.PROTOCOL,
            "version": h["version"], "inference_mode": mode, **self.spaces, **multi_agent,
            "fragment_length": self.x.fragment_length, "explore": self.s.explore,
            "weights_version": self.policy.weights_version, "action_mapping": self.policy.action_mapping(),
            "required_extra": list(REQUIRED_EXTRA), "allow_nonfinite_observations": self.x.allow_nonfinite_observations,
            "limits": {"max_frame_bytes": self.x.max_frame_bytes, "max_open_episodes": self.x.max_open_episodes,
                       "max_requests_in_flight": self.x.max_requests_in_flight,
                       "max_chunk_steps": self.x.max_chunk_steps, "max_batch": self.x.max_batch,
                       "max_pending_steps": self.x.max_pending_steps, "max_unacked_steps": self.x.max_unacked_steps,
                       "max_policy_lag": self.x.max_policy_lag, "max_agents": self.x.max_agents,
                       "max_decoded_bytes": self.chunks.chunk_limits.max_decoded_bytes,
                       "max_act_body_bytes": self.acts.act_limits.max_frame_bytes,
                       "hold_acts_while_training": bool(self.x.hold_acts_while_training)}})
        self._counts["num_connects"] += 1

    def _same_space(self, desc: Any, key: str) -> bool:
        try:
            return space_from_dict(desc) == getattr(self.policy, key)
        except ProtocolError:
            return False

    def _on_start(self, route: bytes, conn: Conn, rid: int, eid: str) -> None:
        if eid not in conn.episodes and len(conn.episodes) >= self.x.max_open_episodes:
            self._send(route, wire.error(rid, wire.TOO_MANY_EPISODES, f"{len(conn.episodes)} episodes are open on "
                                         f"this connection (limit {self.x.max_open_episodes}); end some first"))
            return
        conn.episodes.add(eid)
        self._send(route, {"op": wire.STARTED, "id": rid, "episode_id": eid})

    def _on_weights(self, route: bytes, rid: int, have: int) -> None:
        if self.modules is not None:
            self._send(route, wire.error(rid, wire.NOT_SUPPORTED, "a multi-agent server acts for its clients "
                                         "(remote inference only)"))
            return
        version = self.policy.weights_version
        if have == version:
            self._send(route, {"op": wire.POLICY, "id": rid, "changed": False, "weights_version": version})
            return
        if self._export is None or self._export[0] != version:
            desc = self.policy.exported()
            if desc is None:
                self._send(route, wire.error(rid, wire.NOT_SUPPORTED, f"this policy cannot run in the client: "
                                             f"{self.policy.export_error}"))
                return
            self._export = (version, encode(desc, compress=True))
        self._send(route, {"op": wire.POLICY, "id": rid, "changed": True, "weights_version": version},
                   self._export[1])
