"""A vectorized sum tree: prioritized sampling in O(log N) numpy operations per batch.

Node 1 is the root, node ``i`` has children ``2i`` and ``2i + 1``, and the leaves are nodes
``size .. 2 * size - 1`` with ``size`` the capacity rounded up to a power of two (the padding
leaves stay 0 and are never drawn). Every call works on a whole batch level by level, so the
Python overhead is ``log2(size)`` numpy calls, never one per query. With a million leaves the deep
levels cost a cache miss per query each, which dominates: gathers use ``take``, the cheapest.

Parents are recomputed from their children (never updated by adding deltas), so the sums do not
drift however many updates a long run makes.
"""
from __future__ import annotations

from typing import Any

import numpy as np


class SumTree:
    def __init__(self, capacity: int) -> None:
        if isinstance(capacity, bool) or not isinstance(capacity, (int, np.integer)) or capacity < 1:
            raise ValueError(f"SumTree capacity must be an int >= 1, got {capacity!r}")
        self.capacity = int(capacity)
        self.size = 1 << (self.capacity - 1).bit_length()
        self.depth = self.size.bit_length() - 1
        self.tree = np.zeros(2 * self.size, np.float64)

    def _check(self, indices: Any) -> np.ndarray:
        idx = np.asarray(indices)
        if idx.size and (idx.dtype.kind not in "iu" or idx.min() < 0 or idx.max() >= self.capacity):
            raise IndexError(f"SumTree indices must be ints in [0, {self.capacity}), got {idx!r}")
        return idx.astype(np.int64, copy=False).reshape(-1)

    def update(self, indices: Any, values: Any) -> None:
        """Set leaves to ``values`` (>= 0); for a repeated index the last value wins."""
        idx = self._check(indices)
        vals = np.broadcast_to(np.asarray(values, np.float64), idx.shape)
        if not idx.size:
            return
        if np.any(vals < 0) or not np.all(np.isfinite(vals)):
            raise ValueError(f"SumTree values must be finite and >= 0, got {vals!r}")
        # np.unique keeps the first occurrence: on the reversed arrays that is the last one.
        idx, first = np.unique(idx[::-1], return_index=True)
        tree, node = self.tree, idx + self.size
        tree[node] = vals[::-1][first]
        for _ in range(self.depth):
            node = node >> 1  # repeated parents get the same value written twice: harmless
            child = node << 1
            tree[node] = tree.take(child) + tree.take(child + 1)

    def total(self) -> float:
        return float(self.tree[1])

    def get(self, indices: Any) -> np.ndarray:
        return self.tree.take(self._check(indices) + self.size)

    def sample(self, u: Any) -> np.ndarray:
        """Leaf index for each value of ``u`` in ``[0, total)``: the leaf whose cumulative range holds it."""
        u = np.array(u, np.float64, copy=True).reshape(-1)
        if self.total() <= 0:
            raise ValueError("cannot sample a SumTree whose total is 0: set some priorities > 0 first")
        tree, node = self.tree, np.ones(len(u), np.int64)
        for _ in range(self.depth):
            child = node << 1
            left = tree.take(child)
            # Going right needs a positive right subtree too: rounding can leave u a hair above
            # a subtree's sum, and this keeps every query inside a positive subtree, so no
            # zero-priority leaf is ever returned.
            right = (u >= left) & (tree.take(child + 1) > 0)
            u -= left * right  # exact: subtracts left or 0.0
            node = child + right
        return node - self.size

    def get_state(self) -> dict[str, Any]:
        return {"capacity": self.capacity, "tree": self.tree.copy()}

    def set_state(self, state: dict[str, Any]) -> None:
        tree = np.asarray(state["tree"], np.float64)
        if int(state["capacity"]) != self.capacity or tree.shape != self.tree.shape:
            raise ValueError(
                f"SumTree state has capacity {state['capacity']}; this tree has {self.capacity}: "
                "restore into a tree of the same capacity"
            )
        self.tree[:] = tree
