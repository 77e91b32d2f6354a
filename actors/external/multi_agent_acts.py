"""MultiAgentActs: the act path of a policy server in a multi-agent run (EXTERNAL.md section 10).

Unlike single-agent clients, which record their own chunks, a multi-agent client only reports what
its env does -- ``ma_act`` with the observations of the agents to act (and the rewards and done
flags since their last action), ``ma_end`` when the episode ends -- and the server records the
episode: one ``MultiAgentEpisode`` per client episode, agents mapped to modules by the run's
``policy_mapping_fn``, per-agent chunks tagged with agent and module id cut every
``fragment_length`` env steps and at each agent's end, handed to the chunk intake as if a client had
sent them. So the learners get exactly what ``MultiAgentEnvRunner`` feeds them, and a client needs
no model of the episode bookkeeping (hanging rewards, agents acting in turns).

Every value is checked before anything is recorded (agent ids, counts against ``max_agents``,
rewards and flags only for agents that acted, each observation against its module's space); a
refused request changes nothing and is answered with an error naming the agent. Requests of all
clients are gathered like single-agent acts (the same ``max_batch``/``batch_wait_s`` rule and
``hold_acts_while_training``) and answered from one forward pass per module.

A subclass of ``ActBatcher`` for the queue and the hold it shares; the single-agent ops are refused.
"""
from __future__ import annotations

import logging
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any, Callable

import numpy as np

from actors.env.settings import EnvRunnerSettings
from actors.external.acts import ActBatcher
from actors.external.chunks import ChunkIntake
from actors.external.endpoint import Conn, ServerEndpoint
from actors.external.inference import ServerPolicy
from actors.external.settings import ExternalSettings
from protocols import external as wire
from protocols import nested
from protocols.agent_record import STATE_COLUMN
from protocols.episode import EpisodeChunk
from protocols.errors import ProtocolError
from protocols.external_agents import AgentError, agent_ids, done_flags, reward_pairs
from protocols.multi_agent_episode import ALL, MultiAgentEpisode
from protocols.schema import ChunkSchema
from protocols.space_checks import BadValue

log = logging.getLogger("runnel")

MAX_STEP_COUNTS = 1_000_000
"""Chunks whose env-step counts are kept until a sample takes them."""


@dataclass
class Running:
    """One client episode the server records."""

    episode: MultiAgentEpisode
    acted: set = field(default_factory=set)
    """Agents that acted and are not done: the only ones rewards and done flags may name."""
    done: set = field(default_factory=set)
    in_flight: bool = False
    cut_at: int = 0
    """Env steps recorded at the last cut."""
    counted: int = 0
    """Env steps handed on with chunks so far."""
    reported: bool = False
    states: dict = field(default_factory=dict)
    """Agent -> its recurrent module's state ``[2, cell]`` after its last action (absent: zeros, the start)."""


@dataclass
class _MaAct:
    route: bytes
    rid: int
    eid: str
    running: Running
    agents: list  # the agents to act, in the request's order
    modules: list  # each one's module id
    obs: list  # each one's observation row
    explore: bool


class MultiAgentActs(ActBatcher):
    def __init__(self, endpoint: ServerEndpoint, conns: dict[bytes, Conn], counts: dict[str, int],
                 policies: dict[str, ServerPolicy], policy_mapping_fn: Callable[[Any, Any], str],
                 intake: ChunkIntake, settings: EnvRunnerSettings, external: ExternalSettings, worker_index: int,
                 on_episode_end: Callable[[MultiAgentEpisode], None]) -> None:
        """``policies``: one per module id; ``on_episode_end(episode)``: an episode ended (its statistics)."""
        self.policies = policies
        self.schemas = {mid: ChunkSchema.for_spaces(p.observation_space, p.action_space, ())
                        for mid, p in policies.items()}
        first = next(iter(policies))
        super().__init__(endpoint, conns, counts, policies[first], self.schemas[first], settings, external)
        self.policy_mapping_fn = policy_mapping_fn
        self.seq_lens = {mid: p.seq_len for mid, p in policies.items() if p.state_shape is not None}
        """Recurrent modules' ``max_seq_len``: the server keeps each agent's state and cuts its chunks to it."""
        self.intake, self.worker_index = intake, worker_index
        self.on_episode_end = on_episode_end
        self._env_steps_of: OrderedDict[tuple[str, int], int] = OrderedDict()  # see env_steps_of

    # --- the single-agent ops are not this server's ------------------------------------------------
    def act_one(self, route: bytes, conn: Conn, rid: int, h: dict) -> bool:
        return False

    def on_act(self, route: bytes, conn: Conn, rid: int, h: dict, body: bytes | None) -> None:
        raise ProtocolError(f"'act': this server trains several modules (a multi-agent run); use ma_start/ma_act/"
                            f"ma_end (EXTERNAL.md section 10) with modules {sorted(self.policies)}")

    # --- requests -----------------------------------------------------------------------------------
    def on_multi_agent(self, route: bytes, conn: Conn, rid: int, h: dict) -> None:
        if conn.version < 2:
            raise ProtocolError(f"{h['op']!r} is a version 2 message; this connection said hello with version "
                                f"{conn.version}: say hello with version 2")
        op, eid = h["op"], h["episode_id"]
        try:
            if op == wire.MA_START:
                self._start(route, conn, rid, eid)
            elif op == wire.MA_ACT:
                self._act(route, conn, rid, eid, h)
            else:
                self._end(route, conn, rid, eid, h)
        except AgentError as err:
            self._send(route, err.reply(rid, eid))
        except BadValue as err:
            self._counts["num_bad_values"] += 1
            self._send(route, {**wire.error(rid, wire.BAD_VALUE, f"episode {eid!r}: {err}"), "episode_id": eid,
                               "field": err.field, "agent_id": getattr(err, "agent_id", None)})
        except ProtocolError:
            raise  # a wire rule broken: the loop answers bad_message and counts it
        except Exception as err:  # noqa: BLE001 - a bug (or the user's mapping fn) must not stop the server
            self._broken(route, conn, rid, eid, err)

    def _broken(self, route: bytes, conn: Conn, rid: int, eid: str, err: Exception) -> None:
        """Recording a step failed where the checks saw nothing wrong: the episode may be half-changed, so it
        is forgotten, and the request gets ``server_error``."""
        self._counts["num_server_errors"] += 1
        log.exception("policy server: recording multi-agent episode %r failed; it is forgotten", eid)
        conn.ma_episodes.pop(eid, None)
        self._send(route, wire.error(rid, wire.SERVER_ERROR, f"episode {eid!r} could not be recorded "
                                     f"({type(err).__name__}: {err}); it is forgotten: start a new one",
                                     episode_id=eid))

    def _start(self, route: bytes, conn: Conn, rid: int, eid: str) -> None:
        if eid not in conn.ma_episodes and len(conn.ma_episodes) + len(conn.episodes) >= self.x.max_open_episodes:
            self._send(route, wire.error(rid, wire.TOO_MANY_EPISODES, f"{len(conn.ma_episodes)} episodes are open "
                                         f"on this connection (limit {self.x.max_open_episodes}); end some first"))
            return
        old = conn.ma_episodes.get(eid)
        if old is not None and old.in_flight:
            self._send(route, wire.error(rid, wire.TOO_MANY_REQUESTS, f"episode {eid!r} waits for its actions; "
                                         f"start it again once they came"))
            return
        # the server's own episode id: clients' ids may repeat across clients, chunk ids must not
        conn.ma_episodes[eid] = Running(MultiAgentEpisode(self.policy_mapping_fn, module_ids=set(self.policies),
                                                          env_runner_index=self.worker_index, seq_lens=self.seq_lens))
        self._send(route, {"op": wire.STARTED, "id": rid, "episode_id": eid})

    def _request(self, route: bytes, conn: Conn, rid: int, eid: str, h: dict, final: bool
                 ) -> tuple[Running, tuple] | None:
        """An ma_act's or ma_end's agent lists and its episode; None when refused (the reply is sent)."""
        parsed = self._parse(h, final)
        running = conn.ma_episodes.get(eid)
        if running is None:
            self._send(route, wire.error(rid, wire.UNKNOWN_EPISODE, f"multi-agent episode {eid!r} was not started "
                                         f"on this connection (or has ended); send 'ma_start' first"))
        elif running.in_flight:
            self._send(route, wire.error(rid, wire.TOO_MANY_REQUESTS, f"episode {eid!r} waits for the actions of "
                                         f"its last ma_act; one ma_act per episode at a time"))
            return None
        return None if running is None else (running, parsed)

    def _act(self, route: bytes, conn: Conn, rid: int, eid: str, h: dict) -> None:
        got = self._request(route, conn, rid, eid, h, final=False)
        if got is None:
            return
        running, (agents, obs, rewards, term, trunc, _) = got
        if running.episode.is_done:
            self._send(route, wire.error(rid, wire.UNKNOWN_EPISODE, f"every agent of episode {eid!r} is done; "
                                         f"end it with 'ma_end'"))
            return
        if self._refuse_in_flight(route, conn, rid):
            return
        if self.intake.pending_steps >= self.x.max_pending_steps:
            self._send(route, wire.error(rid, wire.BUSY, f"the server holds {self.intake.pending_steps} env steps "
                                         f"not yet trained on; send this ma_act again later"))
            return
        rows, modules = self._check(conn, running, agents, obs, rewards, term + trunc)
        self._record(running, dict(zip(agents, rows)), rewards, term, trunc, whole=None)
        acting = [i for i, aid in enumerate(agents) if aid not in running.done]
        if not acting:
            self._send(route, {"op": wire.MA_ACTION, "id": rid, "weights_version": self.policy.weights_version,
                               "agents": [], "actions": []})
            return
        running.in_flight = True
        conn.last_seen = time.monotonic()
        self._queue(conn, _MaAct(route, rid, eid, running, [agents[i] for i in acting], [modules[i] for i in acting],
                                 [rows[i] for i in acting], bool(h.get("explore", self.s.explore))))

    def _end(self, route: bytes, conn: Conn, rid: int, eid: str, h: dict) -> None:
        got = self._request(route, conn, rid, eid, h, final=True)
        if got is None:
            return
        running, (agents, obs, rewards, term, trunc, whole) = got
        ep = running.episode
        if ep.agent_ids and not ep.is_done:  # a started episode ends with this step
            rows, _ = self._check(conn, running, agents, obs, rewards, term + trunc)
            self._record(running, dict(zip(agents, rows)), rewards, term, trunc, whole=whole or "truncated")
        del conn.ma_episodes[eid]
        self._send(route, {"op": wire.ENDED, "id": rid, "episode_id": eid})

    def _parse(self, h: dict, final: bool) -> tuple[list, list, dict, list, list, str | None]:
        """The agent lists of an ma_act/ma_end (wire rules, then agent ids); ``whole``: "terminated" or
        "truncated" when ``"__all__"`` is in that list (ma_end)."""
        limit = self.x.max_agents
        raw_agents, obs = h.get("agents", []), h.get("obs", [])
        if not isinstance(raw_agents, list) or not isinstance(obs, list) or len(raw_agents) != len(obs):
            raise ProtocolError(f"{h['op']!r} needs 'agents' and 'obs', two lists of the same length (one "
                                f"observation per agent)")
        if not final and not raw_agents:
            raise ProtocolError("'ma_act' needs at least one agent in 'agents'")
        agents = agent_ids(raw_agents, limit)
        rewards = reward_pairs(h.get("rewards", []), limit)
        term, all_term = done_flags(h.get("terminated", []), limit, "terminated", allow_all=final)
        trunc, all_trunc = done_flags(h.get("truncated", []), limit, "truncated", allow_all=final)
        whole = "terminated" if all_term else "truncated" if all_trunc else None
        return agents, obs, rewards, term, trunc, whole

    def _check(self, conn: Conn, running: Running, agents: list, obs: list, rewards: dict, flagged: list
               ) -> tuple[list, list]:
        """Every refusal before anything is recorded; returns each agent's observation row and module."""
        ep = running.episode
        known = {str(a): a for a in ep.agent_ids}
        for aid in agents:
            other = known.get(str(aid), aid)
            if other != aid or type(other) is not type(aid):
                raise AgentError(wire.BAD_AGENT, aid, f"agent {aid!r} has the str() of agent {other!r} of this "
                                 f"episode, which chunks carry: give them distinct ids")
            if aid in running.done:
                raise AgentError(wire.UNKNOWN_AGENT, aid, f"observation for agent {aid!r}, which is done")
        joining = [aid for aid in agents if aid not in known.values()]
        if len(known) + len(joining) > self.x.max_agents:
            raise AgentError(wire.TOO_MANY_AGENTS, joining[-1], f"with agent {joining[-1]!r} the episode would hold "
                             f"{len(known) + len(joining)} agents; limits.max_agents = {self.x.max_agents}",
                             limit=self.x.max_agents)
        if joining:
            self._check_room(conn, joining)
        started = bool(known)
        for what, names in (("reward", list(rewards)), ("done flag", flagged)):
            for aid in names:
                if aid not in running.acted and not (what == "done flag" and started and aid in agents):
                    why = "is done already" if aid in running.done else "has not acted in this episode"
                    raise AgentError(wire.UNKNOWN_AGENT, aid, f"{what} for agent {aid!r}, which {why}; give "
                                     f"rewards and flags to agents that acted since their last observation")
        rows, modules = [], []
        for aid, o in zip(agents, obs):
            try:
                mid = ep.module_for(aid)
            except Exception as err:  # noqa: BLE001 - the user's mapping fn: its failure is this agent's refusal
                raise AgentError(wire.UNKNOWN_AGENT, aid, f"the run's policy_mapping_fn maps agent {aid!r} to no "
                                 f"module ({type(err).__name__}: {err})") from None
            try:
                rows.append(self.schemas[mid].observation_row(o, self._finite))
            except BadValue as err:
                raise _with_agent(err, aid, mid) from None
            except ProtocolError as err:
                raise AgentError(wire.BAD_OBSERVATION, aid, f"agent {aid!r} (module {mid!r}): {err}") from None
            modules.append(mid)
        return rows, modules

    def _check_room(self, conn: Conn, joining: list) -> None:
        """A hostile client must not fill the server's memory with open episodes: each agent of a connection's
        episodes may hold up to ``fragment_length`` steps before a cut hands them on, and all of them
        together at most ``max_pending_steps`` (agents join only while there is room; running episodes
        always go on, so the limit cannot stall a client)."""
        per_agent = self.x.fragment_length
        held = per_agent * sum(len(r.episode.agent_ids) for r in conn.ma_episodes.values())
        if held + per_agent * len(joining) > self.x.max_pending_steps:
            raise AgentError(wire.TOO_MANY_AGENTS, joining[0], f"agent {joining[0]!r} may not join: this "
                             f"connection's episodes hold {held // per_agent} agents, each up to fragment_length = "
                             f"{per_agent} steps, and max_pending_steps = {self.x.max_pending_steps} bounds them "
                             f"together; end episodes first", limit=self.x.max_pending_steps // per_agent)

    def _record(self, running: Running, obs: dict, rewards: dict, term: list, trunc: list,
                whole: str | None) -> None:
        """One env step into the episode (its first: the reset), cutting chunks as they are due."""
        ep = running.episode
        if not ep.agent_ids:
            ep.add_reset(obs)
        else:
            terms = dict.fromkeys(term, True)
            truncs = dict.fromkeys(trunc, True)
            if whole is not None:
                (terms if whole == "terminated" else truncs)[ALL] = True
            ep.add_step(obs, rewards, terms, truncs)
            finished = set(term) | set(trunc) if whole is None else set(running.acted) | set(obs)
            running.done |= finished
            running.acted -= finished
            if not ep.is_done and ep.env_steps() - running.cut_at >= self.x.fragment_length:
                ep.cut()
                running.cut_at = ep.env_steps()
        self._hand_on(running)

    def _hand_on(self, running: Running) -> None:
        ep = running.episode
        chunks = [c for cs in ep.take_chunks().values() for c in cs]
        if chunks:
            # the env steps since the last hand-on travel with its first chunk: a sample counts them once
            self._env_steps_of[(chunks[0].episode_id, chunks[0].chunk_index)] = ep.env_steps() - running.counted
            running.counted = ep.env_steps()
            if len(self._env_steps_of) > MAX_STEP_COUNTS:  # those of chunks dropped as stale are never asked for
                self._env_steps_of.popitem(last=False)
            self.intake.add_recorded(chunks)
        if ep.is_done and not running.reported:
            running.reported = True
            self.on_episode_end(ep)

    def env_steps_of(self, chunks: list[EpisodeChunk]) -> int:
        """The env steps ``chunks`` (handed on to training) bring: those of every agent together, counted once."""
        pop = self._env_steps_of.pop
        return sum(pop((c.episode_id, c.chunk_index), 0) for c in chunks)

    # --- forward passes ---------------------------------------------------------------------------
    def infer(self) -> None:
        """One forward pass per module over the queued requests' agents (``max_batch`` rows at most)."""
        acts: list[_MaAct] = self._next_batch()
        try:
            answers = self._forward_modules(acts)
        except Exception as err:  # noqa: BLE001 - a bug here must not stop serving every client
            self._failed(acts, err)
            return
        n = sum(len(a.obs) for a in acts)
        self._counts["num_actions_served"] += n
        self._counts["num_inference_batches"] += 1
        for a, (version, env_actions, module_actions, extras, states) in zip(acts, answers):
            conn = self._conns.get(a.route)
            if conn is not None:
                conn.in_flight -= 1
            a.running.in_flight = False
            try:
                ep = a.running.episode
                ep.weights_version = version
                ep.add_actions(dict(zip(a.agents, module_actions)), dict(zip(a.agents, extras)))
            except Exception as err:  # noqa: BLE001 - one episode's failure is not every client's
                if conn is not None:
                    self._broken(a.route, conn, a.rid, a.eid, err)
                continue
            a.running.acted.update(a.agents)
            a.running.states.update((aid, st) for aid, st in zip(a.agents, states) if st is not None)
            self._send(a.route, {"op": wire.MA_ACTION, "id": a.rid, "weights_version": version,
                                 "agents": a.agents, "actions": env_actions})

    def _forward_modules(self, acts: list[_MaAct]) -> list[tuple[int, list, list, list, list]]:
        """Per request: (weights version, env actions, module actions, extras, each agent's next state: None for
        a stateless module), one pass per module; a recurrent module's rows act from their agents' states, and
        the state each acted from goes into its extras (``state_in``: a chunk's learner unrolls from it)."""
        slots: dict[str, list[tuple[int, int]]] = {}  # module -> (request, agent) positions, in order
        for i, a in enumerate(acts):
            for k, mid in enumerate(a.modules):
                slots.setdefault(mid, []).append((i, k))
        versions = [0] * len(acts)  # modules share the run's version (set_weights sets them together)
        env_out, module_out, extra_out, state_out = ([[None] * len(a.agents) for a in acts] for _ in range(4))
        for mid, where in slots.items():
            policy = self.policies[mid]
            rows = [acts[i].obs[k] for i, k in where]
            obs = np.stack(rows) if isinstance(rows[0], np.ndarray) else nested.stack(rows)
            explore = [acts[i].explore for i, _ in where]
            states = None
            if policy.state_shape is None:
                actions, logp, dists, version = policy.forward(obs, explore, {})
            else:
                zeros = np.zeros(policy.state_shape, np.float32)
                states = np.stack([acts[i].running.states.get(acts[i].agents[k], zeros) for i, k in where])
                actions, logp, dists, version, after = policy.forward_recurrent(obs, explore, states)
            env_actions = policy.env_actions(actions).tolist()
            policy.num_env_steps_served += len(where)
            for j, (i, k) in enumerate(where):
                versions[i] = version
                env_out[i][k], module_out[i][k] = env_actions[j], actions[j]
                extra_out[i][k] = {"action_logp": np.float32(logp[j]), "action_dist_inputs": dists[j]}
                if states is not None:
                    extra_out[i][k][STATE_COLUMN] = states[j]
                    state_out[i][k] = after[j]
        return list(zip(versions, env_out, module_out, extra_out, state_out))

    def _failed(self, acts: list, err: Exception) -> None:
        """The forward pass raised: the requests get ``server_error`` and their episodes are forgotten (their
        agents observed and could not act: the episode cannot go on)."""
        super()._failed(acts, err)
        for a in acts:
            conn = self._conns.get(a.route)
            if conn is not None:
                for eid, running in list(conn.ma_episodes.items()):
                    if running is a.running:
                        del conn.ma_episodes[eid]


def _with_agent(err: BadValue, agent_id: Any, module_id: str) -> BadValue:
    """``err`` with the agent named in its message and as its ``agent_id``."""
    out = BadValue(err.field, f"agent {agent_id!r} (module {module_id!r}): {err}")
    out.agent_id = agent_id
    return out

