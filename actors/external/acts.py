"""ActBatcher: the remote-inference path -- act requests taken in, gathered across clients, answered
from one forward pass.

The queue, the cut of a batch and the stacking of its rows are the batching engine central inference
uses too (``actors.inference.batching``). Separate from the server loop, which only says when to run
a batch (``max_batch`` rows queued, or ``batch_wait_s`` passed); everything here runs on the server thread, apart from ``hold``/``release``,
which the driver's thread calls (``hold_acts_while_training``: acts wait while the driver trains on
the batch it took, and are answered with the weights trained on it).
"""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass

import numpy as np

from actors.env.settings import EnvRunnerSettings
from actors.external.endpoint import Conn, ServerEndpoint
from actors.external.inference import ServerPolicy
from actors.external.settings import ExternalSettings
from actors.inference.batching import RequestQueue, stack_blocks
from protocols import external as wire
from protocols.codec import Limits, decode
from protocols.errors import ProtocolError
from protocols.schema import ChunkSchema
from protocols.space_checks import BadValue

log = logging.getLogger("runnel")

_NO_ACTION = [None]  # the one row of an act request without a client-chosen action (read only)


@dataclass
class _Act:
    route: bytes
    rid: int
    obs: list | np.ndarray  # one observation per row (a batched request has several); or a flat Box's rows stacked
    given: list  # per row: the action the client took (log_action), or None
    explore: bool
    batched: bool  # reply with lists


def _length(value: object) -> str:
    return str(len(value)) if isinstance(value, list) else f"a {type(value).__name__}"


@dataclass
class _Answers:
    """A forward pass's results for its rows, as plain lists (what the replies carry)."""
    rows: int
    version: int
    actions: list  # the environment's actions
    logp: list
    dist: list
    raw: list | None  # the module's raw actions (Box action spaces)


class ActBatcher:
    def __init__(self, endpoint: ServerEndpoint, conns: dict[bytes, Conn], counts: dict[str, int],
                 policy: ServerPolicy, schema: ChunkSchema, settings: EnvRunnerSettings,
                 external: ExternalSettings) -> None:
        """``conns`` and ``counts``: the server thread's connections and counters, shared with its loop."""
        self.s, self.x = settings, external
        self.policy, self.schema = policy, schema
        self._finite = not external.allow_nonfinite_observations
        self._send = endpoint.send
        self._conns = conns
        self._counts = counts
        self.act_limits = Limits(max_frame_bytes=8 << 20, max_decoded_bytes=16 << 20, max_buffer_size=1 << 20,
                                 max_array_len=4096, max_map_len=256, max_depth=16)
        self.queue = RequestQueue(external.max_batch, external.batch_wait_s)
        """Act requests waiting for a forward pass (the server loop asks it when one is due)."""
        self.held_until = 0.0  # monotonic time; set by the driver's thread (a float store is atomic)
        self._wake = endpoint.wake

    @property
    def requests(self) -> list:
        """The act requests waiting for a forward pass (the queue's)."""
        return self.queue.requests

    # --- the driver's thread ------------------------------------------------------------------
    def hold(self) -> None:
        """Answer no act for now: the driver trains on what it took (at most ``max_act_hold_s``)."""
        self.held_until = time.monotonic() + self.x.max_act_hold_s

    def release(self) -> None:
        """New weights arrived: answer the waiting acts with them."""
        if self.held_until:
            self.held_until = 0.0
            self._wake()

    # --- the server thread --------------------------------------------------------------------
    def held(self) -> float:
        """Seconds acts are still held for (0: answer them)."""
        until = self.held_until
        return max(0.0, until - time.monotonic()) if until else 0.0

    def act_one(self, route: bytes, conn: Conn, rid: int, h: dict) -> bool:
        """The common request -- one started episode, its observation in the header -- taken without
        the general checks (an id in ``conn.episodes`` passed them at 'start'); False: not that request."""
        eid = h.get("episode_id")
        if (type(eid) is not str or eid not in conn.episodes or "action" in h or "obs" not in h
                or conn.in_flight >= self.x.max_requests_in_flight or "episode_ids" in h
                or type(h.get("explore", False)) is not bool):  # the general path names what is wrong
            return False
        try:
            row = self.schema.observation_row(h["obs"], self._finite)
        except BadValue as err:
            self._refuse_value(route, rid, eid, err)
            return True
        except ProtocolError as err:
            self._send(route, wire.error(rid, wire.BAD_OBSERVATION, str(err)))
            return True
        conn.last_seen = time.monotonic()
        self._queue(conn, _Act(route, rid, [row], _NO_ACTION, bool(h.get("explore", self.s.explore)), False))
        return True

    def _refuse_value(self, route: bytes, rid: int, eid: str, err: BadValue) -> None:
        """The ``bad_value`` reply to an act: which episode, which field, what was wrong."""
        self._counts["num_bad_values"] += 1
        self._send(route, {**wire.error(rid, wire.BAD_VALUE, f"episode {eid!r}: {err}"), "episode_id": eid,
                           "field": err.field})

    def _refuse_in_flight(self, route: bytes, conn: Conn, rid: int) -> bool:
        """Answer ``too_many_requests`` if the connection has ``max_requests_in_flight`` acts unanswered."""
        if conn.in_flight < self.x.max_requests_in_flight:
            return False
        self._send(route, wire.error(rid, wire.TOO_MANY_REQUESTS, f"{conn.in_flight} act requests of this "
                                     f"connection are unanswered (limit {self.x.max_requests_in_flight})"))
        return True

    def _queue(self, conn: Conn, act: _Act) -> None:
        """An act request waits for the next forward pass."""
        conn.in_flight += 1
        self.queue.add(act, len(act.obs))

    def on_act(self, route: bytes, conn: Conn, rid: int, h: dict, body: bytes | None) -> None:
        if body is None:  # small observations travel in the header as plain msgpack
            msg = h
        else:
            msg = decode(body, limits=self.act_limits)
            if not isinstance(msg, dict) or "obs" not in msg:
                raise ProtocolError("an act body must be a map with 'obs' (and optionally 'action')")
        batched = "episode_ids" in h
        if batched:  # several episodes' observations in one request (a vectorized client)
            eids, obs, given = h["episode_ids"], msg["obs"], msg.get("action")
            if (not eids or not isinstance(obs, list) or len(obs) != len(eids)
                    or not (given is None or isinstance(given, list) and len(given) == len(eids))):
                raise ProtocolError(f"a batched act needs 1 or more 'episode_ids' and a list of as many 'obs' (and "
                                    f"'action', if given): got {len(eids)} ids, 'obs' {_length(obs)}"
                                    + ("" if given is None else f", 'action' {_length(given)}"))
            for eid in eids:
                wire.check_episode_id(eid)
            if len(eids) > self.x.max_batch:
                self._send(route, wire.error(rid, wire.BATCH_TOO_LARGE, f"a batched act of {len(eids)} episode_ids; "
                                             f"max_batch = {self.x.max_batch} (the welcome's limits): send them in "
                                             f"smaller requests", limit=self.x.max_batch))
                return
            given = given or [None] * len(eids)
        else:
            eids, obs, given = [h["episode_id"]], [msg["obs"]], [msg.get("action")]
        unknown = [eid for eid in eids if eid not in conn.episodes]
        if unknown:
            self._send(route, wire.error(rid, wire.UNKNOWN_EPISODE, f"episode {unknown[0]!r} was not started on "
                                         f"this connection; send 'start' first"))
            return
        if self._refuse_in_flight(route, conn, rid):
            return
        schema = self.schema
        block = schema.observation_rows(obs, self._finite) if batched else None  # checked already
        try:
            rows = block if block is not None else [schema.observation_from_plain(o) for o in obs]
            given = [None if g is None else schema.action_from_plain(g) for g in given]
        except ProtocolError as err:
            self._send(route, wire.error(rid, wire.BAD_OBSERVATION, str(err)))
            return
        for i, (eid, action) in enumerate(zip(eids, given)):
            try:  # an action outside the space would fail the forward pass (and with it the server thread)
                if block is None:
                    schema.check_observation_values(rows[i], self._finite)
                if action is not None:
                    schema.check_action_values(action)
            except BadValue as err:
                self._refuse_value(route, rid, eid, err)
                return
        given = [None if g is None else self.policy.to_module_action(g) for g in given]
        self._queue(conn, _Act(route, rid, rows, given, bool(h.get("explore", self.s.explore)), batched))

    def infer(self) -> None:
        """One forward pass over the queued requests, ``max_batch`` rows at most (held ones are a backlog)."""
        acts = self._next_batch()
        try:
            out = self._forward(acts)
        except Exception as err:  # noqa: BLE001 - a bug here must not stop serving every client
            self._failed(acts, err)
            return
        n, version, env_list, logp_list, dist_list, raw_list = (out.rows, out.version, out.actions, out.logp,
                                                                out.dist, out.raw)
        # counted before the replies go out: a client that saw its action may read the counters at once
        self.policy.num_env_steps_served += n
        self._counts["num_actions_served"] += n
        self._counts["num_inference_batches"] += 1
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

    def _next_batch(self) -> list:
        """The queued requests the next forward pass answers: ``max_batch`` rows at most (a request's
        rows stay together), the rest wait."""
        return self.queue.take()

    def on_multi_agent(self, route: bytes, conn: Conn, rid: int, h: dict) -> None:
        """A multi-agent op: this server trains one policy (``MultiAgentActs`` serves them)."""
        raise ProtocolError(f"{h['op']!r}: this server trains one policy, not a multi-agent run; use start/act/end")

    def _forward(self, acts: list[_Act]) -> _Answers:
        """One forward pass for ``acts``."""
        blocks = [a.obs for a in acts]
        if len(acts) == 1 and len(blocks[0]) == 1:  # one client acting alone: no gathering
            obs = stack_blocks(blocks)
            explore = [acts[0].explore]
            given = {} if acts[0].given[0] is None else {0: acts[0].given[0]}
        else:
            if not all(type(b) is np.ndarray for b in blocks):  # rows of both kinds: one list of rows
                blocks = [list(b) for b in blocks]
            obs = stack_blocks(blocks)
            explore = [a.explore for a in acts for _ in range(len(a.obs))]
            given = {i: g for i, g in enumerate(g for a in acts for g in a.given) if g is not None}
        n = len(explore)
        policy = self.policy
        module_actions, logp, dists, version = policy.forward(obs, explore, given)
        env_list, logp_list, dist_list = policy.env_actions(module_actions).tolist(), logp.tolist(), dists.tolist()
        raw_list = module_actions.tolist() if policy.box_actions else None
        return _Answers(n, version, env_list, logp_list, dist_list, raw_list)

    def _failed(self, acts: list[_Act], err: Exception) -> None:
        """The forward pass raised: every request of the batch gets ``server_error``; serving goes on."""
        self._counts["num_server_errors"] += 1
        log.exception("policy server: a forward pass over %d act request(s) failed; they get server_error", len(acts))
        for a in acts:
            self._send(a.route, wire.error(a.rid, wire.SERVER_ERROR, f"the server could not compute this action "
                                           f"({type(err).__name__}: {err}); nothing was computed"))
            conn = self._conns.get(a.route)
            if conn is not None:
                conn.in_flight -= 1
