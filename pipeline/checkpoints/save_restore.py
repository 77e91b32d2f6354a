"""An algorithm's checkpoints: what of a running algorithm goes into one, and how it comes back.

``directory.py`` is the on-disk format; this module gathers the pieces from the algorithm's stages
(learner, env runners, plan, the driver's own state) and puts them back. It talks to the algorithm
only through its public attributes and methods, so ``Algorithm`` keeps just the Tune-facing calls.
"""
from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np

from pipeline.checkpoints.directory import CheckpointError, read_checkpoint, read_extras, read_manifest, write_checkpoint
from pipeline.registry import get_algorithm


class SavedCheckpoint(str):
    """What ``save()`` returns: the checkpoint's path (a str), which also answers RLlib's spelling
    ``algo.save().checkpoint.path``; ``metrics`` holds the run's counters at the save."""

    def __new__(cls, path: str, metrics: dict[str, Any] | None = None) -> "SavedCheckpoint":
        out = super().__new__(cls, path)
        out.metrics = dict(metrics or {})
        return out

    @property
    def checkpoint(self) -> Any:
        return CheckpointRef(str(self))

    @property
    def path(self) -> str:
        return str(self)


@dataclasses.dataclass(frozen=True)
class CheckpointRef:
    """RLlib's ``result.checkpoint``: only its ``path``."""

    path: str


def driver_state(algo: Any) -> dict[str, Any]:
    """The driver's own state (plain data): iteration, time, weights version, metrics, numpy RNG."""
    return {"iteration": algo.iteration, "time_total_s": algo.time_total_s,
            "weights_version": algo.weights_version, "metrics": algo.metrics.get_state(),
            "numpy_rng": np_rng_state(),
            "connectors": None if algo.connector is None else as_lists(algo.connector.get_state())}


def as_lists(obj: Any) -> Any:
    """Arrays as nested lists, for the driver state's JSON (float64 survives exactly: JSON floats are
    written with Python's shortest round-trip repr)."""
    if isinstance(obj, np.ndarray):
        return obj.tolist()
    if isinstance(obj, dict):
        return {k: as_lists(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [as_lists(v) for v in obj]
    return obj


def set_driver_state(algo: Any, state: dict[str, Any]) -> None:
    """Put back what ``driver_state`` took (the numpy RNG too, where the checkpoint has it)."""
    algo.iteration = int(state["iteration"])
    algo.time_total_s = float(state["time_total_s"])
    algo.weights_version = int(state["weights_version"])
    algo.metrics.set_state(state["metrics"])
    if state.get("connectors") is not None and algo.connector is not None:
        algo.connector.set_state(state["connectors"])
        if algo.env_runner_group is not None:
            algo.env_runner_group.sync_connectors(algo.connector.get_state())
    if state.get("numpy_rng"):
        name, keys, pos, has_gauss, cached = state["numpy_rng"]
        np.random.set_state((name, np.asarray(keys, np.uint32), pos, has_gauss, cached))


def save_algorithm(algo: Any, checkpoint_dir: str | None = None) -> SavedCheckpoint:
    """Write ``algo``'s checkpoint directory (atomically) and return its path."""
    path = checkpoint_dir or algo.default_checkpoint_dir()
    native = algo.get_module() if algo.config.export_native_model_files else None
    plan_state = algo.plan.get_state() if algo.plan is not None else None
    written = write_checkpoint(path, algo.name, algo.config.to_dict(), algo.learner_group.get_state(),
                               algo.get_state(), native_module=native,
                               runner_states=algo.env_runner_group.get_state(), replay_state=plan_state)
    return SavedCheckpoint(written, algo.counters)


def load_into(algo: Any, checkpoint_dir: str) -> None:
    """Load a checkpoint of ``algo``'s algorithm into it: learner, driver state, runners, plan."""
    manifest, _, learner_state, state = read_checkpoint(checkpoint_dir)
    if manifest["algorithm"] != algo.name:
        raise CheckpointError(f"checkpoint {checkpoint_dir!r} is of {manifest['algorithm']}, not {algo.name}")
    runner_states, plan_state = read_extras(checkpoint_dir)
    algo.learner_group.set_state(learner_state)
    algo.set_state(state)
    algo.sync_weights()
    if runner_states:
        algo.env_runner_group.set_state(runner_states)
    if plan_state and algo.plan is not None:
        algo.plan.set_state(plan_state)


def build_from_checkpoint(checkpoint_dir: str, logdir: str | None, overrides: dict[str, Any]) -> Any:
    """The algorithm a checkpoint was written by, built from its config (with ``overrides``) and restored."""
    manifest = read_manifest(checkpoint_dir)
    config_cls, algo_cls = get_algorithm(manifest["algorithm"])
    _, config_dict, _, _ = read_checkpoint(checkpoint_dir)
    config = config_cls.from_dict(config_dict)
    config.update_from_dict(overrides)  # e.g. num_env_runners=0 to evaluate locally; typos fail in validate
    algo = algo_cls(config, logdir=logdir)
    try:
        algo.restore(checkpoint_dir)
    except BaseException:
        algo.stop()
        raise
    return algo


def np_rng_state() -> list:
    """numpy's global RNG state as plain data (JSON holds it)."""
    name, keys, pos, has_gauss, cached = np.random.get_state()
    return [name, keys.tolist(), int(pos), int(has_gauss), float(cached)]
