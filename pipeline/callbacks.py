"""RLlib-style callbacks (see ``actors.callbacks``): subclass ``Callbacks`` (alias ``DefaultCallbacks``,
``RLlibCallback``), override the hooks you need, and pass the class -- or a list of classes, or
functions per hook -- to ``config.callbacks(...)``."""
from typing import Any

from actors.callbacks import (HOOKS, CallbackError, Callbacks, DefaultCallbacks, MultiCallbacks, RLlibCallback,
                              make_multi_callbacks)
from actors.sys_usage import rss_bytes

__all__ = ["HOOKS", "CallbackError", "Callbacks", "DefaultCallbacks", "MemoryTrackingCallbacks", "MultiCallbacks",
           "RLlibCallback", "make_multi_callbacks"]


class MemoryTrackingCallbacks(Callbacks):
    """RLlib's memory-tracking callbacks: each env runner logs its resident memory at every episode's
    end (``env_runners/memory_rss_mb``) and the driver its own after each ``train()``
    (``memory/driver_rss_mb``) -- a leak shows as a rising line in progress.csv or TensorBoard."""

    def on_episode_end(self, *, metrics_logger: Any = None, **kwargs: Any) -> None:
        if metrics_logger is not None:
            metrics_logger.log_value("memory_rss_mb", rss_bytes() / 2**20, reduce="max", window=1)

    def on_train_result(self, *, result: dict, **kwargs: Any) -> None:
        result.setdefault("memory", {})["driver_rss_mb"] = rss_bytes() / 2**20
