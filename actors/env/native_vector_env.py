"""An env's own vector implementation (gymnasium's ``vector_entry_point``), behind the runner's vector-env API.

Some envs step all their copies at once: gymnasium's ``CartPoleVectorEnv`` advances 32 carts with a handful
of numpy operations, about 5x faster than 32 Python ``CartPoleEnv`` objects. ``make_vector_env`` picks it
for ``gym_env_vectorize_mode="auto"`` (the default) when the env is a gymnasium id that declares one.

Such envs reset sub-envs in one of two ways (gymnasium's ``AutoresetMode``):

* ``SAME_STEP``: the step that ends an episode returns the next episode's first observation, the last one
  in ``info["final_obs"]`` -- what the runner expects; passed through.
* ``NEXT_STEP`` (CartPole's): the step that ends an episode returns its last observation, and the sub-env's
  *next* step ignores its action and only resets (reward 0, no flags). This adapter reports the ended
  episode at once (its last observation in ``final_obs``, and again as the placeholder the runner acts on)
  and marks the reset step in ``StepResult.skipped``: the runner keeps that cell out of every chunk and
  every step count, and starts the next episode from the observation the reset step returned.

``gym_env_vectorize_mode="envpool"`` puts EnvPool's vector env (C++, its own thread pool; the optional extra
``runnel-rl[envpool]``) behind the same adapter: EnvPool's gymnasium API resets ``NEXT_STEP``. ``envpool_id`` says
whether an id is EnvPool's; an ALE id goes to EnvPool's env of its game with ``make_atari``'s settings and frames
(``envpool_atari``). EnvPool gets as many threads as the runner has CPUs (``threads``). ``auto`` does not pick it, even when it is installed: on CartPole gymnasium's numpy
implementation is faster, and a seeded run should not change with what happens to be installed.

The whole vector is one object, so per-sub-env access (``sub_envs``: ``on_sub_environment_created``, a
curriculum's ``set_task``, ``foreach_env``) is not available, a failing step recreates every sub-env (their
episodes end truncated), and a checkpoint does not carry running episodes (a restored runner starts fresh
ones). Seeded runs seed the vector once, at its first reset: every later episode follows from that seed.
"""
from __future__ import annotations

import logging
import warnings
from typing import Any, Callable

import gymnasium as gym
import numpy as np
from gymnasium.vector import AutoresetMode

from actors.env.creators import AtariMaker, GymMaker
from actors.env.envpool_atari import envpool_game_id, make_envpool_atari
from actors.env.vector_env import EnvContext, StepResult, same_step_final_obs, split_infos

log = logging.getLogger(__name__)


def envpool_id(creator: Any) -> str:
    """The id ``creator`` makes, when EnvPool is installed and offers that id (for an ALE id: its game); else a
    ValueError saying why."""
    try:
        import envpool
    except ImportError as err:
        raise ValueError(f"gym_env_vectorize_mode='envpool' needs EnvPool, which is not installed ({err}): pip "
                         f"install 'runnel-rl[envpool]', or use 'auto' or 'sync'") from None
    env_id = creator.env_id if isinstance(creator, (GymMaker, AtariMaker)) else None
    offered = envpool_game_id(env_id) if isinstance(creator, AtariMaker) else env_id
    if offered is None or offered not in envpool.list_all_envs():
        raise ValueError(f"gym_env_vectorize_mode='envpool' needs an env id that EnvPool offers (and gymnasium: the "
                         f"driver reads the spaces from gymnasium's env), e.g. 'CartPole-v1', 'Acrobot-v1', "
                         f"'Pendulum-v1' or an ALE id such as 'ALE/Pong-v5'; got {creator!r}. Use 'auto' or 'sync' "
                         f"for other envs")
    return env_id


ENVPOOL_OWN = ("num_threads", "batch_size", "seed", "num_envs")
"""EnvPool options a runner sets itself: threads from its CPUs, all its envs stepped at once, its seed."""


def make_envpool(env_id: str, num_envs: int, seed: int, env_config: dict, threads: int = 1,
                 atari: bool = False, in_evaluation: bool = False) -> Any:
    """EnvPool's gymnasium vector env stepping all ``num_envs`` at once on ``threads`` threads of its own
    (``env_config``: options EnvPool's env takes, which gymnasium's must take too: the driver builds that one to
    read the spaces). ``atari``: ``env_id`` is an ALE id, built as ``make_atari`` builds it (``envpool_atari``)."""
    taken = sorted(set(env_config) & set(ENVPOOL_OWN))
    if taken:
        raise ValueError(f"{env_id}: env_config sets EnvPool's {taken}, which each runner sets itself: its threads "
                         f"follow num_cpus_per_env_runner (.env_runners(num_cpus_per_env_runner=...)), it steps all "
                         f"num_envs_per_env_runner envs at once, its seed follows .debugging(seed=...)")
    if atari:
        return make_envpool_atari(env_id, num_envs, seed, env_config, in_evaluation, threads)
    import envpool
    return envpool.make_gymnasium(env_id, num_envs=num_envs, seed=seed, num_threads=threads, **env_config)


def native_vector_id(creator: Any) -> str | None:
    """The gymnasium id ``creator`` makes, when that id declares a vector implementation; else None."""
    if not isinstance(creator, GymMaker):
        return None
    env_id = creator.env_id
    try:
        spec = gym.spec(env_id)
    except gym.error.Error:
        return None
    if spec.vector_entry_point is None or spec.additional_wrappers:
        return None
    return env_id


class NativeVectorEnv:
    supports_hooks = False
    """No per-sub-env hooks: the sub-envs are not separate objects."""
    carries_episodes = False
    """A restored runner starts fresh episodes."""

    def __init__(self, env_id: str, env_config: dict, num_envs: int, worker_index: int, num_workers: int,
                 seed: int | None, restart_failed: bool, recreated: bool = False, in_evaluation: bool = False,
                 on_created: Callable | None = None, backend: str = "gymnasium", threads: int = 1) -> None:
        """``backend``: "gymnasium" (the id's ``vector_entry_point``), "envpool" (``envpool.make_gymnasium``) or
        "envpool_atari" (an ALE id through EnvPool, ``envpool_atari``); ``threads``: EnvPool's threads."""
        if backend not in ("gymnasium", "envpool", "envpool_atari"):
            raise ValueError(f"backend {backend!r} is not 'gymnasium', 'envpool' or 'envpool_atari'")
        self.env_id, self.env_config, self.backend = env_id, dict(EnvContext(env_config)), backend
        self.threads, self.in_evaluation = max(1, int(threads)), in_evaluation
        self.num_envs, self.seed, self.restart_failed = num_envs, seed, restart_failed
        self.worker_index = worker_index
        self.before_reset = None
        self.keep_infos = False
        self.reset_infos: list[dict] = [{} for _ in range(num_envs)]
        self.num_restarts = 0
        self._env = self._make()
        mode = AutoresetMode(self._env.metadata.get("autoreset_mode", AutoresetMode.NEXT_STEP))
        if mode is AutoresetMode.DISABLED:
            raise ValueError(f"{env_id}'s vector implementation does not reset its sub-envs by itself "
                             f"(autoreset_mode DISABLED); use gym_env_vectorize_mode='sync'")
        self.next_step = mode is AutoresetMode.NEXT_STEP
        """Ended sub-envs reset on their next step (see the module docstring); else on the same step."""
        with warnings.catch_warnings():  # EnvPool builds its spaces at each read, float64 bounds cast to float32
            warnings.simplefilter("ignore", UserWarning)
            self.single_observation_space = self._env.single_observation_space
            self.single_action_space = self._env.single_action_space
        self._seeded = backend != "gymnasium"  # EnvPool took its seed when it was made (see _make)
        self._resetting = np.zeros(num_envs, bool)  # sub-envs whose next step is a reset step (NEXT_STEP)
        self._none = np.zeros(num_envs, bool)  # no episode started (read only)
        self._last_obs: Any = None

    def _make(self) -> gym.vector.VectorEnv:
        if self.backend != "gymnasium":
            # EnvPool takes its seed when it is made (reset(seed=...) is ignored): each runner its own, a recreated
            # vector a new one (not the same episodes again), an unseeded run a random one (not EnvPool's fixed 42)
            if self.seed is None:
                seed = int(np.random.SeedSequence().generate_state(1)[0] >> 1)
            else:
                seed = self.runner_seed() + 1_000_003 * self.num_restarts
            return make_envpool(self.env_id, self.num_envs, seed, self.env_config, self.threads,
                                atari=self.backend == "envpool_atari", in_evaluation=self.in_evaluation)
        return gym.make_vec(self.env_id, num_envs=self.num_envs, vectorization_mode="vector_entry_point",
                            **self.env_config)

    @property
    def vector_env(self) -> Any:
        """The vector env this adapts (gymnasium's, EnvPool's, or ``envpool_atari.EnvPoolFrames``)."""
        return self._env

    def runner_seed(self) -> int:
        """This runner's seed: the run's, apart for each runner."""
        return self.seed + 10_000 * self.worker_index

    @property
    def sub_envs(self) -> list[gym.Env]:
        raise RuntimeError(f"{self.env_id} runs as one vector env (its own vector implementation), without "
                           f"separate sub-env objects; use gym_env_vectorize_mode='sync' to reach each sub-env "
                           f"(foreach_env, on_sub_environment_created, curriculum tasks)")

    def reset(self) -> Any:
        seed = None
        if self.seed is not None and not self._seeded:  # once: later resets go on from the seeded stream
            seed, self._seeded = self.runner_seed(), True
        obs, info = self._env.reset(seed=seed)
        self.reset_infos = split_infos(info, self.num_envs) if self.keep_infos else [{} for _ in range(self.num_envs)]
        self._resetting = np.zeros(self.num_envs, bool)
        self._last_obs = obs
        return obs

    def step(self, actions: np.ndarray) -> StepResult:
        n = self.num_envs
        try:
            obs, rew, term, trunc, info = self._env.step(actions)
        except Exception as err:  # noqa: BLE001 - any env error is survivable here
            if not self.restart_failed:
                raise
            return self._restart(err)
        term, trunc = np.asarray(term, bool), np.asarray(trunc, bool)
        skipped = None
        final_obs: dict[int, Any] = {}
        if self.next_step:
            if self._resetting.any():
                skipped = self._resetting
            ended = term | trunc
            if ended.any():
                for i in np.flatnonzero(ended):
                    final_obs[int(i)] = obs[i]
            self._resetting = ended
        else:
            final_obs = same_step_final_obs(info)
        self._last_obs = obs
        infos = reset_infos = None
        if self.keep_infos:
            infos = split_infos(info, n, final_obs if not self.next_step else ())
            reset_infos = {i: {} for i in final_obs}
        started = (skipped if skipped is not None else self._none) if self.next_step else None
        return StepResult(obs, np.asarray(rew, np.float32), term, trunc, final_obs, infos=infos,
                          reset_infos=reset_infos, skipped=skipped, started=started)

    def _restart(self, err: Exception) -> StepResult:
        n = self.num_envs
        log.warning("vector env %s of env runner %d raised %r; recreating all its sub-envs", self.env_id,
                    self.worker_index, err)
        self.num_restarts += n
        try:
            self._env.close()
        except Exception:  # noqa: BLE001 - a broken env may fail to close too
            pass
        self._env = self._make()
        prev = self._last_obs
        final = {i: prev[i] for i in range(n)}
        obs = self.reset()
        return StepResult(obs, np.zeros(n, np.float32), np.zeros(n, bool), np.ones(n, bool), final,
                          list(range(n)), started=np.ones(n, bool))

    def get_state(self) -> dict[str, Any]:
        return {}  # one vector object: a restored runner starts fresh episodes

    def set_state(self, state: dict[str, Any]) -> Any:
        return self.reset()

    def close(self) -> None:
        self._env.close()
