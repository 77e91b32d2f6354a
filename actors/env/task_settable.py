"""Curriculum learning: an env whose task (difficulty, level, map) can be read and set from outside."""
from __future__ import annotations

from typing import Any

import gymnasium as gym


class TaskSettableEnv(gym.Env):
    """Subclass and implement ``get_task``/``set_task`` (and ``sample_tasks`` if tasks can be drawn).
    With ``config.environment(env_task_fn=fn)`` the algorithm calls ``fn(train_results, env, env_context)``
    on every sub-env of every training runner after each ``train()`` and sets the task it returns; a
    recreated runner or sub-env and a restored checkpoint get their current task back."""

    def sample_tasks(self, n_tasks: int) -> list[Any]:
        """``n_tasks`` tasks drawn from this env's task distribution."""
        raise NotImplementedError(f"{type(self).__name__} does not implement sample_tasks")

    def set_task(self, task: Any) -> None:
        """Switch to ``task``; takes effect at the latest with the next reset."""
        raise NotImplementedError(f"{type(self).__name__} does not implement set_task")

    def get_task(self) -> Any:
        """The current task."""
        raise NotImplementedError(f"{type(self).__name__} does not implement get_task")
