"""Per-sub-env episode bookkeeping of an env runner, and cutting a fragment into episode chunks.

Each sub-env runs one episode at a time (a ``Slot``: its id, return and length so far, the chunks
held back until it ends). The sampling loop only fills time-major buffers (a ``Fragment``);
``EpisodeSlots.cut`` turns them into one chunk per (sub-env, episode segment) once per fragment,
which keeps this per-sub-env work out of the per-step loop.
"""
from __future__ import annotations

import json
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Callable

import numpy as np

from actors.env.episode_hooks import EpisodeHooks
from actors.metrics import MetricsLogger
from protocols import nested
from protocols.codec import decode, encode
from protocols.episode import EpisodeChunk


ID_POOL = 64
"""Episode ids drawn at a time."""


@dataclass
class Fragment:
    """One run of the sampling loop: ``T`` steps of ``n`` sub-envs, time-major as it was filled."""

    obs_rows: list
    """``T + 1`` batched observations; the last one is where the next fragment starts."""
    act_rows: list
    logp_rows: list
    dist_rows: list
    rewards: np.ndarray  # [T, n]
    terminated: np.ndarray  # [T, n]
    truncated: np.ndarray  # [T, n]
    final_obs: dict[tuple[int, int], Any]
    """``(t, sub-env)`` -> the last observation of the episode that ended there."""
    info_rows: list[list[dict]] | None = None
    """``T + 1`` rows of each sub-env's info, when infos are kept (None otherwise)."""
    final_infos: dict[tuple[int, int], dict] = field(default_factory=dict)
    look_back: np.ndarray | None = None
    """``[n, L, ...]``: each sub-env's ``L`` recorded observations before the fragment's first (views that
    look back, like frame stacking); None when the runner's connectors need none."""
    state_rows: np.ndarray | None = None
    """``[T, n, ...]``: the recurrent state each sub-env acted from at each step (a recurrent module); None
    otherwise."""
    skipped: np.ndarray | None = None
    """``[T, n]``: cells where a sub-env only reset (``StepResult.skipped``): in no chunk and no step count.
    None: there were none."""

    @property
    def num_env_steps(self) -> int:
        """The env steps this fragment holds: every cell but the reset-only ones."""
        steps = self.rewards.size
        return steps - int(self.skipped.sum()) if self.skipped is not None else steps


@dataclass
class Slot:
    """The episode currently running in one sub-env."""

    episode_id: str
    counted: bool = True
    """False for an episode started after ``sample(num_episodes=n)`` had started its n (it is dropped)."""
    chunk_index: int = 0
    t_started: int = 0
    ret: float = 0.0
    length: int = 0
    pending: list = field(default_factory=list)  # held-back chunks (complete_episodes mode)


class EpisodeSlots:
    """The episode running in each sub-env, the ids of those about to start, and the statistics of
    those that ended (logged to the runner's metrics)."""

    def __init__(self, num_envs: int, worker_index: int, clip_rewards: bool | float | None, metrics: MetricsLogger,
                 metrics_window: int, hooks: EpisodeHooks | None,
                 postprocess: Callable[[EpisodeChunk], EpisodeChunk], max_seq_len: int | None = None) -> None:
        """``max_seq_len``: a recurrent module's chunks are cut to at most this many steps, each carrying the
        state it started from (``EpisodeChunk.state_in``)."""
        self.num_envs = num_envs
        self.max_seq_len = max_seq_len
        self.worker_index = worker_index
        self.clip_rewards = clip_rewards
        self.metrics, self.metrics_window = metrics, metrics_window
        self.hooks = hooks
        self.postprocess = postprocess
        """Called on every chunk before it leaves (the runner's ``on_postprocess_trajectory``)."""
        self.running: list[Slot] = []
        # episode ids: unique across runs (OS entropy), yet the same after a resume (state is saved)
        self.ids = np.random.default_rng()
        self._id_pool: list[str] = []  # drawn ahead, ID_POOL at a time (one draw costs ~10 us; episodes can be short)
        self.next_ids: list[deque] = [deque() for _ in range(num_envs)]  # (id, counted) of started episodes
        self.quota: int | None = None  # sample(num_episodes=n): episodes that count, in the order they start
        self.started = 0
        self.ended_log: list[tuple[float, int]] | None = None  # (return, length) of counted episodes, when asked

    def begin(self, index: int) -> None:
        """Sub-env ``index`` is about to start an episode: draw its id (and whether it counts)."""
        counted = True
        if self.quota is not None:
            counted = self.started < self.quota
            self.started += 1
        episode_id = self._new_episode_id()
        self.next_ids[index].append((episode_id, counted))
        if self.hooks is not None:
            self.hooks.created(index, episode_id)

    def _new_episode_id(self) -> str:
        if not self._id_pool:
            raw = self.ids.bytes(16 * ID_POOL).hex()
            self._id_pool = [raw[i : i + 32] for i in range(32 * (ID_POOL - 1), -1, -32)]  # popped from the end
        return self._id_pool.pop()

    def clear_next(self) -> None:
        """Forget the ids drawn for episodes that have not started (every sub-env is about to reset)."""
        self.next_ids = [deque() for _ in range(self.num_envs)]

    def start_all(self) -> None:
        """Every sub-env was reset: each runs the episode it drew an id for."""
        self.running = [Slot(*self.next_ids[j].popleft()) for j in range(self.num_envs)]

    def _clip(self, rewards: np.ndarray) -> np.ndarray:
        c = self.clip_rewards
        if c is None or c is False:
            return rewards
        if c is True:
            return np.sign(rewards)
        return np.clip(rewards, -c, c)

    def cut(self, fragment: Fragment, hold_back: bool, weights_version: int) -> list[EpisodeChunk]:
        """Time-major buffers -> one chunk per (sub-env, episode segment)."""
        f = fragment
        env_major = lambda rows: nested.map_structure(lambda a: np.ascontiguousarray(np.swapaxes(a, 0, 1)), nested.stack(rows))  # noqa: E731
        obs = env_major(f.obs_rows)  # [n, T+1, ...]
        acts = env_major(f.act_rows)
        logp = np.ascontiguousarray(np.stack(f.logp_rows).T)
        dists = env_major(f.dist_rows)
        raw_rewards = np.ascontiguousarray(f.rewards.T)
        clipped = self._clip(raw_rewards)
        terminated, truncated, info_rows, final_infos = f.terminated, f.truncated, f.info_rows, f.final_infos
        dones = (terminated | truncated).T
        col = lambda struct, j, a, b: nested.map_structure(lambda x: x[j, a:b], struct)  # noqa: E731
        out: list[EpisodeChunk] = []
        ended_returns: list[float] = []
        ended_lengths: list[int] = []
        steps = f.rewards.shape[0]
        skipped = f.skipped
        for j, slot in enumerate(self.running):
            start = int(skipped is not None and skipped[0, j])  # a reset-only cell is in no episode
            for t in [*np.flatnonzero(dones[j]), steps - 1]:
                t = int(t)
                if t < start:
                    continue
                ended = bool(dones[j, t])
                seg_obs = col(obs, j, start, t + 1 + (not ended))
                if ended:
                    last = nested.map_structure(lambda a: np.asarray(a)[None], f.final_obs[(t, j)])
                    seg_obs = nested.concat([seg_obs, last])
                chunk = EpisodeChunk(
                    episode_id=slot.episode_id, chunk_index=slot.chunk_index, obs=seg_obs,
                    actions=col(acts, j, start, t + 1), rewards=clipped[j, start : t + 1],
                    # gymnasium allows both flags at once (CartPole at its time limit): terminal wins,
                    # since nothing should be bootstrapped past a terminal state
                    terminated=bool(terminated[t, j]), truncated=bool(truncated[t, j] and not terminated[t, j]),
                    extra={"action_logp": logp[j, start : t + 1], "action_dist_inputs": col(dists, j, start, t + 1)},
                    t_started=slot.t_started, weights_version=weights_version,
                    look_back=None if f.look_back is None else (
                        f.look_back[j] if start == 0 else np.repeat(seg_obs[:1], f.look_back.shape[1], axis=0)),
                    env_runner_index=self.worker_index, env_index=j,
                    infos=([row[j] for row in info_rows[start : t + 1 + (not ended)]]
                           + ([final_infos[(t, j)]] if ended else [])) if info_rows is not None else [],
                )
                slot.ret += float(raw_rewards[j, start : t + 1].sum())
                slot.length += t + 1 - start
                pieces = [chunk]
                if f.state_rows is not None:  # recurrent: sequences of max_seq_len, each with its start state
                    pieces = chunk.split(self.max_seq_len or len(chunk))
                    for k, piece in enumerate(pieces):
                        piece.state_in = np.ascontiguousarray(f.state_rows[start + k * (self.max_seq_len or 0), j])
                slot.chunk_index += len(pieces)
                slot.t_started += t + 1 - start
                if hold_back:
                    slot.pending.extend(pieces)
                    if ended and slot.counted:
                        out.append(self.postprocess(EpisodeChunk.concat(slot.pending)))
                elif slot.counted:
                    out.extend(self.postprocess(piece) for piece in pieces)
                if ended:
                    if slot.counted:
                        ended_returns.append(slot.ret)
                        ended_lengths.append(slot.length)
                    slot = self.running[j] = Slot(*self.next_ids[j].popleft())
                start = t + 1
                if skipped is not None and start < steps and skipped[start, j]:
                    start += 1
        if ended_returns:  # logged before the chunks leave, so whoever receives them finds them counted
            self.metrics.log_episodes(ended_returns, ended_lengths, self.metrics_window)
            if self.ended_log is not None:
                self.ended_log.extend(zip(ended_returns, ended_lengths))
        if self.hooks is not None:
            self.hooks.forget_ended()
        return out

    # --- checkpoints ------------------------------------------------------------------------
    def get_state(self) -> list[dict[str, Any]]:
        """The running episodes as plain data (their held-back chunks as codec frames)."""
        return [{"episode_id": s.episode_id, "chunk_index": s.chunk_index, "t_started": s.t_started,
                 "ret": s.ret, "length": s.length, "pending": [encode(c, compress=False) for c in s.pending]}
                for s in self.running]

    def set_state(self, slots: list[dict[str, Any]]) -> None:
        """Continue the saved episodes (once the vector env resumed them)."""
        self.next_ids = [deque() for _ in range(self.num_envs)]  # the replayed resets drew ids the slots replace
        self.running = [Slot(s["episode_id"], True, s["chunk_index"], s["t_started"], s["ret"], s["length"],
                             [decode(f) for f in s["pending"]]) for s in slots]

    def get_ids_state(self) -> str:
        """Where the episode-id generator stands (and the ids it drew ahead), as JSON."""
        return json.dumps({"generator": self.ids.bit_generator.state, "pool": self._id_pool})

    def set_ids_state(self, state: str) -> None:
        saved = json.loads(state)
        if "generator" not in saved:  # a checkpoint from before the pool: the generator's state alone
            saved = {"generator": saved, "pool": []}
        self.ids.bit_generator.state = saved["generator"]
        self._id_pool = list(saved["pool"])
