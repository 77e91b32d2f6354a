"""Tiny helpers for nested observations/actions: dicts and tuples whose leaves are arrays.

Dict keys are visited in sorted order so that flattening is deterministic on both ends of a
socket, whatever order a sender built its dict in.
"""
from __future__ import annotations

from typing import Any, Callable

import numpy as np


def map_structure(fn: Callable[..., Any], first: Any, *rest: Any) -> Any:
    """Apply ``fn`` leaf-wise to one or more structures of the same shape."""
    if isinstance(first, dict):
        return {k: map_structure(fn, first[k], *(r[k] for r in rest)) for k in sorted(first)}
    if isinstance(first, (tuple, list)):
        return tuple(map_structure(fn, *items) for items in zip(first, *rest, strict=True))
    return fn(first, *rest)


def flatten(struct: Any) -> list[Any]:
    """Leaves in a deterministic order (sorted dict keys, tuple order)."""
    if isinstance(struct, dict):
        return [leaf for k in sorted(struct) for leaf in flatten(struct[k])]
    if isinstance(struct, (tuple, list)):
        return [leaf for item in struct for leaf in flatten(item)]
    return [struct]


def first_leaf(struct: Any) -> Any:
    while isinstance(struct, (dict, tuple, list)):
        struct = struct[sorted(struct)[0]] if isinstance(struct, dict) else struct[0]
    return struct


def batch_len(struct: Any) -> int:
    """Length of the leading dimension, checked to be the same for every leaf."""
    lengths = {len(leaf) for leaf in flatten(struct)}
    if len(lengths) != 1:
        raise ValueError(f"leaves of a nested batch have different lengths: {sorted(lengths)}")
    return lengths.pop()


def stack(items: list[Any]) -> Any:
    """List of same-shaped structures -> one structure of stacked arrays."""
    if items and (type(items[0]) is np.ndarray or isinstance(items[0], (int, float, np.generic))):
        return stack_leaves(items)  # the common case, one leaf: no structure to walk
    return map_structure(lambda *leaves: stack_leaves(leaves), *items)


def stack_leaves(leaves: Any) -> np.ndarray:
    """``np.stack(leaves)``, by ``np.array`` where that gives the same array: several times faster for the
    short lists of small arrays and scalars that episode recording stacks."""
    if len(leaves):
        try:
            out = np.array(leaves)
        except ValueError:  # ragged: np.stack names the shapes
            out = None
        if out is not None and out.dtype != object and out.ndim == np.ndim(leaves[0]) + 1:
            return out
    return np.stack(leaves)


def concat(items: list[Any]) -> Any:
    return map_structure(lambda *leaves: np.concatenate(leaves), *items)
