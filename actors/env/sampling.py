"""FragmentSampler: an env runner's per-step loop, and the observations the next step starts from.

Each step is one call of the acting piece (``actors.env.acting``: a batched forward pass and an
exploration call in this process, or one round trip to an inference server) and one vector-env step, written into
time-major buffers (a ``Fragment``, ``[T, num_envs]``); nothing runs per sub-env except the env's
own ``step`` (and episode hooks, when callbacks asked for them). Cutting the buffers into chunks
happens once per fragment, in ``EpisodeSlots.cut``.
"""
from __future__ import annotations

import logging
from typing import Any

import numpy as np

from actors.connectors.base import ConnectorPipeline
from actors.connectors.module_to_env import ModuleToEnvPipeline
from actors.env.actions import EnvActions
from actors.env.episode_hooks import EpisodeHooks
from actors.env.episode_slots import EpisodeSlots, Fragment
from actors.env.split_sampling import run_split, split_problem
from actors.env.vector_env import AsyncVectorEnv, SyncVectorEnv
from protocols import nested

log = logging.getLogger("runnel")


class FragmentSampler:
    """Steps every sub-env with the acting piece. ``obs`` is None until the first reset (and again after
    ``sample(num_episodes=n)``, whose unfinished episodes are dropped)."""

    def __init__(self, env: SyncVectorEnv | AsyncVectorEnv, acting: Any, env_actions: EnvActions,
                 slots: EpisodeSlots, hooks: EpisodeHooks | None, with_infos: bool,
                 connector: ConnectorPipeline | None = None, update_connector: bool = True,
                 module_to_env: ModuleToEnvPipeline | None = None) -> None:
        self.env, self.acting, self.env_actions = env, acting, env_actions
        self.connector = connector
        """The env-to-module pipeline (``actors.connectors``): chunks store its recording pieces' output, the
        module acts on its views' output; None: observations go through as the env gave them."""
        self.module_to_env = module_to_env
        """The module-to-env pipeline (``actors.connectors.module_to_env``): it may change the actions the env
        gets, or what is recorded; None: the module's actions, converted by ``env_actions``."""
        self.update_connector = update_connector
        """The pipeline may learn from what this runner sees (running statistics); evaluators do not."""
        self.module_obs: Any = None  # what the module acts on next (``obs`` unless the pipeline has views)
        self.slots, self.hooks = slots, hooks
        self.num_envs = slots.num_envs
        self.with_infos = with_infos
        """Keep each step's infos for the chunks (a recording that writes them)."""
        self.obs: Any = None
        self.obs_infos: list[dict] | None = None  # the info of each sub-env's current observation
        self.oldest_version = 0
        """The oldest weights version that acted in the last ``run`` (what its chunks are stamped with)."""
        self._split: bool | None = None  # double-buffered (decided at the first run: nothing it rests on changes)

    def reset(self) -> None:
        """Reset every sub-env; each starts a fresh episode."""
        if getattr(self.acting, "recurrent", False):
            self.acting.reset_states(None)
        self.slots.clear_next()
        self.obs = self.env.reset()
        if self.connector is not None:
            self.connector.reset_memory(self.num_envs)
            self.obs, self.module_obs = self._observe(self.obs, np.ones(self.num_envs, bool))
        else:
            self.module_obs = self.obs
        if not self.env.supports_hooks:
            for j in range(self.num_envs):
                self.slots.begin(j)
        self.slots.start_all()
        if self.with_infos:
            reset_infos = getattr(self.env, "reset_infos", None) or [{}] * self.num_envs
            self.obs_infos = [plain_info(i) for i in reset_infos]
        if self.hooks is not None:
            infos = getattr(self.env, "reset_infos", None) or [{}] * self.num_envs
            for j in range(self.num_envs):
                self.hooks.started(j, nested.map_structure(lambda a: a[j], self.obs), infos[j])

    def resume(self, raw_obs: Any) -> None:
        """Go on from observations a restored vector env gave back (their episodes resume; a view's
        memory of earlier steps was not saved, so it starts from these)."""
        self.obs = raw_obs
        if self.connector is not None:
            self.connector.reset_stack(self.num_envs)
            self.obs, self.module_obs = self._observe(raw_obs, np.ones(self.num_envs, bool), update=False)
        else:
            self.module_obs = raw_obs

    def double_buffered(self) -> bool:
        """Steps one half of the sub-envs while the other half's actions are inferred (``split_sampling``):
        central inference with ``double_buffer`` on, where this loop allows it (why not is logged)."""
        if self._split is None:
            problem = split_problem(self)
            if problem is not None and len(getattr(self.acting, "lanes", ())) > 1:
                log.info("env runner: double buffering off: %s; stepping every sub-env at once", problem)
            self._split = problem is None
        return self._split

    def _observe(self, raw: Any, starts: np.ndarray, update: bool | None = None) -> tuple[Any, Any]:
        """Raw env observations -> (what chunks store, what the module acts on)."""
        update = self.update_connector if update is None else update
        recorded = self.connector.record(raw, starts, update)
        return recorded, (self.connector.view(recorded, starts, update) if self.connector.views else recorded)

    def _record_one(self, raw: Any, env_index: int) -> Any:
        """Sub-env ``env_index``'s last observation of an episode through the recording pieces (learning nothing
        from it)."""
        batch = nested.map_structure(lambda a: np.asarray(a)[None], raw)
        out = self.connector.record_final(batch, env_index)
        return nested.map_structure(lambda a: a[0], out)

    def run(self, steps: int, explore: bool, t0: int) -> Fragment:
        """``steps`` steps of every sub-env from ``obs``; ``t0`` is the timestep exploration
        schedules start from. The caller runs this in the acting piece's ``session()``."""
        if self.double_buffered():
            return run_split(self, steps, explore, t0)
        n = self.num_envs
        obs_rows, act_rows, logp_rows, dist_rows = [], [], [], []
        rewards = np.zeros((steps, n), np.float32)
        terminated = np.zeros((steps, n), bool)
        truncated = np.zeros((steps, n), bool)
        final_obs: dict[tuple[int, int], Any] = {}
        info_rows: list[list[dict]] | None = [self.obs_infos or [{}] * n] if self.with_infos else None
        final_infos: dict[tuple[int, int], dict] = {}
        obs, module_obs = self.obs, self.module_obs
        conn = self.connector
        watched = conn is not None and bool(conn.step_watchers)
        to_env = self.module_to_env
        look_back = conn.recent() if conn is not None and conn.look_back else None
        recurrent = getattr(self.acting, "recurrent", False)
        state_rows: list[np.ndarray] | None = [] if recurrent else None
        act = self.acting.act
        oldest = None
        skipped: np.ndarray | None = None  # [T, n] reset-only cells (``StepResult.skipped``), once there is one
        for t in range(steps):
            obs_rows.append(obs)
            if state_rows is not None:  # the state each sub-env acts from: a chunk starting here carries it
                state_rows.append(self.acting.states(n).copy())
            act_np, logp, dist_inputs, version = act(module_obs, explore, t0 + t * n)
            if oldest is None or version < oldest:
                oldest = version
            env_act = None
            if to_env is not None:
                out = to_env({"actions": act_np, "action_logp": logp, "action_dist_inputs": dist_inputs},
                             module_obs, explore)
                act_np, logp, dist_inputs, env_act = (out["actions"], out["action_logp"], out["action_dist_inputs"],
                                                      out.get("actions_for_env"))
            act_rows.append(act_np)
            logp_rows.append(logp)
            dist_rows.append(dist_inputs)
            res = self.env.step(self.env_actions(act_np) if env_act is None else env_act)
            if watched:
                conn.after_step(act_np, res.rewards)
            rewards[t], terminated[t], truncated[t] = res.rewards, res.terminated, res.truncated
            if res.skipped is not None:
                if skipped is None:
                    skipped = np.zeros((steps, n), bool)
                skipped[t] = res.skipped
            started = res.final_obs.keys() if res.started is None else res.started
            if recurrent and len(res.final_obs) + (res.skipped is not None):
                self.acting.reset_states(started_rows(started))
            for i, o in res.final_obs.items():
                final_obs[(t, i)] = o if conn is None else self._record_one(o, i)
                if not self.env.supports_hooks:
                    self.slots.begin(i)
            if self.hooks is not None:
                self.hooks.step_all(act_np, res.rewards, res.obs, res)
            if info_rows is not None:
                step_infos = [plain_info(i) for i in (res.infos or [{}] * n)]
                reset_infos = res.reset_infos or {}
                for i in res.final_obs:
                    final_infos[(t, i)] = step_infos[i]
                info_rows.append([plain_info(reset_infos.get(i, {})) if i in res.final_obs else step_infos[i]
                                  for i in range(n)])
            if conn is None:
                obs = module_obs = res.obs
            else:
                starts = np.zeros(n, bool)
                starts[started_rows(started)] = True
                obs, module_obs = self._observe(res.obs, starts)
        self.obs, self.module_obs = obs, module_obs
        self.oldest_version = oldest if oldest is not None else self.acting.weights_version
        obs_rows.append(obs)
        if info_rows is not None:
            self.obs_infos = info_rows[-1]
        return Fragment(obs_rows, act_rows, logp_rows, dist_rows, rewards, terminated, truncated, final_obs,
                        info_rows, final_infos, look_back,
                        None if state_rows is None else np.stack(state_rows), skipped)


def started_rows(started: Any) -> list[int] | np.ndarray:
    """The sub-envs a step started episodes in: ``final_obs`` keys, or a ``StepResult.started`` mask."""
    return np.flatnonzero(started) if isinstance(started, np.ndarray) else list(started)


def plain_info(info: Any) -> dict:
    """An env info as plain data the codec carries (numpy scalars to Python numbers, arrays kept)."""
    if not isinstance(info, dict):
        return {}
    out = {}
    for k, v in info.items():
        if isinstance(v, np.generic):
            v = v.item()
        elif isinstance(v, dict):
            v = plain_info(v)
        out[str(k)] = v
    return out
