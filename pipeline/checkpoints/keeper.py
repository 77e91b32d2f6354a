"""Which checkpoints of a run to keep (``num_to_keep``, ``checkpoint_score_attribute``)."""
from __future__ import annotations

import math
import os
import re
import shutil
from dataclasses import dataclass

from pipeline.checkpoints.directory import MANIFEST

CHECKPOINT_DIR = re.compile(r"^checkpoint_(\d{6})$")
PARTIAL_DIR = re.compile(r"^\.checkpoint_\d{6}\.tmp-[0-9a-f]{8}$")
"""A checkpoint being written (``directory.write_checkpoint``): left behind by a process killed meanwhile."""


@dataclass
class Kept:
    path: str
    iteration: int
    score: float | None


class CheckpointKeeper:
    """Keeps at most ``num_to_keep`` checkpoints (None: all): the best by ``score_attribute`` (a result
    key such as ``env_runners/episode_return_mean``; ``score_order`` "max" or "min"), else the latest.
    The newest checkpoint is never deleted: a resumed run starts from it."""

    def __init__(self, num_to_keep: int | None = None, score_attribute: str | None = None,
                 score_order: str = "max") -> None:
        if num_to_keep is not None and (not isinstance(num_to_keep, int) or num_to_keep < 1):
            raise ValueError(f"num_to_keep={num_to_keep!r} must be an int >= 1 (or None to keep every checkpoint)")
        if score_order not in ("max", "min"):
            raise ValueError(f"checkpoint_score_order={score_order!r} must be 'max' or 'min'")
        self.num_to_keep, self.score_attribute, self.score_order = num_to_keep, score_attribute, score_order
        self.kept: list[Kept] = []

    def adopt(self, path: str, iteration: int) -> None:
        """A checkpoint from before a resume (unscored: it ranks below scored ones)."""
        self.kept.append(Kept(path, iteration, None))

    def add(self, path: str, iteration: int, result: dict | None) -> list[str]:
        """Record a new checkpoint; delete the ones no longer kept and return their paths."""
        self.kept = [k for k in self.kept if k.path != path] + [Kept(path, iteration, self._score(result))]
        if self.num_to_keep is None or len(self.kept) <= self.num_to_keep:
            return []
        newest = max(self.kept, key=lambda k: k.iteration)
        ranked = sorted((k for k in self.kept if k is not newest), key=self._rank, reverse=True)
        keep = ranked[:self.num_to_keep - 1] + [newest]
        dropped = [k for k in self.kept if k not in keep]
        for k in dropped:
            shutil.rmtree(k.path, ignore_errors=True)
        self.kept = sorted(keep, key=lambda k: k.iteration)
        return [k.path for k in dropped]

    def _score(self, result: dict | None) -> float | None:
        if self.score_attribute is None or result is None:
            return None
        from pipeline.algorithm_results import lookup

        value = lookup(result, self.score_attribute)
        if isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value):
            return float(value)
        return None

    def _rank(self, k: Kept) -> tuple:
        """Higher is better: scored before unscored, then by score, then the more recent."""
        if self.score_attribute is None:
            return (0, 0.0, k.iteration)
        if k.score is None:
            return (-1, 0.0, k.iteration)
        return (1, k.score if self.score_order == "max" else -k.score, k.iteration)


def checkpoints_in(run_dir: str) -> list[tuple[int, str]]:
    """``(iteration, path)`` of every complete checkpoint directly in ``run_dir``, oldest first."""
    found = []
    for name in os.listdir(run_dir) if os.path.isdir(run_dir) else []:
        m = CHECKPOINT_DIR.match(name)
        path = os.path.join(run_dir, name)
        if m and os.path.isfile(os.path.join(path, MANIFEST)):
            found.append((int(m.group(1)), path))
    return sorted(found)


def partial_checkpoints(run_dir: str) -> list[str]:
    """Checkpoint directories whose writing never finished (a driver killed while saving), in ``run_dir``."""
    names = os.listdir(run_dir) if os.path.isdir(run_dir) else []
    return sorted(os.path.join(run_dir, name) for name in names if PARTIAL_DIR.match(name))
