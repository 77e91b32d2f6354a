"""Turning ``config.env`` into an env creator: gymnasium ids, registered names, classes, import paths.

An Atari id (``"ALE/Pong-v5"``, gymnasium's ``"ale_py:ALE/Pong-v5"``, ``"PongNoFrameskip-v4"``) builds
the game with the standard Atari preprocessing (``actors.env.atari.make_atari``; ``env_config={"atari":
False}`` for the bare ALE env).

An import path ``"module:Class"`` is looked up on ``sys.path`` and then in the current directory
(the one the driver runs in), as ``python -m`` would, so ``runnel train --env myenv:MyEnv`` finds
``./myenv.py`` without ``PYTHONPATH=.``. The creator handed to env runners carries the path and
that directory, not the class, and imports it the same way inside the runner's process.
"""
from __future__ import annotations

import difflib
import inspect
import os
import sys
from typing import Any, Callable

import gymnasium as gym

from actors.env import EnvContext
from actors.env.atari import ale_env_id, make_atari
from pipeline.config.base import ConfigError
from pipeline.config.plain import resolve_import_path

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


class _AtariMaker:
    """Picklable creator for an ALE id: the game with the standard Atari preprocessing."""

    def __init__(self, env_id: str) -> None:
        self.env_id = env_id

    def __call__(self, ctx: EnvContext) -> gym.Env:
        return make_atari(self.env_id, ctx)

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.env_id!r})"


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


def _add_to_sys_path(directory: str | None) -> None:
    """Append ``directory`` to ``sys.path`` (after installed packages, so it never shadows them)."""
    if not directory or not os.path.isdir(directory):
        return
    here = os.path.abspath(directory)
    if any(os.path.abspath(p or os.curdir) == here for p in sys.path):
        return
    sys.path.append(here)


def _resolve_env_path(path: str) -> Callable[[EnvContext], gym.Env]:
    obj = resolve_import_path(path, "env")
    return _ClassMaker(obj) if isinstance(obj, type) else obj


class _ImportPathMaker:
    """Creator for ``"module:Class"``: pickles as the path and the driver's working directory, and
    imports the env (with that directory on ``sys.path``) in whichever process builds it."""

    def __init__(self, path: str, directory: str | None) -> None:
        self.path = path
        self.directory = directory
        self._creator: Callable[[EnvContext], gym.Env] | None = None

    def resolve(self) -> Callable[[EnvContext], gym.Env]:
        if self._creator is None:
            _add_to_sys_path(self.directory)
            try:
                self._creator = _resolve_env_path(self.path)
            except ConfigError as err:
                top = self.path.partition(":")[0].split(".")[0]
                cause = err.__cause__
                if isinstance(cause, ModuleNotFoundError) and cause.name == top:
                    raise ConfigError(
                        f"{err} (looked on sys.path and in {self.directory}): run from the directory that holds "
                        f"{top}.py (or the package {top}/), or add that directory to PYTHONPATH") from cause
                raise
        return self._creator

    def __call__(self, ctx: EnvContext) -> gym.Env:
        return self.resolve()(ctx)

    def __getstate__(self) -> dict[str, Any]:
        return {"path": self.path, "directory": self.directory}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.path, self.directory, self._creator = state["path"], state["directory"], None

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.path!r})"


def env_creator(env: Any) -> Callable[[EnvContext], gym.Env]:
    """Resolve ``config.env``; raises ConfigError that names the env and near matches."""
    if isinstance(env, str):
        if env in _REGISTRY:
            return _REGISTRY[env]
        tune_creator = _tune_registered(env)
        if tune_creator is not None:  # RLlib users register with ray.tune.registry.register_env
            return tune_creator
        try:
            atari = ale_env_id(env)
        except ImportError as err:
            raise ConfigError(f"env {env!r}: {err}") from err
        if atari is not None:
            return _AtariMaker(atari)
        if env in gym.registry:
            return _GymMaker(env)
        if ":" in env:
            maker = _ImportPathMaker(env, os.getcwd())
            maker.resolve()  # fail here, in the driver, on a path that does not import
            return maker
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


def _tune_registered(name: str) -> Callable[[EnvContext], gym.Env] | None:
    try:
        from ray.tune.registry import ENV_CREATOR, _global_registry
    except ImportError:
        return None
    try:
        if _global_registry.contains(ENV_CREATOR, name):
            return _global_registry.get(ENV_CREATOR, name)
    except Exception:  # noqa: BLE001 - Ray's registry unreachable: treat as not registered
        return None
    return None


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
