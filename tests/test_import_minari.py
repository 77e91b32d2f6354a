"""``runnel import minari``: a dataset written here in Minari 0.5's on-disk layout (h5py), imported,
read back step for step, inspected, and trained on by BC."""
import json
import os

import gymnasium as gym
import numpy as np
import pytest

h5py = pytest.importorskip("h5py", reason="runnel import minari reads HDF5 with h5py (the dev extra installs it)")

from actors.offline import OfflineReader, ReaderSettings  # noqa: E402
from actors.env import EnvRunnerSettings  # noqa: E402
from pipeline import BCConfig  # noqa: E402
from pipeline.cli import main  # noqa: E402
from pipeline.import_minari import MinariImportError, import_minari  # noqa: E402
from pipeline.record import inspect_recording  # noqa: E402


def _space_json(space):
    """Minari's serialization of the spaces used here (a JSON string inside metadata.json)."""
    if isinstance(space, gym.spaces.Box):
        d = {"type": "Box", "dtype": str(space.dtype), "shape": list(space.shape), "low": space.low.tolist(),
             "high": space.high.tolist()}
    else:
        d = {"type": "Discrete", "dtype": "int64", "start": int(space.start), "n": int(space.n)}
    return json.dumps(d)


def make_minari_dataset(root, episodes=6, seed=0):
    """CartPole episodes played by a fixed policy, written as Minari 0.5 writes them."""
    env = gym.make("CartPole-v1", max_episode_steps=60)
    data = root / "data"
    data.mkdir(parents=True)
    played = []
    with h5py.File(data / "main_data.hdf5", "w", track_order=True) as f:
        for i in range(episodes):
            obs, _ = env.reset(seed=seed + i)
            o, a, r, te, tr = [obs], [], [], [], []
            while True:
                action = int(obs[2] > 0)  # push toward the pole's lean
                obs, rew, term, trunc, _ = env.step(action)
                o.append(obs), a.append(action), r.append(rew), te.append(term), tr.append(trunc)
                if term or trunc:
                    break
            g = f.create_group(f"episode_{i}")
            g.attrs["id"], g.attrs["total_steps"] = i, len(r)
            g.create_dataset("observations", data=np.array(o, np.float32))
            g.create_dataset("actions", data=np.array(a, np.int64))
            g.create_dataset("rewards", data=np.array(r, np.float64))
            g.create_dataset("terminations", data=np.array(te))
            g.create_dataset("truncations", data=np.array(tr))
            played.append((np.array(o, np.float32), np.array(a), np.array(r, np.float32), te[-1], tr[-1]))
    meta = {"total_episodes": episodes, "total_steps": sum(len(p[2]) for p in played), "data_format": "hdf5",
            "jpeg_encoding": False, "dataset_id": "cartpole/test-v0",
            "observation_space": _space_json(env.observation_space), "action_space": _space_json(env.action_space)}
    (data / "metadata.json").write_text(json.dumps(meta))
    return played


def test_every_step_round_trips_and_bc_trains_on_it(tmp_path):
    played = make_minari_dataset(tmp_path / "ds")
    out = str(tmp_path / "rec")
    summary = import_minari(str(tmp_path / "ds"), out)
    assert summary["episodes"] == 6 and summary["steps"] == sum(len(p[2]) for p in played)
    settings = EnvRunnerSettings(env_creator=None, rollout_fragment_length=10, seed=0,
                                 action_space=gym.spaces.Discrete(2))
    reader = OfflineReader(settings, offline=ReaderSettings(out, shuffle_buffer_size=0))
    got = {}
    while reader.epoch == 0:
        for c in reader.sample(num_timesteps=1):
            got[c.episode_id] = c
    assert len(got) == 6
    for i, (obs, actions, rewards, term, trunc) in enumerate(played):
        c = got[f"minari-cartpole/test-v0-{i}"]
        np.testing.assert_array_equal(c.obs, obs)  # T + 1 rows: next obs at the end included
        np.testing.assert_array_equal(c.actions, actions)
        np.testing.assert_array_equal(c.rewards, rewards)
        assert (c.terminated, c.truncated) == (term, trunc and not term)
    info = inspect_recording(out)
    assert info["episodes"] == 6 and info["algorithm"] == "minari:cartpole/test-v0"
    algo = (BCConfig().offline_data(input_=out).env_runners(num_env_runners=0)
            .training(train_batch_size_per_learner=64, minibatch_size=32).build(logdir=None))
    try:
        assert algo.train()["num_env_steps_trained_lifetime"] >= 64
    finally:
        algo.stop()


def test_cli_import_and_errors(tmp_path, capsys):
    make_minari_dataset(tmp_path / "ds", episodes=2)
    assert main(["import", "minari", str(tmp_path / "ds"), str(tmp_path / "rec"), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["episodes"] == 2
    assert main(["import", "minari", str(tmp_path / "ds"), str(tmp_path / "rec")]) == 2
    assert "already holds a recording" in capsys.readouterr().err
    assert main(["import", "minari", str(tmp_path / "nothing"), str(tmp_path / "rec2")]) == 2
    assert "is not a Minari dataset" in capsys.readouterr().err
    meta_path = tmp_path / "ds" / "data" / "metadata.json"
    meta = json.loads(meta_path.read_text())
    meta["observation_space"] = json.dumps({"type": "Text", "max_length": 3, "min_length": 1, "charset": "ab"})
    meta_path.write_text(json.dumps(meta))
    with pytest.raises(MinariImportError, match="'Text' is not supported"):
        import_minari(str(tmp_path / "ds"), str(tmp_path / "rec3"))
    meta["data_format"] = "arrow"
    meta_path.write_text(json.dumps(meta))
    with pytest.raises(MinariImportError, match="stored as 'arrow'"):
        import_minari(str(tmp_path / "ds"), str(tmp_path / "rec4"))
