"""Curriculum learning: an env whose task (difficulty, level, map) can be read and set from outside,
and what an env runner keeps of its sub-envs' tasks."""
from __future__ import annotations

from typing import Any, Callable

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


def task_env(env: gym.Env) -> Any:
    """The object that holds ``set_task``: the env itself, or the env inside gymnasium's wrappers."""
    if hasattr(env, "set_task"):
        return env
    inner = getattr(env, "unwrapped", env)
    if not hasattr(inner, "set_task"):
        raise TypeError(f"env {type(inner).__name__} has no set_task/get_task: a curriculum (env_task_fn) needs "
                        f"a TaskSettableEnv (pipeline.TaskSettableEnv)")
    return inner


class SubEnvTasks:
    """The task of each sub-env of one env runner, once a task function set them: kept so that a
    sub-env recreated after a crash, a recreated runner and a restored checkpoint get it back."""

    def __init__(self, num_envs: int) -> None:
        self.num_envs = num_envs
        self.tasks: list[Any] | None = None  # None until a task function (or a restore) set them

    def restore(self, index: int, env: gym.Env) -> None:
        """Sub-env ``index`` was just created (first or recreated): its current task back."""
        if self.tasks is not None:
            task_env(env).set_task(self.tasks[index])

    def apply(self, env_task_fn: Callable, train_results: dict, sub_envs: list[gym.Env],
              context: Callable[[int], Any]) -> list[Any]:
        """``env_task_fn(train_results, sub_env, context(i))`` picks each sub-env's next task, set
        where it changed. Returns the tasks."""
        tasks = []
        for i, env in enumerate(sub_envs):
            target = task_env(env)
            task = env_task_fn(train_results, target, context(i))
            if self.tasks is None or task != self.tasks[i]:
                target.set_task(task)
            tasks.append(task)
        self.tasks = tasks
        return tasks

    def set(self, tasks: list[Any], sub_envs: list[gym.Env]) -> None:
        """Give each sub-env its task."""
        if len(tasks) != self.num_envs:
            raise ValueError(f"{len(tasks)} env tasks for {self.num_envs} sub-environments")
        for env, task in zip(sub_envs, tasks):
            task_env(env).set_task(task)
        self.tasks = list(tasks)
