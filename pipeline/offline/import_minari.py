"""``runnel import minari DATASET_DIR OUT``: a Minari dataset (its on-disk HDF5 format, read with
``h5py``; the ``minari`` package is not needed) as a runnel recording.

Minari 0.5 keeps a dataset in ``DATASET_DIR/data/``: ``metadata.json`` (``data_format``,
``jpeg_encoding``, the spaces serialized as JSON strings, ``dataset_id``...) and ``main_data.hdf5``
with one group per episode, ``episode_<i>``, holding ``observations`` (``T + 1`` rows: the last is
the final observation), ``actions``, ``rewards``, ``terminations`` and ``truncations`` (``T`` rows
each) and, when the dataset recorded them, ``infos`` (a group of ``T + 1``-row datasets: the reset
info, then each step's). Dict and Tuple spaces are groups (Tuple members named ``_index_<i>``);
image spaces may be stored as one JPEG byte string per row (``jpeg_encoding``).

Each episode becomes one whole-episode chunk (its ``T + 1`` observations: the final observation is
the chunk's last row, as runnel's chunks keep it); Box actions stay in the env's units (the manifest
says so, readers rescale them). An episode whose last step is neither terminated nor truncated is
written as truncated, as Minari's own collector does when it closes a running episode. The recording
is written beside ``OUT`` and renamed into place at the end, so a failed import leaves nothing.
"""
from __future__ import annotations

import io
import json
import os
import shutil
import uuid
from typing import Any

import gymnasium as gym
import numpy as np

from actors.offline import Recorder, RecordingSettings, write_manifest
from actors.offline.recorder import RECORD_STEPS
from pipeline.version import runnel_version
from protocols.episode import EpisodeChunk

SPACE_TYPES = ("Box", "Discrete", "MultiDiscrete", "MultiBinary", "Dict", "Tuple")
INSTALL_HINT = "pip install 'runnel-rl[minari]' (or pip install h5py)"


class MinariImportError(ValueError):
    """A dataset that cannot be imported; the message names the file or space and what would work."""


# --- spaces --------------------------------------------------------------------------------------
def space_from_minari(desc: Any, where: str = "space") -> gym.Space:
    """Minari's serialized space (a dict, or that dict as a JSON string) -> a gymnasium space."""
    if isinstance(desc, str):
        try:
            desc = json.loads(desc)
        except json.JSONDecodeError as err:
            raise MinariImportError(f"{where} is not a serialized Minari space ({err})") from None
    if not isinstance(desc, dict) or "type" not in desc:
        raise MinariImportError(f"{where} is not a serialized Minari space: {str(desc)[:200]}")
    kind = desc["type"]
    try:
        if kind == "Box":
            dtype = np.dtype(desc["dtype"])
            return gym.spaces.Box(np.array(desc["low"], dtype), np.array(desc["high"], dtype),
                                  tuple(desc["shape"]), dtype)
        if kind == "Discrete":
            return gym.spaces.Discrete(int(desc["n"]), start=int(desc.get("start", 0)))
        if kind == "MultiDiscrete":
            return gym.spaces.MultiDiscrete(desc["nvec"], dtype=desc.get("dtype", "int64"), start=desc.get("start"))
        if kind == "MultiBinary":
            return gym.spaces.MultiBinary(desc["n"])
        if kind == "Dict":
            return gym.spaces.Dict({k: space_from_minari(v, f"{where}[{k!r}]") for k, v in desc["subspaces"].items()})
        if kind == "Tuple":
            return gym.spaces.Tuple([space_from_minari(v, f"{where}[{i}]") for i, v in enumerate(desc["subspaces"])])
    except (KeyError, TypeError, ValueError) as err:
        if isinstance(err, MinariImportError):
            raise
        raise MinariImportError(f"{where}: a {kind} space described as {json.dumps(desc)[:200]} cannot be "
                                f"rebuilt ({type(err).__name__}: {err})") from None
    raise MinariImportError(f"{where} is a Minari {kind!r} space, which runnel does not support "
                            f"(runnel reads {', '.join(SPACE_TYPES)})")


def is_image_space(space: gym.Space) -> bool:
    """The spaces Minari JPEG-encodes when a dataset has ``jpeg_encoding``: uint8 [0, 255] Boxes of
    2 or 3 dimensions, at least 32 x 32."""
    return (isinstance(space, gym.spaces.Box) and len(space.shape) in (2, 3) and space.shape[0] >= 32
            and space.shape[1] >= 32 and space.dtype == np.uint8 and bool(np.all(space.low == 0))
            and bool(np.all(space.high == 255)))


# --- reading one episode ------------------------------------------------------------------------
def _decode_jpeg(rows: np.ndarray, where: str) -> np.ndarray:
    try:
        from PIL import Image
    except ImportError:
        raise MinariImportError(f"{where} holds JPEG-encoded images; decoding them needs Pillow: "
                                f"pip install pillow") from None
    return np.stack([np.asarray(Image.open(io.BytesIO(np.asarray(r, np.uint8).tobytes())), np.uint8) for r in rows])


def _read(node: Any, space: gym.Space, rows: int, where: str) -> Any:
    """The dataset (or group) ``node`` as arrays shaped like ``space`` with ``rows`` rows."""
    import h5py

    if isinstance(space, (gym.spaces.Dict, gym.spaces.Tuple)):
        if not isinstance(node, h5py.Group):
            raise MinariImportError(f"{where} is a dataset, but its space is a {type(space).__name__}")
        items = (list(space.spaces.items()) if isinstance(space, gym.spaces.Dict)
                 else [(f"_index_{i}", s) for i, s in enumerate(space.spaces)])
        missing = [k for k, _ in items if k not in node]
        if missing:
            raise MinariImportError(f"{where} has no {', '.join(missing)} (its space has {[k for k, _ in items]})")
        parts = [_read(node[k], s, rows, f"{where}/{k}") for k, s in items]
        keys = [k for k, _ in items]
        return dict(zip(keys, parts)) if isinstance(space, gym.spaces.Dict) else tuple(parts)
    if not isinstance(node, h5py.Dataset):
        raise MinariImportError(f"{where} is a group, but its space is a {type(space).__name__}")
    data = node[()]
    if is_image_space(space) and (data.dtype == object or data.ndim == 2):
        data = _decode_jpeg(data, where)  # one JPEG byte string per row (Minari's jpeg_encoding)
    data = np.asarray(data)
    if data.ndim == 0 or len(data) != rows:
        raise MinariImportError(f"{where} has {0 if data.ndim == 0 else len(data)} rows; expected {rows}")
    if data.shape[1:] != tuple(space.shape or ()):
        raise MinariImportError(f"{where} has rows of shape {data.shape[1:]}, but its space {space} has "
                                f"shape {space.shape}")
    return data.astype(space.dtype, copy=False) if space.dtype is not None else data


def _info_rows(group: Any, rows: int, where: str) -> list[dict]:
    """Minari's ``infos`` group (nested groups of ``rows``-row datasets) -> ``rows`` plain dicts."""
    import h5py

    out: list[dict] = [{} for _ in range(rows)]
    for key, node in group.items():
        if isinstance(node, h5py.Group):
            for row, sub in zip(out, _info_rows(node, rows, f"{where}/{key}")):
                row[key] = sub
            continue
        data = node[()]
        if data.ndim == 0 or len(data) != rows:
            raise MinariImportError(f"{where}/{key} has {0 if data.ndim == 0 else len(data)} rows; expected {rows}")
        for row, value in zip(out, data):
            if isinstance(value, bytes) and h5py.check_string_dtype(node.dtype) is not None:
                value = value.decode("utf-8")
            row[key] = value.item() if isinstance(value, np.generic) else value
    return out


def _episode(group: Any, name: str, obs_space: gym.Space, act_space: gym.Space, infos: bool,
             episode_id: str, where: str) -> tuple[EpisodeChunk | None, bool]:
    """One ``episode_<i>`` group as a whole-episode chunk (None when it has no steps), and whether
    its last step was neither terminated nor truncated."""
    for key in ("observations", "actions", "rewards", "terminations", "truncations"):
        if key not in group:
            hint = (" (a dataset without terminations/truncations cannot tell where its episodes end: "
                    "re-create it with Minari 0.4 or later)" if key in ("terminations", "truncations") else "")
            raise MinariImportError(f"{where}/{name} has no {key!r}{hint}")
    rewards = np.asarray(group["rewards"][()], np.float32).reshape(-1)
    steps = len(rewards)
    term = np.asarray(group["terminations"][()], bool).reshape(-1)
    trunc = np.asarray(group["truncations"][()], bool).reshape(-1)
    if len(term) != steps or len(trunc) != steps:
        raise MinariImportError(f"{where}/{name} has {steps} rewards, {len(term)} terminations and "
                                f"{len(trunc)} truncations; Minari episodes have T of each")
    if steps == 0:
        return None, False
    early = np.flatnonzero(term[:-1] | trunc[:-1])
    if len(early):
        raise MinariImportError(f"{where}/{name} ends at step {int(early[0])} of {steps} (terminated or "
                                f"truncated before its last step): not a Minari episode")
    obs = _read(group["observations"], obs_space, steps + 1, f"{where}/{name}/observations")
    actions = _read(group["actions"], act_space, steps, f"{where}/{name}/actions")
    info_rows: list = []
    if infos and "infos" in group:
        info_rows = _info_rows(group["infos"], steps + 1, f"{where}/{name}/infos")
    terminated, unfinished = bool(term[-1]), not (term[-1] or trunc[-1])
    return EpisodeChunk(episode_id=episode_id, chunk_index=0, obs=obs, actions=actions, rewards=rewards,
                        terminated=terminated, truncated=not terminated, infos=info_rows), unfinished


# --- the import -----------------------------------------------------------------------------------
def read_metadata(dataset_dir: str) -> tuple[str, dict[str, Any]]:
    """``(data directory, metadata)`` of a Minari dataset (``DATASET_DIR`` or its ``data/``)."""
    data = os.path.join(dataset_dir, "data") if os.path.isdir(os.path.join(dataset_dir, "data")) else dataset_dir
    meta_path = os.path.join(data, "metadata.json")
    if not os.path.isfile(meta_path):
        raise MinariImportError(f"{dataset_dir!r} is not a Minari dataset: no {meta_path} (a dataset directory, "
                                f"such as ~/.minari/datasets/NAMESPACE/NAME-v0, holds data/metadata.json and "
                                f"data/main_data.hdf5)")
    try:
        with open(meta_path, encoding="utf-8") as f:
            meta = json.load(f)
    except json.JSONDecodeError as err:
        raise MinariImportError(f"{meta_path} is not valid JSON ({err})") from None
    if not isinstance(meta, dict):
        raise MinariImportError(f"{meta_path} holds no metadata object")
    return data, meta


def import_minari(dataset_dir: str, out: str, infos: bool = False) -> dict[str, Any]:
    """Write ``dataset_dir``'s episodes into the new recording ``out``; returns a summary.

    ``infos``: also import each step's info dict (when the dataset recorded them)."""
    data, meta = read_metadata(dataset_dir)
    meta_path, main_path = os.path.join(data, "metadata.json"), os.path.join(data, "main_data.hdf5")
    fmt = meta.get("data_format", "hdf5")
    if fmt != "hdf5":
        raise MinariImportError(f"{dataset_dir!r} is stored as {fmt!r}; runnel imports Minari's 'hdf5' format "
                                f"(convert it with minari: load the dataset and re-create it with data_format='hdf5')")
    missing = [k for k in ("observation_space", "action_space") if k not in meta]
    if missing:
        raise MinariImportError(f"{meta_path} has no {' or '.join(missing)}; runnel does not rebuild the env from "
                                f"env_spec to learn them")
    obs_space = space_from_minari(meta["observation_space"], "observation_space")
    act_space = space_from_minari(meta["action_space"], "action_space")
    if not os.path.isfile(main_path):
        raise MinariImportError(f"{dataset_dir!r} has no {main_path} (Minari's hdf5 datasets keep their "
                                f"episodes there)")
    if os.path.isdir(out) and os.listdir(out) or os.path.exists(out) and not os.path.isdir(out):
        raise MinariImportError(f"{out!r} already exists and is not empty: import into a new directory")
    try:
        import h5py
    except ImportError:
        raise MinariImportError(f"reading Minari's HDF5 files needs h5py: {INSTALL_HINT}") from None

    dataset_id = str(meta.get("dataset_id") or os.path.basename(os.path.normpath(dataset_dir)))
    parent = os.path.dirname(os.path.abspath(out))
    os.makedirs(parent, exist_ok=True)
    tmp = os.path.join(parent, f".{os.path.basename(os.path.abspath(out))}.importing-{uuid.uuid4().hex[:8]}")
    config = {"minari_metadata": {k: v for k, v in meta.items() if k not in ("observation_space", "action_space")},
              "minari_dataset_dir": os.path.abspath(dataset_dir), "infos": bool(infos)}
    summary = {"dataset_id": dataset_id, "episodes": 0, "steps": 0, "empty_episodes": 0, "unfinished_episodes": 0}
    try:
        write_manifest(tmp, obs_space, act_space, f"minari:{dataset_id}", config, runnel_version(),
                       actions_normalized=False)
        recorder = Recorder(RecordingSettings(tmp), "minari000")
        try:
            with h5py.File(main_path, "r") as f:
                names = [k for k in f.keys() if k.startswith("episode_") and k[len("episode_"):].isdigit()]
                if not names:
                    raise MinariImportError(f"{main_path} holds no episode_<i> groups")
                batch: list[EpisodeChunk] = []
                batch_steps = 0
                for name in sorted(names, key=lambda k: int(k[len("episode_"):])):
                    chunk, unfinished = _episode(f[name], name, obs_space, act_space, infos,
                                                 f"minari-{dataset_id}-{name[len('episode_'):]}", main_path)
                    if chunk is None:
                        summary["empty_episodes"] += 1
                        continue
                    summary["episodes"] += 1
                    summary["steps"] += len(chunk)
                    summary["unfinished_episodes"] += unfinished
                    batch.append(chunk)
                    batch_steps += len(chunk)
                    if batch_steps >= RECORD_STEPS:  # the recorder packs one call's episodes into records
                        recorder.record(batch)
                        batch, batch_steps = [], 0
                recorder.record(batch)
        except OSError as err:
            raise MinariImportError(f"{main_path} cannot be read as HDF5 ({err})") from err
        finally:
            recorder.close()
        recorder.flush()  # raises if the writer failed
        if os.path.isdir(out):
            os.rmdir(out)  # empty (checked above)
        os.replace(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    summary.update(output=out, observation_space=str(obs_space), action_space=str(act_space))
    return summary
