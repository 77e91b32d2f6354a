"""SingleAgentEpisodes: a ``PolicyClient``'s single-agent episodes, from a checked observation to a cut chunk.

Apart from ``protocols.client`` because an episode's life is its own job: check what the caller hands
in against the server's spaces, record each step in the episode's builder, act the way the server's
welcome says (``protocols.client_inference``), and cut the episode into chunks every
``fragment_length`` steps and at its end. The client keeps the connection, the spool its chunks go to
and the background thread; multi-agent episodes are ``protocols.client_multi_agent``'s.

Locked with the client's lock where an episode's builder or the connection changes, as the client's
background thread may pump the connection (and welcome a new server) between two calls.
"""
from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable

import numpy as np

from protocols import external as wire
from protocols import nested
from protocols.client_connection import Connection
from protocols.client_inference import Inference
from protocols.client_spool import ChunkSpool
from protocols.episode import EpisodeBuilder, EpisodeChunk
from protocols.errors import ProtocolError
from protocols.space_checks import BadValue, box_rows_pass, check_values, value_spec

log = logging.getLogger("runnel.client")


@dataclass
class Episode:
    """What a running episode keeps between the client's calls: the step that waits for its reward."""

    builder: EpisodeBuilder | None  # None: training_enabled=False (acted, never uploaded)
    started_remote: bool = False
    prev_action: Any = None  # the module action of the last step, waiting for its reward and next obs
    prev_extra: dict = field(default_factory=dict)
    reward: float = 0.0
    versions: list[int] = field(default_factory=list)  # weights versions of the steps since the last cut
    state: Any = None  # a recurrent policy's state after the last step acted (None: the episode's start)
    chunk_state: Any = None  # the state the chunk being built acted its first step from (its state_in)
    in_flight: tuple | None = None  # send_action's request (id, epoch, header, body, local result) until received


class SingleAgentEpisodes:
    def __init__(self, conn: Connection, lock: threading.RLock, inference: Inference, spool: ChunkSpool,
                 spool_chunk: Callable[[EpisodeChunk], None]) -> None:
        """``spool_chunk`` keeps a cut chunk until the server commits it (the client's, as it may wait
        for room in the spool)."""
        self._conn = conn
        self._lock = lock
        self._inference = inference
        self._spool = spool
        self._spool_chunk = spool_chunk
        self._episodes: dict[str, Episode] = {}
        self._obs_values = self._act_values = None  # the server's spaces (from its welcome) as value checks
        self._finite_obs = True
        self._remote = False
        self._welcome: dict[str, Any] = {}

    def __contains__(self, episode_id: object) -> bool:
        return episode_id in self._episodes

    def welcomed(self, welcome: dict[str, Any]) -> None:
        """A server's welcome, after every (re)connect: its spaces and inference mode, and it knows no episode."""
        self._obs_values = value_spec(welcome.get("observation_space"))
        self._act_values = value_spec(welcome.get("action_space"), actions=True)
        self._finite_obs = not welcome.get("allow_nonfinite_observations", False)
        self._remote = welcome["inference_mode"] == "remote"
        self._welcome = welcome
        for ep in self._episodes.values():  # the server forgot them (or it is another server)
            ep.started_remote = False

    def restart(self, eids: list[str]) -> bool:
        """Start again the episodes a restarted server forgot; False when some are not running here."""
        if not all(e in self._episodes for e in eids):
            return False
        for eid in eids:  # the server restarted mid-episode: it forgot them
            self._start_remote(eid)
        return True

    # --- an episode's calls, as the client's API takes them -----------------------------------
    def start(self, eid: str, training_enabled: bool) -> None:
        with self._lock:
            if eid in self._episodes:
                raise ValueError(f"episode {eid!r} is already running; end it first or pick another id")
            self._episodes[eid] = Episode(EpisodeBuilder(eid) if training_enabled else None)
        if self._remote:
            self._start_remote(eid)

    def act(self, eid: str, obs: Any, given: Any) -> Any:
        """The env's action for ``obs``: the policy's, or ``given`` (recorded as the client's own)."""
        ep = self._episodes.get(eid) or self._episode(eid)
        if ep.in_flight is not None:
            raise ValueError(f"episode {eid!r} waits for the action send_action() asked for: call receive_action()")
        self._check_value(eid, "obs", obs)
        if given is not None:
            self._check_value(eid, "action", given)
        obs = self._observed(ep, obs)
        if self._remote:
            return self._took(ep, *self._inference.act_remote(eid, obs, given, ep.builder is not None))
        if self._spool.server_version > self._inference.weights_version:
            self._pull_announced_weights()
        return self._took(ep, *self._act_local(ep, obs, given))

    def act_batch(self, episode_ids: list[str], observations: list[Any]) -> list[Any]:
        if len(episode_ids) != len(observations):
            raise ValueError(f"{len(episode_ids)} episode ids for {len(observations)} observations")
        eps = [self._episode(eid) for eid in episode_ids]
        if not box_rows_pass(self._obs_values, observations, self._finite_obs):  # one pass for the common case
            for eid, o in zip(episode_ids, observations):  # all of them before any is recorded
                self._check_value(eid, "obs", o)
        obs = [self._observed(ep, o) for ep, o in zip(eps, observations)]
        if self._remote:
            rows = self._inference.act_remote_batch(list(episode_ids), obs)
        else:
            before = [ep.state for ep in eps]
            rows, after = self._inference.act_local_batch(obs, before)
            for ep, prev, state in zip(eps, before, after):
                ep.state = state
                self._chunk_starts(ep, prev)
        return [self._took(ep, *row) for ep, row in zip(eps, rows)]

    def send(self, episode_id: str, observation: Any) -> None:
        ep = self._episodes.get(episode_id) or self._episode(episode_id)
        if ep.in_flight is not None:
            raise ValueError(f"episode {episode_id!r} already waits for an action: call receive_action() first")
        self._check_value(episode_id, "obs", observation)
        obs = self._observed(ep, observation)
        if not self._remote:
            ep.in_flight = (0, 0, None, None, self._act_local(ep, obs, None))
            return
        request, body = self._inference.act_request(episode_id, obs, None)
        with self._lock:
            rid, epoch = self._conn.issue(request, body)
        ep.in_flight = (rid, epoch, request, body, None)

    def receive(self, episode_id: str, wait_s: float) -> Any:
        ep = self._episodes.get(episode_id) or self._episode(episode_id)
        if ep.in_flight is None:
            raise ValueError(f"no action was asked for episode {episode_id!r}: call send_action() first")
        (rid, epoch, request, body, done), ep.in_flight = ep.in_flight, None  # a failed wait asks anew
        if done is None:
            deadline = time.monotonic() + wait_s
            with self._lock:
                reply, _ = self._conn.complete(rid, epoch, request, body, deadline, retry_unknown_episode=episode_id)
            done = self._inference.read_action(reply, ep.builder is not None)
        return self._took(ep, *done)

    def log_returns(self, episode_id: str, reward: Any) -> None:
        self._episode(episode_id).reward += float(reward)

    def end(self, episode_id: str, observation: Any, truncated: bool) -> None:
        ep = self._episode(episode_id)
        if ep.in_flight is not None:
            raise ValueError(f"episode {episode_id!r} waits for the action send_action() asked for: call "
                             f"receive_action() first (the final observation follows the last action taken)")
        self._check_value(episode_id, "obs", observation)
        with self._lock:
            if ep.builder is not None and ep.prev_action is not None:
                self._add_step(ep, observation, terminated=not truncated, truncated=truncated)
            del self._episodes[episode_id]
        if ep.started_remote:
            self._conn.send({"op": wire.END, "id": 0, "episode_id": episode_id})

    # --- recording ----------------------------------------------------------------------------
    def _episode(self, eid: str) -> Episode:
        ep = self._episodes.get(eid)
        if ep is None:
            raise ValueError(f"unknown episode id {eid!r}: call start_episode() first (running: "
                             f"{list(self._episodes)[:5]})")
        return ep

    def _check_value(self, eid: str, field: str, value: Any) -> None:
        """Refuse a value the server would refuse (``bad_value``; in a chunk, ``bad_chunk``) before it is
        recorded: a NaN observation kept in an episode would get its whole chunk refused."""
        spec, finite = (self._obs_values, self._finite_obs) if field == "obs" else (self._act_values, True)
        try:
            check_values(field, spec, value, finite)
        except BadValue as err:
            raise BadValue(err.field, f"episode {eid!r}: {err}") from None

    def _observed(self, ep: Episode, obs: Any) -> Any:
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

    def _act_local(self, ep: Episode, obs: Any, given: Any) -> tuple:
        """Act with the exported policy, carrying a recurrent policy's state from step to step."""
        prev = ep.state
        acted, ep.state = self._inference.act_local(obs, given, prev)
        self._chunk_starts(ep, prev)
        return acted

    def _chunk_starts(self, ep: Episode, prev: Any) -> None:
        """A step acted from state ``prev``: if it is its chunk's first, the chunk's ``state_in`` is that state."""
        if ep.builder is not None and ep.chunk_state is None:
            ep.chunk_state = self._inference.start_state(prev)

    def _pull_announced_weights(self) -> None:
        """The server said it has newer weights: fetch them before acting (local inference)."""
        with self._lock:
            try:
                self._inference.pull_weights()
            except (TimeoutError, wire.ServerError, ProtocolError) as err:  # act with what we have (EXTERNAL.md 9.1)
                log.warning("could not pull the new weights: %s", err)
            if self._inference.weights_version < self._spool.server_version:  # e.g. not exportable: ask no more
                self._spool.server_version = self._inference.weights_version

    def _took(self, ep: Episode, action: Any, module_action: Any, extra: dict, version: int) -> Any:
        """The episode acted: keep what its next step records; returns the env's action."""
        ep.prev_action, ep.prev_extra = module_action, extra
        if ep.builder is not None:  # an acting-only episode cuts no chunks: nothing would ever clear these
            ep.versions.append(version)
        return action

    def _add_step(self, ep: Episode, obs: Any, terminated: bool = False, truncated: bool = False) -> None:
        b = ep.builder
        b.add_step(ep.prev_action, ep.reward, obs, terminated=terminated, truncated=truncated, extra=ep.prev_extra)
        ep.prev_action, ep.reward = None, 0.0
        limit = self._welcome["fragment_length"]
        if b.is_done or len(b) >= limit:
            b.weights_version = min(ep.versions) if ep.versions else 0
            ep.versions.clear()
            chunk = b.cut()
            chunk.state_in, ep.chunk_state = ep.chunk_state, None
            self._spool_chunk(chunk)

    def _start_remote(self, eid: str) -> None:
        self._conn.request({"op": wire.START, "episode_id": eid})
        self._episodes[eid].started_remote = True
