"""``runnel import minari``: datasets written here in Minari 0.5's on-disk layout (with h5py, the way
minari's HDF5 storage writes them), imported, read back step for step, inspected, and trained on
by BC; nested spaces, infos, JPEG-encoded images, and the errors people meet."""
import glob
import io
import json
import os
import sys

import gymnasium as gym
import numpy as np
import pytest

h5py = pytest.importorskip("h5py", reason="runnel import minari reads HDF5 with h5py (the dev extra installs it)")

from actors.env import EnvRunnerSettings  # noqa: E402
from actors.offline import OfflineReader, ReaderSettings  # noqa: E402
from pipeline import BCConfig  # noqa: E402
from pipeline.cli.main import main  # noqa: E402
from pipeline.offline.import_minari import MinariImportError, import_minari  # noqa: E402
from pipeline.offline.record import inspect_recording  # noqa: E402
from protocols import nested  # noqa: E402
from protocols.shards import ShardReader  # noqa: E402

S = gym.spaces


# --- writing Minari 0.5's layout ---------------------------------------------------------------
def _space_desc(space):
    """Minari's serialization of a space (metadata.json holds the top level as a JSON string)."""
    if isinstance(space, S.Box):
        return {"type": "Box", "dtype": str(space.dtype), "shape": list(space.shape), "low": space.low.tolist(),
                "high": space.high.tolist()}
    if isinstance(space, S.Discrete):
        return {"type": "Discrete", "dtype": "int64", "start": int(space.start), "n": int(space.n)}
    if isinstance(space, S.MultiDiscrete):
        return {"type": "MultiDiscrete", "dtype": str(space.dtype), "nvec": space.nvec.tolist(),
                "start": space.start.tolist()}
    if isinstance(space, S.MultiBinary):
        return {"type": "MultiBinary", "n": space.n}
    if isinstance(space, S.Dict):
        return {"type": "Dict", "subspaces": {k: _space_desc(s) for k, s in space.spaces.items()}}
    if isinstance(space, S.Tuple):
        return {"type": "Tuple", "subspaces": [_space_desc(s) for s in space.spaces]}
    raise AssertionError(space)


def _write_tree(group, key, value, jpeg_space=None):
    """A column as minari writes it: dicts as groups, tuples as groups of ``_index_<i>``, leaves as
    resizable chunked datasets; images of an image space as one JPEG byte string per row."""
    if isinstance(value, dict):
        sub = group.create_group(key)
        for k, v in value.items():
            _write_tree(sub, k, v, jpeg_space.spaces[k] if jpeg_space is not None else None)
    elif isinstance(value, tuple):
        sub = group.create_group(key)
        for i, v in enumerate(value):
            _write_tree(sub, f"_index_{i}", v, jpeg_space.spaces[i] if jpeg_space is not None else None)
    elif jpeg_space is not None and isinstance(jpeg_space, S.Box) and jpeg_space.dtype == np.uint8 \
            and len(jpeg_space.shape) == 3 and jpeg_space.shape[0] >= 32:
        frames = [_jpeg(f) for f in value]
        dt = h5py.vlen_dtype(np.uint8) if len({len(f) for f in frames}) > 1 else None
        group.create_dataset(key, data=frames, dtype=dt, chunks=True)
    else:
        value = np.asarray(value)
        group.create_dataset(key, data=value, chunks=True, maxshape=(None, *value.shape[1:]))


def _jpeg(frame):
    from PIL import Image

    buf = io.BytesIO()
    Image.fromarray(frame).save(buf, format="JPEG")
    return np.frombuffer(buf.getvalue(), np.uint8)


def write_minari(root, dataset_id, obs_space, act_space, episodes, jpeg_encoding=False, **meta_extra):
    """``episodes``: dicts with observations (T + 1 rows), actions, rewards, terminations, truncations
    and optionally infos, each a column tree; written as ``root/data/{metadata.json,main_data.hdf5}``."""
    data = root / "data"
    data.mkdir(parents=True)
    with h5py.File(data / "main_data.hdf5", "w", track_order=True) as f:
        for i, ep in enumerate(episodes):
            g = f.create_group(f"episode_{i}")
            g.attrs["id"], g.attrs["seed"], g.attrs["total_steps"] = i, i, len(ep["rewards"])
            for key in ("observations", "actions", "rewards", "terminations", "truncations", "infos"):
                if key in ep:
                    space = {"observations": obs_space, "actions": act_space}.get(key) if jpeg_encoding else None
                    _write_tree(g, key, ep[key], space)
    meta = {"total_episodes": len(episodes), "total_steps": sum(len(e["rewards"]) for e in episodes),
            "data_format": "hdf5", "jpeg_encoding": jpeg_encoding,
            "observation_space": json.dumps(_space_desc(obs_space)), "action_space": json.dumps(_space_desc(act_space)),
            "dataset_size": 0.1, "dataset_id": dataset_id, "minari_version": "0.5.4", "algorithm_name": "fixed",
            **meta_extra}
    (data / "metadata.json").write_text(json.dumps(meta))


def cartpole_episodes(n=6, seed=0, max_steps=40):
    """CartPole played by a fixed policy (push toward the pole's lean), some episodes truncated at
    ``max_steps``, some terminated."""
    env = gym.make("CartPole-v1", max_episode_steps=max_steps)
    eps = []
    for i in range(n):
        obs, _ = env.reset(seed=seed + i)
        o, a, r, te, tr = [obs], [], [], [], []
        while True:
            action = int(obs[2] > 0) if i % 2 == 0 else int(obs[3] < 0)  # odd ones fall over
            obs, rew, term, trunc, _ = env.step(action)
            o.append(obs), a.append(action), r.append(rew), te.append(term), tr.append(trunc)
            if term or trunc:
                break
        eps.append({"observations": np.array(o, np.float32), "actions": np.array(a, np.int64),
                    "rewards": np.array(r, np.float64), "terminations": np.array(te), "truncations": np.array(tr)})
    env.close()
    return eps, env.observation_space, env.action_space


def read_back(out):
    """Every chunk of a recording, by episode id, straight from its shards."""
    chunks = {}
    for path in glob.glob(os.path.join(out, "*.rshard")):
        for c in ShardReader(path).chunks():
            assert c.episode_id not in chunks
            chunks[c.episode_id] = c
    return chunks


def assert_tree_equal(a, b):
    fa, fb = nested.flatten(a), nested.flatten(b)
    assert len(fa) == len(fb)
    for x, y in zip(fa, fb):
        assert x.dtype == y.dtype and x.shape == y.shape
        np.testing.assert_array_equal(x, y)


# --- tests ---------------------------------------------------------------------------------------
def test_cartpole_round_trips_step_for_step_inspects_and_bc_trains(tmp_path):
    eps, obs_space, act_space = cartpole_episodes()
    assert {bool(e["terminations"][-1]) for e in eps} == {True, False}  # both endings are exercised
    write_minari(tmp_path / "ds", "cartpole/fixed-v0", obs_space, act_space, eps)
    out = str(tmp_path / "rec")
    summary = import_minari(str(tmp_path / "ds"), out)
    assert summary["episodes"] == 6 and summary["steps"] == sum(len(e["rewards"]) for e in eps)
    assert summary["unfinished_episodes"] == 0 == summary["empty_episodes"]

    got = read_back(out)
    assert len(got) == 6
    for i, e in enumerate(eps):
        c = got[f"minari-cartpole/fixed-v0-{i}"]
        assert c.chunk_index == 0 and len(c) == len(e["rewards"])
        np.testing.assert_array_equal(c.obs, e["observations"])  # T + 1 rows: the final observation is the last
        np.testing.assert_array_equal(c.obs[-1], e["observations"][-1])
        np.testing.assert_array_equal(c.actions, e["actions"])
        np.testing.assert_array_equal(c.rewards, e["rewards"].astype(np.float32))
        assert (c.terminated, c.truncated) == (bool(e["terminations"][-1]), bool(e["truncations"][-1]))
        assert c.is_done

    # the reader that training uses serves the same whole episodes
    settings = EnvRunnerSettings(env_creator=None, rollout_fragment_length=10, seed=0, action_space=act_space)
    reader = OfflineReader(settings, offline=ReaderSettings(out, shuffle_buffer_size=0))
    served = {}
    while reader.epoch == 0:
        for c in reader.sample(num_timesteps=1):
            served[c.episode_id] = c
    assert sorted(served) == sorted(got)
    for k, c in served.items():
        np.testing.assert_array_equal(c.obs, got[k].obs)
        np.testing.assert_array_equal(c.actions, got[k].actions)

    info = inspect_recording(out)
    assert info["episodes"] == 6 and info["steps"] == summary["steps"]
    assert info["algorithm"] == "minari:cartpole/fixed-v0"
    assert info["damaged_records"] == 0 == info["torn_tails"]
    manifest = json.loads((tmp_path / "rec" / "manifest.json").read_text())
    assert manifest["observation_space"]["type"] == "Box" and manifest["action_space"]["type"] == "Discrete"
    assert manifest["config"]["minari_metadata"]["algorithm_name"] == "fixed"

    algo = (BCConfig().environment("CartPole-v1").offline_data(input_=out).env_runners(num_env_runners=0)
            .training(train_batch_size_per_learner=64, minibatch_size=32).build(logdir=None))
    try:
        result = algo.train()
        assert result["num_env_steps_trained_lifetime"] >= 64
    finally:
        algo.stop()


def test_nested_spaces_infos_and_unfinished_episodes(tmp_path):
    obs_space = S.Dict({"pos": S.Box(-1, 1, (3,), np.float32),
                        "parts": S.Tuple((S.Discrete(4), S.MultiBinary(2))),
                        "wide": S.Box(-5, 5, (2, 2), np.float64)})
    act_space = S.MultiDiscrete([3, 2])
    rng = np.random.default_rng(0)
    eps = []
    for i, (steps, ending) in enumerate([(5, "term"), (7, "trunc"), (0, None), (4, None)]):
        def col(space, rows):
            if isinstance(space, S.Dict):
                return {k: col(s, rows) for k, s in space.spaces.items()}
            if isinstance(space, S.Tuple):
                return tuple(col(s, rows) for s in space.spaces)
            return np.stack([space.sample() for _ in range(rows)]) if rows else np.zeros((0, *space.shape), space.dtype)
        term, trunc = np.zeros(steps, bool), np.zeros(steps, bool)
        if ending == "term":
            term[-1] = True
        elif ending == "trunc":
            trunc[-1] = True
        eps.append({"observations": col(obs_space, steps + 1), "actions": col(act_space, steps),
                    "rewards": rng.normal(size=steps), "terminations": term, "truncations": trunc,
                    "infos": {"step": np.arange(steps + 1), "sub": {"x": np.arange(steps + 1) * 0.5},
                              "label": np.array([f"s{t}" for t in range(steps + 1)], dtype=h5py.string_dtype())}})
    write_minari(tmp_path / "ds", "nested/test-v0", obs_space, act_space, eps)
    out = tmp_path / "rec"
    summary = import_minari(str(tmp_path / "ds" / "data"), str(out), infos=True)  # data/ itself works too
    assert (summary["episodes"], summary["empty_episodes"], summary["unfinished_episodes"]) == (3, 1, 1)

    got = read_back(str(out))
    assert sorted(got) == [f"minari-nested/test-v0-{i}" for i in (0, 1, 3)]
    for i in (0, 1, 3):
        c, e = got[f"minari-nested/test-v0-{i}"], eps[i]
        assert_tree_equal(c.obs, e["observations"])
        assert_tree_equal(c.actions, e["actions"])
        np.testing.assert_array_equal(c.rewards, e["rewards"].astype(np.float32))
        assert len(c.infos) == len(c) + 1
        assert c.infos[0] == {"step": 0, "sub": {"x": 0.0}, "label": "s0"}
        assert c.infos[-1]["step"] == len(c) and c.infos[-1]["label"] == f"s{len(c)}"
    assert (got["minari-nested/test-v0-0"].terminated, got["minari-nested/test-v0-0"].truncated) == (True, False)
    assert (got["minari-nested/test-v0-1"].terminated, got["minari-nested/test-v0-1"].truncated) == (False, True)
    # an episode ending with neither flag is written as truncated (as Minari's collector closes one)
    assert (got["minari-nested/test-v0-3"].terminated, got["minari-nested/test-v0-3"].truncated) == (False, True)
    info = inspect_recording(str(out))
    assert info["episodes"] == 3

    # without infos=True the infos stay behind
    out2 = tmp_path / "rec2"
    import_minari(str(tmp_path / "ds"), str(out2))
    assert all(c.infos == [] for c in read_back(str(out2)).values())


def test_jpeg_encoded_images_are_decoded(tmp_path):
    pytest.importorskip("PIL", reason="Minari's JPEG-encoded images are decoded with Pillow")
    from PIL import Image

    obs_space, act_space = S.Box(0, 255, (32, 32, 3), np.uint8), S.Discrete(3, start=1)
    rng = np.random.default_rng(1)
    eps = [{"observations": rng.integers(0, 256, (t + 1, 32, 32, 3), dtype=np.uint8),
            "actions": rng.integers(1, 4, t), "rewards": np.ones(t), "terminations": np.arange(t) == t - 1,
            "truncations": np.zeros(t, bool)} for t in (3, 5)]
    write_minari(tmp_path / "ds", "pixels/test-v0", obs_space, act_space, eps, jpeg_encoding=True)
    out = str(tmp_path / "rec")
    import_minari(str(tmp_path / "ds"), out)
    got = read_back(out)
    for i, e in enumerate(eps):
        c = got[f"minari-pixels/test-v0-{i}"]
        want = np.stack([np.asarray(Image.open(io.BytesIO(_jpeg(f).tobytes()))) for f in e["observations"]])
        assert c.obs.dtype == np.uint8 and c.obs.shape == (len(e["rewards"]) + 1, 32, 32, 3)
        np.testing.assert_array_equal(c.obs, want)
        np.testing.assert_array_equal(c.actions, e["actions"])


def test_cli_import_inspect_and_errors(tmp_path, capsys):
    eps, obs_space, act_space = cartpole_episodes(n=2)
    write_minari(tmp_path / "ds", "cartpole/cli-v0", obs_space, act_space, eps)
    rec = str(tmp_path / "rec")
    assert main(["import", "minari", str(tmp_path / "ds"), rec, "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["episodes"] == 2 and out["dataset_id"] == "cartpole/cli-v0"
    assert main(["inspect", rec, "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["episodes"] == 2
    assert main(["import", "minari", str(tmp_path / "ds"), str(tmp_path / "rec_text")]) == 0
    assert "imported Minari dataset cartpole/cli-v0: 2 episodes" in capsys.readouterr().out

    def fails(args, *needles):
        assert main(["import", "minari", *args]) == 2
        err = capsys.readouterr().err
        for needle in needles:
            assert needle in err, err

    fails([str(tmp_path / "ds"), rec], "already exists and is not empty")
    fails([str(tmp_path / "nothing"), str(tmp_path / "r1")], "is not a Minari dataset", "data/metadata.json")
    assert not os.path.exists(tmp_path / "r1")


def _dataset_with(tmp_path, name, change_meta=None, change_file=None):
    eps, obs_space, act_space = cartpole_episodes(n=2)
    write_minari(tmp_path / name, f"cartpole/{name}-v0", obs_space, act_space, eps)
    meta_path = tmp_path / name / "data" / "metadata.json"
    if change_meta:
        meta = json.loads(meta_path.read_text())
        change_meta(meta)
        meta_path.write_text(json.dumps(meta))
    if change_file:
        with h5py.File(tmp_path / name / "data" / "main_data.hdf5", "a") as f:
            change_file(f)
    return str(tmp_path / name)


def _set_obs_space(meta, desc):
    meta["observation_space"] = json.dumps(desc)


@pytest.mark.parametrize("case, needles", [
    ("text_space", ["observation_space['name']", "'Text' space", "Box, Discrete"]),
    ("arrow", ["stored as 'arrow'", "data_format='hdf5'"]),
    ("no_spaces", ["no observation_space or action_space"]),
    ("no_main_file", ["main_data.hdf5"]),
    ("not_hdf5", ["main_data.hdf5 cannot be read as HDF5"]),
    ("no_terminations", ["episode_1 has no 'terminations'", "where its episodes end"]),
    ("no_truncations", ["episode_0 has no 'truncations'"]),
    ("early_end", ["episode_0 ends at step 2", "before its last step"]),
    ("short_obs", ["episode_1/observations has", "expected"]),
    ("wrong_shape", ["episode_0/observations has rows of shape (3,)"]),
])
def test_errors_name_the_problem_and_leave_no_output(tmp_path, case, needles):
    def drop(key, ep):
        return lambda f: f[f"episode_{ep}"].__delitem__(key)

    def replace(key, ep, value):
        def change(f):
            del f[f"episode_{ep}"][key]
            f[f"episode_{ep}"].create_dataset(key, data=value)
        return change

    def early(f):
        f["episode_0"]["terminations"][2] = True

    setups = {
        "text_space": dict(change_meta=lambda m: _set_obs_space(m, {"type": "Dict", "subspaces": {
            "name": {"type": "Text", "max_length": 3, "min_length": 1, "charset": "ab"}}})),
        "arrow": dict(change_meta=lambda m: m.update(data_format="arrow")),
        "no_spaces": dict(change_meta=lambda m: [m.pop("observation_space"), m.pop("action_space")]),
        "no_main_file": dict(),
        "not_hdf5": dict(),
        "no_terminations": dict(change_file=drop("terminations", 1)),
        "no_truncations": dict(change_file=drop("truncations", 0)),
        "early_end": dict(change_file=early),
        "short_obs": dict(change_file=replace("observations", 1, np.zeros((2, 4), np.float32))),
        "wrong_shape": dict(),
    }
    ds = _dataset_with(tmp_path, "ds", **setups[case])
    if case == "no_main_file":
        os.remove(os.path.join(ds, "data", "main_data.hdf5"))
    if case == "not_hdf5":
        with open(os.path.join(ds, "data", "main_data.hdf5"), "wb") as f:
            f.write(b"not an HDF5 file" * 10)
    if case == "wrong_shape":  # keep the row count right so that the shape is what fails
        with h5py.File(os.path.join(ds, "data", "main_data.hdf5"), "a") as f:
            rows = len(f["episode_0"]["rewards"]) + 1
            del f["episode_0"]["observations"]
            f["episode_0"].create_dataset("observations", data=np.zeros((rows, 3), np.float32))
    out = tmp_path / "rec"
    with pytest.raises(MinariImportError) as err:
        import_minari(ds, str(out))
    for needle in needles:
        assert needle in str(err.value), str(err.value)
    assert not out.exists() and not [p for p in os.listdir(tmp_path) if "importing" in p]


def test_missing_h5py_names_the_install(tmp_path, monkeypatch):
    ds = _dataset_with(tmp_path, "ds")
    monkeypatch.setitem(sys.modules, "h5py", None)  # import h5py raises ImportError
    hint = r"needs h5py: pip install 'runnel-rl\[minari\]' \(or pip install h5py\)"
    with pytest.raises(MinariImportError, match=hint):
        import_minari(ds, str(tmp_path / "rec"))
    assert not (tmp_path / "rec").exists()
