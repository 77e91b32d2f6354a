"""MultiAgentEpisode: multi-agent step dicts -> per-agent chunks tagged with agent and module ids.

Covers simultaneous and turn-based agents, rewards for waiting agents, early finishers, late
joiners, agents done without a final observation, cuts at fragment boundaries, the module
mapping, the counters and returns, the codec round trip, and the errors for misuse.
"""
from __future__ import annotations

import numpy as np
import pytest

from protocols.codec import decode_chunks, encode
from protocols.episode import EpisodeBuilder, EpisodeChunk
from protocols.multi_agent_episode import DEFAULT_MODULE_ID, MultiAgentEpisode
from protocols.multi_agent_episode_checks import MappingError


def ob(agent: int, t: int) -> np.ndarray:
    """An observation that says whose it is and when it was made."""
    return np.array([agent, t], np.float32)


def extra(v: float) -> dict:
    return {"action_logp": np.float32(-v), "vf_preds": np.float32(v)}


def all_flags(done: bool = False) -> dict:
    return {"__all__": done}


def one_chunk(chunks: dict, module: str, agent: str) -> EpisodeChunk:
    found = [c for c in chunks.get(module, []) if c.agent_id == agent]
    assert len(found) == 1, (module, agent, chunks)
    return found[0]


def test_two_agents_acting_together():
    ep = MultiAgentEpisode(lambda aid, episode: f"p{aid}", module_ids={"p0", "p1"}, env_index=3,
                           env_runner_index=2, weights_version=4)
    ep.add_reset({0: ob(0, 0), 1: ob(1, 0)})
    for t in range(1, 4):
        assert ep.agents_to_act() == [0, 1]
        ep.add_actions({0: np.int64(t), 1: np.int64(10 + t)}, {0: extra(t), 1: extra(10 + t)})
        ep.add_step({0: ob(0, t), 1: ob(1, t)}, {0: 1.0, 1: 2.0 * t}, all_flags(t == 3), all_flags())
    assert ep.is_terminated and not ep.is_truncated and ep.agents_to_act() == []
    chunks = ep.take_chunks()
    assert sorted(chunks) == ["p0", "p1"]
    for agent, rewards in ((0, [1, 1, 1]), (1, [2, 4, 6])):
        c = one_chunk(chunks, f"p{agent}", str(agent)).validate()
        assert c.module_id == f"p{agent}" and c.chunk_index == 0 and c.t_started == 0
        assert np.array_equal(c.obs, np.stack([ob(agent, t) for t in range(4)]))
        assert c.actions.tolist() == [10 * agent + t for t in (1, 2, 3)]
        assert c.rewards.tolist() == rewards and c.terminated and not c.truncated
        assert c.extra["vf_preds"].tolist() == [10 * agent + t for t in (1, 2, 3)]
        assert (c.env_index, c.env_runner_index, c.weights_version) == (3, 2, 4)
    assert ep.env_steps() == len(ep) == 3 and ep.agent_steps() == 6
    assert ep.get_return() == 3 + 12
    assert ep.take_chunks() == {}


def play_turns(ep: MultiAgentEpisode) -> None:
    """X and O alternate; rewards go to both every step; the game ends with no observation."""
    ep.add_reset({"X": ob(0, 0)})
    ep.add_actions({"X": 0})
    ep.add_step({"O": ob(1, 1)}, {"X": 0.1}, all_flags(), all_flags())
    ep.add_actions({"O": 10})
    ep.add_step({"X": ob(0, 2)}, {"O": 0.2, "X": 0.3}, all_flags(), all_flags())
    ep.add_actions({"X": 1})
    ep.add_step({"O": ob(1, 3)}, {"X": 0.5, "O": 0.6}, all_flags(), all_flags())
    ep.add_actions({"O": 11})
    ep.add_step({}, {"X": -1.0, "O": 1.0}, all_flags(True), all_flags())


def test_turn_based_rewards_for_the_waiting_agent_add_up_onto_its_next_step():
    ep = MultiAgentEpisode()
    play_turns(ep)
    chunks = ep.take_chunks()[DEFAULT_MODULE_ID]
    x, o = (one_chunk({"m": chunks}, "m", a) for a in ("X", "O"))
    # X's first step: 0.1 while O thought, 0.3 when O moved; its last: 0.5, then -1 at the end
    assert x.rewards.tolist() == pytest.approx([0.4, -0.5])
    assert o.rewards.tolist() == pytest.approx([0.8, 1.0])
    assert x.actions.tolist() == [0, 1] and o.actions.tolist() == [10, 11]
    # the game ended while both waited: each keeps its last observation as the final row
    assert np.array_equal(x.obs, np.stack([ob(0, 0), ob(0, 2), ob(0, 2)]))
    assert np.array_equal(o.obs, np.stack([ob(1, 1), ob(1, 3), ob(1, 3)]))
    assert x.terminated and o.terminated
    assert ep.agent_returns == pytest.approx({"X": -0.1, "O": 1.8})
    assert ep.env_steps() == 4 and ep.agent_steps() == 4


def test_an_early_finisher_is_closed_at_once_and_stays_out():
    ep = MultiAgentEpisode()
    ep.add_reset({"a": ob(0, 0), "b": ob(1, 0)})
    ep.add_actions({"a": 0, "b": 0})
    ep.add_step({"a": ob(0, 1), "b": ob(1, 1)}, {"a": 1.0, "b": 1.0}, {"a": True, "__all__": False}, all_flags())
    done = ep.take_chunks()[DEFAULT_MODULE_ID]
    assert [(c.agent_id, c.terminated, len(c)) for c in done] == [("a", True, 1)]
    assert ep.agents_to_act() == ["b"] and not ep.is_done
    for t in (2, 3):
        ep.add_actions({"b": t})
        # a dead agent may linger in the env's dicts with a zero reward and its done flag
        ep.add_step({"b": ob(1, t)}, {"b": 1.0, "a": 0.0}, {"a": True, "__all__": False},
                    {"__all__": t == 3})
    assert ep.is_truncated and not ep.is_terminated
    (b,) = ep.take_chunks()[DEFAULT_MODULE_ID]
    assert b.agent_id == "b" and b.truncated and len(b) == 3 and b.obs.shape == (4, 2)
    assert ep.agent_returns == {"a": 1.0, "b": 3.0}


@pytest.mark.parametrize("bad", ["obs", "reward"])
def test_data_for_a_finished_agent_is_refused(bad):
    ep = MultiAgentEpisode()
    ep.add_reset({"a": ob(0, 0), "b": ob(1, 0)})
    ep.add_actions({"a": 0, "b": 0})
    ep.add_step({"a": ob(0, 1), "b": ob(1, 1)}, {}, {"a": True}, {})
    ep.add_actions({"b": 1})
    obs = {"b": ob(1, 2), **({"a": ob(0, 2)} if bad == "obs" else {})}
    with pytest.raises(ValueError, match="agent 'a', which finished earlier"):
        ep.add_step(obs, {"a": 0.5 if bad == "reward" else 0.0}, {}, {})
    assert ep.env_steps() == 1 and ep.agents_to_act() == []  # nothing of the refused step was recorded


def test_a_late_joiner_gets_its_own_builder_and_module():
    calls = []

    def mapping(aid, episode):
        calls.append(aid)
        return "late" if aid == "b" else "early"

    ep = MultiAgentEpisode(mapping)
    ep.add_reset({"a": ob(0, 0)})
    ep.add_actions({"a": 0})
    ep.add_step({"a": ob(0, 1)}, {"a": 1.0, "b": 5.0}, all_flags(), all_flags())  # b rewarded before it observes
    ep.add_actions({"a": 1})
    ep.add_step({"a": ob(0, 2), "b": ob(1, 2)}, {"a": 1.0, "b": 2.0}, all_flags(), all_flags())
    assert ep.agents_to_act() == ["a", "b"] and ep.agent_ids == ["a", "b"]
    assert ep.observations_to_act().keys() == {"early", "late"}
    ep.add_actions({"a": 2, "b": 7})
    ep.add_step({"a": ob(0, 3), "b": ob(1, 3)}, {"a": 1.0, "b": 3.0}, all_flags(True), all_flags())
    chunks = ep.take_chunks()
    b = one_chunk(chunks, "late", "b")
    assert b.t_started == 0 and b.rewards.tolist() == [3.0] and b.actions.tolist() == [7]
    assert np.array_equal(b.obs, np.stack([ob(1, 2), ob(1, 3)]))
    assert len(one_chunk(chunks, "early", "a")) == 3
    assert b.episode_id != one_chunk(chunks, "early", "a").episode_id  # (episode_id, chunk_index) stays unique
    assert ep.rewards_before_first_obs == {"b": 7.0}  # no step to credit them to, as in RLlib
    assert ep.agent_returns == {"a": 3.0, "b": 3.0}
    assert calls == ["a", "b"]  # once per agent per episode


def test_an_agent_that_joins_already_done_leaves_no_trace():
    ep = MultiAgentEpisode()
    ep.add_reset({"a": ob(0, 0)})
    ep.add_actions({"a": 0})
    ep.add_step({"a": ob(0, 1), "ghost": ob(9, 1)}, {"a": 1.0}, {"ghost": True}, {})
    assert ep.agent_ids == ["a"] and ep.agents_to_act() == ["a"]


def test_truncated_without_a_final_observation_repeats_the_last_one():
    ep = MultiAgentEpisode(record_infos=True)
    ep.add_reset({"a": ob(0, 0), "b": ob(1, 0), "c": ob(2, 0)}, {"a": {"r": 0}})
    ep.add_actions({"a": 0, "b": 0, "c": 0})
    # b is truncated on its own with no observation while the others go on
    ep.add_step({"a": ob(0, 1)}, {"a": 1.0, "b": 2.0}, {}, {"b": True}, {"b": {"why": "time"}})
    (b,) = ep.take_chunks()[DEFAULT_MODULE_ID]
    assert b.agent_id == "b" and b.truncated and not b.terminated and b.rewards.tolist() == [2.0]
    assert np.array_equal(b.obs, np.stack([ob(1, 0), ob(1, 0)]))
    assert b.infos == [{}, {"why": "time"}]
    ep.add_actions({"a": 1})
    # "__all__" truncates while a acted and c still waits: neither gets an observation
    ep.add_step({}, {"a": 0.5}, {"c": True}, {"__all__": True})
    assert ep.is_truncated and not ep.is_terminated
    chunks = ep.take_chunks()[DEFAULT_MODULE_ID]
    a, c = (one_chunk({"m": chunks}, "m", x) for x in ("a", "c"))
    assert a.truncated and not a.terminated and a.rewards.tolist() == [1.0, 0.5]
    assert np.array_equal(a.obs, np.stack([ob(0, 0), ob(0, 1), ob(0, 1)]))
    assert a.infos == [{"r": 0}, {}, {}]
    assert c.terminated and not c.truncated  # terminated and truncated at once: terminated wins
    assert np.array_equal(c.obs, np.stack([ob(2, 0), ob(2, 0)]))


def test_every_agent_done_without_all_ends_the_episode():
    ep = MultiAgentEpisode()
    ep.add_reset({"a": ob(0, 0), "b": ob(1, 0)})
    ep.add_actions({"a": 0, "b": 0})
    ep.add_step({"a": ob(0, 1), "b": ob(1, 1)}, {}, {"a": True}, {"b": True, "__all__": False})
    assert ep.is_terminated and ep.is_done
    with pytest.raises(ValueError, match="already done"):
        ep.add_actions({"a": 1})


def record_turns_with_cuts(cut_every: int | None, steps: int = 9) -> tuple[MultiAgentEpisode, list[EpisodeChunk]]:
    """Three agents: 0 acts every step, 1 every second step, 2 every third; cut every few env steps."""
    ep = MultiAgentEpisode(lambda aid, e: "even" if aid % 2 == 0 else "odd")
    ep.add_reset({0: ob(0, 0), 1: ob(1, 0), 2: ob(2, 0)})
    out: list[EpisodeChunk] = []
    for t in range(1, steps + 1):
        ep.add_actions({aid: np.int64(100 * aid + t) for aid in ep.agents_to_act()},
                       {aid: extra(t) for aid in ep.agents_to_act()})
        obs = {aid: ob(aid, t) for aid in (0, 1, 2) if t % (aid + 1) == 0}
        ep.add_step(obs, {0: 1.0, 1: 0.5, 2: 0.25}, all_flags(t == steps), all_flags())
        if cut_every and t % cut_every == 0:
            ep.weights_version = t
            ep.cut()
        for chunks in ep.take_chunks().values():
            out.extend(chunks)
    return ep, out


def test_cuts_at_fragment_boundaries_continue_each_agent():
    ep, chunks = record_turns_with_cuts(cut_every=4)
    _, whole = record_turns_with_cuts(cut_every=None)
    for agent in ("0", "1", "2"):
        mine = [c.validate() for c in chunks if c.agent_id == agent]
        assert [c.chunk_index for c in mine] == list(range(len(mine)))
        for c in mine:
            assert c.obs.shape[0] == len(c.actions) + 1
        for prev, nxt in zip(mine, mine[1:]):
            assert nxt.t_started == prev.t_started + len(prev)
            assert np.array_equal(prev.obs[-1], nxt.obs[0])
        glued = EpisodeChunk.concat(mine)
        (ref,) = [c for c in whole if c.agent_id == agent]
        for name in ("obs", "actions", "rewards"):
            assert np.array_equal(getattr(glued, name), getattr(ref, name)), (agent, name)
        assert np.array_equal(glued.extra["action_logp"], ref.extra["action_logp"])
        assert glued.terminated and ref.terminated
    by_agent = {a: [(c.chunk_index, len(c), c.weights_version) for c in chunks if c.agent_id == a] for a in "012"}
    # agent 2 acts at t=0, 3, 6: its step pending at the cut after t=4 completes at t=6, in the next chunk
    assert by_agent["0"] == [(0, 4, 4), (1, 4, 8), (2, 1, 8)]
    assert by_agent["2"] == [(0, 1, 4), (1, 1, 8), (2, 1, 8)]
    # agent 1's step completed at t=8 is cut at t=8; the last step closes at the end
    assert by_agent["1"] == [(0, 2, 4), (1, 2, 8), (2, 1, 8)]
    assert ep.agent_steps() == 9 + 5 + 3  # agent 1's last action ends on its repeated observation


def test_module_mapping_groups_chunks_per_module():
    shared = MultiAgentEpisode(lambda aid, e: "shared")
    play_turns(shared)
    chunks = shared.take_chunks()
    assert list(chunks) == ["shared"] and sorted(c.agent_id for c in chunks["shared"]) == ["O", "X"]
    assert shared.module_returns == pytest.approx({"shared": 1.7})
    assert shared.module_steps == {"shared": 4}

    own = MultiAgentEpisode(lambda aid, e: "p_" + aid)
    play_turns(own)
    chunks = own.take_chunks()
    assert {m: [c.agent_id for c in cs] for m, cs in chunks.items()} == {"p_X": ["X"], "p_O": ["O"]}
    assert own.module_returns == pytest.approx({"p_X": -0.1, "p_O": 1.8})
    assert own.return_metrics() == pytest.approx({
        "agent_episode_returns_mean/X": -0.1, "agent_episode_returns_mean/O": 1.8,
        "module_episode_returns_mean/p_X": -0.1, "module_episode_returns_mean/p_O": 1.8})


def test_bad_mappings_name_the_agent():
    ep = MultiAgentEpisode(lambda aid, e: "p9", module_ids={"p0", "p1"})
    with pytest.raises(MappingError, match=r"agent 'a' to module 'p9', which does not exist; modules: \['p0', 'p1'\]"):
        ep.add_reset({"a": ob(0, 0)})
    ep = MultiAgentEpisode(lambda aid, e: 3)
    with pytest.raises(MappingError, match="mapped agent 'a' to 3; it must return a module id"):
        ep.add_reset({"a": ob(0, 0)})
    ep = MultiAgentEpisode(lambda aid, e: {"b": "p0"}[aid])
    with pytest.raises(MappingError, match="policy_mapping_fn raised KeyError for agent 'a': 'a'"):
        ep.add_reset({"a": ob(0, 0)})
    # the user's error, which a stage group hands to the caller instead of restarting the runner
    assert issubclass(MappingError, ValueError) and MappingError.runnel_user_code


def test_one_agent_with_the_default_module_is_the_single_agent_episode():
    ep = MultiAgentEpisode(weights_version=2)
    single = EpisodeBuilder(weights_version=2)
    ep.add_reset({"agent0": ob(0, 0)})
    single.add_reset(ob(0, 0))
    for t in range(1, 6):
        ep.add_actions({"agent0": np.int64(t)}, {"agent0": extra(t)})
        ep.add_step({"agent0": ob(0, t)}, {"agent0": float(t)}, {"__all__": t == 5}, {"__all__": False})
        single.add_step(np.int64(t), float(t), ob(0, t), terminated=t == 5, extra=extra(t))
    (c,) = ep.take_chunks()[DEFAULT_MODULE_ID]
    ref = single.cut()
    assert (c.agent_id, c.module_id) == ("agent0", "default_policy")
    assert np.array_equal(c.obs, ref.obs) and np.array_equal(c.actions, ref.actions)
    assert np.array_equal(c.rewards, ref.rewards) and c.terminated == ref.terminated
    assert c.extra.keys() == ref.extra.keys() and c.weights_version == ref.weights_version


def test_chunks_round_trip_through_the_codec_with_their_ids():
    _, chunks = record_turns_with_cuts(cut_every=3)
    decoded = decode_chunks(encode(chunks))
    assert len(decoded) == len(chunks)
    for before, after in zip(chunks, decoded):
        assert isinstance(after, EpisodeChunk)
        assert (after.agent_id, after.module_id) == (before.agent_id, before.module_id)
        assert type(after.agent_id) is str and after.agent_id in {"0", "1", "2"}
        assert (after.episode_id, after.chunk_index, after.t_started) == (
            before.episode_id, before.chunk_index, before.t_started)
        assert np.array_equal(after.obs, before.obs) and np.array_equal(after.rewards, before.rewards)
        assert np.array_equal(after.extra["vf_preds"], before.extra["vf_preds"])


def started(**kw) -> MultiAgentEpisode:
    ep = MultiAgentEpisode(**kw)
    ep.add_reset({"a": ob(0, 0), "b": ob(1, 0)})
    return ep


@pytest.mark.parametrize("case, message", [
    ("unknown agent", "action for agent 'z', but it has had no observation"),
    ("acted twice", "action for agent 'a', but it already acted"),
    ("extras alone", "extras for agent 'b', which is given no action"),
    ("step before acting", r"add_step while agents \['b'\] have not acted"),
    ("extra keys change", "agent 'a': extra keys changed mid-episode"),
    ("reset twice", "add_reset called twice"),
    ("all as an agent", "'__all__', which is not an agent id"),
    ("ids alike", "agents '1' and 1 have the same str()"),
    ("reward not a number", "reward 'high' for agent 'a' is not a number"),
])
def test_misuse_is_refused_naming_the_agent(case, message):
    ep = started()
    with pytest.raises(ValueError, match=message):
        if case == "unknown agent":
            ep.add_actions({"z": 0})
        elif case == "acted twice":
            ep.add_actions({"a": 0})
            ep.add_actions({"a": 1})
        elif case == "extras alone":
            ep.add_actions({"a": 0}, {"b": extra(1)})
        elif case == "step before acting":
            ep.add_actions({"a": 0})
            ep.add_step({"a": ob(0, 1)}, {}, {}, {})
        elif case == "extra keys change":
            ep.add_actions({"a": 0, "b": 0}, {"a": extra(0)})
            ep.add_step({"a": ob(0, 1), "b": ob(1, 1)}, {}, {}, {})
            ep.add_actions({"a": 1}, {"a": {"action_logp": np.float32(0)}})
        elif case == "reset twice":
            ep.add_reset({"a": ob(0, 0)})
        elif case == "all as an agent":
            ep.add_actions({"a": 0, "b": 0})
            ep.add_step({"__all__": ob(0, 1)}, {}, {}, {})
        elif case == "ids alike":
            MultiAgentEpisode().add_reset({"1": ob(0, 0), 1: ob(1, 0)})
        elif case == "reward not a number":
            ep.add_actions({"a": 0, "b": 0})
            ep.add_step({"a": ob(0, 1)}, {"a": "high"}, {}, {})


def test_a_refused_call_changes_nothing():
    ep = started()
    with pytest.raises(ValueError, match="agent 'z'"):
        ep.add_actions({"a": 0, "z": 0})
    assert ep.agents_to_act() == ["a", "b"] and ep.agent_steps() == 0
    with pytest.raises(ValueError, match="before add_reset"):
        MultiAgentEpisode().add_step({}, {}, {}, {})
    with pytest.raises(ValueError, match="no observation for any agent"):
        MultiAgentEpisode().add_reset({})
