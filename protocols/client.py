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

Observations and actions are checked against the server's spaces before anything is recorded or
sent (``protocols.space_checks``): a value the server would refuse -- NaN, an action out of range --
raises ``BadValue`` (a ValueError) and leaves the episode as it was, so one bad value cannot get a
whole chunk refused.

The client keeps the spool's throttle and the background thread; its parts live beside it: the
socket and its requests in ``protocols.client_connection``, the spool in ``protocols.client_spool``,
remote and local inference in ``protocols.client_inference``, the episodes in
``protocols.client_episodes`` (single-agent) and ``protocols.client_multi_agent``.
"""
from __future__ import annotations

import logging
import os
import threading
import time
import uuid
from typing import Any

import numpy as np
import zmq

from protocols import external as wire
from protocols.client_connection import Connection, curve_options
from protocols.client_episodes import SingleAgentEpisodes
from protocols.client_inference import Inference
from protocols.client_multi_agent import MultiAgentEpisodes
from protocols.client_spool import ChunkSpool
from protocols.episode import EpisodeChunk

log = logging.getLogger("runnel.client")


class PolicyClient:
    """A connection to a policy server (``actors.external.policy_server``); thread-safe."""

    def __init__(self, address: str, inference_mode: str | None = None, *, update_interval: float = 10.0,
                 server_public_key: str | bytes | None = None, client_key: str | tuple | None = None,
                 timeout_s: float = 60.0, spool_chunks: int = 1024, resend_after_s: float = 10.0,
                 heartbeat_s: float = 1.0, name: str | None = None, observation_space: Any = None,
                 action_space: Any = None, seed: int | None = None, spool_dir: str | None = None,
                 spin_s: float = 0.0, throttle: bool = True) -> None:
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
        trades a busy core for latency (pair it with the server's ``spin_s``; 0: always block).
        ``throttle``: stop collecting (the call that cuts a chunk waits) while the server has not
        committed ``welcome.limits.max_unacked_steps`` env steps this client sent -- so a fast simulator
        collects what training can use, as an env runner would. ``False`` for a simulator that must
        never wait (the server then drops what it cannot use: ``stale``). In local inference the
        client fetches new weights as soon as a reply announces them, throttled or not."""
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
        self.throttle = bool(throttle)
        self.name = name or f"client-{os.getpid()}-{uuid.uuid4().hex[:6]}"
        self._spaces = {k: _space_dict(v) for k, v in (("observation_space", observation_space),
                                                        ("action_space", action_space)) if v is not None}
        rng = np.random.default_rng(seed)
        self._lock = threading.RLock()
        self.welcome: dict[str, Any] | None = None
        self.server_id: str | None = None
        self._closed = threading.Event()
        self._conn = Connection(address, curve_options(server_public_key, client_key), self._lock,
                                timeout_s=self.timeout_s, spin_s=self.spin_s, hello=self._hello_fields,
                                on_welcome=self._welcomed, restart_episodes=self._restart_episodes,
                                on_chunks=self._on_chunks)
        self._inference = Inference(self._conn, rng)
        self._multi_agent = MultiAgentEpisodes(self._conn, lambda: int((self.welcome.get("limits") or {}).get(
            "max_agents", 64)))
        self._spool = ChunkSpool(self._conn, self._lock, spool_dir, self.resend_after_s)
        if spool_dir is not None:
            self._spool.load(spool_dir)
        self._episodes = SingleAgentEpisodes(self._conn, self._lock, self._inference, self._spool, self._spool_chunk)
        with self._lock:
            try:
                self._conn.hello()
            except BaseException:  # refused, unreachable: no socket left reconnecting in the background
                self._conn.close()
                raise
        self._thread = threading.Thread(target=self._background, name="runnel-client", daemon=True)
        self._thread.start()

    # --- the RLlib-shaped API -----------------------------------------------------------------
    @property
    def inference_mode(self) -> str:
        return self.welcome["inference_mode"]

    @property
    def multi_agent(self) -> bool:
        """The server trains several modules: episodes are multi-agent (EXTERNAL.md section 10)."""
        return bool(self.welcome.get("multi_agent"))

    @property
    def weights_version(self) -> int:
        """The version of the weights this client acts with (local) or last saw (remote)."""
        return self._inference.weights_version

    @property
    def committed(self) -> list[tuple[str, int]]:
        """Ids of every chunk the server acknowledged, in order (for accounting and tests)."""
        return self._spool.committed

    @property
    def rejected(self) -> list[tuple[tuple[str, int], str]]:
        """Chunks the server refused as malformed (id, reason): a bug in the caller, never resent."""
        return self._spool.rejected

    def start_episode(self, episode_id: str | None = None, training_enabled: bool = True) -> str:
        """Begin an episode; returns its id. ``training_enabled=False``: act but send no experience.
        With a multi-agent server (its welcome says ``multi_agent``) the episode is multi-agent: dicts
        keyed by agent id go in and out of ``get_action``, ``log_returns`` and ``end_episode``."""
        eid = wire.check_episode_id(episode_id) if episode_id is not None else uuid.uuid4().hex
        if self.multi_agent:
            if not training_enabled:
                raise ValueError("training_enabled=False is not built for multi-agent episodes: the server records "
                                 "every multi-agent episode it acts in")
            self._multi_agent.start(eid)
            return eid
        self._episodes.start(eid, training_enabled)
        return eid

    def get_action(self, episode_id: str, observation: Any) -> Any:
        """The policy's action for ``observation`` (the reward for the previous action goes to
        ``log_returns`` before this call). A multi-agent episode takes ``{agent_id: observation}`` for
        the agents that observe now and returns ``{agent_id: action}`` for those that act."""
        if episode_id not in self._episodes and episode_id in self._multi_agent:  # single-agent first: hot path
            return self._multi_agent.act(episode_id, observation)
        return self._episodes.act(episode_id, observation, None)

    def get_actions(self, episode_ids: list[str], observations: list[Any]) -> list[Any]:
        """``get_action`` for several episodes at once (a simulator stepping many envs): one request
        and one batched forward pass on the server, or one numpy pass here in local inference."""
        return self._episodes.act_batch(episode_ids, observations)

    def send_action(self, episode_id: str, observation: Any) -> None:
        """Ask for the action without waiting for it; ``receive_action`` collects it. A program
        stepping many episodes (on this client or on several) sends every request first, so the
        server answers them in one batch while nobody waits. One request per episode at a time."""
        self._episodes.send(episode_id, observation)

    def receive_action(self, episode_id: str, timeout_s: float | None = None) -> Any:
        """The action ``send_action`` asked for (waits up to ``timeout_s``, default the client's
        ``timeout_s``, then raises ``TimeoutError``)."""
        return self._episodes.receive(episode_id, self.timeout_s if timeout_s is None else timeout_s)

    def log_action(self, episode_id: str, observation: Any, action: Any) -> None:
        """Record an action the client chose itself (off-policy data for the policy to learn from)."""
        self._episodes.act(episode_id, observation, np.asarray(action))

    def log_returns(self, episode_id: str, reward: Any, info: dict | None = None,
                    terminateds: dict | None = None, truncateds: dict | None = None) -> None:
        """Reward for the latest action; several calls before the next action add up. A multi-agent
        episode takes ``{agent_id: reward}``, and the env's ``terminateds``/``truncateds`` dicts of the
        step: agents marked there observe their final step in the next ``get_action`` and act no more."""
        if episode_id not in self._episodes and episode_id in self._multi_agent:  # single-agent first: hot path
            self._multi_agent.log_returns(episode_id, reward, terminateds, truncateds)
            return
        self._episodes.log_returns(episode_id, reward)

    def end_episode(self, episode_id: str, observation: Any, truncated: bool = False) -> None:
        """The episode's last observation; ``truncated=True`` when it was cut (a time limit) rather
        than reaching a terminal state. A multi-agent episode takes ``{agent_id: observation}`` (the
        final observations there are; ``{}`` or None for none) and ends for every agent ("__all__")."""
        if episode_id not in self._episodes and episode_id in self._multi_agent:  # single-agent first: hot path
            self._multi_agent.end(episode_id, observation, truncated)
            return
        self._episodes.end(episode_id, observation, truncated)

    def update_policy_weights(self) -> None:
        """Pull the newest weights now (local inference; the background thread does it every
        ``update_interval`` seconds)."""
        if self.inference_mode == "local":
            self._inference.pull_weights()

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
                self._conn.pump(min(left, 0.05))
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
                self._conn.close()

    def __enter__(self) -> "PolicyClient":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close(flush=exc[0] is None)

    # --- experience ---------------------------------------------------------------------------
    def _spool_chunk(self, chunk: EpisodeChunk) -> None:
        """Keep the chunk until the server commits it (waits while the spool is full, or while the server
        has not committed the most steps it wants in flight, ``throttle``); send it now."""
        spool = self._spool
        steps_limit = (self.welcome.get("limits") or {}).get("max_unacked_steps") if self.throttle else None
        if type(steps_limit) is not int or steps_limit < 1:
            steps_limit = None
        deadline, held = time.monotonic() + self.timeout_s, len(spool)
        while len(spool) >= self.spool_limit or (steps_limit and spool and self._unacked_steps() + len(chunk) > steps_limit):
            if len(spool) < held:  # progress: training is running, however slowly
                deadline, held = time.monotonic() + self.timeout_s, len(spool)
            if time.monotonic() > deadline:
                raise TimeoutError(f"{len(spool)} chunk(s) ({spool.steps} env steps) wait for {self.address} to "
                                   f"commit them, and it committed none for {self.timeout_s:.0f} s; is training "
                                   f"running?")
            self._conn.pump(0.05)
            self._maintain()
        spool.add(chunk)

    def _unacked_steps(self) -> int:
        """What ``max_unacked_steps`` counts: spooled steps acted on by the newest weights the server
        announced or newer -- older ones are taken already or will be dropped as stale, and must not
        keep the client from collecting what the next update wants."""
        return self._spool.steps_from(max(self._spool.server_version, self._inference.weights_version))

    # --- what the connection leaves to the client ---------------------------------------------
    def _hello_fields(self) -> dict[str, Any]:
        """What this client says about itself in every hello."""
        return {"inference_mode": self.requested_mode or "", "name": self.name, **self._spaces}

    def _welcomed(self, welcome: dict[str, Any]) -> None:
        """A server's welcome, after every (re)connect: it may be a new server, which knows no episode."""
        new_server = welcome.get("server_id") != self.server_id
        self.welcome, self.server_id = welcome, welcome.get("server_id")
        self._inference.welcomed(welcome)
        self._episodes.welcomed(welcome)
        if new_server:
            self._multi_agent.forget()
        self._spool.resend(everything=True)
        if new_server:
            log.info("connected to policy server %s at %s (%s inference)", self.server_id, self.address,
                     welcome["inference_mode"])

    def _restart_episodes(self, eids: list[str]) -> bool:
        """The connection's callback, given before the episodes exist."""
        return self._episodes.restart(eids)

    def _on_chunks(self, header: dict) -> None:
        self._spool.on_message(header)

    def _maintain(self) -> None:
        """Resend what went unacknowledged, ping a quiet server, pull weights when due."""
        now = time.monotonic()
        self._spool.resend()
        self._conn.ping_if_quiet(now, self.heartbeat_s)
        self._inference.maintain(now, self.update_interval)

    def _background(self) -> None:
        while not self._closed.wait(min(0.1, self.heartbeat_s)):
            if not self._lock.acquire(timeout=0.1):
                continue
            try:
                self._conn.pump(0.0)
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


def _space_dict(space: Any) -> dict:
    if isinstance(space, dict):
        return space
    from protocols.spaces import space_to_dict

    return space_to_dict(space)
