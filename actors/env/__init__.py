"""The env-runner role: vector envs, the runner, its exploration piece and its streaming thread."""
from actors.env.env_runner import EnvRunner
from actors.env.settings import EnvRunnerSettings
from actors.env.vector_env import EnvContext

__all__ = ["EnvContext", "EnvRunner", "EnvRunnerSettings"]
