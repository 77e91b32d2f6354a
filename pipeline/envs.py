"""Turning ``config.env`` into an env creator: gymnasium ids, registered names, classes, import paths.

An Atari id (``"ALE/Pong-v5"``, gymnasium's ``"ale_py:ALE/Pong-v5"``, ``"PongNoFrameskip-v4"``) builds
the game with the standard Atari preprocessing (``actors.env.atari.make_atari``; ``env_config={"atari":
False}`` for the bare ALE env).

An import path ``"module:Class"`` is looked up on ``sys.path`` and then in the current directory
(the one the driver runs in), as ``python -m`` would, so ``runnel train --env myenv:MyEnv`` finds
``./myenv.py`` without ``PYTHONPATH=.``. The creator handed to env runners carries the path and
that directory, not the class, and imports it the same way inside the runner's process. The creators
themselves are in ``actors.env.creators`` (torch-free, for runners under central inference).
"""
from __future__ import annotations

import difflib
import os
from typing import Any, Callable

import gymnasium as gym

from actors.env import EnvContext
from actors.env.atari import ale_env_id
from actors.env.creators import AtariMaker, ClassMaker, GymMaker, ImportPathMaker
from pipeline.config.base import ConfigError

_REGISTRY: dict[str, Callable[[EnvContext], gym.Env]] = {}


def register_env(name: str, creator: Callable[[EnvContext], gym.Env]) -> None:
    """Make ``config.environment(name)`` build envs with ``creator(env_context)``."""
    if not callable(creator):
        raise TypeError(f"register_env({name!r}, ...) needs a callable creator, got {creator!r}")
    _REGISTRY[name] = creator


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
            return AtariMaker(atari)
        if env in gym.registry:
            return GymMaker(env)
        if ":" in env:
            maker = ImportPathMaker(env, os.getcwd())
            try:
                maker.resolve()  # fail here, in the driver, on a path that does not import
            except ValueError as err:
                raise ConfigError(str(err)) from err.__cause__
            return maker
        known = list(_REGISTRY) + list(gym.registry)
        close = difflib.get_close_matches(env, known, n=3)
        hint = f" Did you mean {' or '.join(map(repr, close))}?" if close else ""
        raise ConfigError(
            f"unknown env {env!r}: not a gymnasium id, not registered with pipeline.register_env, and not an "
            f"import path 'package.module:Class'.{hint}"
        )
    if isinstance(env, type):
        return ClassMaker(env)
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
