"""Checkpoint directories: written atomically, read without unpickling anything from the files.

Layout::

    manifest.json   format version, algorithm, runnel version, files
    config.json     the algorithm config (plain data; callables as import paths)
    learner.pt      module, target and optimizer tensors, the learner's named fields, RNGs
                    (loaded with torch weights_only=True)
    state.json      iteration, time, weights version, the metrics logger's state (counters and
                    episode-metric windows), numpy RNG state

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

import torch

FORMAT_VERSION = 2
RUNNEL_VERSION = "0.2.0"
MANIFEST = "manifest.json"


class CheckpointError(ValueError):
    """A checkpoint is missing, corrupted, or of a format this runnel cannot read."""


def write_checkpoint(path: str | os.PathLike, algorithm: str, config: dict, learner_state: dict,
                     state: dict, native_module: Any = None) -> str:
    target = Path(path).expanduser().resolve()
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = target.parent / f".{target.name}.tmp-{uuid.uuid4().hex[:8]}"
    tmp.mkdir()
    try:
        (tmp / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True))
        learner_state = dict(learner_state)
        learner_state["rng"] = json.dumps(learner_state.get("rng"))  # numpy's 128-bit ints -> text
        torch.save(learner_state, tmp / "learner.pt")
        (tmp / "state.json").write_text(json.dumps(state, indent=2, sort_keys=True))
        files = ["config.json", "learner.pt", "state.json"]
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


def _fsync_dir(path: Path) -> None:
    for f in path.iterdir():
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
        learner_state = torch.load(p / "learner.pt", map_location="cpu", weights_only=True)
        learner_state["rng"] = json.loads(learner_state["rng"])
    except Exception as err:  # noqa: BLE001 - torch raises many kinds for a damaged file
        raise CheckpointError(f"checkpoint {str(p)!r}: learner.pt cannot be read ({type(err).__name__}: "
                              f"{str(err).splitlines()[0] if str(err) else ''})") from None
    return manifest, config, learner_state, state
