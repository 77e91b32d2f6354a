"""Env creators that travel to env runners: a gymnasium id, an Atari id, an env class, an import path.

Picklable objects, not closures (a config's ``to_dict`` and Ray both carry them), kept in a torch-free
module: a runner under central inference unpickles its creator without importing torch (or the
driver's ``pipeline`` package). ``pipeline.envs.env_creator`` picks one for ``config.env``.
"""
from __future__ import annotations

import inspect
import os
import sys
from typing import Any, Callable

import gymnasium as gym

from actors.env.atari import make_atari
from actors.env.vector_env import EnvContext
from actors.imports import import_object


class GymMaker:
    """Creator for a gymnasium id."""

    def __init__(self, env_id: str) -> None:
        self.env_id = env_id

    def __call__(self, ctx: EnvContext) -> gym.Env:
        return gym.make(self.env_id, **dict(ctx))

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.env_id!r})"


class AtariMaker:
    """Creator for an ALE id: the game with the standard Atari preprocessing (``actors.env.atari``)."""

    def __init__(self, env_id: str) -> None:
        self.env_id = env_id

    def __call__(self, ctx: EnvContext) -> gym.Env:
        return make_atari(self.env_id, ctx)

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.env_id!r})"


class ClassMaker:
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


def add_to_sys_path(directory: str | None) -> None:
    """Append ``directory`` to ``sys.path`` (after installed packages, so it never shadows them)."""
    if not directory or not os.path.isdir(directory):
        return
    here = os.path.abspath(directory)
    if any(os.path.abspath(p or os.curdir) == here for p in sys.path):
        return
    sys.path.append(here)


class ImportPathMaker:
    """Creator for ``"module:Class"``: pickles as the path and the driver's working directory, and
    imports the env (with that directory on ``sys.path``) in whichever process builds it."""

    def __init__(self, path: str, directory: str | None) -> None:
        self.path = path
        self.directory = directory
        self._creator: Callable[[EnvContext], gym.Env] | None = None

    def resolve(self) -> Callable[[EnvContext], gym.Env]:
        """The creator; ValueError naming the path (and where it was looked for) when it does not import."""
        if self._creator is None:
            add_to_sys_path(self.directory)
            module, _, qualname = self.path.partition(":")
            if not module or not qualname:
                raise ValueError(f"env {self.path!r} is not an import path; write it as 'package.module:Name'")
            try:
                obj = import_object(self.path)
            except (ImportError, AttributeError) as err:
                hint = ""
                top = module.split(".")[0]
                if isinstance(err, ModuleNotFoundError) and err.name == top:
                    hint = (f" (looked on sys.path and in {self.directory}): run from the directory that holds "
                            f"{top}.py (or the package {top}/), or add that directory to PYTHONPATH")
                raise ValueError(f"cannot import env {self.path!r}: {err}{hint}") from err
            self._creator = ClassMaker(obj) if isinstance(obj, type) else obj
        return self._creator

    def __call__(self, ctx: EnvContext) -> gym.Env:
        return self.resolve()(ctx)

    def __getstate__(self) -> dict[str, Any]:
        return {"path": self.path, "directory": self.directory}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.path, self.directory, self._creator = state["path"], state["directory"], None

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.path!r})"
