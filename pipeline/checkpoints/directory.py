"""Checkpoint directories: written atomically, read without unpickling anything from the files.

Layout::

    manifest.json   format version, algorithm, runnel version, files
    config.json     the algorithm config (plain data; callables as import paths)
    learner.pt      module, target and optimizer tensors, the learner's named fields, RNGs
                    (loaded with torch weights_only=True)
    modules/<id>/learner.pt
                    multi-agent runs: each module's learner state, one subdirectory per module
                    (learner.pt then holds what the MultiLearner keeps besides, and the module ids)
    state.json      iteration, time, weights version, the metrics logger's state (counters and
                    episode-metric windows), numpy RNG state
    runners.pt      each env runner's state: weights, counters, RNG, its running episodes
                    (torch weights_only=True; chunks inside as codec frames)
    replay.npz      with ``store_buffer_in_checkpoints``: the replay stage's arrays (read with
    replay.json     ``allow_pickle=False``) and the rest of its state

The directory is written under a temporary name beside the target and renamed into place, so a
crash while saving leaves the previous checkpoint at that path intact.
"""
from __future__ import annotations

import json
import os
import shutil
import uuid
from pathlib import Path
from typing import Any

import numpy as np
import torch

from pipeline.checkpoints.errors import CheckpointError

FORMAT_VERSION = 2
RUNNEL_VERSION = "0.2.0"
MANIFEST = "manifest.json"


def write_checkpoint(path: str | os.PathLike, algorithm: str, config: dict, learner_state: dict,
                     state: dict, native_module: Any = None, runner_states: dict | None = None,
                     replay_state: dict | None = None) -> str:
    target = Path(path).expanduser().resolve()
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = target.parent / f".{target.name}.tmp-{uuid.uuid4().hex[:8]}"
    tmp.mkdir()
    try:
        (tmp / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True))
        files = ["config.json", "learner.pt", "state.json"]
        learner_state = dict(learner_state)
        modules = learner_state.get("modules")
        if isinstance(modules, dict):  # a MultiLearner's state: one subdirectory per module
            learner_state["modules"] = sorted(modules)
            for mid in learner_state["modules"]:
                (tmp / "modules" / mid).mkdir(parents=True)
                _save_learner(modules[mid], tmp / "modules" / mid / "learner.pt")
                files.append(f"modules/{mid}/learner.pt")
        _save_learner(learner_state, tmp / "learner.pt")
        (tmp / "state.json").write_text(json.dumps(state, indent=2, sort_keys=True))
        if runner_states:
            # copies: arrays from remote runners arrive as read-only views into one Ray buffer, and
            # torch.save refuses tensors of different dtypes that share memory
            torch.save(_map_arrays(runner_states, lambda a: torch.from_numpy(np.array(a, copy=True, order="C")),
                                   np.ndarray),
                       tmp / "runners.pt")
            files.append("runners.pt")
        if replay_state:
            arrays: dict[str, Any] = {}
            plain = _split_arrays(replay_state, arrays, "")
            with open(tmp / "replay.npz", "wb") as f:
                np.savez(f, **arrays)
            (tmp / "replay.json").write_text(json.dumps(plain))
            files += ["replay.npz", "replay.json"]
        if native_module is not None:
            torch.save(native_module, tmp / "model_native.pt")  # for users' own tools; runnel never loads it
            files.append("model_native.pt")
        manifest = {"format_version": FORMAT_VERSION, "algorithm": algorithm, "runnel_version": RUNNEL_VERSION,
                    "files": files}
        (tmp / MANIFEST).write_text(json.dumps(manifest, indent=2))
        _fsync_dir(tmp)
        if target.exists():
            old = target.parent / f".{target.name}.old-{uuid.uuid4().hex[:8]}"
            os.rename(target, old)
            os.rename(tmp, target)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.rename(tmp, target)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return str(target)


def _save_learner(learner_state: dict, path: Path) -> None:
    learner_state = dict(learner_state)
    learner_state["rng"] = json.dumps(learner_state.get("rng"))  # numpy's 128-bit ints -> text
    torch.save(learner_state, path)


def _load_learner(path: Path) -> dict:
    learner_state = torch.load(path, map_location="cpu", weights_only=True)
    learner_state["rng"] = json.loads(learner_state["rng"])
    return learner_state


def _fsync_dir(path: Path) -> None:
    for f in path.iterdir():
        if f.is_dir():
            _fsync_dir(f)
            continue
        with open(f, "rb") as fh:
            os.fsync(fh.fileno())


def read_manifest(path: str | os.PathLike) -> dict:
    p = Path(path).expanduser()
    if not p.is_dir():
        raise CheckpointError(f"no checkpoint directory at {str(p)!r}")
    try:
        manifest = json.loads((p / MANIFEST).read_text())
    except FileNotFoundError:
        raise CheckpointError(f"{str(p)!r} has no {MANIFEST}: it is not a runnel checkpoint directory") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise CheckpointError(f"{str(p / MANIFEST)!r} is corrupted: {err}") from None
    if not isinstance(manifest, dict) or "format_version" not in manifest or "algorithm" not in manifest:
        raise CheckpointError(f"{str(p / MANIFEST)!r} lacks format_version/algorithm: not a runnel checkpoint")
    if manifest["format_version"] != FORMAT_VERSION:
        raise CheckpointError(
            f"checkpoint {str(p)!r} has format version {manifest['format_version']!r}; this runnel "
            f"({RUNNEL_VERSION}) reads format {FORMAT_VERSION}. Load it with the runnel version that wrote it "
            f"({manifest.get('runnel_version', 'unknown')})."
        )
    missing = [f for f in manifest.get("files", []) if not (p / f).is_file()]
    if missing:
        raise CheckpointError(f"checkpoint {str(p)!r} is incomplete: missing {missing}")
    return manifest


def _map_arrays(tree: Any, fn: Any, kind: type) -> Any:
    """``fn`` applied to every leaf of type ``kind`` (runners.pt keeps numpy arrays as tensors,
    which ``torch.load(weights_only=True)`` reads)."""
    if isinstance(tree, kind):
        return fn(tree)
    if isinstance(tree, dict):
        return {k: _map_arrays(v, fn, kind) for k, v in tree.items()}
    if isinstance(tree, (list, tuple)):
        return [_map_arrays(v, fn, kind) for v in tree]
    return tree


def _split_arrays(tree: Any, arrays: dict[str, Any], prefix: str) -> Any:
    """Nested state -> the same without numpy arrays, which move to ``arrays`` under path keys."""
    if isinstance(tree, np.ndarray):
        arrays[prefix] = tree
        return {"__array__": prefix}
    if isinstance(tree, dict):
        return {k: _split_arrays(v, arrays, f"{prefix}/{k}") for k, v in tree.items()}
    if isinstance(tree, (list, tuple)):
        return [_split_arrays(v, arrays, f"{prefix}/{i}") for i, v in enumerate(tree)]
    return tree


def _join_arrays(tree: Any, arrays: Any) -> Any:
    if isinstance(tree, dict):
        if set(tree) == {"__array__"}:
            return arrays[tree["__array__"]]
        return {k: _join_arrays(v, arrays) for k, v in tree.items()}
    if isinstance(tree, list):
        return [_join_arrays(v, arrays) for v in tree]
    return tree


def read_extras(path: str | os.PathLike) -> tuple[dict | None, dict | None]:
    """-> (runner states, replay state), each None when the checkpoint has none."""
    p = Path(path).expanduser()
    files = read_manifest(p).get("files", [])
    runners = replay = None
    try:
        if "runners.pt" in files:
            runners = _map_arrays(torch.load(p / "runners.pt", map_location="cpu", weights_only=True),
                                  lambda t: t.numpy(), torch.Tensor)
        if "replay.npz" in files:
            with np.load(p / "replay.npz", allow_pickle=False) as npz:
                arrays = {k: npz[k] for k in npz.files}
            replay = _join_arrays(json.loads((p / "replay.json").read_text()), arrays)
    except Exception as err:  # noqa: BLE001 - numpy/torch raise many kinds for a damaged file
        raise CheckpointError(f"checkpoint {str(p)!r}: runner or replay state cannot be read "
                              f"({type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''})") from None
    return runners, replay


def read_checkpoint(path: str | os.PathLike) -> tuple[dict, dict, dict, dict]:
    """-> (manifest, config, learner_state, state)."""
    p = Path(path).expanduser()
    manifest = read_manifest(p)
    try:
        config = json.loads((p / "config.json").read_text())
        state = json.loads((p / "state.json").read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise CheckpointError(f"checkpoint {str(p)!r} is corrupted: {err}") from None
    try:
        learner_state = _load_learner(p / "learner.pt")
        if isinstance(learner_state.get("modules"), list):  # a multi-agent run's modules, one directory each
            learner_state["modules"] = {mid: _load_learner(p / "modules" / mid / "learner.pt")
                                        for mid in learner_state["modules"]}
    except Exception as err:  # noqa: BLE001 - torch raises many kinds for a damaged file
        raise CheckpointError(f"checkpoint {str(p)!r}: learner.pt cannot be read ({type(err).__name__}: "
                              f"{str(err).splitlines()[0] if str(err) else ''})") from None
    return manifest, config, learner_state, state


def read_module_state(path: str | os.PathLike, module_id: str) -> dict:
    """One module's learner state from a checkpoint: ``modules/<module_id>/learner.pt`` of a multi-agent
    run's checkpoint, or ``learner.pt`` of a single-agent one as module ``default_policy``."""
    p = Path(path).expanduser()
    files = read_manifest(p).get("files", [])
    modules = sorted(f.split("/")[1] for f in files if f.startswith("modules/"))
    if modules:
        if module_id not in modules:
            raise CheckpointError(f"checkpoint {str(p)!r} has no module {module_id!r}; its modules are {modules}")
        file = p / "modules" / module_id / "learner.pt"
    elif module_id != "default_policy":
        raise CheckpointError(f"checkpoint {str(p)!r} is of a single-agent run: its one module is 'default_policy', "
                              f"not {module_id!r}")
    else:
        file = p / "learner.pt"
    try:
        return _load_learner(file)
    except Exception as err:  # noqa: BLE001 - torch raises many kinds for a damaged file
        raise CheckpointError(f"checkpoint {str(p)!r}: {file.relative_to(p)} cannot be read "
                              f"({type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''})") from None
