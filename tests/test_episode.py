"""EpisodeBuilder, EpisodeChunk slicing/splitting/concatenation and validation."""
from dataclasses import replace

import numpy as np
import pytest

from protocols import EpisodeBuilder, EpisodeChunk, ProtocolError, new_episode_id
from protocols import nested


def _obs(t: int) -> dict:
    return {"pos": np.full(3, t, np.float32), "cam": (np.full((2, 2), t, np.uint8), np.int64(t))}


def _episode(steps: int = 10, *, terminated: bool = True, record_infos: bool = True) -> EpisodeBuilder:
    b = EpisodeBuilder(env_runner_index=2, env_index=1, weights_version=5, record_infos=record_infos)
    b.add_reset(_obs(0), {"reset": True})
    for t in range(1, steps + 1):
        b.add_step(
            np.int64(t % 3), float(t), _obs(t),
            terminated=terminated and t == steps, info={"t": t},
            extra={"action_logp": np.float32(-t), "dist": np.array([t, -t], np.float32)},
        )
    return b


def assert_chunks_equal(a: EpisodeChunk, b: EpisodeChunk) -> None:
    assert type(a.obs) is type(b.obs)
    for x, y in zip(nested.flatten(a.obs), nested.flatten(b.obs), strict=True):
        assert x.dtype == y.dtype and x.shape == y.shape and np.array_equal(x, y)
    for x, y in zip(nested.flatten(a.actions), nested.flatten(b.actions), strict=True):
        assert x.dtype == y.dtype and np.array_equal(x, y)
    assert np.array_equal(a.rewards, b.rewards)
    assert a.extra.keys() == b.extra.keys()
    for k in a.extra:
        assert np.array_equal(a.extra[k], b.extra[k])
    for f in ("episode_id", "chunk_index", "terminated", "truncated", "infos", "t_started",
              "weights_version", "env_runner_index", "env_index", "agent_id", "module_id"):
        assert getattr(a, f) == getattr(b, f), f


def test_builder_step_by_step_cut_shapes():
    b = _episode(10)
    assert len(b) == 10 and b.total_length == 10 and b.total_return == sum(range(1, 11))
    assert b.terminated and b.is_done
    c = b.cut()
    assert len(c) == 10 and c.is_done and c.t_started == 0 and c.chunk_index == 0
    assert c.obs["pos"].shape == (11, 3) and c.obs["pos"].dtype == np.float32
    assert isinstance(c.obs["cam"], tuple)
    assert c.obs["cam"][0].shape == (11, 2, 2) and c.obs["cam"][1].shape == (11,)
    assert c.actions.shape == (10,) and c.actions.dtype == np.int64
    assert c.rewards.dtype == np.float32 and c.ret == pytest.approx(55.0)
    assert c.extra["action_logp"].shape == (10,) and c.extra["dist"].shape == (10, 2)
    assert len(c.infos) == 11 and c.infos[0] == {"reset": True} and c.infos[-1] == {"t": 10}
    assert (c.env_runner_index, c.env_index, c.weights_version) == (2, 1, 5)
    assert c.validate() is c


def test_builder_cuts_consecutive_chunks():
    b = EpisodeBuilder()
    b.add_reset(np.zeros(2, np.float32))
    chunks = []
    for t in range(1, 8):
        b.add_step(1, 0.5, np.full(2, t, np.float32), truncated=t == 7)
        if t % 3 == 0 or t == 7:
            chunks.append(b.cut())
    assert [len(c) for c in chunks] == [3, 3, 1]
    assert [c.chunk_index for c in chunks] == [0, 1, 2]
    assert [c.t_started for c in chunks] == [0, 3, 6]
    assert [c.truncated for c in chunks] == [False, False, True]
    for prev, nxt in zip(chunks, chunks[1:]):
        assert np.array_equal(prev.obs[-1], nxt.obs[0])   # shared boundary observation
    whole = EpisodeChunk.concat(chunks)
    assert len(whole) == 7 and whole.obs.shape == (8, 2) and whole.truncated
    assert b.total_length == 7 and b.total_return == pytest.approx(3.5)


def test_builder_errors():
    b = EpisodeBuilder()
    with pytest.raises(ValueError, match="before add_reset"):
        b.add_step(0, 0.0, 0)
    b.add_reset(np.zeros(1))
    with pytest.raises(ValueError, match="twice"):
        b.add_reset(np.zeros(1))
    with pytest.raises(ValueError, match="nothing to cut"):
        b.cut()
    b.add_step(0, 1.0, np.zeros(1), extra={"a": 1.0})
    with pytest.raises(ValueError, match="extra keys changed"):
        b.add_step(0, 1.0, np.zeros(1), extra={"b": 1.0})
    assert len(b) == 1, "a rejected step must leave the builder unchanged"
    b.add_step(0, 1.0, np.zeros(1), extra={"a": 2.0}, terminated=True)
    assert b.cut().validate().extra["a"].tolist() == [1.0, 2.0]
    with pytest.raises(ValueError, match="already done"):
        b.add_step(0, 1.0, np.zeros(1))


@pytest.mark.parametrize("max_len", [1, 3, 4, 10, 25])
def test_split_concat_round_trip(max_len):
    chunk = _episode(10).cut()
    parts = chunk.split(max_len)
    assert sum(len(p) for p in parts) == 10
    assert [p.chunk_index for p in parts] == list(range(len(parts)))
    assert all(not p.is_done for p in parts[:-1]) and parts[-1].terminated
    for p in parts:
        p.validate()
    assert_chunks_equal(EpisodeChunk.concat(parts), chunk)


def test_slice_views_and_flags():
    chunk = _episode(6).cut()
    s = chunk.slice(2, 4)
    assert len(s) == 2 and s.t_started == 2 and not s.terminated
    assert s.obs["pos"].shape == (3, 3) and np.shares_memory(s.obs["pos"], chunk.obs["pos"])
    assert s.infos == chunk.infos[2:5]
    assert chunk.slice(3, 6).terminated
    with pytest.raises(ValueError):
        chunk.slice(4, 4)
    with pytest.raises(ValueError):
        chunk.split(0)


def test_concat_errors():
    chunk = _episode(9).cut()
    a, b, c = chunk.split(3)
    with pytest.raises(ValueError, match="at least one"):
        EpisodeChunk.concat([])
    with pytest.raises(ValueError, match="different episodes"):
        EpisodeChunk.concat([a, replace(b, episode_id=new_episode_id())])
    with pytest.raises(ValueError, match="does not follow"):
        EpisodeChunk.concat([a, c])                                  # gap in chunk_index
    with pytest.raises(ValueError, match="starts at step"):
        EpisodeChunk.concat([a, replace(b, t_started=4)])
    with pytest.raises(ValueError, match="ends the episode"):
        EpisodeChunk.concat([replace(a, truncated=True), b])
    bad_obs = nested.map_structure(lambda x: x.copy(), b.obs)
    bad_obs["pos"][0] += 1
    with pytest.raises(ValueError, match="differs"):
        EpisodeChunk.concat([a, replace(b, obs=bad_obs)])
    with pytest.raises(ValueError, match="extra"):
        EpisodeChunk.concat([a, replace(b, extra={"action_logp": b.extra["action_logp"]})])


def test_validate_errors():
    good = _episode(4).cut()
    assert good.validate() is good
    cases = [
        (dict(episode_id=""), "episode_id"),
        (dict(episode_id=7), "episode_id"),
        (dict(chunk_index=-1), "chunk_index"),
        (dict(t_started=1.5), "t_started"),
        (dict(weights_version=True), "weights_version"),
        (dict(terminated=True, truncated=True), "both"),
        (dict(rewards=[1.0, 2.0]), "rewards"),
        (dict(rewards=np.zeros((4, 1), np.float32)), "rewards"),
        (dict(actions=np.zeros(5, np.int64)), "actions must have 4 rows"),
        (dict(obs={"pos": np.zeros((4, 3), np.float32), "cam": good.obs["cam"]}), "obs must have 5 rows"),
        (dict(obs={"pos": np.float32(1.0), "cam": good.obs["cam"]}), "numpy arrays"),
        (dict(obs=np.array(1.0)), "0-d"),
        (dict(extra={"v": np.zeros(3)}), r"extra\['v'\]"),
        (dict(extra=[1]), "extra must be a dict"),
        (dict(infos=[{}] * 3), "infos"),
    ]
    for changes, message in cases:
        with pytest.raises(ProtocolError, match=message):
            replace(good, **changes).validate()


def test_episode_ids_are_unique():
    assert len({new_episode_id() for _ in range(100)}) == 100
