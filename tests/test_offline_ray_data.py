"""The Ray Data reading path: datasets of records and of transitions over the shard files, and the
``input_reader="ray_data"`` reader stage."""
import glob
import os
import shutil

import numpy as np
import pytest
import ray

from actors.offline.dataset import record_dataset, transition_dataset
from pipeline import BCConfig
from protocols.shards import ShardReader, decode_record

DATA = os.path.join(os.path.dirname(os.path.abspath(__file__)), "data")


@pytest.fixture(scope="module")
def ray2():
    ray.init(num_cpus=2, include_dashboard=False, logging_level="ERROR", log_to_driver=False)
    yield
    ray.shutdown()


def _local_chunks(files):
    out = []
    for f in files:
        reader = ShardReader(f)
        for _, frame in reader.frames():
            out += decode_record(frame, reader.limits)
    return out


def test_transitions_equal_what_the_shards_hold(ray2):
    files = sorted(glob.glob(os.path.join(DATA, "cartpole_random", "*.rshard")))
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
        np.testing.assert_array_equal(got["action_logp"][rows], c.extra["action_logp"])
        assert got["terminated"][rows][-1] == c.terminated and not got["terminated"][rows][:-1].any()


def test_a_torn_shard_is_counted_and_the_records_before_it_read(ray2, tmp_path):
    src = sorted(glob.glob(os.path.join(DATA, "cartpole_expert", "*.rshard")))[0]
    torn = tmp_path / "rec"
    torn.mkdir()
    shutil.copy(os.path.join(DATA, "cartpole_expert", "manifest.json"), torn / "manifest.json")
    data = open(src, "rb").read()
    offsets = [off for off, _ in ShardReader(src).frames()]
    (torn / "runner001-00000.rshard").write_bytes(data[:offsets[5] + 100])  # killed while writing record 6
    rows = list(record_dataset([str(torn / "runner001-00000.rshard")]).iter_rows())
    good = [r for r in rows if len(r["frame"])]
    assert len(good) == 5 and any(r["offset"] == -2 for r in rows)


@pytest.mark.parametrize("num_env_runners", [0, 1])
def test_bc_trains_with_the_ray_data_reader(ray2, num_env_runners):
    algo = (BCConfig().offline_data(input_=os.path.join(DATA, "cartpole_expert"), input_reader="ray_data")
            .env_runners(num_env_runners=num_env_runners)
            .training(train_batch_size_per_learner=256, minibatch_size=128).debugging(seed=0).build(logdir=None))
    try:
        for _ in range(3):
            result = algo.train()
        assert result["num_env_steps_trained_lifetime"] >= 3 * 256
    finally:
        algo.stop()
