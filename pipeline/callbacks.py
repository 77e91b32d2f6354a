"""RLlib-style callbacks: subclass ``Callbacks``, override the hooks you need, pass the class to
``config.callbacks(MyCallbacks)``. Hooks run in the driver process."""
from __future__ import annotations

from typing import Any


class Callbacks:
    def on_algorithm_init(self, *, algorithm: Any, **kwargs: Any) -> None:
        """After the algorithm built its runners and learners."""

    def on_train_result(self, *, algorithm: Any, result: dict, **kwargs: Any) -> None:
        """After each ``train()``; may add keys to ``result``."""

    def on_env_runners_recreated(self, *, algorithm: Any, env_runner_group: Any, env_runner_indices: list[int],
                                 is_evaluation: bool, **kwargs: Any) -> None:
        """After failed env runners were recreated and their weights restored."""

    def on_checkpoint_loaded(self, *, algorithm: Any, **kwargs: Any) -> None:
        """After ``restore``/``from_checkpoint`` loaded a checkpoint."""
