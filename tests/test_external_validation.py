"""Values checked at the edge and again at the learner: a client's action outside the action space,
a NaN observation or an over-long chunk gets an error reply naming the episode and the field, never
reaches training, and stops nobody else; a learner handed such a batch anyway refuses it and trains
on the next."""
from __future__ import annotations

import math
import os

import gymnasium as gym
import numpy as np
import pytest
import torch

from actors.metrics import MetricsLogger
from actors.replay import ReplayBuffer, ReplaySettings
from pipeline.algorithms.dqn.config import DQNConfig
from pipeline.algorithms.dqn.learner import DQNLearner
from pipeline.algorithms.ppo.config import PPOConfig
from pipeline.algorithms.ppo.learner import PPOLearner
from pipeline.groups.learner_group import LearnerGroup
from protocols import external as wire
from protocols.client import PolicyClient
from protocols.codec import encode
from protocols.episode import EpisodeBuilder, EpisodeChunk
from protocols.errors import ProtocolError
from protocols.schema import ChunkSchema
from protocols.space_checks import BadValue, box_rows_pass, check_values, value_spec
from protocols.spaces import space_to_dict
from tests.spec_client import Array, SpecClient, frame
from tests.test_external import ids, make_server, server  # noqa: F401 - the server fixture

CARTPOLE = gym.make("CartPole-v1")
GOOD_OBS = [0.01, -0.02, 0.03, 0.04]
S = gym.spaces


@pytest.mark.parametrize("space, value, actions, problem", [
    (S.Discrete(2), np.array([0, 1, 1]), True, None),
    (S.Discrete(2), np.array([0, 5, 9]), True, "x[1] = 5 is not in Discrete(2) (a whole number from 0 to 1)"),
    (S.Discrete(2), np.array([0.0, 1.0]), True, None),
    (S.Discrete(2), np.array([0.0, 0.5]), True, "x[1] = 0.5"),
    (S.Discrete(2), np.array(np.nan), True, "x = nan"),
    (S.Discrete(3, start=1), np.array(3), False, None),  # an observation: the space's own range
    (S.Discrete(3, start=1), np.array(3), True, "x = 3 is not in Discrete(3)"),  # an action: the policy's index
    (S.MultiDiscrete([2, 5]), np.array([[1, 4], [1, 5]]), True, "x[1, 1] = 5 is not in MultiDiscrete([2, 5]) "
                                                                  "(a whole number from 0 to 4)"),
    (S.MultiDiscrete([2, 5]), np.array([1, 4, 0]), True, "has shape (3,)"),
    (S.MultiBinary(3), np.array([0, 1, 2], np.int8), True, "x[2] = 2"),
    (S.Box(-1, 1, (2,)), np.array([[5.0, -7.0]], np.float32), True, None),  # Box bounds are not enforced
    (S.Box(-1, 1, (2,)), np.array([[0.0, np.inf]], np.float32), True, "x[0, 1] = inf is not a finite number"),
    (S.Dict({"a": S.Box(0, 1, (1,)), "b": S.Tuple([S.Discrete(2)])}), {"a": np.zeros(1), "b": (np.array(2),)},
     False, "x['b'][0] = 2"),
])
def test_space_checks(space, value, actions, problem):
    spec = value_spec(space_to_dict(space), actions)
    if problem is None:
        check_values("x", spec, value)
    else:
        with pytest.raises(BadValue) as err:
            check_values("x", spec, value)
        assert problem in str(err.value) and err.value.field.startswith("x")


def test_non_finite_observations_pass_when_allowed_and_plain_fractions_are_not_truncated():
    spec = value_spec(space_to_dict(S.Box(-1, 1, (2,))))
    check_values("obs", spec, np.array([np.nan, np.inf]), finite=False)
    schema = ChunkSchema.for_spaces(S.Discrete(4), S.Discrete(2))
    assert schema.observation_from_plain(3.0).dtype == np.int64  # a whole float is cast as before
    with pytest.raises(BadValue, match="action = 0.5"):  # once cast to int64 it read 0: a wrong action, silently
        schema.check_action_values(schema.action_from_plain(0.5))


@pytest.mark.parametrize("value", [
    [0.5, -1, 2, 0], [True, False, 1, 0.25],  # taken by the shortcut
    [0, 0, 0, math.nan], [math.inf, -math.inf, 0, 0], [1e39, 0, 0, 0], [1e308, 1e308, 0, 0],  # bad values
    ["1", 0, 0, 0], [None, 0, 0, 0], [[1], 0, 0, 0], [1, 2, 3], {"a": 1}, 3.0,  # not an observation
])
def test_the_act_paths_observation_shortcut_answers_as_the_general_checks_do(value):
    """``observation_row`` (one call on the act path) refuses and converts exactly as
    ``observation_from_plain`` followed by ``check_observation_values`` do."""
    schema = ChunkSchema.for_spaces(S.Box(-1, 1, (4,)), S.Discrete(2))

    def outcome(convert):
        try:
            row = convert()
        except BadValue as err:
            return "BadValue", str(err), err.field
        except ProtocolError as err:
            return "ProtocolError", str(err)
        return row.dtype, row.tolist()

    def general():
        row = schema.observation_from_plain(value)
        schema.check_observation_values(row)
        return row
    assert outcome(lambda: schema.observation_row(value)) == outcome(general)

def play(client: PolicyClient, steps: int = 3) -> str:
    """A short well-behaved episode through ``client``; returns its id."""
    eid = client.start_episode()
    obs = np.array(GOOD_OBS, np.float32)
    for _ in range(steps):
        assert client.get_action(eid, obs) in (0, 1)
        client.log_returns(eid, 1.0)
    client.end_episode(eid, obs)
    return eid


def chunk(eid: str, actions: list, obs: np.ndarray | None = None, index: int = 0) -> EpisodeChunk:
    """A chunk of ``len(actions)`` steps with the extras a policy server asks for."""
    steps = len(actions)
    obs = np.zeros((steps + 1, 4), np.float32) if obs is None else obs
    b = EpisodeBuilder(eid)
    b.add_reset(obs[0])
    for t, a in enumerate(actions):
        b.add_step(np.int64(a), 1.0, obs[t + 1],
                   extra={"action_logp": np.float32(-0.7), "action_dist_inputs": np.zeros(2, np.float32)})
    c = b.cut()
    c.chunk_index = index
    return c


def send(spec: SpecClient, c: EpisodeChunk) -> dict:
    return spec.request({"op": "chunks", "ids": [[c.episode_id, c.chunk_index]]}, encode([c]))[0]


@pytest.fixture
def spec(server):  # noqa: F811 - the server fixture
    client = SpecClient(server.address)
    assert client.hello()["op"] == "welcome"
    yield client
    client.close()


def test_an_action_outside_the_space_in_an_act_is_a_bad_value_and_everyone_else_is_served(server, spec):  # noqa: F811
    """The issue's first crash: a log_action of 7 for Discrete(2) used to kill the act thread."""
    assert spec.request({"op": "start", "episode_id": "e1"})[0]["op"] == "started"
    reply, _ = spec.request({"op": "act", "episode_id": "e1", "obs": GOOD_OBS, "action": 7})
    assert reply["op"] == "error" and reply["code"] == wire.BAD_VALUE and not reply["fatal"]
    assert reply["episode_id"] == "e1" and reply["field"] == "action"
    assert "'e1'" in reply["message"] and "7" in reply["message"] and "Discrete(2" in reply["message"]
    # a fraction and NaN are no actions of a Discrete space either; a batched act names the episode at fault
    for bad in (0.5, math.nan):
        assert spec.request({"op": "act", "episode_id": "e1", "obs": GOOD_OBS, "action": bad})[0]["code"] == \
            wire.BAD_VALUE
    assert spec.request({"op": "start", "episode_id": "e2"})[0]["op"] == "started"
    reply, _ = spec.request({"op": "act", "episode_ids": ["e1", "e2"], "obs": [GOOD_OBS, GOOD_OBS],
                             "action": [None, -1]})
    assert reply["code"] == wire.BAD_VALUE and reply["episode_id"] == "e2" and reply["field"] == "action"
    # the same connection goes on acting, a logged action in range is taken, and other clients are served
    assert spec.act("e1", GOOD_OBS)[0] in (0, 1)
    assert spec.request({"op": "act", "episode_id": "e1", "obs": GOOD_OBS, "action": 1})[0]["action"] == 1
    with PolicyClient(server.address, "remote", timeout_s=20) as good:
        play(good)
        assert len(server.sample(3)) == 1
        server.commit()
    assert server.error is None
    assert server.get_metrics()["external/num_bad_values"]["value"] == 4


def test_a_nan_observation_is_a_bad_value_in_the_header_and_in_a_body(server, spec):  # noqa: F811
    assert spec.request({"op": "start", "episode_id": "n"})[0]["op"] == "started"
    reply, _ = spec.request({"op": "act", "episode_id": "n", "obs": [0.0, math.nan, 0.0, 0.0]})
    assert reply["code"] == wire.BAD_VALUE and reply["episode_id"] == "n" and reply["field"] == "obs"
    assert "obs[1] = nan" in reply["message"]
    body = frame("msg", {"obs": Array([0.0, 0.0, math.inf, 0.0], [4], "<f4")})
    reply, _ = spec.request({"op": "act", "episode_id": "n"}, body)
    assert reply["code"] == wire.BAD_VALUE and reply["field"] == "obs" and "obs[2] = inf" in reply["message"]
    assert spec.act("n", GOOD_OBS)[0] in (0, 1)
    assert server.error is None


def test_a_chunk_with_actions_outside_the_space_is_refused_for_good_and_never_sampled(server, spec):  # noqa: F811
    """The issue's second crash: such a chunk was acknowledged as received, then crashed the learner."""
    bad = chunk("bad-actions", [5, 9])
    for _ in range(2):  # a copy is refused the same way: refused for good
        reply = send(spec, bad)
        assert reply["op"] == "error" and reply["code"] == wire.BAD_CHUNK and not reply["fatal"]
        assert reply["ids"] == [["bad-actions", 0]] and reply["field"] == "actions"
        assert "'bad-actions' #0" in reply["message"] and "actions[0] = 5" in reply["message"]
    good = chunk("good", [0, 1, 1])
    assert send(spec, good)["ids"] == [["good", 0]]
    assert server.chunks.pending_steps == 3  # only the good chunk is held
    assert ids(server.sample(1)) == [("good", 0)]
    assert server.chunks.pending_steps == 0
    server.commit()  # commits ("good", 0): the bad chunk is never committed either
    assert spec.wait_committed(["good", 0])
    assert not any(m["op"] == "committed" and ["bad-actions", 0] in m["ids"] for m in spec.unasked)
    assert server.get_metrics()["external/num_bad_chunks"]["value"] == 2


@pytest.mark.parametrize("where, value, field", [
    ("obs", math.nan, "obs"), ("obs", -math.inf, "obs"), ("rewards", math.nan, "rewards"),
    ("action_logp", math.inf, "extra['action_logp']"), ("action_dist_inputs", math.nan, "extra['action_dist_inputs']"),
])
def test_a_chunk_with_a_non_finite_value_is_a_bad_chunk_naming_the_field(server, spec, where, value, field):  # noqa: F811
    c = chunk(f"nonfinite-{where}", [0, 1])
    target = {"obs": c.obs, "rewards": c.rewards}.get(where)
    (c.extra[where] if target is None else target).reshape(-1)[1] = value
    reply = send(spec, c)
    assert reply["code"] == wire.BAD_CHUNK and reply["field"] == field and reply["ids"] == [[c.episode_id, 0]]
    assert server.chunks.pending_steps == 0


def test_a_chunk_longer_than_the_fragment_length_is_refused(server, spec):  # noqa: F811
    assert spec.hello()["fragment_length"] == 20
    reply = send(spec, chunk("long", [0] * 21))
    assert reply["code"] == wire.BAD_CHUNK and "fragment_length = 20" in reply["message"]
    assert send(spec, chunk("fits", [0] * 20))["ids"] == [["fits", 0]]
    assert ids(server.sample(1)) == [("fits", 0)]


def test_a_server_that_allows_non_finite_observations_says_so_and_takes_them(tmp_path):
    srv = make_server(tmp_path, allow_nonfinite_observations=True)
    spec = SpecClient(srv.address)
    try:
        assert spec.hello()["allow_nonfinite_observations"] is True
        obs = np.zeros((3, 4), np.float32)
        obs[1, 0] = np.inf
        assert send(spec, chunk("inf-obs", [0, 1], obs))["ids"] == [["inf-obs", 0]]
        assert send(spec, chunk("bad-action", [0, 2]))["code"] == wire.BAD_CHUNK  # actions are still checked
        assert ids(srv.sample(1)) == [("inf-obs", 0)]
    finally:
        spec.close()
        srv.stop()


def test_the_python_client_refuses_bad_values_before_recording_them(server):  # noqa: F811
    with PolicyClient(server.address, "remote", timeout_s=20) as client:
        eid = client.start_episode()
        obs = np.array(GOOD_OBS, np.float32)
        assert client.get_action(eid, obs) in (0, 1)
        client.log_returns(eid, 1.0)
        with pytest.raises(BadValue, match=f"episode '{eid}': obs\\[3\\] = nan") as err:
            client.get_action(eid, np.array([0.0, 0.0, 0.0, np.nan], np.float32))
        assert err.value.field == "obs"
        with pytest.raises(BadValue, match="action = 7"):
            client.log_action(eid, obs, 7)
        assert client.get_action(eid, obs) in (0, 1)  # the episode goes on as if the bad calls never happened
        client.end_episode(eid, obs)
        got = server.sample(2)
        assert ids(got) == [(eid, 0)] and len(got[0]) == 2 and np.isfinite(got[0].obs).all()
        server.commit()


def test_the_python_client_drops_a_refused_chunk_from_its_spool(server, tmp_path):  # noqa: F811
    """A chunk refused as bad_chunk is dropped (on disk too), not resent: here one a crashed process
    left in its spool directory."""
    spool = tmp_path / "spool"
    spool.mkdir()
    bad = chunk("left-behind", [3, 0])
    (spool / f"{b'left-behind'.hex()}_0.chunk").write_bytes(encode([bad], compress=True))
    client = PolicyClient(server.address, "remote", timeout_s=20, spool_dir=str(spool))
    try:
        client.flush(timeout_s=10)  # returns once the spool is empty: the refusal emptied it
        assert [key for key, _ in client.rejected] == [("left-behind", 0)]
        assert "actions[0] = 3" in client.rejected[0][1]
        assert client.unacknowledged == 0 and os.listdir(spool) == []
        eid = play(client)  # and the client goes on delivering
        assert ids(server.sample(3)) == [(eid, 0)]
        server.commit()
    finally:
        client.close(flush=False)


# --- the learner: defence in depth -------------------------------------------------------------
def ppo_learner() -> PPOLearner:
    cfg = PPOConfig(seed=0, model_config={"fcnet_hiddens": [8]}, train_batch_size_per_learner=16,
                    minibatch_size=16, num_epochs=1)
    return PPOLearner(cfg, CARTPOLE.observation_space, CARTPOLE.action_space)


def weights(learner) -> list[torch.Tensor]:
    return [p.detach().clone() for p in learner.module.parameters()]


def test_a_learner_refuses_a_batch_with_an_action_out_of_range_or_a_nan_and_trains_on_the_next(caplog):
    learner = ppo_learner()
    out_of_range = [chunk("bad", [0, 5, 1, 0])]
    with pytest.raises((RuntimeError, IndexError)):  # what the check prevents: the loss cannot gather action 5
        learner.train_on_batch(out_of_range, 0)
    nan_obs = chunk("nan", [0, 1, 1, 0])
    nan_obs.obs[2, 1] = np.nan
    before = weights(learner)
    with caplog.at_level("WARNING", logger="runnel"):
        assert learner.update(out_of_range, 0) == {"num_batches_refused": 1.0}
        assert learner.update(encode([nan_obs]), 0) == {"num_batches_refused": 1.0}  # as a remote learner gets it
    assert "chunk 'bad' #0: actions[1] = 5 is not in Discrete(2" in caplog.text
    assert "chunk 'nan' #0: obs[2, 1] = nan" in caplog.text
    assert learner.num_batches_refused == 2
    assert all(torch.equal(a, b) for a, b in zip(before, weights(learner)))
    stats = learner.update([chunk("good", [0, 1, 1, 0]), chunk("good2", [1, 1, 0, 0])], 0)
    assert "policy_loss" in stats and math.isfinite(stats["policy_loss"])
    assert not all(torch.equal(a, b) for a, b in zip(before, weights(learner)))
    assert all(torch.isfinite(p).all() for p in learner.module.parameters())


def test_a_learner_group_counts_refused_batches_and_does_not_count_them_as_updates():
    cfg = PPOConfig(seed=0, model_config={"fcnet_hiddens": [8]}, train_batch_size_per_learner=8, minibatch_size=8,
                    num_epochs=1)
    group = LearnerGroup(PPOLearner, cfg, CARTPOLE.observation_space, CARTPOLE.action_space)
    try:
        m = MetricsLogger()
        stats, _ = group.update([chunk("bad", [0, 1, 2])], 0, m)
        assert stats == {"num_batches_refused": 1.0} and group.weights_version == 0
        group.update([chunk("good", [0, 1, 1])], 0, m)
        assert group.weights_version == 1
        assert m.peek("learners/default_policy/num_batches_refused") == 1
        assert m.peek("learners/__all_modules__/num_updates") == 1
        assert m.peek("learners/__all_modules__/num_env_steps_trained_lifetime") == 3
    finally:
        group.stop()


def test_a_dqn_learner_refuses_a_replayed_batch_out_of_range_and_leaves_no_priorities():
    replay = ReplayBuffer(ReplaySettings(capacity=64, seed=0))
    replay.add([chunk(f"r{i}", [0, 1, 1, 0, 1]) for i in range(4)])
    learner = DQNLearner(DQNConfig(seed=0, model_config={"fcnet_hiddens": [8]}), CARTPOLE.observation_space,
                         CARTPOLE.action_space)
    batch = replay.sample(8)
    bad = {**batch, "actions": batch["actions"].copy()}
    bad["actions"][3] = 2
    stats, outputs = learner.update_with_outputs(bad, 0)
    assert stats == {"num_batches_refused": 1.0} and outputs == {}
    nan = {**batch, "rewards": batch["rewards"].copy()}
    nan["rewards"][0] = np.nan
    assert learner.update_with_outputs(nan, 0) == ({"num_batches_refused": 1.0}, {})
    stats, outputs = learner.update_with_outputs(batch, 0)
    assert "num_batches_refused" not in stats and outputs["td_error"].shape == (8,)


def test_a_batched_act_is_checked_in_one_pass_and_a_bad_row_is_still_named():
    schema = ChunkSchema.for_spaces(S.Box(-1, 1, (4,)), S.Discrete(2))
    rows = schema.observation_rows([[0.5, -1, 2, 0], [True, False, 1, 0.25]])
    assert rows.dtype == np.float32 and rows.tolist() == [[0.5, -1, 2, 0], [1, 0, 1, 0.25]]
    for bad in ([[0, 0, 0, math.nan]], [[1e39, 0, 0, 0]], [["1", 0, 0, 0]], [[0, 0, 0]], [[[1], 0, 0, 0]], [None]):
        assert schema.observation_rows([[0.0] * 4] + bad) is None  # declined: checked row by row, which names it
    assert ChunkSchema.for_spaces(S.Discrete(3), S.Discrete(2)).observation_rows([1, 2]) is None
    spec = value_spec(space_to_dict(S.Box(-1, 1, (2,))))
    ok = [np.zeros(2, np.float32), np.ones(2)]
    assert box_rows_pass(spec, ok) and not box_rows_pass(spec, ok + [np.array([0.0, np.inf])])
    assert box_rows_pass(spec, ok + [np.array([0.0, np.inf])], finite=False)
    assert not box_rows_pass(spec, [[0.0, 1.0]]) and not box_rows_pass(value_spec(space_to_dict(S.Discrete(2))), [])
