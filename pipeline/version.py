"""runnel's version, read from the installed distribution's metadata.

The distribution is published as ``runnel-rl`` (``runnel`` on the package index is an unrelated
project); the command is still ``runnel`` and the import packages are ``pipeline``, ``actors`` and
``protocols``. A development set-up made before the rename still has the old ``runnel`` name.
"""
from __future__ import annotations

import importlib.metadata

DISTRIBUTION = "runnel-rl"
_NAMES = (DISTRIBUTION, "runnel")

__all__ = ["DISTRIBUTION", "runnel_version"]


def runnel_version() -> str:
    """The installed runnel's version (``"0.2.0"``), or ``"unknown"`` when running from a source tree that
    was never installed."""
    for name in _NAMES:
        try:
            return importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            continue
    return "unknown"
