"""Episode callbacks inside an env runner: the episode view hooks receive, and the driver of the hooks.

Only built when the callbacks override an episode hook: the sampling loop stays vectorized
otherwise. The view keeps references to the rows the runner already holds (no copies), plus what
the hooks add: ``custom_data`` (alias ``user_data``), old-style ``custom_metrics`` (reported as
``custom_metrics/<key>_mean|_min|_max`` over the smoothing window) and per-timestep data.
"""
from __future__ import annotations

from typing import Any

import numpy as np

from actors.callbacks import call_hook, overrides
from protocols import nested


class RunnerEpisode:
    """One sub-environment's running episode, as episode hooks see it (RLlib's SingleAgentEpisode
    accessors, and the old ``last_*_for``/``user_data``/``custom_metrics`` ones)."""

    def __init__(self, id_: str, env_index: int, worker_index: int) -> None:
        self.id_ = id_
        self.env_index = env_index
        self.worker_index = worker_index
        self.observations: list[Any] = []
        self.actions: list[Any] = []
        self.rewards: list[float] = []
        self.infos: list[dict] = []
        self.is_terminated = False
        self.is_truncated = False
        self.custom_data: dict[str, Any] = {}
        self.custom_metrics: dict[str, float] = {}
        self.hist_data: dict[str, list] = {}
        self._temporary: dict[str, list] = {}

    # --- RLlib's accessors --------------------------------------------------------------------
    @property
    def episode_id(self) -> str:
        return self.id_

    @property
    def user_data(self) -> dict[str, Any]:
        return self.custom_data

    @property
    def is_done(self) -> bool:
        return self.is_terminated or self.is_truncated

    def __len__(self) -> int:
        return len(self.rewards)

    @property
    def length(self) -> int:
        return len(self.rewards)

    def get_return(self) -> float:
        return float(sum(self.rewards))

    @property
    def total_reward(self) -> float:
        return self.get_return()

    def get_observations(self, indices: int | slice | list | None = None) -> Any:
        return _pick(self.observations, indices)

    def get_actions(self, indices: int | slice | list | None = None) -> Any:
        return _pick(self.actions, indices)

    def get_rewards(self, indices: int | slice | list | None = None) -> Any:
        return _pick(self.rewards, indices)

    def get_infos(self, indices: int | slice | list | None = None) -> Any:
        return _pick(self.infos, indices)

    def last_observation_for(self, agent_id: Any = None) -> Any:
        return self.observations[-1] if self.observations else None

    def last_info_for(self, agent_id: Any = None) -> dict | None:
        return self.infos[-1] if self.infos else None

    def last_reward_for(self, agent_id: Any = None) -> float:
        return self.rewards[-1] if self.rewards else 0.0

    def last_action_for(self, agent_id: Any = None) -> Any:
        return self.actions[-1] if self.actions else None

    def add_temporary_timestep_data(self, key: str, data: Any) -> None:
        """Data for the current timestep, kept until the episode ends (not sent with the chunks)."""
        self._temporary.setdefault(key, []).append(data)

    def get_temporary_timestep_data(self, key: str) -> list:
        if key not in self._temporary:
            raise KeyError(f"no temporary timestep data under {key!r} in episode {self.id_}; "
                           f"keys: {sorted(self._temporary)}")
        return self._temporary[key]


def _pick(rows: list, indices: int | slice | list | None) -> Any:
    if indices is None:
        return list(rows)
    if isinstance(indices, (list, tuple)):
        return [rows[i] for i in indices]
    return rows[indices]


class EpisodeHooks:
    """Calls a runner's episode hooks at RLlib's moments: created (before the sub-env's reset),
    start (after it), step (after each step is in the episode, the last one too) and end."""

    def __init__(self, runner: Any, callbacks: Any, where: str, metrics: Any, window: int) -> None:
        self.runner, self.callbacks, self.where, self.metrics, self.window = runner, callbacks, where, metrics, window
        self.active = {h: overrides(callbacks, h) for h in ("on_episode_created", "on_episode_start",
                                                             "on_episode_step", "on_episode_end")}
        self.episodes: dict[int, RunnerEpisode] = {}
        self.upcoming: dict[int, RunnerEpisode] = {}  # created; its sub-env resets inside the vector step
        self.ended: dict[str, RunnerEpisode] = {}  # ended in the current fragment (postprocessing looks them up)

    def find(self, episode_id: str) -> RunnerEpisode | None:
        """The view of a running episode, or of one that ended in the current fragment."""
        found = self.ended.get(episode_id)
        return found if found is not None else next((e for e in self.episodes.values() if e.id_ == episode_id), None)

    def forget_ended(self) -> None:
        self.ended.clear()

    def resume(self, env_index: int, episode_id: str, obs: Any) -> None:
        """An episode continued from a checkpoint: a view from here on, no created/start hooks again."""
        episode = self.episodes[env_index] = RunnerEpisode(episode_id, env_index, self.runner.worker_index)
        episode.observations.append(obs)
        episode.infos.append({})

    def _call(self, hook: str, episode: RunnerEpisode) -> None:
        if self.active[hook]:
            call_hook(self.callbacks, hook, self.where, self.runner.metrics, episode=episode, env_runner=self.runner,
                      worker=self.runner, env=self.runner.env, rl_module=self.runner.module,
                      env_index=episode.env_index, metrics_logger=self.metrics)

    def created(self, env_index: int, episode_id: str) -> None:
        episode = self.upcoming[env_index] = RunnerEpisode(episode_id, env_index, self.runner.worker_index)
        self._call("on_episode_created", episode)

    def started(self, env_index: int, obs: Any, info: dict | None) -> None:
        episode = self.episodes[env_index] = self.upcoming.pop(env_index)
        episode.observations.append(obs)
        episode.infos.append(info or {})
        self._call("on_episode_start", episode)

    def stepped(self, env_index: int, action: Any, reward: float, obs: Any, info: dict | None, terminated: bool,
                truncated: bool) -> None:
        episode = self.episodes[env_index]
        episode.actions.append(action)
        episode.rewards.append(float(reward))
        episode.observations.append(obs)
        episode.infos.append(info or {})
        episode.is_terminated, episode.is_truncated = bool(terminated), bool(truncated and not terminated)
        self._call("on_episode_step", episode)
        if terminated or truncated:
            self.ended[episode.id_] = episode
            self._call("on_episode_end", episode)
            for key, value in episode.custom_metrics.items():
                for suffix, reduce in (("mean", "mean"), ("min", "min"), ("max", "max")):
                    self.metrics.log_value(f"custom_metrics/{key}_{suffix}", value, reduce=reduce, window=self.window)

    def step_all(self, actions: np.ndarray, rewards: np.ndarray, next_obs: Any, res: Any, first: int = 0) -> None:
        """Feed one vector step: ``next_obs`` batched (reset observations where episodes ended),
        the ended sub-envs' last observations in ``res.final_obs``. ``first``: the sub-env of the arrays'
        first row (a double-buffering runner steps half its sub-envs at a time; ``final_obs`` is keyed by
        sub-env)."""
        infos = res.infos or [None] * len(rewards)
        for k in range(len(rewards)):
            j = first + k
            ended = j in res.final_obs
            obs = res.final_obs[j] if ended else nested.map_structure(lambda a: a[k], next_obs)
            self.stepped(j, actions[k], rewards[k], obs, infos[k], res.terminated[k], res.truncated[k])
            if ended:
                self.started(j, nested.map_structure(lambda a: a[k], next_obs), (res.reset_infos or {}).get(j))
