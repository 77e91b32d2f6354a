"""Turning ``config.env`` into an env creator: gymnasium ids, registered names, classes, import paths."""
from __future__ import annotations

import difflib
import inspect
from typing import Any, Callable

import gymnasium as gym

from actors.env import EnvContext
from pipeline.config import ConfigError, resolve_import_path

_REGISTRY: dict[str, Callable[[EnvContext], gym.Env]] = {}


def register_env(name: str, creator: Callable[[EnvContext], gym.Env]) -> None:
    """Make ``config.environment(name)`` build envs with ``creator(env_context)``."""
    if not callable(creator):
        raise TypeError(f"register_env({name!r}, ...) needs a callable creator, got {creator!r}")
    _REGISTRY[name] = creator


class _GymMaker:
    """Picklable creator for a gymnasium id (closures would not survive ``to_dict``)."""

    def __init__(self, env_id: str) -> None:
        self.env_id = env_id

    def __call__(self, ctx: EnvContext) -> gym.Env:
        return gym.make(self.env_id, **dict(ctx))


class _ClassMaker:
    """Env class -> ``cls(env_config)``, or ``cls()`` when its constructor takes no arguments."""

    def __init__(self, cls: type) -> None:
        self.cls = cls
        try:
            params = inspect.signature(cls).parameters.values()
            self.takes_config = any(p.kind is not p.KEYWORD_ONLY for p in params)
        except (TypeError, ValueError):
            self.takes_config = True

    def __call__(self, ctx: EnvContext) -> gym.Env:
        return self.cls(ctx) if self.takes_config else self.cls()


def env_creator(env: Any) -> Callable[[EnvContext], gym.Env]:
    """Resolve ``config.env``; raises ConfigError that names the env and near matches."""
    if isinstance(env, str):
        if env in _REGISTRY:
            return _REGISTRY[env]
        if env in gym.registry:
            return _GymMaker(env)
        if ":" in env:
            obj = resolve_import_path(env, "env")
            return _ClassMaker(obj) if isinstance(obj, type) else obj
        known = list(_REGISTRY) + list(gym.registry)
        close = difflib.get_close_matches(env, known, n=3)
        hint = f" Did you mean {' or '.join(map(repr, close))}?" if close else ""
        raise ConfigError(
            f"unknown env {env!r}: not a gymnasium id, not registered with pipeline.register_env, and not an "
            f"import path 'package.module:Class'.{hint}"
        )
    if isinstance(env, type):
        return _ClassMaker(env)
    if callable(env):
        return env
    raise ConfigError(f"config.env must be a str, an env class or a creator function, got {env!r}")


def probe_spaces(creator: Callable[[EnvContext], gym.Env], env_config: dict) -> tuple[gym.Space, gym.Space]:
    """Build one env in the driver to learn its spaces (and fail early on a broken env)."""
    try:
        env = creator(EnvContext(env_config, worker_index=0, vector_index=0))
    except ConfigError:
        raise
    except Exception as err:
        raise ConfigError(f"creating the env failed: {type(err).__name__}: {err}") from err
    try:
        return env.observation_space, env.action_space
    finally:
        env.close()
