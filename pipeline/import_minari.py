"""``runnel import minari DATASET_DIR OUT``: a Minari dataset (its on-disk HDF5 format, read with
``h5py``; the ``minari`` package is not needed) as a runnel recording.

Minari 0.5 keeps a dataset in ``DATASET_DIR/data/``: ``metadata.json`` (``data_format``, the spaces
serialized as JSON, ``dataset_id``...) and ``main_data.hdf5`` with one group per episode,
``episode_<i>``, holding ``observations`` (``T + 1`` rows: the last is the final observation),
``actions``, ``rewards``, ``terminations`` and ``truncations`` (``T`` rows each); Dict and Tuple
spaces are groups (Tuple members named ``_index_<i>``). Each episode becomes one whole-episode
chunk; Box actions are kept in the env's units (the manifest says so, readers rescale them).
"""
from __future__ import annotations

import json
import os
from typing import Any

import gymnasium as gym
import numpy as np

from actors.offline import Recorder, RecordingSettings, write_manifest
from pipeline.version import runnel_version
from protocols.episode import EpisodeChunk

SPACE_TYPES = ("Box", "Discrete", "MultiDiscrete", "MultiBinary", "Dict", "Tuple")


class MinariImportError(ValueError):
    """A dataset that cannot be imported; the message names the file or space and what would work."""


def space_from_minari(desc: Any) -> gym.Space:
    """Minari's serialized space (a dict, or that dict as a JSON string) -> a gymnasium space."""
    if isinstance(desc, str):
        desc = json.loads(desc)
    kind = desc.get("type")
    if kind == "Box":
        dtype = np.dtype(desc["dtype"])
        return gym.spaces.Box(np.array(desc["low"], dtype), np.array(desc["high"], dtype), tuple(desc["shape"]), dtype)
    if kind == "Discrete":
        return gym.spaces.Discrete(int(desc["n"]), start=int(desc.get("start", 0)))
    if kind == "MultiDiscrete":
        return gym.spaces.MultiDiscrete(desc["nvec"], dtype=desc.get("dtype", "int64"), start=desc.get("start"))
    if kind == "MultiBinary":
        return gym.spaces.MultiBinary(desc["n"])
    if kind == "Dict":
        return gym.spaces.Dict({k: space_from_minari(v) for k, v in desc["subspaces"].items()})
    if kind == "Tuple":
        return gym.spaces.Tuple([space_from_minari(v) for v in desc["subspaces"]])
    raise MinariImportError(f"Minari space type {kind!r} is not supported (runnel reads {list(SPACE_TYPES)})")


def _read(node: Any, space: gym.Space) -> Any:
    if isinstance(space, gym.spaces.Dict):
        return {k: _read(node[k], s) for k, s in space.spaces.items()}
    if isinstance(space, gym.spaces.Tuple):
        return tuple(_read(node[f"_index_{i}"], s) for i, s in enumerate(space.spaces))
    return np.asarray(node[()])


def _rows(tree: Any) -> int:
    if isinstance(tree, dict):
        return _rows(next(iter(tree.values())))
    if isinstance(tree, tuple):
        return _rows(tree[0])
    return len(tree)


def import_minari(dataset_dir: str, out: str) -> dict[str, Any]:
    """Write ``dataset_dir``'s episodes into the recording ``out``; returns a summary."""
    data = os.path.join(dataset_dir, "data") if os.path.isdir(os.path.join(dataset_dir, "data")) else dataset_dir
    meta_path, main_path = os.path.join(data, "metadata.json"), os.path.join(data, "main_data.hdf5")
    if not os.path.isfile(meta_path):
        raise MinariImportError(f"{dataset_dir!r} is not a Minari dataset: no {meta_path} (a dataset directory holds "
                                f"data/metadata.json and data/main_data.hdf5)")
    with open(meta_path, encoding="utf-8") as f:
        meta = json.load(f)
    if meta.get("data_format", "hdf5") != "hdf5":
        raise MinariImportError(f"{dataset_dir!r} is stored as {meta['data_format']!r}; runnel imports Minari's "
                                f"'hdf5' format (re-create the dataset with data_format='hdf5')")
    if "observation_space" not in meta or "action_space" not in meta:
        raise MinariImportError(f"{meta_path} holds no observation_space/action_space (runnel does not rebuild the "
                                f"env to learn them)")
    obs_space, act_space = space_from_minari(meta["observation_space"]), space_from_minari(meta["action_space"])
    if meta.get("jpeg_encoding") and any(getattr(s, "dtype", None) == np.uint8 and len(getattr(s, "shape", ())) == 3
                                         for s in (obs_space, act_space)):
        raise MinariImportError(f"{dataset_dir!r} stores its images JPEG-encoded, which runnel does not decode")
    if not os.path.isfile(main_path):
        raise MinariImportError(f"{dataset_dir!r} has no {main_path}")
    try:
        import h5py
    except ImportError:
        raise MinariImportError("reading Minari's HDF5 files needs h5py: pip install 'runnel-rl[minari]' "
                                "(or pip install h5py)") from None
    dataset_id = str(meta.get("dataset_id", os.path.basename(os.path.normpath(dataset_dir))))
    write_manifest(out, obs_space, act_space, f"minari:{dataset_id}", {"minari_metadata": meta}, runnel_version(),
                   actions_normalized=False)
    recorder = Recorder(RecordingSettings(out), "minari000")
    episodes = steps = 0
    try:
        with h5py.File(main_path, "r") as f:
            names = sorted((k for k in f.keys() if k.startswith("episode_")), key=lambda k: int(k.split("_")[1]))
            for name in names:
                group = f[name]
                for key in ("observations", "actions", "rewards", "terminations", "truncations"):
                    if key not in group:
                        raise MinariImportError(f"{main_path}: {name} has no {key!r}")
                obs, actions = _read(group["observations"], obs_space), _read(group["actions"], act_space)
                rewards = np.asarray(group["rewards"][()], np.float32)
                term, trunc = np.asarray(group["terminations"][()], bool), np.asarray(group["truncations"][()], bool)
                n = len(rewards)
                if _rows(obs) != n + 1 or _rows(actions) != n or len(term) != n or len(trunc) != n:
                    raise MinariImportError(f"{main_path}: {name} has {_rows(obs)} observations, {_rows(actions)} "
                                            f"actions and {n} rewards; Minari episodes have T + 1, T and T")
                if n == 0:
                    continue
                recorder.record([EpisodeChunk(
                    episode_id=f"minari-{dataset_id}-{name.split('_')[1]}", chunk_index=0, obs=obs, actions=actions,
                    rewards=rewards, terminated=bool(term[-1]), truncated=bool(trunc[-1]) and not bool(term[-1]))])
                episodes += 1
                steps += n
    finally:
        recorder.close()
    return {"dataset_id": dataset_id, "episodes": episodes, "steps": steps, "output": out,
            "observation_space": str(obs_space), "action_space": str(act_space)}
