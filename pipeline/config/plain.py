"""Settings as plain, JSON-able data (``to_dict``, what checkpoints keep) and back.

Classes and functions become ``"module:qualname"`` import paths and spaces ``{"__space__": ...}``;
the settings that hold code (``CODE_SETTINGS``) are checked here too, since a saved config can only
keep code that has an import path.
"""
from __future__ import annotations

import dataclasses
import importlib
import logging
import os
import sys
from dataclasses import fields
from typing import Any

from pipeline.config.checks import ConfigError

log = logging.getLogger("runnel")

CODE_SETTINGS = ("callbacks_functions", "env_task_fn", "custom_evaluation_function", "policy_mapping_fn",
                 "policies_to_train")
"""Settings that hold functions: a checkpoint keeps their import paths, or leaves out one that has none
(a lambda, a nested function) with a warning, instead of failing the save."""


def plain_settings(config: Any) -> dict[str, Any]:
    """Plain, JSON-able settings; classes and functions become ``"module:qualname"`` paths."""
    out = {}
    for f in fields(config):
        if f.name == "_unknown":
            continue
        value = getattr(config, f.name)
        if f.name in CODE_SETTINGS:
            value = _code_to_plain(value, f.name)
        out[f.name] = _to_plain(value, f.name)
    return out


def from_plain(value: Any) -> Any:
    """A value as ``plain_settings`` wrote it, with spaces made spaces again."""
    if isinstance(value, dict) and "__space__" in value:
        from protocols.spaces import space_from_dict

        value = space_from_dict(value["__space__"])
    return value


def function_problems(config: Any) -> list[str]:
    """Settings that must hold a function (or its import path)."""
    problems = []
    for key in ("env_task_fn", "custom_evaluation_function"):
        if getattr(config, key) is not None and not callable(getattr(config, key)) and not isinstance(getattr(config, key), str):
            problems.append(f"{key} must be a function, got {getattr(config, key)!r}")
    return problems


def import_path(obj: Any) -> str:
    return f"{obj.__module__}:{obj.__qualname__}"


def resolve_import_path(path: str, what: str) -> Any:
    """``"package.module:Name"`` -> the object, with an error that says what was looked for."""
    module_name, _, qualname = path.partition(":")
    if not module_name or not qualname:
        raise ConfigError(f"{what} {path!r} is not an import path; write it as 'package.module:Name'")
    try:
        try:
            obj = importlib.import_module(module_name)
        except ModuleNotFoundError as err:
            # a module beside the user's script ("mycallbacks:MyCallbacks" run without PYTHONPATH=.)
            if err.name != module_name.split(".")[0] or os.getcwd() in sys.path:
                raise
            sys.path.append(os.getcwd())
            obj = importlib.import_module(module_name)
        for part in qualname.split("."):
            obj = getattr(obj, part)
    except (ImportError, AttributeError) as err:
        raise ConfigError(f"cannot import {what} {path!r}: {err}") from err
    return obj


def _code_to_plain(value: Any, name: str) -> Any:
    """Functions in ``CODE_SETTINGS`` that have no import path are left out of saved configs (with a warning)."""
    if isinstance(value, dict):
        return {k: _code_to_plain(v, name) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_code_to_plain(v, name) for v in value]
    if callable(value) and ("<lambda>" in getattr(value, "__qualname__", "<lambda>") or "<locals>" in value.__qualname__):
        log.warning("config setting %s holds %r, which has no import path: it is not saved with the config (define "
                    "it at module level to keep it in checkpoints)", name, value)
        return None
    return value


def _to_plain(value: Any, name: str) -> Any:
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, dict):
        return {str(k): _to_plain(v, name) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_to_plain(v, name) for v in value]
    if dataclasses.is_dataclass(value):
        return _to_plain(dataclasses.asdict(value), name)
    if callable(value):
        if "<lambda>" in getattr(value, "__qualname__", "<lambda>") or "<locals>" in value.__qualname__:
            raise ConfigError(
                f"config setting {name!r} holds {value!r}, which cannot be referenced by import path; "
                f"define it at module level, or register it with pipeline.register_env(name, creator) and use the name"
            )
        return import_path(value)
    from protocols.spaces import space_to_dict

    try:
        return {"__space__": space_to_dict(value)}
    except Exception:  # noqa: BLE001 - not a space either
        raise ConfigError(f"config setting {name!r}={value!r} cannot be stored as plain data") from None
