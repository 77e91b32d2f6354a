"""Run directories: one per training run, named for people, unique across processes."""
from __future__ import annotations

import os
import re
import uuid
from datetime import datetime
from typing import Any

RESULTS_ROOT_ENV = "RUNNEL_RESULTS_DIR"
"""Environment variable that moves the default results root (``~/runnel_results``)."""


def results_root() -> str:
    return os.path.abspath(os.path.expanduser(os.environ.get(RESULTS_ROOT_ENV) or "~/runnel_results"))


def env_label(env: Any) -> str:
    """A short name for an env setting (id, registered name, class or import path)."""
    if env is None:
        return "no-env"
    if isinstance(env, str):
        return env
    return getattr(env, "__name__", type(env).__name__)


def path_safe(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9._-]+", "_", text).strip("_.") or "env"


def run_dir_name(algo_name: str, env: Any) -> str:
    """``PPO_CartPole-v1_2026-11-24_10-00-00``: what ran, and when."""
    return f"{algo_name}_{path_safe(env_label(env))}_{datetime.now():%Y-%m-%d_%H-%M-%S}"


def make_run_dir(path: str) -> str:
    """Create ``path``, or ``path_<random>`` if it is taken (another run started the same second,
    maybe in another process: ``mkdir`` decides atomically), and return the one created."""
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    candidate = path
    while True:
        try:
            os.mkdir(candidate)
            return candidate
        except FileExistsError:
            candidate = f"{path}_{uuid.uuid4().hex[:6]}"
