"""MultiAgentEpisode: one multi-agent env episode, recorded as per-agent episode chunks.

A multi-agent env speaks in dicts keyed by agent id (RLlib's new-stack ``MultiAgentEnv``):
``reset()`` gives observations for the agents that act first, ``step(actions)`` gives
observations, rewards, terminateds, truncateds and infos, with ``"__all__"`` in the two flag
dicts. Only agents with an observation act next, so agents may act together, in turns, join
late or finish early. This recorder turns that stream into what every stage already handles:
one ``EpisodeBuilder`` per agent, cut into ``EpisodeChunk``s tagged with ``agent_id`` (as a str,
the wire's type) and ``module_id``, handed out grouped per module so a learner batches per
module. A single-agent run is the case of one agent mapped to ``default_policy``.

Each agent goes round a cycle: it *observes* (``agents_to_act()`` lists it), it *acts*
(``add_actions``), and its step completes when its next observation arrives, possibly several
env steps later. How the awkward cases go, as RLlib's ``MultiAgentEpisode`` does them:

- Rewards an agent receives between its action and its next observation add up onto that step's
  reward (RLlib keeps them as "hanging" rewards until the next observation). Rewards for an agent
  before its first observation belong to no step; they are kept in ``rewards_before_first_obs``
  and count in no return (RLlib drops them too).
- ``policy_mapping_fn(agent_id, episode)`` is called once per agent per episode, at its first
  observation (or on the first ``module_for`` call); the module stays for the whole episode.
- An agent terminated or truncated before ``"__all__"`` is closed at once: its last chunk is
  ready while the others play on. An agent that receives its first observation already done
  never acted and leaves no trace.
- An agent that is done without a final observation (the env omitted it, or ``"__all__"`` ended
  the episode while the agent waited for its turn) gets its last observation repeated as the
  final row. RLlib raises for the truncated case (the bug behind mobile-env PR#68); here a
  truncated agent is recorded ``truncated=True`` on the repeated observation, so bootstrapping
  uses the value of the last state the agent saw instead of crashing the run.
- Terminated and truncated at once: terminated wins, as in the single-agent runner.

Per-agent chunks have their own episode ids, ``"<episode id>.<n>"`` for the n-th agent to join,
so that everything keyed by ``(episode_id, chunk_index)`` (replay, recorder, resend dedup) keeps
each agent's chunks apart.

Each agent's rows live in its ``AgentRecord`` (``protocols.agent_record``), with the observations before
its chunk that an episode made with ``look_back`` (module id -> rows, for modules whose env-to-module
pipeline has a view such as frame stacking) gives its chunks. What the episode refuses is checked in
``protocols.multi_agent_episode_checks``.
"""
from __future__ import annotations

from collections.abc import Callable, Collection, Mapping, Sequence
from typing import Any

from protocols.agent_record import AgentID, AgentRecord
from protocols.episode import EpisodeChunk, new_episode_id
from protocols.multi_agent_episode_checks import (ALL, agent_flags, check_actions, check_extras, check_joining,
                                                  check_look_back, check_reset, check_running,
                                                  check_step, mapped_module, plain_step)

DEFAULT_MODULE_ID = "default_policy"


def map_to_default_module(agent_id: AgentID, episode: "MultiAgentEpisode") -> str:
    """The mapping when none is given: every agent acts with ``default_policy``."""
    return DEFAULT_MODULE_ID


class MultiAgentEpisode:
    """Records one episode of one multi-agent env and cuts it into per-agent chunks.

    Usage (an env runner's loop)::

        ep = MultiAgentEpisode(policy_mapping_fn, module_ids={"p0", "p1"})
        ep.add_reset(*env.reset())
        while not ep.is_done:
            obs_by_module = ep.observations_to_act()      # one forward pass per module
            ep.add_actions(actions, extras)               # {agent: action}, {agent: {"action_logp": ...}}
            ep.add_step(*env.step(actions))
            if fragment_full:
                ep.cut()                                  # close every agent's open steps
            send(ep.take_chunks())                        # {module_id: [EpisodeChunk, ...]}
    """

    def __init__(self, policy_mapping_fn: Callable[[AgentID, "MultiAgentEpisode"], str] | None = None, *,
                 module_ids: Collection[str] | None = None, episode_id: str | None = None,
                 env_runner_index: int = 0, env_index: int = 0, weights_version: int = 0,
                 record_infos: bool = False, look_back: Mapping[str, int] | None = None,
                 seq_lens: Mapping[str, int] | None = None) -> None:
        """``look_back``: module id -> how many recorded observations before each chunk that module's agents'
        chunks carry (a view's depth); modules absent or at 0 carry none. ``seq_lens``: recurrent module id ->
        its ``max_seq_len`` (its agents' actions carry a ``state_in`` column, and their chunks are cut into
        sequences of at most that many steps, each with its start state)."""
        self.seq_lens = dict(seq_lens or {})
        check_look_back(look_back or {})
        self.look_back = {m: int(n) for m, n in (look_back or {}).items() if n}
        self.id_ = episode_id or new_episode_id()
        self.policy_mapping_fn = policy_mapping_fn or map_to_default_module
        self.module_ids = frozenset(module_ids) if module_ids is not None else None
        """The modules that exist; a mapping to any other id raises (None: any str is accepted)."""
        # what every agent's chunks carry besides their own ids
        self.env_runner_index, self.env_index, self.record_infos = env_runner_index, env_index, record_infos
        self.weights_version = weights_version
        """Stamped on the chunks cut from now on; the runner sets it when new weights arrive."""
        self.is_terminated = self.is_truncated = False
        self.custom_data: dict[str, Any] = {}
        """Free room for callbacks (RLlib's ``episode.custom_data``)."""
        self.rewards_before_first_obs: dict[AgentID, float] = {}
        """Rewards of agents that had not observed yet: no step to credit them to (RLlib drops them too)."""
        self._agents: dict[AgentID, AgentRecord] = {}
        self._modules: dict[AgentID, str] = {}  # mapped once per agent per episode
        self._wire_ids: dict[str, AgentID] = {}  # str(agent id) -> agent id: two ids must not print alike
        self._chunks: list[EpisodeChunk] = []  # cut and not yet taken
        self._started = False
        self._env_steps = 0
        self._agent_steps = 0
        self._module_steps: dict[str, int] = {}
        self._ready = 0  # agents holding an observation they have not acted on
        self._playing: set[AgentID] = set()  # agents joined and not done
        self.plain_steps = True
        """Record the commonest step (every observing agent paid, nobody else) in one pass; False: the
        general recording, which gives the same chunks (tests compare the two)."""

    # --- what the episode is and holds ------------------------------------------------------
    @property
    def is_done(self) -> bool:
        return self.is_terminated or self.is_truncated

    @property
    def agent_ids(self) -> list[AgentID]:
        """Agents that joined, in the order they did."""
        return list(self._agents)

    @property
    def agent_episode_ids(self) -> dict[AgentID, str]:
        """The episode id each agent's chunks carry."""
        return {aid: a.episode_id for aid, a in self._agents.items()}

    def module_for(self, agent_id: AgentID) -> str:
        """The module ``agent_id`` acts with: ``policy_mapping_fn`` asked once, then remembered."""
        module_id = self._modules.get(agent_id)
        if module_id is None:
            module_id = mapped_module(self.policy_mapping_fn, agent_id, self, self.module_ids)
            self._modules[agent_id] = module_id
        return module_id

    def agents_to_act(self) -> list[AgentID]:
        """Agents holding an observation they have not acted on (in the order they got it)."""
        return [aid for aid, a in self._agents.items() if a.ready]

    get_agents_to_act = agents_to_act  # RLlib's name, for callbacks written against it

    def waiting_rows(self) -> list[tuple[str, AgentID, Any]]:
        """``(module id, agent id, observation)`` of each agent to act, in the order they got it: what a
        sampler gathers from many episodes into one batch per module."""
        return [(a.module_id, aid, a.last_obs) for aid, a in self._agents.items() if a.ready]

    def recent_rows(self, agent_id: AgentID) -> list[Any]:
        """The agent's newest recorded observation and, before it, as many earlier ones as its module's
        ``look_back`` (oldest first; its first observation repeated before its first step): what a view
        builds the agent's acting input from, and what its chunks let a learner rebuild."""
        return self._agents[agent_id].recent_rows()

    def observations_to_act(self) -> dict[str, dict[AgentID, Any]]:
        """The observations waiting for an action, grouped by module: one forward pass each."""
        out: dict[str, dict[AgentID, Any]] = {}
        for aid, a in self._agents.items():
            if a.ready:
                out.setdefault(a.module_id, {})[aid] = a.last_obs
        return out

    def env_steps(self) -> int:
        """``step()`` calls recorded (RLlib's ``episode.env_steps()``)."""
        return self._env_steps

    def agent_steps(self) -> int:
        """Actions taken, by all agents together (RLlib's ``episode.agent_steps()``)."""
        return self._agent_steps

    def __len__(self) -> int:
        return self._env_steps

    @property
    def module_steps(self) -> dict[str, int]:
        """Actions taken per module."""
        return dict(self._module_steps)

    @property
    def agent_returns(self) -> dict[AgentID, float]:
        """Each agent's rewards so far (those awaiting its next observation included)."""
        return {aid: a.ret for aid, a in self._agents.items()}

    @property
    def module_returns(self) -> dict[str, float]:
        """The returns of the agents mapped to each module, summed per module."""
        out: dict[str, float] = {}
        for a in self._agents.values():
            out[a.module_id] = out.get(a.module_id, 0.0) + a.ret
        return out

    def get_return(self) -> float:
        """The episode's return: every agent's rewards summed."""
        return sum(a.ret for a in self._agents.values())

    def return_metrics(self) -> dict[str, float]:
        """This episode's per-agent and per-module returns under RLlib's result keys (less the
        ``env_runners/`` prefix), to be averaged over episodes; the episode return and length go
        through the usual episode statistics."""
        out = {f"agent_episode_returns_mean/{aid}": a.ret for aid, a in self._agents.items()}
        out.update({f"module_episode_returns_mean/{m}": r for m, r in self.module_returns.items()})
        return out

    # --- recording --------------------------------------------------------------------------
    def add_reset(self, obs: Mapping[AgentID, Any], infos: Mapping[AgentID, dict] | None = None) -> None:
        """The env's ``reset()``: every agent with an observation joins and is to act."""
        check_reset(obs, self.id_, self._started)
        check_joining(list(obs), self._wire_ids, self.module_for)
        self._started = True
        infos = infos or {}
        for aid, o in obs.items():
            self._join(aid, o, infos.get(aid))

    def add_actions(self, actions: Mapping[AgentID, Any],
                    extras: Mapping[AgentID, Mapping[str, Any]] | None = None) -> None:
        """Actions (and the policy outputs per agent: ``action_logp``, ``action_dist_inputs``,
        ``vf_preds``...) for agents in ``agents_to_act()``; may come in parts, e.g. one per module."""
        check_running("add_actions", self.id_, self._started, self.is_done)
        extras = extras or {}
        check_extras(actions, extras)
        rows = [(tuple(e), tuple(e.values())) for e in (extras.get(aid, {}) for aid in actions)]
        self._add_actions(list(actions), list(actions.values()), rows)

    def add_action_rows(self, agent_ids: list[AgentID], actions: list[Any], keys: tuple[str, ...],
                        rows: list[tuple]) -> None:
        """``add_actions`` for a batch: ``agent_ids[j]`` took ``actions[j]`` with the policy outputs
        ``rows[j]`` (values under ``keys``, the same for every agent). What a sampler that holds a
        forward pass's outputs as columns passes without a dict per agent."""
        check_running("add_actions", self.id_, self._started, self.is_done)
        self._add_actions(agent_ids, actions, [(keys, row) for row in rows])

    def _add_actions(self, agent_ids: list[AgentID], actions: list[Any], extras: list[tuple[tuple, tuple]]) -> None:
        agents = self._agents
        check_actions(agent_ids, extras, agents, self.agents_to_act)  # everything before changing anything
        module_steps = self._module_steps
        for aid, action, (keys, row) in zip(agent_ids, actions, extras):
            a = agents[aid]
            if keys != a.extra_keys:
                if a.extra_keys is None:
                    a.extra_keys = keys
                else:  # the same keys in another order
                    order = {k: i for i, k in enumerate(keys)}
                    row = tuple(row[order[k]] for k in a.extra_keys)
            a.actions.append(action)
            a.extra_rows.append(row)
            a.ready = False
            module_steps[a.module_id] = module_steps.get(a.module_id, 0) + 1
        self._ready -= len(agent_ids)
        self._agent_steps += len(agent_ids)

    def add_step(self, obs: Mapping[AgentID, Any], rewards: Mapping[AgentID, float],
                 terminateds: Mapping[AgentID, bool], truncateds: Mapping[AgentID, bool],
                 infos: Mapping[AgentID, dict] | None = None) -> None:
        """The env's ``step()`` result. Agents that got an observation complete their step (or join);
        agents done without one are closed on their last observation."""
        if not self._started or self.is_terminated or self.is_truncated:
            check_running("add_step", self.id_, self._started, self.is_done)
        agents = self._agents
        if self._ready:
            raise ValueError(f"add_step while agents {self.agents_to_act()} have not acted on their observations: "
                             "give every agent in agents_to_act() an action (add_actions) before stepping the env")
        if plain_step(obs, rewards, terminateds, truncateds, self._playing):
            self._env_steps += 1
            # the commonest step, every agent that observes paid and nobody else, in one pass (no rewards loop)
            one_pass = self.plain_steps and not self.record_infos and rewards.keys() == obs.keys()
            if not one_pass:
                for aid, r in rewards.items():
                    a = agents[aid]
                    a.pending_reward += r
                    a.ret += r
            if self.record_infos:
                infos = infos or {}
                for aid, o in obs.items():
                    self._complete(agents[aid], o, infos.get(aid), False, False)
                return
            for aid, o in obs.items():  # _complete's common case inline: a step of a running agent
                a = agents[aid]
                if one_pass:
                    r = rewards[aid]
                    a.ret += r
                    a.rewards.append(a.pending_reward + r)
                else:
                    a.rewards.append(a.pending_reward)
                a.obs.append(o)
                a.pending_reward, a.last_obs, a.ready = 0.0, o, True
                if a.last_info:
                    a.last_info = {}
            self._ready += len(obs)
            return
        all_term = bool(terminateds.get(ALL, False))
        all_trunc = bool(truncateds.get(ALL, False)) and not all_term
        joining = [aid for aid in obs if aid not in agents]
        if joining:
            joining = [aid for aid in joining
                       if not any(agent_flags(aid, terminateds, truncateds, all_term, all_trunc))]
        check_step(obs, rewards, agents, self.id_)
        check_joining(joining, self._wire_ids, self.module_for)
        infos = infos or {}
        self._env_steps += 1
        for aid, r in rewards.items():
            a = agents.get(aid)
            if a is None:
                self.rewards_before_first_obs[aid] = self.rewards_before_first_obs.get(aid, 0.0) + float(r)
            elif not a.done:
                r = float(r)
                a.pending_reward += r
                a.ret += r
        any_flag = all_term or all_trunc or any(terminateds.values()) or any(truncateds.values())
        for aid, o in obs.items():
            term, trunc = (agent_flags(aid, terminateds, truncateds, all_term, all_trunc) if any_flag
                           else (False, False))
            a = agents.get(aid)
            if a is not None:
                self._complete(a, o, infos.get(aid), term, trunc)
            elif not (term or trunc):  # joined and done at once: never acted, nothing to record
                self._join(aid, o, infos.get(aid))
        if any_flag:  # without a flag set, an agent without an observation waits for its turn
            for aid, a in agents.items():
                if a.done or aid in obs:
                    continue
                term, trunc = agent_flags(aid, terminateds, truncateds, all_term, all_trunc)
                if term or trunc:  # done without a final observation: repeat the last one
                    self._complete(a, a.last_obs, infos.get(aid, a.last_info), term, trunc)
        if all_term or all_trunc:
            self.is_terminated, self.is_truncated = all_term, all_trunc
        elif any_flag and self._agents and all(a.done for a in self._agents.values()):
            # every agent finished though the env did not say "__all__": nobody is left to act
            self.is_truncated = all(a.truncated for a in self._agents.values())
            self.is_terminated = not self.is_truncated

    def cut(self) -> None:
        """Close every running agent's steps since the last cut into a chunk (a fragment ends).

        An agent's next chunk starts from the last observation of this one and continues its
        ``chunk_index``; an action still waiting for its next observation goes into that chunk.
        """
        for a in self._agents.values():
            if not a.done:
                self._emit(a)

    def take_chunks(self) -> dict[str, list[EpisodeChunk]]:
        """The chunks cut so far (by ``cut``, by agents finishing), grouped per module, and forget them."""
        out: dict[str, list[EpisodeChunk]] = {}
        for chunk in self._chunks:
            out.setdefault(chunk.module_id or DEFAULT_MODULE_ID, []).append(chunk)
        self._chunks = []
        return out

    # --- internals --------------------------------------------------------------------------
    def _join(self, aid: AgentID, obs: Any, info: dict | None) -> None:
        module_id = self.module_for(aid)
        a = AgentRecord.joined(aid, module_id, f"{self.id_}.{len(self._agents)}", obs, info,
                               self.look_back.get(module_id, 0), self.record_infos)
        a.seq_len = self.seq_lens.get(module_id)
        self._wire_ids[str(aid)] = aid
        self._agents[aid] = a
        self._ready += 1
        self._playing.add(aid)

    def _complete(self, a: AgentRecord, obs: Any, info: dict | None, term: bool, trunc: bool) -> None:
        """The agent's pending action gets its next observation: one step recorded."""
        a.record_step(obs, info, self.record_infos)
        if term or trunc:
            a.done, a.truncated = True, trunc
            self._playing.discard(a.agent_id)
            self._emit(a)
        else:
            a.ready = True
            self._ready += 1

    def _emit(self, a: AgentRecord) -> None:
        self._chunks.extend(a.cut(self.weights_version, self.env_runner_index, self.env_index))


def add_action_batch(episodes: Sequence[MultiAgentEpisode], who: Sequence[tuple[int, AgentID]], actions: Sequence[Any],
                     keys: tuple[str, ...], rows: Sequence[tuple]) -> bool:
    """``add_action_rows`` for one batch of agents of many episodes (a sampler's forward pass): agent
    ``who[j] = (episode index, agent id)`` took ``actions[j]`` with the outputs ``rows[j]``. Only the common
    case, every agent running, to act and with these ``keys`` (or none yet), each episode taking
    ``plain_steps``: then recorded in one pass over the batch, and True; otherwise nothing is recorded and
    False says to give each episode its rows (``add_action_rows``, which names what is wrong)."""
    records = []
    for i, aid in who:  # everything checked before anything changes, as add_action_rows does
        ep = episodes[i]
        a = ep._agents.get(aid)
        if (a is None or not a.ready or (a.extra_keys is not None and a.extra_keys != keys) or not ep.plain_steps
                or not ep._started or ep.is_terminated or ep.is_truncated):
            return False
        records.append((ep, a))
    for (ep, a), action, row in zip(records, actions, rows):
        a.actions.append(action)
        a.extra_rows.append(row)
        a.ready = False
        if a.extra_keys is None:
            a.extra_keys = keys
        module_steps = ep._module_steps
        module_steps[a.module_id] = module_steps.get(a.module_id, 0) + 1
        ep._ready -= 1
        ep._agent_steps += 1
    return True
