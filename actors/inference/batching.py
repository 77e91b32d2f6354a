"""The batching engine shared by central inference and the external-client policy server.

Both gather requests from many peers -- env runners (``actors.inference.server``) or remote clients
(``actors.external.acts``) -- and answer them from one forward pass. What they share lives here:

* ``RequestQueue``: requests in arrival order with their row counts; a batch is due once
  ``max_batch`` rows are queued or the oldest request has waited ``max_wait_s``; ``take`` cuts at
  most ``max_batch`` rows, keeping each request's rows together (the rest is a backlog, served next);
* ``stack_blocks``: the requests' observation blocks as one batch (arrays concatenated, single rows
  stacked, nested observations leaf by leaf); ``gather_blocks``: the same into a buffer the caller keeps;
* ``row_slices``: where each request's rows are in the batch, to split the answers back.

Torch-free: the forward pass itself is ``actors.inference.forward``. A queue belongs to the one
thread that serves its socket; nothing here locks.
"""
from __future__ import annotations

import time
from typing import Any, Callable

import numpy as np

from protocols import nested


class RequestQueue:
    def __init__(self, max_batch: int, max_wait_s: float) -> None:
        if not isinstance(max_batch, int) or isinstance(max_batch, bool) or max_batch < 1:
            raise ValueError(f"max_batch must be an int >= 1, got {max_batch!r}")
        if not isinstance(max_wait_s, (int, float)) or isinstance(max_wait_s, bool) or max_wait_s < 0:
            raise ValueError(f"max_wait_s must be a number >= 0, got {max_wait_s!r}")
        self.max_batch, self.max_wait_s = max_batch, float(max_wait_s)
        self.requests: list[Any] = []
        self.sizes: list[int] = []
        self.rows = 0
        """Rows of all queued requests."""
        self.first_at = 0.0
        """When the oldest queued request arrived (``time.monotonic()``)."""

    def __len__(self) -> int:
        return len(self.requests)

    def add(self, request: Any, rows: int) -> None:
        if not self.requests:
            self.first_at = time.monotonic()
        self.requests.append(request)
        self.sizes.append(rows)
        self.rows += rows

    def full(self) -> bool:
        """``max_batch`` rows or more are queued."""
        return self.rows >= self.max_batch

    def due(self, now: float) -> bool:
        """A batch should run now: the queue is full, or its oldest request waited ``max_wait_s``."""
        return bool(self.requests) and (self.rows >= self.max_batch or now >= self.first_at + self.max_wait_s)

    def wait_ms(self, now: float, idle_ms: int) -> int:
        """How long a poll may sleep before the next batch is due (``idle_ms`` with nothing queued)."""
        if not self.requests:
            return idle_ms
        if self.rows >= self.max_batch:
            return 0
        return max(0, min(idle_ms, int((self.first_at + self.max_wait_s - now) * 1000) + 1))

    def take(self) -> list[Any]:
        """The requests of the next batch: ``max_batch`` rows at most (at least one request, however
        large), in arrival order; the rest stay queued."""
        if self.rows <= self.max_batch:
            out, self.requests, self.sizes, self.rows = self.requests, [], [], 0
            return out
        rows = count = 0
        for size in self.sizes:
            if count and rows + size > self.max_batch:
                break
            rows, count = rows + size, count + 1
        out, self.requests = self.requests[:count], self.requests[count:]
        self.sizes = self.sizes[count:]
        self.rows -= rows
        return out


def stack_blocks(blocks: list[Any]) -> Any:
    """Each request's observations -> one batch. A block is an array with a leading row dimension,
    a list of single observations (arrays or nested structures), or a nested structure of arrays
    with leading rows; all blocks of a batch are of one kind."""
    first = blocks[0]
    if type(first) is np.ndarray:
        return first if len(blocks) == 1 else np.concatenate(blocks)
    if isinstance(first, list):
        rows = [o for b in blocks for o in b]
        if len(rows) == 1 and isinstance(rows[0], np.ndarray):  # one client acting alone: no stacking
            return rows[0][None]
        return np.stack(rows) if isinstance(rows[0], np.ndarray) else nested.stack(rows)
    return first if len(blocks) == 1 else nested.concat(blocks)


def gather_blocks(blocks: list[Any], out: Callable[[tuple[int, ...], np.dtype], np.ndarray]) -> Any:
    """``stack_blocks`` into a buffer the caller keeps, ``out(shape, dtype)`` (the inference server's is pinned
    on a GPU and reused from batch to batch): each block is copied once, from where it lies (a decoded
    frame, a runner's shared-memory segment) to its rows, and the batch goes to the device from there.
    ``stack_blocks`` would copy them into a new array that the upload then copies again into pinned memory.
    Blocks that are not arrays of one dtype and row shape are stacked by ``stack_blocks``."""
    first = blocks[0]
    if type(first) is not np.ndarray or any(
            type(b) is not np.ndarray or b.dtype != first.dtype or b.shape[1:] != first.shape[1:] for b in blocks):
        return stack_blocks(blocks)
    batch = out((sum(len(b) for b in blocks), *first.shape[1:]), first.dtype)
    start = 0
    for b in blocks:
        batch[start:start + len(b)] = b
        start += len(b)
    return batch


def row_slices(sizes: list[int]) -> list[slice]:
    """Consecutive slices of ``sizes`` rows each: where each request's rows are in its batch."""
    out, start = [], 0
    for n in sizes:
        out.append(slice(start, start + n))
        start += n
    return out
