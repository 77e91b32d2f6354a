"""Which vector env a runner steps (``gym_env_vectorize_mode``), in one place."""
from __future__ import annotations

import logging
from typing import Any

from actors.env.creators import AtariMaker
from actors.env.native_vector_env import NativeVectorEnv, envpool_id, native_vector_id
from actors.env.vector_env import AsyncVectorEnv, SyncVectorEnv

log = logging.getLogger(__name__)

VECTORIZE_MODES = ("auto", "sync", "async", "vector_entry_point", "envpool")


def make_vector_env(mode: str, threads: int = 1, **kwargs) -> Any:
    """``auto``: the env's own vector implementation when it has one (``native_vector_env``), else ``sync``.
    ``threads``: the CPUs the runner has, EnvPool's threads (``envpool``)."""
    if mode in ("auto", "vector_entry_point"):
        env_id = native_vector_id(kwargs["creator"])
        if env_id is None:
            if mode == "vector_entry_point":
                raise ValueError(f"gym_env_vectorize_mode='vector_entry_point' needs a gymnasium id whose "
                                 f"registration declares a vector_entry_point; {kwargs['creator']!r} does not. "
                                 f"Use 'auto' (that implementation where there is one) or 'sync'")
            return SyncVectorEnv(**kwargs)
        native = {k: v for k, v in kwargs.items() if k != "creator"}
        if mode == "vector_entry_point":
            return NativeVectorEnv(env_id, **native)
        try:
            return NativeVectorEnv(env_id, **native)
        except TypeError as err:  # env_config keys its vector implementation does not take
            log.info("%s: its vector implementation refused env_config (%s); stepping separate envs", env_id, err)
            return SyncVectorEnv(**kwargs)
    if mode == "envpool":  # asked for by name only: see native_vector_env's docstring
        env_id = envpool_id(kwargs["creator"])
        backend = "envpool_atari" if isinstance(kwargs["creator"], AtariMaker) else "envpool"
        return NativeVectorEnv(env_id, backend=backend, threads=threads,
                               **{k: v for k, v in kwargs.items() if k != "creator"})
    if mode == "sync":
        return SyncVectorEnv(**kwargs)
    if mode == "async":
        return AsyncVectorEnv(**kwargs)
    raise ValueError(f"gym_env_vectorize_mode {mode!r} is not one of {list(VECTORIZE_MODES)}")
