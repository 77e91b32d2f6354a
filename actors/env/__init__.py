"""The env-runner role: vector envs, the runner, its exploration piece and its streaming thread.

The names are imported when first used (PEP 562), so importing ``actors.env.settings`` or another
torch-free part does not pull in the runner's torch-using pieces (a runner under central inference
imports no torch).
"""
from typing import Any

__all__ = ["EnvContext", "EnvRunner", "EnvRunnerSettings"]


def __getattr__(name: str) -> Any:
    if name == "EnvRunner":
        from actors.env.env_runner import EnvRunner

        return EnvRunner
    if name == "EnvRunnerSettings":
        from actors.env.settings import EnvRunnerSettings

        return EnvRunnerSettings
    if name == "EnvContext":
        from actors.env.vector_env import EnvContext

        return EnvContext
    raise AttributeError(f"module 'actors.env' has no attribute {name!r}")
