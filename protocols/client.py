"""PolicyClient: attach a simulator, game or robot running outside the cluster to a runnel policy server.

Imports only numpy, msgpack, lz4 and pyzmq (through ``protocols``), so it installs into a
simulator's own Python. The methods are RLlib's ``PolicyClient``'s::

    client = PolicyClient("tcp://trainer:9900")
    eid = client.start_episode()
    action = client.get_action(eid, obs)          # the policy's action for this observation
    client.log_returns(eid, reward)               # the reward that action earned
    ...
    client.end_episode(eid, final_obs)            # the episode's last observation

``inference_mode="remote"`` asks the server for every action (one round trip; the server batches
all clients' requests into one forward pass). ``"local"`` computes actions here with weights pulled
every ``update_interval`` seconds (``protocols.numpy_policy``; no torch needed) and never waits on
the network while acting.

Experience leaves as episode chunks (cut every ``fragment_length`` steps the server asks for, and
at the end of each episode), each kept in a bounded spool until the server says it *committed*
the chunk -- handed it to training or recording. A chunk not acknowledged in time, or any chunk
still in the spool when the client reconnects (a new server, a cut connection), is sent again;
the server drops the copies it already has. So nothing a client sent is lost or trained on twice,
whichever side restarts. A background thread keeps the connection alive (pings, resends, weight
pulls) between calls. See ``protocols/EXTERNAL.md`` for the wire protocol.
"""
from __future__ import annotations

import itertools
import logging
import os
import threading
import time
import uuid
import warnings
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import zmq

from protocols import external as wire
from protocols import nested
from protocols.codec import Limits, decode, encode
from protocols.episode import EpisodeBuilder, EpisodeChunk
from protocols.errors import ProtocolError
from protocols.external import ServerError

log = logging.getLogger("runnel.client")

_NOBLOCK, _EVENTS, _POLLIN, _RCVMORE = int(zmq.NOBLOCK), int(zmq.EVENTS), int(zmq.POLLIN), int(zmq.RCVMORE)
"""Plain ints: pyzmq's enum flags cost a conversion on every call of the hot path."""
REPLY_LIMITS = Limits(max_frame_bytes=256 << 20, max_decoded_bytes=512 << 20)
"""Bounds for what a client decodes from a server (weights of large policies included)."""
INLINE_ELEMENTS = 4096
"""Observations with at most this many numbers go in the act header as plain msgpack; bigger ones in a frame."""
BUSY_RETRY_S = 0.5
"""How soon a chunk the server was too busy to take is offered again."""


@dataclass
class _Episode:
    builder: EpisodeBuilder | None  # None: training_enabled=False (acted, never uploaded)
    started_remote: bool = False
    prev_action: Any = None  # the module action of the last step, waiting for its reward and next obs
    prev_extra: dict = field(default_factory=dict)
    reward: float = 0.0
    versions: list[int] = field(default_factory=list)  # weights versions of the steps since the last cut
    in_flight: tuple | None = None  # send_action's request (id, epoch, header, body, local result) until received


@dataclass
class _Spooled:
    frame: bytes
    steps: int
    sent_at: float = 0.0  # 0: not sent since the last (re)connect
    received: bool = False


class PolicyClient:
    """A connection to a policy server (``actors.external.policy_server``); thread-safe."""

    def __init__(self, address: str, inference_mode: str | None = None, *, update_interval: float = 10.0,
                 server_public_key: str | bytes | None = None, client_key: str | tuple | None = None,
                 timeout_s: float = 60.0, spool_chunks: int = 1024, resend_after_s: float = 10.0,
                 heartbeat_s: float = 1.0, name: str | None = None, observation_space: Any = None,
                 action_space: Any = None, seed: int | None = None, spool_dir: str | None = None,
                 spin_s: float = 0.0) -> None:
        """``address``: the server's ``tcp://host:port``. ``inference_mode``: "remote", "local" or None
        (the server's default). ``server_public_key`` (z85, or the path of the server's ``.key`` file)
        turns on CURVE encryption; ``client_key`` is then this client's key pair (the path of a
        ``.key_secret`` file written by ``runnel keys``, or ``(public, secret)`` z85). ``timeout_s``:
        how long a call waits for an unreachable server before raising ``TimeoutError``.
        ``spool_chunks``: unacknowledged chunks kept for resending (acting blocks when it is full).
        ``observation_space``/``action_space`` (gymnasium spaces or ``protocols.spaces`` dicts),
        when given, are checked against the server's at connect time. ``spool_dir``: keep the spool
        on disk too, so chunks survive a crash of this process; a client started later with the same
        directory sends them (one directory per client process). ``spin_s``: while waiting for a
        reply, poll this long without sleeping before blocking -- on a machine whose idle cores sleep,
        waking costs more than a remote-inference round trip, so a simulator that acts in a tight loop
        trades a busy core for latency (pair it with the server's ``spin_s``; 0: always block)."""
        if inference_mode not in (None, "remote", "local"):
            raise ValueError(f"inference_mode={inference_mode!r}; use 'remote', 'local' or None (the server's choice)")
        self.address = address
        self.requested_mode = inference_mode
        self.update_interval = float(update_interval)
        self.timeout_s = float(timeout_s)
        self.spool_limit = int(spool_chunks)
        self.spool_dir = spool_dir
        self.resend_after_s = float(resend_after_s)
        self.heartbeat_s = float(heartbeat_s)
        if not 0.0 <= float(spin_s) <= 1.0:
            raise ValueError(f"spin_s={spin_s!r}; use 0 (block while waiting) up to 1.0 seconds (typically 0.001)")
        self.spin_s = float(spin_s)
        self.name = name or f"client-{os.getpid()}-{uuid.uuid4().hex[:6]}"
        self._spaces = {k: _space_dict(v) for k, v in (("observation_space", observation_space),
                                                        ("action_space", action_space)) if v is not None}
        self._rng = np.random.default_rng(seed)
        self._ids = itertools.count(1)
        self._lock = threading.RLock()
        self._replies: dict[int, tuple[dict, list]] = {}
        self._awaiting: set[int] = set()  # request ids whose replies a caller waits for
        self._episodes: dict[str, _Episode] = {}
        self._spool: OrderedDict[tuple[str, int], _Spooled] = OrderedDict()
        self._spool_freed = threading.Condition(self._lock)
        self.welcome: dict[str, Any] | None = None
        self.server_id: str | None = None
        self.rejected: list[tuple[tuple[str, int], str]] = []
        """Chunks the server refused as malformed (id, reason): a bug in the caller, never resent."""
        self.committed: list[tuple[str, int]] = []
        """Ids of every chunk the server acknowledged, in order (for accounting and tests)."""
        self._policy: Any = None
        self._policy_version = -1
        self._last_pull = 0.0
        self._last_heard = 0.0
        self._in_hello = False
        self._epoch = 0  # connections said hello on: a request sent before the latest hello is sent again
        self._closed = threading.Event()
        # one context (one ZeroMQ I/O thread) for all clients of this process: a simulator hosting many
        # clients wakes one thread per burst of replies, not one per client
        self._ctx = zmq.Context.instance()
        self._curve = _curve_options(server_public_key, client_key)
        self._sock = self._connect()
        if spool_dir is not None:
            self._load_spool(spool_dir)
        with self._lock:
            self._hello()
        self._thread = threading.Thread(target=self._background, name="runnel-client", daemon=True)
        self._thread.start()

    # --- the RLlib-shaped API -----------------------------------------------------------------
    @property
    def inference_mode(self) -> str:
        return self.welcome["inference_mode"]

    @property
    def weights_version(self) -> int:
        """The version of the weights this client acts with (local) or last saw (remote)."""
        return self._policy_version

    def start_episode(self, episode_id: str | None = None, training_enabled: bool = True) -> str:
        """Begin an episode; returns its id. ``training_enabled=False``: act but send no experience."""
        eid = wire.check_episode_id(episode_id) if episode_id is not None else uuid.uuid4().hex
        with self._lock:
            if eid in self._episodes:
                raise ValueError(f"episode {eid!r} is already running; end it first or pick another id")
            self._episodes[eid] = _Episode(EpisodeBuilder(eid) if training_enabled else None)
        if self.inference_mode == "remote":
            self._start_remote(eid)
        return eid

    def get_action(self, episode_id: str, observation: Any) -> Any:
        """The policy's action for ``observation`` (the reward for the previous action goes to
        ``log_returns`` before this call)."""
        return self._step(episode_id, observation, None)

    def get_actions(self, episode_ids: list[str], observations: list[Any]) -> list[Any]:
        """``get_action`` for several episodes at once (a simulator stepping many envs): one request
        and one batched forward pass on the server, or one numpy pass here in local inference."""
        if len(episode_ids) != len(observations):
            raise ValueError(f"{len(episode_ids)} episode ids for {len(observations)} observations")
        eps = [self._episode(eid) for eid in episode_ids]
        obs = [self._observed(ep, o) for ep, o in zip(eps, observations)]
        if self.inference_mode == "remote":
            rows = self._act_remote_batch(list(episode_ids), obs)
        else:
            rows = self._act_local_batch(obs)
        return [self._took(ep, *row) for ep, row in zip(eps, rows)]

    def send_action(self, episode_id: str, observation: Any) -> None:
        """Ask for the action without waiting for it; ``receive_action`` collects it. A program
        stepping many episodes (on this client or on several) sends every request first, so the
        server answers them in one batch while nobody waits. One request per episode at a time."""
        ep = self._episodes.get(episode_id) or self._episode(episode_id)
        if ep.in_flight is not None:
            raise ValueError(f"episode {episode_id!r} already waits for an action: call receive_action() first")
        obs = self._observed(ep, observation)
        if not self._remote:
            ep.in_flight = (0, 0, None, None, self._act_local(obs, None))
            return
        request, body = self._act_request(episode_id, obs, None)
        with self._lock:
            rid, epoch = self._issue(request, body)
        ep.in_flight = (rid, epoch, request, body, None)

    def receive_action(self, episode_id: str, timeout_s: float | None = None) -> Any:
        """The action ``send_action`` asked for (waits up to ``timeout_s``, default the client's
        ``timeout_s``, then raises ``TimeoutError``)."""
        ep = self._episodes.get(episode_id) or self._episode(episode_id)
        if ep.in_flight is None:
            raise ValueError(f"no action was asked for episode {episode_id!r}: call send_action() first")
        (rid, epoch, request, body, done), ep.in_flight = ep.in_flight, None  # a failed wait asks anew
        if done is None:
            deadline = time.monotonic() + (self.timeout_s if timeout_s is None else timeout_s)
            with self._lock:
                reply, _ = self._complete(rid, epoch, request, body, deadline, retry_unknown_episode=episode_id)
            done = self._read_action(reply, ep.builder is not None)
        return self._took(ep, *done)

    def log_action(self, episode_id: str, observation: Any, action: Any) -> None:
        """Record an action the client chose itself (off-policy data for the policy to learn from)."""
        self._step(episode_id, observation, np.asarray(action))

    def log_returns(self, episode_id: str, reward: float, info: dict | None = None) -> None:
        """Reward for the latest action; several calls before the next action add up."""
        self._episode(episode_id).reward += float(reward)

    def end_episode(self, episode_id: str, observation: Any, truncated: bool = False) -> None:
        """The episode's last observation; ``truncated=True`` when it was cut (a time limit) rather
        than reaching a terminal state."""
        ep = self._episode(episode_id)
        if ep.in_flight is not None:
            raise ValueError(f"episode {episode_id!r} waits for the action send_action() asked for: call "
                             f"receive_action() first (the final observation follows the last action taken)")
        with self._lock:
            if ep.builder is not None and ep.prev_action is not None:
                self._add_step(ep, observation, terminated=not truncated, truncated=truncated)
            del self._episodes[episode_id]
        if ep.started_remote:
            self._send({"op": wire.END, "id": 0, "episode_id": episode_id})

    def update_policy_weights(self) -> None:
        """Pull the newest weights now (local inference; the background thread does it every
        ``update_interval`` seconds)."""
        if self.inference_mode == "local":
            self._pull_weights()

    def flush(self, timeout_s: float | None = None) -> None:
        """Wait until the server committed every chunk sent so far (``TimeoutError`` after ``timeout_s``,
        default the client's ``timeout_s``)."""
        deadline = time.monotonic() + (self.timeout_s if timeout_s is None else timeout_s)
        with self._lock:
            while self._spool:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise TimeoutError(f"{len(self._spool)} chunk(s) not acknowledged by {self.address} "
                                       f"within the timeout")
                self._pump(min(left, 0.05))
                self._maintain()

    @property
    def unacknowledged(self) -> int:
        """Chunks in the spool (sent or not, not yet committed by the server)."""
        return len(self._spool)

    def spooled_ids(self) -> list[tuple[str, int]]:
        """``(episode_id, chunk_index)`` of every chunk in the spool."""
        with self._lock:
            return list(self._spool)

    def close(self, flush: bool = True, timeout_s: float | None = None) -> None:
        """Say goodbye (after ``flush``, unless ``flush=False``) and release the socket."""
        if self._closed.is_set():
            return
        try:
            if flush:
                self.flush(timeout_s)
        finally:
            self._closed.set()
            self._thread.join(timeout=5.0)
            with self._lock:
                try:
                    self._sock.send(wire.pack({"op": wire.BYE, "id": 0}), zmq.NOBLOCK)
                except zmq.ZMQError:
                    pass
                self._sock.close(linger=100)

    def __enter__(self) -> "PolicyClient":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close(flush=exc[0] is None)

    # --- acting -------------------------------------------------------------------------------
    def _episode(self, eid: str) -> _Episode:
        ep = self._episodes.get(eid)
        if ep is None:
            raise ValueError(f"unknown episode id {eid!r}: call start_episode() first (running: "
                             f"{list(self._episodes)[:5]})")
        return ep

    def _observed(self, ep: _Episode, obs: Any) -> Any:
        """Record a new observation in the episode (closing its previous step); returns it as arrays."""
        # copies: an env may reuse its observation buffer, and the chunk keeps every row
        obs = np.array(obs) if type(obs) is np.ndarray or isinstance(obs, list) else nested.map_structure(np.array, obs)
        if ep.builder is not None:
            with self._lock:
                if not ep.builder.started:
                    ep.builder.add_reset(obs)
                elif ep.prev_action is not None:
                    self._add_step(ep, obs)
        return obs

    def _step(self, eid: str, obs: Any, given: Any) -> Any:
        ep = self._episodes.get(eid) or self._episode(eid)
        if ep.in_flight is not None:
            raise ValueError(f"episode {eid!r} waits for the action send_action() asked for: call receive_action()")
        obs = self._observed(ep, obs)
        if self._remote:
            return self._took(ep, *self._act_remote(eid, obs, given, ep.builder is not None))
        return self._took(ep, *self._act_local(obs, given))

    def _took(self, ep: _Episode, action: Any, module_action: Any, extra: dict, version: int) -> Any:
        """The episode acted: keep what its next step records; returns the env's action."""
        ep.prev_action, ep.prev_extra = module_action, extra
        if ep.builder is not None:  # an acting-only episode cuts no chunks: nothing would ever clear these
            ep.versions.append(version)
        return action

    def _add_step(self, ep: _Episode, obs: Any, terminated: bool = False, truncated: bool = False) -> None:
        b = ep.builder
        b.add_step(ep.prev_action, ep.reward, obs, terminated=terminated, truncated=truncated, extra=ep.prev_extra)
        ep.prev_action, ep.reward = None, 0.0
        limit = self.welcome["fragment_length"]
        if b.is_done or len(b) >= limit:
            b.weights_version = min(ep.versions) if ep.versions else 0
            ep.versions.clear()
            self._spool_chunk(b.cut())

    def _act_remote(self, eid: str, obs: Any, given: Any, record: bool = True) -> tuple[Any, Any, dict, int]:
        """``record``: the step goes into a chunk, so keep the module action and extras too."""
        request, body = self._act_request(eid, obs, given)
        reply, _ = self._request(request, body, retry_unknown_episode=eid)
        return self._read_action(reply, record)

    def _act_request(self, eid: str, obs: Any, given: Any) -> tuple[dict, bytes | None]:
        request: dict[str, Any] = {"op": wire.ACT, "episode_id": eid}
        body = None
        dense = type(obs) is np.ndarray
        if (obs.size if dense else _size(obs)) <= INLINE_ELEMENTS:
            request["obs"] = obs.tolist() if dense else _plain(obs)  # small: plain msgpack in the header
            if given is not None:
                request["action"] = _plain(given)
        else:
            body = encode({"obs": obs} if given is None else {"obs": obs, "action": given}, compress=False)
        return request, body

    def _read_action(self, reply: dict, record: bool) -> tuple[Any, Any, dict, int]:
        version = reply.get("weights_version", 0)
        if version > self._policy_version:
            self._policy_version = int(version)
        action = self._from_plain_action(reply["action"])  # a new array, built from the reply's plain values
        env_action = action[()] if action.ndim == 0 else action
        if not record:  # acting only: nothing keeps the module action or the extras
            return env_action, None, {}, version
        module_action = np.asarray(reply["module_action"], np.float32) if "module_action" in reply else action
        extra = {"action_logp": np.float32(reply["logp"]), "action_dist_inputs": np.asarray(reply["dist"], np.float32)}
        return (env_action if action.ndim == 0 else action.copy()), module_action, extra, version

    def _act_remote_batch(self, eids: list[str], obs: list[Any]) -> list[tuple[Any, Any, dict, int]]:
        reply, _ = self._request({"op": wire.ACT, "episode_ids": eids, "obs": [_plain(o) for o in obs]},
                                 retry_unknown_episode=eids)
        version = int(reply.get("weights_version", 0))
        self._policy_version = max(self._policy_version, version)
        raws = reply.get("module_action")
        rows = []
        for i, (action, logp, dist) in enumerate(zip(reply["action"], reply["logp"], reply["dist"])):
            action = self._from_plain_action(action)
            module_action = np.asarray(raws[i], np.float32) if raws is not None else action
            rows.append((_env_value(action), module_action,
                         {"action_logp": np.float32(logp), "action_dist_inputs": np.asarray(dist, np.float32)}, version))
        return rows

    def _act_local_batch(self, obs: list[Any]) -> list[tuple[Any, Any, dict, int]]:
        if self._policy is None:
            self._pull_weights()
        policy, version = self._policy, self._policy_version
        actions, extra = policy.act(nested.stack(obs), explore=self.welcome.get("explore", True), rng=self._rng)
        return [(_env_value(self._to_env(actions[i])), actions[i], {k: v[i] for k, v in extra.items()}, version)
                for i in range(len(obs))]

    def _from_plain_action(self, value: Any) -> np.ndarray:
        return np.asarray(value, dtype=self._action_dtype)

    def _act_local(self, obs: Any, given: Any) -> tuple[Any, Any, dict, int]:
        if self._policy is None:
            self._pull_weights()
        policy, version = self._policy, self._policy_version
        batch = nested.map_structure(lambda a: a[None], obs)
        if given is None:
            actions, extra = policy.act(batch, explore=self.welcome.get("explore", True), rng=self._rng)
        else:
            actions = self._to_module(np.asarray(given))[None]
            extra = policy.extras(batch, actions)
        module_action = actions[0]
        extra = {k: v[0] for k, v in extra.items()}
        return _env_value(self._to_env(module_action)), module_action, extra, version

    def _to_module(self, action: np.ndarray) -> np.ndarray:
        """An env action the client chose (``log_action``) -> the policy's raw action."""
        m = self.welcome["action_mapping"]
        if m["kind"] != "box" or not m["normalize"]:
            return action
        low, high = np.asarray(m["low"], np.float64), np.asarray(m["high"], np.float64)
        return (2.0 * (action - low) / (high - low) - 1.0).astype(np.float32)

    def _to_env(self, action: np.ndarray) -> np.ndarray:
        m = self.welcome["action_mapping"]
        if m["kind"] == "box":
            low, high = np.asarray(m["low"], np.float64), np.asarray(m["high"], np.float64)
            if m["normalize"]:
                action = low + (np.clip(action, -1.0, 1.0) + 1.0) * 0.5 * (high - low)
            elif m["clip"]:
                action = np.clip(action, low, high)
        return np.asarray(action).astype(m["dtype"], copy=False)

    def _start_remote(self, eid: str) -> None:
        self._request({"op": wire.START, "episode_id": eid})
        self._episodes[eid].started_remote = True

    # --- experience ---------------------------------------------------------------------------
    def _spool_chunk(self, chunk: EpisodeChunk) -> None:
        """Keep the chunk until the server commits it (waits while the spool is full); send it now."""
        deadline = time.monotonic() + self.timeout_s
        while len(self._spool) >= self.spool_limit:
            if time.monotonic() > deadline:
                raise TimeoutError(f"the spool of {self.spool_limit} unacknowledged chunks is full and "
                                   f"{self.address} committed none for {self.timeout_s:.0f} s; is training running?")
            self._pump(0.05)
            self._maintain()
        key = (chunk.episode_id, chunk.chunk_index)
        entry = _Spooled(encode([chunk], compress=True), len(chunk))
        self._spool[key] = entry
        if self.spool_dir is not None:
            _write_atomically(self._spool_path(key), entry.frame)
        self._send_chunk(key, entry)

    def _spool_path(self, key: tuple[str, int]) -> str:
        return os.path.join(self.spool_dir, f"{key[0].encode('ascii').hex()}_{key[1]}.chunk")

    def _load_spool(self, directory: str) -> None:
        """Chunks an earlier process with this spool directory left unacknowledged."""
        os.makedirs(directory, exist_ok=True)
        for name in sorted(os.listdir(directory)):
            stem, ext = os.path.splitext(name)
            eid_hex, _, index = stem.rpartition("_")
            try:
                key = (bytes.fromhex(eid_hex).decode("ascii"), int(index))
            except ValueError:
                continue
            if ext == ".chunk":
                with open(os.path.join(directory, name), "rb") as f:
                    self._spool[key] = _Spooled(f.read(), 0)
        if self._spool:
            log.info("resending %d chunk(s) left in %s", len(self._spool), directory)

    def _send_chunk(self, key: tuple[str, int], entry: _Spooled) -> None:
        header = {"op": wire.CHUNKS, "id": next(self._ids), "ids": [list(key)]}
        try:
            self._sock.send_multipart([wire.pack(header), entry.frame], zmq.NOBLOCK, copy=False)
            entry.sent_at = time.monotonic()
        except zmq.Again:  # the pipe is full (server gone): the next maintenance round retries
            entry.sent_at = 0.0

    def _resend(self, everything: bool = False) -> None:
        now = time.monotonic()
        for key, entry in self._spool.items():
            if everything or entry.sent_at == 0.0 or (not entry.received and now - entry.sent_at > self.resend_after_s):
                entry.received = False
                self._send_chunk(key, entry)

    def _on_committed(self, ids: Any) -> None:
        for item in ids if isinstance(ids, list) else ():
            key = (item[0], item[1]) if isinstance(item, list) and len(item) == 2 else None
            if key is not None and self._spool.pop(key, None) is not None:
                self.committed.append(key)
                if self.spool_dir is not None:
                    try:
                        os.unlink(self._spool_path(key))
                    except FileNotFoundError:
                        pass
        self._spool_freed.notify_all()

    # --- weights (local inference) ------------------------------------------------------------
    def _pull_weights(self) -> None:
        from protocols.numpy_policy import NumpyPolicy

        header, parts = self._request({"op": wire.WEIGHTS, "have": self._policy_version})
        self._last_pull = time.monotonic()
        if header.get("changed"):
            desc = _decode_body(parts, "policy")
            self._policy = NumpyPolicy(desc)
            self._policy_version = int(header["weights_version"])

    # --- the connection -----------------------------------------------------------------------
    def _connect(self) -> zmq.Socket:
        sock = self._ctx.socket(zmq.DEALER)
        for opt, value in ((zmq.LINGER, 0), (zmq.RECONNECT_IVL, 100), (zmq.RECONNECT_IVL_MAX, 2000),
                           (zmq.HEARTBEAT_IVL, 1000), (zmq.HEARTBEAT_TIMEOUT, 5000), (zmq.HEARTBEAT_TTL, 10000),
                           (zmq.SNDHWM, 10000), (zmq.RCVHWM, 10000)):
            sock.setsockopt(opt, value)
        for opt, value in self._curve:
            sock.setsockopt(opt, value)
        sock.connect(self.address)
        self._poller = zmq.Poller()
        self._poller.register(sock, zmq.POLLIN)
        return sock

    def _hello(self) -> None:
        self._in_hello = True
        try:
            self._say_hello()
        finally:
            self._in_hello = False

    def _say_hello(self) -> None:
        header = {"op": wire.HELLO, "protocol": wire.PROTOCOL, "version": wire.VERSION,
                  "inference_mode": self.requested_mode or "", "name": self.name, **self._spaces}
        welcome, _ = self._request(header, hello=True)
        self._epoch += 1
        new_server = welcome.get("server_id") != self.server_id
        self.welcome, self.server_id = welcome, welcome.get("server_id")
        self._action_dtype = np.dtype(welcome["action_mapping"]["dtype"])
        self._remote = welcome["inference_mode"] == "remote"
        for ep in self._episodes.values():  # the server forgot them (or it is another server)
            ep.started_remote = False
        self._resend(everything=True)
        if new_server:
            log.info("connected to policy server %s at %s (%s inference)", self.server_id, self.address,
                     welcome["inference_mode"])

    def _send(self, header: dict, body: bytes | None = None) -> None:
        with self._lock:
            if body is None:
                self._sock.send(wire.pack(header))
            else:
                self._sock.send_multipart([wire.pack(header), body], copy=len(body) < 65536)

    def _request(self, header: dict, body: bytes | None = None, *, hello: bool = False,
                 retry_unknown_episode: str | list[str] | None = None) -> tuple[dict, list]:
        """Send and wait for the reply with the same id; re-hello and retry when the server does
        not know this connection; ``TimeoutError`` when no reply comes within ``timeout_s``."""
        deadline = time.monotonic() + self.timeout_s
        with self._lock:
            rid, epoch = self._issue(header, body)
            return self._complete(rid, epoch, header, body, deadline, hello, retry_unknown_episode)

    def _issue(self, header: dict, body: bytes | None) -> tuple[int, int]:
        """Send a request under a new id (under the lock); its reply is kept for ``_complete``."""
        rid = next(self._ids)
        header["id"] = rid
        self._awaiting.add(rid)
        try:
            self._send(header, body)
        except BaseException:
            self._awaiting.discard(rid)
            raise
        return rid, self._epoch

    def _complete(self, rid: int, epoch: int, header: dict, body: bytes | None, deadline: float, hello: bool = False,
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
                    self._hello()
                elif code == wire.UNKNOWN_EPISODE and restart and all(e in self._episodes for e in restart):
                    for eid in restart:  # the server restarted mid-episode: it forgot them
                        self._start_remote(eid)
                elif code == wire.BUSY and time.monotonic() < deadline:
                    self._pump(0.01)
                else:
                    raise ServerError(str(code), str(h.get("message")), bool(h.get("fatal")))
            rid, epoch = self._issue(header, body)

    def _await(self, rid: int, deadline: float, what: str, epoch: int) -> tuple[dict, list] | None:
        """The reply to request ``rid``; None if the client said hello again meanwhile."""
        resent_at = time.monotonic()
        while rid not in self._replies:
            if self._epoch != epoch and what != wire.HELLO:
                return None
            now = time.monotonic()
            if now > deadline:
                raise TimeoutError(f"no answer to {what!r} from the policy server at {self.address} within "
                                   f"{self.timeout_s:.0f} s; is it running, and is the address (and CURVE key) right?")
            self._pump(min(deadline - now, 0.25))
            if rid not in self._replies and time.monotonic() - resent_at > 2.0 and what != wire.HELLO:
                # a silent server may be a new one that never saw this request: ask who is there
                resent_at = time.monotonic()
                self._send({"op": wire.PING, "id": 0})
        return self._replies.pop(rid)

    def _pump(self, timeout_s: float) -> None:
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
            parts = [sock.recv(_NOBLOCK)]
            while sock.getsockopt(_RCVMORE):
                parts.append(sock.recv(_NOBLOCK))
            self._last_heard = time.monotonic()
            try:
                header = wire.unpack_header(parts[0])
            except ProtocolError as err:
                log.warning("dropped a malformed message from the server: %s", err)
                continue
            self._dispatch(header, parts[1:])

    def _dispatch(self, header: dict, parts: list) -> None:
        op, rid = header["op"], header.get("id", 0)
        if op == wire.COMMITTED:
            self._on_committed(header.get("ids"))
        elif op == wire.RECEIVED:
            for item in header.get("ids") or ():
                entry = self._spool.get(tuple(item)) if isinstance(item, list) else None
                if entry is not None:
                    entry.received = True
            self._on_committed(header.get("committed") or [])
        elif op == wire.ERROR and header.get("ids"):  # about chunks: nothing waits for these
            code = header.get("code")
            for item in header["ids"]:
                key = tuple(item) if isinstance(item, list) else None
                if code == wire.BAD_CHUNK and self._spool.pop(key, None) is not None:
                    self.rejected.append((key, str(header.get("message"))))
                    if self.spool_dir is not None:
                        os.unlink(self._spool_path(key))
                    log.error("the server refused chunk %s: %s", key, header.get("message"))
                elif code == wire.HELLO_FIRST:
                    self._rehello()
                    return
                elif key in self._spool:  # busy: try again soon
                    entry = self._spool[key]
                    entry.received = False
                    entry.sent_at = time.monotonic() - self.resend_after_s + BUSY_RETRY_S
        elif rid in self._awaiting:
            self._replies[rid] = (header, parts)
        elif op == wire.ERROR and header.get("code") != wire.HELLO_FIRST:
            log.warning("policy server: %s [%s]", header.get("message"), header.get("code"))
        elif op == wire.ERROR and header.get("code") == wire.HELLO_FIRST:  # to a ping: a new connection
            self._rehello()

    def _rehello(self) -> None:
        """Say hello on a connection the server does not know (once, however many replies say so)."""
        if not self._in_hello:
            self._hello()

    def _maintain(self) -> None:
        """Resend what went unacknowledged, ping a quiet server, pull weights when due."""
        now = time.monotonic()
        self._resend()
        if now - self._last_heard > self.heartbeat_s:
            self._send({"op": wire.PING, "id": 0})
            self._last_heard = now  # one ping per interval
        if (self.welcome and self.welcome["inference_mode"] == "local" and self._policy is not None
                and now - self._last_pull > self.update_interval):
            try:
                self._pull_weights()
            except (TimeoutError, ServerError) as err:  # keep acting with the weights we have
                self._last_pull = now
                log.warning("could not pull new weights: %s", err)

    def _background(self) -> None:
        while not self._closed.wait(min(0.1, self.heartbeat_s)):
            if not self._lock.acquire(timeout=0.1):
                continue
            try:
                self._pump(0.0)
                self._maintain()
            except zmq.ZMQError:
                if self._closed.is_set():
                    return
                raise
            except Exception as err:  # noqa: BLE001 - the next call on the main thread raises what matters
                log.warning("client background thread: %s", err)
            finally:
                self._lock.release()


def run_env(client: PolicyClient, env: Any, num_episodes: int | None = None, max_steps: int | None = None,
            seed: int | None = None) -> list[float]:
    """Drive a gymnasium-style ``env`` (``reset()``/``step()``) through ``client`` for
    ``num_episodes`` episodes or ``max_steps`` steps (the last episode is finished); returns
    the episodes' returns."""
    if num_episodes is None and max_steps is None:
        raise ValueError("give num_episodes or max_steps")
    returns: list[float] = []
    steps = 0
    while (num_episodes is None or len(returns) < num_episodes) and (max_steps is None or steps < max_steps):
        obs, _ = env.reset(seed=None if seed is None else seed + len(returns))
        eid = client.start_episode()
        total, done = 0.0, False
        while not done:
            action = client.get_action(eid, obs)
            obs, reward, terminated, truncated, _ = env.step(action)
            client.log_returns(eid, reward)
            total += float(reward)
            steps += 1
            done = terminated or truncated
            if done:
                client.end_episode(eid, obs, truncated=bool(truncated and not terminated))
        returns.append(total)
    return returns


def _write_atomically(path: str, data: bytes) -> None:
    tmp = f"{path}.tmp"
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def _plain(value: Any) -> Any:
    """Arrays -> nested lists (msgpack natives); dicts stay maps, tuples become arrays."""
    if isinstance(value, np.ndarray):
        return value.tolist()
    if isinstance(value, np.generic):
        return value.item()
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, (tuple, list)):
        return [_plain(v) for v in value]
    return value


def _size(value: Any) -> int:
    return sum(np.size(leaf) for leaf in nested.flatten(value))


def _decode_body(parts: list, what: str) -> Any:
    if not parts:
        raise ProtocolError(f"the server's {what!r} reply has no body")
    return decode(parts[0], limits=REPLY_LIMITS)


def _env_value(action: Any) -> Any:
    """Read-only decoded arrays -> values an env may keep (0-d arrays as numpy scalars)."""
    a = np.array(action)
    return a[()] if a.ndim == 0 else a


def _space_dict(space: Any) -> dict:
    if isinstance(space, dict):
        return space
    from protocols.spaces import space_to_dict

    return space_to_dict(space)


def _curve_options(server_public_key: Any, client_key: Any) -> list[tuple[int, bytes]]:
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
