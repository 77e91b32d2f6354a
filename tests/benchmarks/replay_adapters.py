"""The two replay buffers ``tests/benchmarks/replay.py`` compares, behind one small interface: ``load()``
(imports, before the memory baseline), ``make(chunks)`` (the system's own chunk objects from the benchmark's
synthetic dicts), ``add``, ``full``, ``stored``, ``sample``, ``update`` (priorities) and ``nbytes``.

``RunnelAdapter`` wraps ``actors.replay.ReplayBuffer``; ``RLlibAdapter`` wraps RLlib 2.60's episode replay
buffers and runs only in the anchors venv (``replay.py --rllib-worker``), where it imports numpy, gymnasium
and Ray, nothing of runnel.
"""
from __future__ import annotations

import argparse
import importlib
import sys
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[2]


class RunnelAdapter:
    name = "runnel"

    @staticmethod
    def load() -> None:
        if str(ROOT) not in sys.path:
            sys.path.insert(0, str(ROOT))
        for module in ("actors.replay", "protocols.episode"):
            importlib.import_module(module)

    def __init__(self, spec: dict, prioritized: bool, args: argparse.Namespace) -> None:
        from actors.replay import ReplayBuffer, ReplaySettings
        from protocols.episode import EpisodeChunk

        self.chunk_cls = EpisodeChunk
        self.buf = ReplayBuffer(ReplaySettings(capacity=spec["capacity"], prioritized=prioritized, alpha=0.6,
                                               beta=0.4, n_step=args.n_step, gamma=0.99, seed=args.seed))
        self.capacity = spec["capacity"]

    def make(self, chunks: list[dict]) -> list:
        C = self.chunk_cls
        return [C(episode_id=c["episode_id"], chunk_index=c["chunk_index"], obs=c["obs"], actions=c["actions"],
                  rewards=c["rewards"], terminated=c["terminated"], truncated=c["truncated"],
                  t_started=c["t_started"], env_index=c["env_index"]) for c in chunks]

    def add(self, items: list) -> None:
        self.buf.add(items)

    def full(self) -> bool:
        return self.buf.storage.num_written >= self.capacity

    def stored(self) -> int:
        return len(self.buf)

    def sample(self, batch_size: int):
        return self.buf.sample(batch_size)

    def update(self, batch, priorities: np.ndarray) -> None:
        self.buf.update_priorities(batch["indices"], priorities)

    def nbytes(self) -> int | None:
        tree = self.buf.tree
        return self.buf.storage.nbytes() + (0 if tree is None else tree.tree.nbytes)


class RLlibAdapter:
    name = "rllib"

    @staticmethod
    def load() -> None:
        for module in ("gymnasium", "ray.rllib.env.single_agent_episode",
                       "ray.rllib.utils.replay_buffers.prioritized_episode_buffer"):
            importlib.import_module(module)

    def __init__(self, spec: dict, prioritized: bool, args: argparse.Namespace) -> None:
        import gymnasium as gym
        from ray.rllib.env.single_agent_episode import SingleAgentEpisode
        from ray.rllib.utils.replay_buffers.episode_replay_buffer import EpisodeReplayBuffer
        from ray.rllib.utils.replay_buffers.prioritized_episode_buffer import PrioritizedEpisodeReplayBuffer

        self.episode_cls = SingleAgentEpisode
        dtype = np.dtype(spec["obs_dtype"])
        lo, hi = (0, 255) if dtype == np.uint8 else (-np.inf, np.inf)
        self.obs_space = gym.spaces.Box(lo, hi, tuple(spec["obs_shape"]), dtype)
        self.act_space = gym.spaces.Discrete(spec["num_actions"])
        self.prioritized = prioritized
        self.n_step = args.n_step
        self.buf = (PrioritizedEpisodeReplayBuffer(capacity=spec["capacity"], alpha=0.6) if prioritized
                    else EpisodeReplayBuffer(capacity=spec["capacity"]))
        self.buf.rng = np.random.default_rng(args.seed)
        self.capacity = spec["capacity"]

    def make(self, chunks: list[dict]) -> list:
        # As the env runner returns them: numpy'ized chunks with spaces; a continuation starts
        # with the previous chunk's last observation (len_lookback_buffer=0: no extra lookback).
        E = self.episode_cls
        return [E(id_=c["episode_id"], observations=c["obs"], infos=[{} for _ in range(len(c["obs"]))],
                  actions=c["actions"], rewards=c["rewards"], terminated=c["terminated"], truncated=c["truncated"], t_started=c["t_started"],
                  len_lookback_buffer=0, observation_space=self.obs_space, action_space=self.act_space)
                for c in chunks]

    def add(self, items: list) -> None:
        self.buf.add(items)

    def full(self) -> bool:
        # Steps ever added: it evicts whole episodes, so what it holds stays a bit below capacity.
        return self.buf.get_added_timesteps() >= self.capacity

    def stored(self) -> int:
        return self.buf.get_num_timesteps()

    def sample(self, batch_size: int):
        # As DQN's/SAC's new-API-stack training step calls it.
        return self.buf.sample(num_items=batch_size, n_step=self.n_step, batch_length_T=0, lookback=0,
                               min_batch_length_T=0, gamma=0.99, beta=0.4 if self.prioritized else 0.0,
                               sample_episodes=True)

    def update(self, batch, priorities: np.ndarray) -> None:
        self.buf.update_priorities(priorities)

    def nbytes(self) -> int | None:
        return None  # Python objects: only the RSS figure applies
