"""Laying chunks out for a learner: the steps of many chunks end to end, as torch tensors; a replayed
batch cut into the slices of several updates, and their statistics combined."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from protocols import nested
from protocols.episode import EpisodeChunk


@dataclass
class Batch:
    """Steps of many chunks laid end to end (torch tensors on the learner's device)."""

    obs: Any
    """Observations at which each step's action was taken, ``[N, ...]``."""
    all_obs: Any
    """Every observation incl. each chunk's closing one, ``[N + num_chunks, ...]`` (for values)."""
    actions: Any
    rewards: np.ndarray
    lengths: np.ndarray
    terminated: np.ndarray
    extra: dict[str, Any]
    weights_versions: np.ndarray

    def __len__(self) -> int:
        return len(self.rewards)

    def tensors(self) -> list[Any]:
        """The device tensors (for stream bookkeeping on GPU)."""
        return [self.obs, self.all_obs, self.actions, self.extra]


def step_rows(lengths: np.ndarray) -> np.ndarray:
    """Indices of ``all_obs`` rows at which an action was taken (all but each chunk's closing row)."""
    keep = np.ones(int(lengths.sum() + len(lengths)), bool)
    keep[np.cumsum(lengths + 1) - 1] = False
    return np.flatnonzero(keep)


def chunks_to_batch(chunks: list[EpisodeChunk], device: torch.device) -> Batch:
    lengths = np.fromiter((len(c) for c in chunks), np.int64, len(chunks))
    all_obs = nested.concat([c.obs for c in chunks])
    to_t = lambda a: torch.as_tensor(np.ascontiguousarray(a), device=device)  # noqa: E731
    all_obs_t = nested.map_structure(to_t, all_obs)
    rows_t = torch.as_tensor(step_rows(lengths), device=device)
    return Batch(
        obs=nested.map_structure(lambda a: a[rows_t], all_obs_t),
        all_obs=all_obs_t,
        actions=nested.map_structure(to_t, nested.concat([c.actions for c in chunks])),
        rewards=np.concatenate([c.rewards for c in chunks]).astype(np.float32, copy=False),
        lengths=lengths,
        terminated=np.fromiter((c.terminated for c in chunks), bool, len(chunks)),
        extra={k: nested.map_structure(to_t, nested.concat([c.extra[k] for c in chunks])) for k in chunks[0].extra},
        weights_versions=np.repeat([c.weights_version for c in chunks], lengths),
    )


class ChunkBatch(list):
    """A train batch: its chunks (a plain list), plus the learner-ready ``Batch`` a loader thread
    may have built from them already (``to_batch`` reuses it).

    Batches cut from a stream hold exactly ``batch_size`` steps: a chunk that straddles two batches
    is cut with ``EpisodeChunk.slice`` (both pieces keep its ``chunk_index``; ``t_started`` tells
    them apart; the first piece bootstraps from the observation where it was cut)."""

    def __init__(self, chunks: list[EpisodeChunk]) -> None:
        super().__init__(chunks)
        self.batch: Batch | None = None
        self.device: torch.device | None = None
        self.ready_event: Any = None  # CUDA event recorded after the side-stream copy

    @property
    def num_steps(self) -> int:
        return sum(len(c) for c in self)

    def weights_versions(self) -> tuple[np.ndarray, np.ndarray]:
        """(weights_version, steps) per chunk."""
        return (np.fromiter((c.weights_version for c in self), np.int64, len(self)),
                np.fromiter((len(c) for c in self), np.int64, len(self)))

    def to_batch(self, device: torch.device) -> Batch:
        """The learner ``Batch`` on ``device``: the prebuilt one when it matches, else built now."""
        if self.batch is not None and self.device == device:
            if self.ready_event is not None:  # the copy ran in the loader's CUDA stream
                stream = torch.cuda.current_stream(device)
                stream.wait_event(self.ready_event)
                nested.map_structure(lambda t: t.record_stream(stream), self.batch.tensors())
                self.ready_event = None
            return self.batch
        return chunks_to_batch(list(self), device)


def as_batch(chunks: list[EpisodeChunk], device: torch.device) -> Batch:
    """Any list of chunks as a learner ``Batch`` (a ``ChunkBatch``'s prebuilt one when it has it)."""
    if isinstance(chunks, ChunkBatch):
        return chunks.to_batch(device)
    return chunks_to_batch(chunks, device)


def check_num_batches(batch: Any, num_batches: Any) -> None:
    """``num_batches`` must split a replayed batch (a dict of arrays) into equal non-empty slices."""
    if isinstance(num_batches, bool) or not isinstance(num_batches, (int, np.integer)) or num_batches < 1:
        raise ValueError(f"num_batches must be an int >= 1, got {num_batches!r}")
    if not isinstance(batch, dict):
        raise ValueError(f"num_batches={num_batches} splits a replayed batch (a dict of arrays), not a "
                         f"{type(batch).__name__}: pass chunks with num_batches=1")
    rows = len(batch["rewards"])
    if rows % num_batches or rows == 0:
        raise ValueError(f"a replayed batch of {rows} rows does not split into num_batches={num_batches} "
                         f"equal batches: sample num_batches * batch_size rows")


def batch_slices(batch: dict[str, Any], num_batches: int) -> list[dict[str, Any]]:
    """A replayed batch (numpy arrays or tensors, nested where observations are) as ``num_batches``
    consecutive equal slices (views, no copies)."""
    size = len(batch["rewards"]) // num_batches
    return [{k: nested.map_structure(lambda a, lo=i * size: a[lo:lo + size], v) for k, v in batch.items()}
            for i in range(num_batches)]


def read_stats(steps: list[dict[str, Any]]) -> list[dict[str, float]]:
    """``steps`` (one dict of statistics per gradient step) as floats. Tensor values -- on the learner's
    device -- are stacked and read in one transfer."""
    out: list[dict[str, float]] = [{} for _ in steps]
    tensors, owners = [], []
    for i, step in enumerate(steps):
        for k, v in step.items():
            if isinstance(v, torch.Tensor):
                tensors.append(v if v.dim() == 0 and v.dtype == torch.float32 else v.float().reshape(()))
                owners.append((i, k))
            else:
                out[i][k] = float(v)
    if tensors:
        with torch.no_grad():  # statistics are read, never differentiated
            values = torch.stack(tensors).tolist()
        for (i, k), v in zip(owners, values):
            out[i][k] = v
    return out


def mean_stats(steps: list[dict[str, float]]) -> dict[str, float]:
    """Each statistic summed over ``steps`` (floats, one dict per gradient step) and divided by their number."""
    sums: dict[str, float] = {}
    for step in steps:
        for k, v in step.items():
            sums[k] = sums.get(k, 0.0) + v
    return {k: v / len(steps) for k, v in sums.items()}


def combined_stats(steps: list[dict[str, Any]]) -> dict[str, float]:
    """The statistics of several updates in a row as one, as the metrics would have averaged them: counters
    (``num_...``) as the last update left them, everything else averaged over the updates that reported
    it (a phase may add or drop a statistic). Tensor values are stacked and read in one conversion,
    not one per update."""
    values: dict[str, list[float]] = {}
    tensors, owners = [], []
    for step in steps:
        for k, v in step.items():
            if isinstance(v, torch.Tensor):
                tensors.append(v.detach().float().reshape(()))
                owners.append(k)
            else:
                values.setdefault(k, []).append(float(v))
    if tensors:
        for k, v in zip(owners, torch.stack(tensors).tolist()):
            values.setdefault(k, []).append(v)
    return {k: v[-1] if k.startswith("num_") else float(np.mean(v)) for k, v in values.items()}
