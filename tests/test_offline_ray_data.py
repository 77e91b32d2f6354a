"""The Ray Data reading path: datasets of records and of transitions over the shard files, and the
``input_reader="ray_data"`` reader stage (same chunks, same damage counts and same disjoint shard
shares as the local reader)."""
import glob
import os
import shutil

import gymnasium as gym
import numpy as np
import pytest
import ray

from actors.env import EnvRunnerSettings
from actors.offline import OfflineReader, ReaderSettings, Recorder, RecordingSettings, reader_class
from actors.offline.dataset import DAMAGED, TORN, RayDataReader, record_dataset, transition_dataset
from protocols.shards import RECORD_HEADER_SIZE, ShardReader, decode_record

DATA = os.path.join(os.path.dirname(os.path.abspath(__file__)), "data")
EXPERT = os.path.join(DATA, "cartpole_expert")


@pytest.fixture(scope="module")
def ray2():
    ray.init(address="local", num_cpus=2, include_dashboard=False, logging_level="ERROR", log_to_driver=False)
    yield
    ray.shutdown()


def _local_chunks(files):
    out = []
    for f in files:
        reader = ShardReader(f)
        for off, frame in reader.frames():
            try:
                out += decode_record(frame, reader.limits)
            except Exception:
                continue
    return out


def _shards(path):
    return sorted(glob.glob(os.path.join(path, "*.rshard")))


@pytest.fixture(scope="module")
def split(tmp_path_factory):
    """The expert recording (20 episodes of 500 steps) re-recorded into 4 shards of 5 records."""
    out = str(tmp_path_factory.mktemp("split"))
    rec = Recorder(RecordingSettings(out, output_max_file_size=70_000), "runner001")
    for _, frame in ShardReader(_shards(EXPERT)[0]).frames():
        rec.record(decode_record(frame))
    rec.close()
    shutil.copy(os.path.join(EXPERT, "manifest.json"), os.path.join(out, "manifest.json"))
    assert len(_shards(out)) == 4
    return out


@pytest.fixture(scope="module")
def damaged(split, tmp_path_factory):
    """``split`` with shard 0's record framing broken twice (its index still points at them), one
    record of shard 1 flipped (its checksum fails) and shard 2 torn inside its third record."""
    out = str(tmp_path_factory.mktemp("damaged"))
    shutil.copytree(split, out, dirs_exist_ok=True)
    files = _shards(out)
    for i, f in enumerate(files[:3]):
        offsets = [off for off, _ in ShardReader(f).frames()]
        data = bytearray(open(f, "rb").read())
        if i == 0:
            for off in offsets[1:3]:
                data[off:off + 4] = b"XXXX"
        elif i == 1:
            mid = offsets[1] + RECORD_HEADER_SIZE + 2000
            data[mid] ^= 0xFF
        else:
            data = data[:offsets[2] + 100]
        open(f, "wb").write(bytes(data))
    return out


def _reader(cls, path, worker_index=0, num_readers=1):
    settings = EnvRunnerSettings(env_creator=None, rollout_fragment_length=1000, seed=0,
                                 action_space=gym.spaces.Discrete(2))
    return cls(settings, worker_index, offline=ReaderSettings(path, shuffle_buffer_size=0, input_reader="ray_data"),
               num_readers=num_readers)


def _one_epoch(reader):
    """Every chunk of one pass over the reader's shards, and its damage counts for that pass."""
    steps = sum(len(c) for c in _local_chunks(reader.files))
    chunks = reader.sample(num_timesteps=steps)
    assert sum(len(c) for c in chunks) == steps
    reader.sample(num_timesteps=1)  # starts the next pass: the last shard's damage is counted by then
    counts = {k: reader.counts[k] for k in ("damaged_records", "torn_tails")}
    reader.stop()
    return chunks, counts


def _key(c):
    return (c.episode_id, c.chunk_index)


def _assert_same_chunks(a, b):
    assert sorted(map(_key, a)) == sorted(map(_key, b))
    by_key = {_key(c): c for c in b}
    for c in a:
        d = by_key[_key(c)]
        for name in ("obs", "actions", "rewards"):
            np.testing.assert_array_equal(getattr(c, name), getattr(d, name))
        assert (c.terminated, c.truncated, c.t_started) == (d.terminated, d.truncated, d.t_started)
        assert c.extra.keys() == d.extra.keys()
        for k in c.extra:
            np.testing.assert_array_equal(c.extra[k], d.extra[k])


def test_the_reader_is_registered():
    assert reader_class(ReaderSettings(EXPERT, input_reader="ray_data")) is RayDataReader
    assert reader_class(ReaderSettings(EXPERT)) is OfflineReader


@pytest.mark.slow
def test_transitions_equal_what_the_shards_hold(ray2):
    files = _shards(os.path.join(DATA, "cartpole_random"))
    chunks = _local_chunks(files)
    columns: dict = {}
    for batch in transition_dataset(files).iter_batches(batch_size=1000, batch_format="numpy"):
        for k, v in batch.items():
            columns.setdefault(k, []).append(v)
    got = {k: np.concatenate(v) for k, v in columns.items()}
    steps = sum(len(c) for c in chunks)
    assert len(got["rewards"]) == steps
    order = {c.episode_id: c for c in chunks}
    assert set(got["episode_id"]) == set(order)
    for eid, c in list(order.items())[:5]:  # row by row, for a few episodes
        rows = np.flatnonzero(got["episode_id"] == eid)
        rows = rows[np.argsort(got["t"][rows])]
        np.testing.assert_array_equal(got["obs"][rows], c.obs[:-1])
        np.testing.assert_array_equal(got["next_obs"][rows], c.obs[1:])
        np.testing.assert_array_equal(got["actions"][rows], c.actions)
        np.testing.assert_array_equal(got["rewards"][rows], c.rewards)
        np.testing.assert_array_equal(got["action_logp"][rows], c.extra["action_logp"])
        assert got["terminated"][rows][-1] == c.terminated and not got["terminated"][rows][:-1].any()
        assert got["truncated"][rows][-1] == c.truncated and not got["truncated"][rows][:-1].any()


def test_step_columns_come_in_bounded_batches_and_join_to_the_same_rows(monkeypatch):
    from actors.offline import dataset

    rows = [r for f in _shards(os.path.join(DATA, "cartpole_random")) for r in dataset._shard_frames({"path": f})]
    batch = {"frame": np.array([r["frame"] for r in rows] + [b""], dtype=object)}  # and a blank (damaged) row
    whole = list(dataset._steps(batch))
    monkeypatch.setattr(dataset, "STEP_BATCH_BYTES", 2000)
    parts = list(dataset._steps(batch))
    assert len(whole) == 1 and len(parts) > 10
    assert all(sum(v.nbytes for v in p.values()) < 2000 + 500 * 64 for p in parts)
    for k, v in whole[0].items():
        np.testing.assert_array_equal(np.concatenate([p[k] for p in parts]), v)


def test_a_torn_shard_is_counted_and_the_records_before_it_read(ray2, tmp_path):
    src = _shards(EXPERT)[0]
    torn = tmp_path / "rec"
    torn.mkdir()
    shutil.copy(os.path.join(EXPERT, "manifest.json"), torn / "manifest.json")
    data = open(src, "rb").read()
    offsets = [off for off, _ in ShardReader(src).frames()]
    (torn / "runner001-00000.rshard").write_bytes(data[:offsets[5] + 100])  # killed while writing record 6
    rows = list(record_dataset([str(torn / "runner001-00000.rshard")]).iter_rows())
    good = [r for r in rows if len(r["frame"])]
    assert len(good) == 5 and [r["offset"] for r in rows if not len(r["frame"])] == [TORN]
    steps = sum(len(b["rewards"]) for b in transition_dataset([str(torn / "runner001-00000.rshard")]).iter_batches())
    assert steps == 5 * 500


def test_the_reader_stage_hands_out_what_the_local_reader_does(ray2, split):
    got, counts = _one_epoch(_reader(RayDataReader, split))
    want, want_counts = _one_epoch(_reader(OfflineReader, split))
    assert len(got) == 20 and counts == want_counts == {"damaged_records": 0, "torn_tails": 0}
    _assert_same_chunks(got, want)


def test_damage_is_counted_as_the_local_reader_counts_it(ray2, damaged):
    rows = list(record_dataset(_shards(damaged)).iter_rows())
    assert sorted(r["offset"] for r in rows if r["offset"] < 0) == [TORN, DAMAGED, DAMAGED]
    assert sum(1 for r in rows if r["offset"] >= 0 and not len(r["frame"])) == 1  # the flipped one
    got, counts = _one_epoch(_reader(RayDataReader, damaged))
    want, want_counts = _one_epoch(_reader(OfflineReader, damaged))
    assert want_counts == {"damaged_records": 3, "torn_tails": 1}
    assert counts == want_counts
    assert len(got) == 20 - 3 - 3  # 2 broken framings, 1 flipped, 3 records lost in the torn tail
    _assert_same_chunks(got, want)


def test_readers_at_different_indices_read_disjoint_shards(ray2, split):
    shares = [_one_epoch(_reader(RayDataReader, split, i, num_readers=2))[0] for i in (1, 2)]
    ids = [{c.episode_id for c in share} for share in shares]
    assert ids[0] and ids[1] and not ids[0] & ids[1]
    assert ids[0] | ids[1] == {c.episode_id for c in _local_chunks(_shards(split))}


@pytest.mark.slow
@pytest.mark.parametrize("num_env_runners", [0, 1, 2])
def test_bc_trains_with_the_ray_data_reader(ray2, num_env_runners):
    # 2: the two reader actors hold both CPUs; their Ray Data tasks ask for none, so they still run
    from pipeline import BCConfig

    algo = (BCConfig().offline_data(input_=EXPERT, input_reader="ray_data")
            .env_runners(num_env_runners=num_env_runners)
            .training(train_batch_size_per_learner=256, minibatch_size=128).debugging(seed=0).build(logdir=None))
    try:
        for _ in range(3):
            result = algo.train()
        assert result["num_env_steps_trained_lifetime"] >= 3 * 256
        assert result["training_iteration"] == 3
    finally:
        algo.stop()
