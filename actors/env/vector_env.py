"""Vectorized environments for env runners, with same-step autoreset.

``step`` returns the *reset* observation for a sub-env whose episode just ended, and its real last
observation in ``final_obs[i]``: each episode's next observation is then stored exactly once.

``SyncVectorEnv`` steps its sub-envs in this process and can recreate one that raises (its
episode is closed as truncated). When seeded, every episode's reset gets its own seed, derived from
the run's seed, the runner, the sub-env and the sub-env's episode count, and the actions of each
running episode are recorded: ``get_state``/``set_state`` then carry a sub-env's episode across a
checkpoint by replaying its actions after the same seeded reset, which reproduces the env exactly
whenever its dynamics follow from the reset seed and the actions (gymnasium envs that draw their
randomness from ``np_random`` do). ``AsyncVectorEnv`` runs each sub-env in its own process
(gymnasium's ``AsyncVectorEnv``); a failure there recreates the whole vector.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any, Callable

import gymnasium as gym
import numpy as np

from protocols import nested

log = logging.getLogger(__name__)

MAX_RECORDED_ACTIONS = 100_000
"""Actions kept per running episode for resuming it from a checkpoint; a longer episode resumes fresh."""


class EnvContext(dict):
    """The ``env_config`` dict handed to an env creator, plus where the env lives.

    ``recreated`` is True for an env that replaces a failed one (or lives in a recreated runner);
    ``in_evaluation`` for an env of an evaluator."""

    def __init__(self, env_config: dict | None, worker_index: int = 0, vector_index: int = 0,
                 num_workers: int = 0, recreated: bool = False, in_evaluation: bool = False) -> None:
        super().__init__(env_config or {})
        self.worker_index = worker_index
        self.vector_index = vector_index
        self.num_workers = num_workers
        self.recreated = recreated
        self.in_evaluation = in_evaluation

    @property
    def remote(self) -> bool:
        return self.worker_index > 0


@dataclass
class StepResult:
    obs: Any
    """Batched next observations (reset observations where an episode ended)."""
    rewards: np.ndarray
    terminated: np.ndarray
    truncated: np.ndarray
    final_obs: dict[int, Any] = field(default_factory=dict)
    """Sub-env index -> the last observation of the episode that ended at this step."""
    restarted: list[int] = field(default_factory=list)
    """Sub-envs that raised and were recreated; their episodes were closed as truncated."""
    infos: list[dict] | None = None
    """Each sub-env's step info (the last step's for an ended episode), when ``keep_infos`` is on."""
    reset_infos: dict[int, dict] | None = None
    """Sub-env index -> the reset info of the episode that started at this step (``keep_infos``)."""
    skipped: np.ndarray | None = None
    """Sub-envs whose step was only a reset (an env that resets on the step after an episode ended,
    ``native_vector_env``): their action was ignored, and the cell belongs to no episode. None: no such sub-env."""
    started: np.ndarray | None = None
    """Sub-envs whose observation in ``obs`` is an episode's first; None: those in ``final_obs``."""


class SyncVectorEnv:
    supports_hooks = True
    """Calls ``before_reset`` and ``on_created`` (the async vector env's sub-envs live elsewhere)."""
    carries_episodes = True
    """``get_state``/``set_state`` carry running episodes across a checkpoint."""
    next_step = False
    """Ended sub-envs reset on the same step (``native_vector_env`` has envs that do not)."""

    def __init__(self, creator: Callable[[EnvContext], gym.Env], env_config: dict, num_envs: int,
                 worker_index: int, num_workers: int, seed: int | None, restart_failed: bool,
                 recreated: bool = False, in_evaluation: bool = False,
                 on_created: Callable[[int, gym.Env, EnvContext], None] | None = None) -> None:
        self.creator, self.env_config, self.recreated = creator, env_config, recreated
        self.worker_index, self.num_workers = worker_index, num_workers
        self.seed, self.restart_failed = seed, restart_failed
        self.in_evaluation, self.on_created = in_evaluation, on_created
        self.before_reset: Callable[[int], None] | None = None
        """Called with a sub-env's index right before its reset (episode hooks: "created")."""
        self.keep_infos = False
        self.reset_infos: list[dict] = [{} for _ in range(num_envs)]
        self.num_restarts = 0
        self.episodes = [0] * num_envs  # episodes started, per sub-env (drives the reset seeds)
        self._episode_seed: list[int | None] = [None] * num_envs
        self._actions: list[list] = [[] for _ in range(num_envs)]  # this episode's, when seeded
        self._seeded = [False] * num_envs  # whether sub-env i (this env object) had its first, seeded reset
        self.envs = [self._make(i) for i in range(num_envs)]
        self.num_envs = num_envs
        self.single_observation_space = self.envs[0].observation_space
        self.single_action_space = self.envs[0].action_space
        # Python ints take gymnasium's cheap path in Discrete.contains (numpy ints cost an issubdtype each)
        self._as_list = isinstance(self.single_action_space, gym.spaces.Discrete)
        self._last_obs: list[Any] = []

    def _make(self, i: int, recreated: bool = False) -> gym.Env:
        ctx = EnvContext(self.env_config, self.worker_index, i, self.num_workers, recreated or self.recreated,
                         self.in_evaluation)
        env = self.creator(ctx)
        self._seeded[i] = False
        if self.on_created is not None:
            self.on_created(i, env, ctx)
        return env

    @property
    def sub_envs(self) -> list[gym.Env]:
        return self.envs

    def _reset(self, i: int) -> Any:
        """Start sub-env i's next episode (seeded, when the run is: every episode, so a checkpoint can replay the
        running one from its seed and actions -- or only the env's first, for envs that say a seeded reset costs
        too much, ``reseed_each_episode = False``: an ALE env reloads its ROM to take a seed, 80 ms, and seeded
        Atari runs spent a tenth of their sampling time there. Their later episodes follow the env's own
        generator, still the same run for the same seed, and a restored runner starts them afresh.)"""
        seed = None
        if self.seed is not None and (not self._seeded[i] or getattr(self.envs[i], "reseed_each_episode", True)):
            seed = int(np.random.SeedSequence([self.seed, self.worker_index, i, self.episodes[i]]).generate_state(1)[0])
            self._seeded[i] = True
        self.episodes[i] += 1
        self._episode_seed[i] = seed
        self._actions[i] = []
        if self.before_reset is not None:
            self.before_reset(i)
        obs, info = self.envs[i].reset(seed=seed)
        self.reset_infos[i] = info
        return obs

    def reset(self) -> Any:
        self._last_obs = [self._reset(i) for i in range(self.num_envs)]
        return nested.stack(self._last_obs)

    def step(self, actions: np.ndarray) -> StepResult:
        return self.step_rows(0, self.num_envs, actions)

    def step_rows(self, lo: int, hi: int, actions: np.ndarray) -> StepResult:
        """Step sub-envs ``lo..hi-1`` only, with one action each (a runner that double-buffers steps one half
        while the other's actions are inferred): the result's arrays cover that range, ``final_obs`` and
        ``reset_infos`` are keyed by sub-env index."""
        n = hi - lo
        rewards = np.zeros(n, np.float32)
        terminated = np.zeros(n, bool)
        truncated = np.zeros(n, bool)
        final_obs: dict[int, Any] = {}
        restarted: list[int] = []
        last_obs = self._last_obs
        if self._as_list:
            actions = actions.tolist()
        record = self.seed is not None
        infos: list[dict] | None = [{} for _ in range(n)] if self.keep_infos else None
        for k in range(n):
            i = lo + k
            try:
                obs, rew, term, trunc, info = self.envs[i].step(actions[k])
                if infos is not None:
                    infos[k] = info
                if record and len(self._actions[i]) < MAX_RECORDED_ACTIONS:
                    self._actions[i].append(actions[k])
                if term or trunc:
                    final_obs[i] = obs
                    obs = self._reset(i)
            except Exception as err:  # noqa: BLE001 - any env error is survivable here
                if not self.restart_failed:
                    raise
                obs = self._restart(i, err)
                final_obs[i], rew, term, trunc = last_obs[i], 0.0, False, True
                restarted.append(i)
            last_obs[i] = obs
            rewards[k] = rew
            terminated[k] = term
            truncated[k] = trunc
        reset_infos = {i: self.reset_infos[i] for i in final_obs} if infos is not None else None
        return StepResult(nested.stack(last_obs[lo:hi] if n != self.num_envs else last_obs), rewards, terminated,
                          truncated, final_obs, restarted, infos, reset_infos)

    def _restart(self, i: int, err: Exception) -> Any:
        log.warning("sub-environment %d of env runner %d raised %r; recreating it", i, self.worker_index, err)
        self.num_restarts += 1
        try:
            self.envs[i].close()
        except Exception:  # noqa: BLE001 - a broken env may fail to close too
            pass
        self.envs[i] = self._make(i, recreated=True)
        return self._reset(i)

    def get_state(self) -> dict[str, Any]:
        """Episode counters and, when seeded, each running episode's reset seed and actions."""
        return {"episodes": list(self.episodes), "seeds": list(self._episode_seed),
                "actions": [np.asarray(a) if len(a) < MAX_RECORDED_ACTIONS else None for a in self._actions]}

    def set_state(self, state: dict[str, Any]) -> Any:
        """Resume: each sub-env's running episode is rebuilt by replaying its actions after its seeded
        reset (a sub-env whose episode cannot be rebuilt starts a fresh one). Returns the batched
        observations to act on next."""
        self.episodes = list(state["episodes"])
        self._last_obs = [None] * self.num_envs
        for i in range(self.num_envs):
            seed, actions = state["seeds"][i], state["actions"][i]
            if seed is None or actions is None:
                self._last_obs[i] = self._reset(i)
                continue
            obs = self.envs[i].reset(seed=seed)[0]
            self._episode_seed[i], self._actions[i] = seed, list(actions)
            for k, a in enumerate(self._actions[i]):
                obs, _, term, trunc, _ = self.envs[i].step(a.item() if self._as_list else a)
                if (term or trunc) and k < len(actions) - 1:
                    log.warning("sub-environment %d of env runner %d ended early while replaying its episode: "
                                "the env does not follow from its seed and actions; starting a fresh episode",
                                i, self.worker_index)
                    obs = self._reset(i)
                    break
            self._last_obs[i] = obs
        return nested.stack(self._last_obs)

    def close(self) -> None:
        for env in self.envs:
            env.close()


class AsyncVectorEnv:
    """Each sub-env in its own process (gymnasium); for envs slow enough to be worth the IPC.
    Sub-environment hooks (``on_sub_environment_created``, episode "created" before the reset) do
    not reach into those processes."""

    supports_hooks = False
    carries_episodes = False
    next_step = False

    def __init__(self, creator: Callable[[EnvContext], gym.Env], env_config: dict, num_envs: int,
                 worker_index: int, num_workers: int, seed: int | None, restart_failed: bool,
                 recreated: bool = False, in_evaluation: bool = False, on_created: Any = None) -> None:
        self._fns = [
            (lambda i=i: creator(EnvContext(env_config, worker_index, i, num_workers, recreated, in_evaluation)))
            for i in range(num_envs)
        ]
        self.before_reset = None
        self.keep_infos = False
        self.num_envs, self.seed, self.restart_failed = num_envs, seed, restart_failed
        self.worker_index = worker_index
        self.num_restarts = 0
        self._seeded = False
        self._env = self._make()
        self.single_observation_space = self._env.single_observation_space
        self.single_action_space = self._env.single_action_space
        self._last_obs = None

    @property
    def sub_envs(self) -> list[gym.Env]:
        raise RuntimeError("the sub-environments of gym_env_vectorize_mode='async' live in their own processes; "
                           "use gym_env_vectorize_mode='sync' to reach them from the env runner (foreach_env, "
                           "curriculum tasks)")

    def _make(self) -> gym.vector.AsyncVectorEnv:
        return gym.vector.AsyncVectorEnv(self._fns, autoreset_mode=gym.vector.AutoresetMode.SAME_STEP)

    def reset(self) -> Any:
        seed = None
        if self.seed is not None and not self._seeded:  # once: later resets go on from the seeded streams
            seed, self._seeded = [self.seed + 10_000 * self.worker_index + i for i in range(self.num_envs)], True
        self._last_obs = self._env.reset(seed=seed)[0]
        return self._last_obs

    def get_state(self) -> dict[str, Any]:
        return {}  # sub-envs in other processes: a resumed runner starts fresh episodes

    def set_state(self, state: dict[str, Any]) -> Any:
        return self.reset()

    def step(self, actions: np.ndarray) -> StepResult:
        try:
            obs, rew, term, trunc, info = self._env.step(actions)
        except Exception as err:  # noqa: BLE001
            if not self.restart_failed:
                raise
            log.warning("async vector env of env runner %d raised %r; recreating all its sub-envs", self.worker_index, err)
            self.num_restarts += self.num_envs
            try:
                self._env.close(terminate=True)
            except Exception:  # noqa: BLE001
                pass
            self._env = self._make()
            prev = self._last_obs
            n = self.num_envs
            final = {i: nested.map_structure(lambda a: a[i], prev) for i in range(n)}
            self._last_obs = self._env.reset()[0]
            return StepResult(self._last_obs, np.zeros(n, np.float32), np.zeros(n, bool), np.ones(n, bool),
                              final, list(range(n)))
        final_obs = same_step_final_obs(info)
        self._last_obs = obs
        infos = split_infos(info, self.num_envs, final_obs) if self.keep_infos else None
        return StepResult(obs, rew.astype(np.float32), term, trunc, final_obs, infos=infos, reset_infos={})

    def close(self) -> None:
        self._env.close()


def same_step_final_obs(info: dict) -> dict[int, Any]:
    """Sub-env index -> the last observation of the episode that ended at this step, from gymnasium's
    same-step autoreset infos (``final_obs`` masked by ``_final_obs``)."""
    if "_final_obs" not in info:
        return {}
    return {int(i): info["final_obs"][i] for i in np.flatnonzero(info["_final_obs"])}


def split_infos(info: dict, n: int, final: Any = ()) -> list[dict]:
    """gymnasium's batched infos (``{key: array over sub-envs}``) -> one dict per sub-env; a sub-env in
    ``final`` (its episode ended at this step) gets its ``final_info``."""
    step_info = {k: v for k, v in info.items() if not k.startswith("_") and k not in ("final_obs", "final_info")}
    final_info = info.get("final_info") or {}
    return [{k: v[i] for k, v in (final_info if i in final else step_info).items() if not k.startswith("_")}
            for i in range(n)]
