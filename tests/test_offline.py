"""Recording and reading experience: shard files, the recorder, the reader, the config, the CLI.

No Ray here: the recorder and the reader are plain classes, tested in-process. Crash tests (a
process killed while it writes) are in test_offline_crash.py, learning in test_offline_learning.py.
"""
from __future__ import annotations

import json
import os
import shutil
import struct
from collections import Counter

import gymnasium as gym
import numpy as np
import pytest

from actors.offline import OfflineReader, ReaderSettings, Recorder, RecordingSettings, read_manifest, write_manifest
from pipeline import BCConfig, MARWILConfig, PPOConfig
from pipeline.cli.main import main as cli
from pipeline.config.base import ConfigError
from pipeline.offline.record import inspect_recording
from protocols.codec import encode
from protocols.episode import EpisodeBuilder, EpisodeChunk
from protocols.errors import ProtocolError
from protocols.shards import (RECORD_HEADER_SIZE, TRAILER_SIZE, ShardReader, ShardWriter,
                              decode_record)

HERE = os.path.dirname(os.path.abspath(__file__))
EXPERT = os.path.join(HERE, "data", "cartpole_expert")


def episode(length: int, seed: int, done: bool = True, obs_space: gym.Space | None = None,
            act_space: gym.Space | None = None, infos: bool = False) -> list[EpisodeChunk]:
    """One episode's chunks (cut every 7 steps) with observations drawn from ``obs_space``."""
    obs_space = obs_space or gym.spaces.Box(-1, 1, (3,), np.float32)
    act_space = act_space or gym.spaces.Discrete(2)
    obs_space.seed(seed)
    act_space.seed(seed + 1)
    b = EpisodeBuilder(record_infos=infos)
    b.add_reset(obs_space.sample(), {"t": 0} if infos else None)
    chunks = []
    for t in range(length):
        b.add_step(act_space.sample(), float(t), obs_space.sample(), terminated=done and t == length - 1,
                   info={"t": t + 1} if infos else None, extra={"action_logp": np.float32(-0.5)})
        if len(b) == 7 or t == length - 1:
            chunks.append(b.cut())
    return chunks


def same(a: EpisodeChunk, b: EpisodeChunk) -> bool:
    return encode(a) == encode(b)


def write_shard(path: str, records: list[list[EpisodeChunk]], close: bool = True) -> list[int]:
    w = ShardWriter(path, {"writer": "test"})
    offsets = [w.append(encode(r, compress=True), sum(len(c) for c in r), len(r), sum(c.is_done for c in r))
               for r in records]
    if close:
        w.close(fsync=False)
    else:
        w.flush()
    return offsets


# --- shard files ---------------------------------------------------------------------------------
def test_shard_round_trip_with_and_without_index(tmp_path):
    records = [episode(10 + i, i) for i in range(5)]
    path = str(tmp_path / "a.rshard")
    write_shard(path, records)
    r = ShardReader(path)
    assert r.scan.complete and r.index["steps"] == [10, 11, 12, 13, 14] and r.index["meta"]["writer"] == "test"
    got = [decode_record(f) for _, f in r.frames()]
    assert len(got) == 5 and all(same(a, b) for ra, rb in zip(records, got) for a, b in zip(ra, rb))
    # Without the trailer (a writer that died after writing its index) the records are found by scanning.
    with open(path, "r+b") as f:
        f.truncate(os.path.getsize(path) - TRAILER_SIZE)
    r = ShardReader(path)
    assert not r.scan.complete
    assert [len(decode_record(f)) for _, f in r.frames()] == [len(x) for x in records]
    assert r.scan.damaged_bytes == 0


def test_torn_tail_is_found_and_everything_before_it_reads(tmp_path):
    records = [episode(20, i) for i in range(4)]
    path = str(tmp_path / "torn.rshard")
    offsets = write_shard(path, records, close=False)
    full = os.path.getsize(path)
    data = open(path, "rb").read()
    last = offsets[-1]
    for cut in (last + 1, last + RECORD_HEADER_SIZE - 1, last + RECORD_HEADER_SIZE + 5, full - 1):
        torn = str(tmp_path / f"torn{cut}.rshard")
        with open(torn, "wb") as f:
            f.write(data[:cut])
        r = ShardReader(torn)
        got = [decode_record(f) for _, f in r.frames()]
        assert len(got) == 3, cut
        assert all(same(a, b) for ra, rb in zip(records, got) for a, b in zip(ra, rb))
        assert r.scan.damaged_bytes == cut - last and r.scan.damage, cut
    empty = str(tmp_path / "empty.rshard")
    open(empty, "wb").close()
    r = ShardReader(empty)
    assert list(r.frames()) == [] and r.scan.damaged_bytes == 0 and "shorter" in r.scan.damage


def test_damaged_record_in_a_closed_shard_is_skipped_and_counted(tmp_path):
    records = [episode(9, i) for i in range(4)]
    path = str(tmp_path / "d.rshard")
    offsets = write_shard(path, records)
    with open(path, "r+b") as f:  # break the second record's framing
        f.seek(offsets[1])
        f.write(b"XXXX")
    r = ShardReader(path)
    got = [decode_record(f) for _, f in r.frames()]
    assert len(got) == 3 and r.scan.damaged_records == 1 and "no record" in r.scan.damage
    # and the reader stage skips it too, counting it
    shutil.copy(path, tmp_path / "rec.rshard")
    os.remove(path)
    reader = OfflineReader(_runner_settings(), offline=ReaderSettings(str(tmp_path), shuffle_buffer_size=0))
    steps = reader.sample(num_timesteps=27)
    assert sum(len(c) for c in steps) == 27
    reader.sample(num_timesteps=27)  # the second epoch: the first one's end has been accounted
    assert reader.counts["damaged_records"] >= 1


def test_newer_shard_format_is_refused_with_the_versions(tmp_path):
    path = str(tmp_path / "new.rshard")
    write_shard(path, [episode(3, 0)])
    with open(path, "r+b") as f:
        f.seek(8)
        f.write(struct.pack("<H", 99))
    with pytest.raises(ProtocolError, match="version 99.*up to 1"):
        ShardReader(path)
    other = str(tmp_path / "other.rshard")
    with open(other, "wb") as f:
        f.write(b"PK\x03\x04" + b"\0" * 40)
    with pytest.raises(ProtocolError, match="not a runnel shard"):
        ShardReader(other)


def test_a_shard_file_is_never_shared(tmp_path):
    path = str(tmp_path / "x.rshard")
    ShardWriter(path).close(fsync=False)
    with pytest.raises(FileExistsError):
        ShardWriter(path)


# --- the recorder -----------------------------------------------------------------------------------
def _read_all(directory: str) -> list[EpisodeChunk]:
    out = []
    for name in sorted(os.listdir(directory)):
        if name.endswith(".rshard"):
            out.extend(ShardReader(os.path.join(directory, name)).chunks())
    return out


def test_recorder_chunk_mode_rotates_and_keeps_every_chunk_in_order(tmp_path):
    out = str(tmp_path / "rec")
    rec = Recorder(RecordingSettings(out, output_max_file_size=2000, output_write_episodes=False), "runner001")
    sent = [c for i in range(12) for c in episode(15, i)]
    for i in range(0, len(sent), 3):
        rec.record(sent[i:i + 3])
    rec.flush()
    assert rec.get_metrics()["recorded_chunks"] == len(sent)
    rec.close()
    shards = sorted(os.listdir(out))
    assert len(shards) > 2 and all(ShardReader(os.path.join(out, s)).scan.complete for s in shards)
    got = _read_all(out)
    assert len(got) == len(sent) and all(same(a, b) for a, b in zip(sent, got))


def test_recorder_episode_mode_joins_each_episode_and_keeps_unfinished_ones_at_close(tmp_path):
    out = str(tmp_path / "rec")
    rec = Recorder(RecordingSettings(out), "runner001")
    a, b, c = episode(20, 1), episode(16, 2), episode(9, 3, done=False)
    rec.record([a[0], b[0], c[0]])  # interleaved, as a vector env samples them
    rec.record([a[1], b[1], c[1]])
    rec.record(a[2:] + b[2:])
    rec.flush()
    # both episodes ended in the same batch: one record holds them (records group short episodes)
    assert rec.get_metrics()["records"] == 1 and rec.get_metrics()["open_episodes"] == 1
    rec.close()
    got = _read_all(out)
    assert [len(x) for x in got] == [20, 16, 9]  # in the order they ended; c written as it was at close
    assert same(got[0], EpisodeChunk.concat(a)) and same(got[1], EpisodeChunk.concat(b))
    assert not got[2].is_done


def test_recorder_surfaces_a_failed_writer_instead_of_dropping_experience(tmp_path):
    out = str(tmp_path / "rec")
    rec = Recorder(RecordingSettings(out, output_write_episodes=False), "runner001")
    shutil.rmtree(out)
    open(out, "w").close()  # the directory is gone: the writer cannot open its shard
    rec.record(episode(5, 0))
    with pytest.raises(RuntimeError, match="recording to .* failed"):
        rec.flush()
    with pytest.raises(RuntimeError, match="failed"):
        rec.record(episode(5, 1))
    rec.close()


def test_nested_spaces_infos_and_next_obs_round_trip(tmp_path):
    obs_space = gym.spaces.Dict({"pos": gym.spaces.Box(-1, 1, (2,), np.float32),
                                 "inner": gym.spaces.Tuple((gym.spaces.Discrete(5), gym.spaces.Box(0, 255, (3, 3), np.uint8)))})
    for act_space in (gym.spaces.MultiDiscrete([3, 4]), gym.spaces.Box(-2, 2, (2,), np.float32)):
        out = str(tmp_path / type(act_space).__name__)
        write_manifest(out, obs_space, act_space, "test", {}, "test")
        rec = Recorder(RecordingSettings(out), "runner001")
        sent = [EpisodeChunk.concat(episode(12, i, obs_space=obs_space, act_space=act_space, infos=True))
                for i in range(3)]
        rec.record(sent)
        rec.close()
        got = sorted(_read_all(out), key=lambda c: c.episode_id)
        sent.sort(key=lambda c: c.episode_id)
        assert all(same(a, b) for a, b in zip(sent, got))
        assert got[0].infos[-1] == {"t": 12} and got[0].obs["inner"][1].shape == (13, 3, 3)  # T + 1 obs rows
        m = read_manifest(out)
        from protocols.spaces import space_from_dict

        assert space_from_dict(m["observation_space"]) == obs_space and space_from_dict(m["action_space"]) == act_space


def test_manifest_refuses_other_spaces_in_the_same_directory(tmp_path):
    out = str(tmp_path)
    write_manifest(out, gym.spaces.Box(-1, 1, (3,)), gym.spaces.Discrete(2), "PPO", {}, "x")
    write_manifest(out, gym.spaces.Box(-1, 1, (3,)), gym.spaces.Discrete(2), "PPO", {}, "x")  # same: fine
    with pytest.raises(ValueError, match="another action space"):
        write_manifest(out, gym.spaces.Box(-1, 1, (3,)), gym.spaces.Discrete(3), "PPO", {}, "x")


# --- the reader -------------------------------------------------------------------------------------
def _runner_settings(**kw):
    from actors.env import EnvRunnerSettings

    return EnvRunnerSettings(env_creator=None, rollout_fragment_length=50, seed=0,
                             action_space=kw.pop("action_space", gym.spaces.Discrete(2)), **kw)


def _recording(tmp_path, n_writers=3, n_episodes=8) -> tuple[str, Counter]:
    out = str(tmp_path / "rec")
    write_manifest(out, gym.spaces.Box(-1, 1, (3,), np.float32), gym.spaces.Discrete(2), "test", {}, "test")
    steps: Counter = Counter()
    for w in range(n_writers):
        rec = Recorder(RecordingSettings(out, output_max_file_size=1500), f"runner{w:03d}")
        for e in range(n_episodes):
            chunks = episode(5 + 3 * e + w, 100 * w + e)
            rec.record(chunks)
            for c in chunks:
                steps[(c.episode_id, c.t_started)] += len(c)
        rec.close()
    return out, steps


def _epoch(reader: OfflineReader, total_steps: int) -> Counter:
    got: Counter = Counter()
    n = 0
    while n < total_steps:
        for c in reader.sample(num_timesteps=1):
            got[c.episode_id] += len(c)
            n += len(c)
    return got


def test_reader_hands_out_every_step_once_per_epoch_shuffled(tmp_path):
    out, steps = _recording(tmp_path)
    total = sum(steps.values())
    per_episode: Counter = Counter()
    for (eid, _), n in steps.items():
        per_episode[eid] += n
    reader = OfflineReader(_runner_settings(), offline=ReaderSettings(out, shuffle_buffer_size=0))
    assert _epoch(reader, total) == per_episode
    assert _epoch(reader, total) == per_episode and reader.epoch >= 1  # it loops: the next epoch holds it all again
    # A shuffle buffer mixes neighbouring epochs: three epochs' worth of steps came out of at most
    # four epochs read (three plus what the buffer held), and (seeded) every episode is among them.
    shuffled = OfflineReader(_runner_settings(), offline=ReaderSettings(out, shuffle_buffer_size=40))
    got = _epoch(shuffled, 3 * total)
    assert set(got) == set(per_episode) and all(got[e] <= 4 * per_episode[e] for e in got)
    first = [c.episode_id for c in OfflineReader(_runner_settings(), offline=ReaderSettings(out, shuffle_buffer_size=0)
                                                 ).sample(num_timesteps=total)]
    mixed = [c.episode_id for c in OfflineReader(_runner_settings(), offline=ReaderSettings(out, shuffle_buffer_size=40)
                                                 ).sample(num_timesteps=total)]
    assert first != mixed


def test_readers_take_disjoint_shares_of_the_shards(tmp_path):
    out, steps = _recording(tmp_path)
    shares = [OfflineReader(_runner_settings(), worker_index=i, offline=ReaderSettings(out), num_readers=2).files
              for i in (1, 2)]
    assert not set(shares[0]) & set(shares[1])
    assert sorted(shares[0] + shares[1]) == sorted(os.path.join(out, f) for f in os.listdir(out) if f.endswith(".rshard"))


def test_reader_whole_episodes_only_and_action_rescaling(tmp_path):
    box = gym.spaces.Box(np.array([0.0, -4.0], np.float32), np.array([10.0, 4.0], np.float32))
    dirs = {}
    for mode in (True, False):
        out = dirs[mode] = str(tmp_path / f"episodes{mode}")
        write_manifest(out, gym.spaces.Box(-1, 1, (3,), np.float32), box, "external", {}, "x", actions_normalized=False)
        rec = Recorder(RecordingSettings(out, output_write_episodes=mode), "runner001")
        chunks = episode(14, 0, act_space=box) + episode(6, 1, act_space=box, done=False)
        rec.record(chunks)
        rec.close()
    reader = OfflineReader(_runner_settings(action_space=box),
                           offline=ReaderSettings(dirs[True], input_read_episodes=True, shuffle_buffer_size=0))
    for _ in range(3):  # the unfinished episode (written at close) is never handed out
        (c,) = reader.sample(num_episodes=1)
        assert len(c) == 14 and c.is_done
    # chunk-mode records are pieces of episodes: asking for whole ones is an error that names the fix
    reader = OfflineReader(_runner_settings(action_space=box),
                           offline=ReaderSettings(dirs[False], input_read_episodes=True, shuffle_buffer_size=0))
    with pytest.raises(RuntimeError, match="output_write_episodes=True"):
        reader.sample(num_episodes=1)
    reader = OfflineReader(_runner_settings(action_space=box), offline=ReaderSettings(dirs[False], shuffle_buffer_size=0))
    c = reader.sample(num_timesteps=1)[0]
    raw = next(x for x in chunks if (x.episode_id, x.chunk_index) == (c.episode_id, c.chunk_index)).actions
    np.testing.assert_allclose(c.actions, 2 * (raw - box.low) / (box.high - box.low) - 1, rtol=1e-6)


def test_reader_reads_the_checked_in_recording_of_an_earlier_version():
    out = inspect_recording(EXPERT)
    assert out["episodes"] == 20 and out["steps"] == 10_000 and out["damaged_records"] == 0
    assert out["episode_return_mean"] == 500.0 and out["action_space"]["type"] == "Discrete"


# --- config and CLI -----------------------------------------------------------------------------------
def test_offline_config_errors_name_the_fix(tmp_path):
    def problems(cfg):
        with pytest.raises(ConfigError) as err:
            cfg.validate()
        return str(err.value)

    assert "did you mean 'input_'" in problems(BCConfig().offline_data(inputs=EXPERT))
    assert "learns from recorded experience" in problems(BCConfig().environment("CartPole-v1"))
    assert "neither a directory" in problems(BCConfig().offline_data(input_=str(tmp_path / "nope")))
    assert "holds no .rshard" in problems(BCConfig().offline_data(input_=str(tmp_path)))
    assert "record the recording again" in problems(BCConfig().offline_data(input_=EXPERT, output=str(tmp_path)))
    assert "beta must be" in problems(MARWILConfig().offline_data(input_=EXPERT).training(beta=-1))
    assert "evaluation runs an env" in problems(BCConfig().offline_data(input_=EXPERT).evaluation(evaluation_interval=1))
    assert "output_fsync" in problems(PPOConfig().environment("CartPole-v1").offline_data(output=str(tmp_path), output_fsync="sometimes"))
    assert "input_reader" in problems(BCConfig().offline_data(input_=EXPERT, input_reader="spark"))


def test_cli_inspect(capsys):
    assert cli(["inspect", EXPERT, "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["episodes"] == 20 and out["torn_tails"] == 0
    assert cli(["inspect", "/nonexistent/dir"]) == 2
    assert "neither a directory" in capsys.readouterr().err


class InfoCartPole(gym.Wrapper):
    """CartPole whose infos say where they come from: reset infos {"reset": seed-ish}, step infos {"t": t}."""

    def __init__(self, ctx=None):
        super().__init__(gym.make("CartPole-v1"))
        self.t = 0

    def reset(self, **kw):
        obs, _ = self.env.reset(**kw)
        self.t = 0
        return obs, {"t": 0, "reset": True}

    def step(self, action):
        obs, r, term, trunc, _ = self.env.step(action)
        self.t += 1
        return obs, r, term, trunc, {"t": self.t, "x": np.float32(obs[0])}


def test_env_runner_records_infos_when_asked(tmp_path):
    from actors.env import EnvRunner, EnvRunnerSettings

    out = str(tmp_path / "rec")
    settings = EnvRunnerSettings(env_creator=InfoCartPole, num_envs=2, rollout_fragment_length=30, seed=0,
                                 recording=RecordingSettings(out, output_write_episodes=False, output_write_infos=True))
    runner = EnvRunner(settings, worker_index=1)
    sampled = [c for _ in range(4) for c in runner.sample()]
    runner.stop()
    got = {(c.episode_id, c.chunk_index): c for c in _read_all(out)}
    for c in sampled:
        r = got[(c.episode_id, c.chunk_index)]
        assert len(r.infos) == len(r) + 1 and same(r, c)
        # each observation row's info: the episode's step count at that row, the reset info first
        assert [i["t"] for i in r.infos] == list(range(r.t_started, r.t_started + len(r) + 1))
        assert all(i["x"] == pytest.approx(float(o[0])) for i, o in zip(r.infos[1:], r.obs[1:]))
        assert r.infos[0].get("reset") is (r.t_started == 0 or None)
    assert any(c.is_done for c in sampled)


def test_a_flipped_bit_inside_a_record_is_caught_by_its_checksum(tmp_path):
    records = [episode(9, i) for i in range(4)]
    path = str(tmp_path / "flip.rshard")
    offsets = write_shard(path, records)
    with open(path, "r+b") as f:  # one bit in the middle of the third record's frame
        f.seek((offsets[2] + offsets[3]) // 2)
        byte = f.read(1)
        f.seek(-1, 1)
        f.write(bytes([byte[0] ^ 0x10]))
    summary = inspect_recording(str(tmp_path))
    assert summary["damaged_records"] == 1 and summary["records"] == 3 and "checksum mismatch" in summary["damage"][0]
    reader = OfflineReader(_runner_settings(), offline=ReaderSettings(str(tmp_path), shuffle_buffer_size=0))
    got = [c for _ in range(6) for c in reader.sample(num_timesteps=1)]  # two chunks per record
    assert {c.episode_id for c in got} == {records[i][0].episode_id for i in (0, 1, 3)}
    assert reader.counts["damaged_records"] == 1
