"""Reading recorded experience: a stage that hands out recorded chunks in an env runner's place.

``OfflineReader`` implements the env runner role, so every plan that samples from env runners
trains from a recording unchanged: PPO-style plans (BC, MARWIL) get chunks from ``sample()``,
the off-policy plan (CQL, DQN/SAC) puts them into replay. Several readers (``num_env_runners``)
read disjoint sets of shards in parallel, as Ray actors under the fault-tolerant manager.

Memory stays bounded: shards are read one record at a time, a few shards at once
(``shards_in_flight``, interleaved so one sample mixes shards), and a shuffle buffer of at most
``shuffle_buffer_size`` steps hands out a random element each time. Reading loops over the data
forever (one *epoch* per pass, shard order reshuffled each time). Damaged records and torn tails
are skipped and counted (``offline_data/damaged_records``, ``offline_data/torn_tails``).
"""
from __future__ import annotations

import glob
import os
import random
from dataclasses import dataclass
from typing import Any, Callable, Iterator

import numpy as np

from actors.core import EnvRunnerRole
from actors.metrics import MetricsLogger
from actors.offline.recorder import MANIFEST, MULTI_AGENT_FORMAT, read_json_manifest, read_manifest
from protocols.codec import encode
from protocols.episode import EpisodeChunk
from protocols.errors import ProtocolError
from protocols.shards import SUFFIX, ShardReader, decode_record


@dataclass
class ReaderSettings:
    """What to read and how (``config.offline_data(input_=...)``)."""

    input_: str | list
    """A recording directory, a glob of shard files, or a list of either."""
    input_read_episodes: bool = False
    """Hand out only whole episodes (records of a recording made with ``output_write_episodes``);
    other records are skipped and counted."""
    shuffle_buffer_size: int = 10_000
    """Steps held to draw from at random (records are shuffled, not single steps); 0 reads in file order."""
    actions_in_input_normalized: bool | None = None
    """Box actions in the data are already in the policy's [-1, 1] range. None: as the recording's
    manifest says (runnel's recordings are); False: rescale them from the action space's bounds."""
    shards_in_flight: int = 4
    """Shards read at once, interleaved record by record."""
    input_reader: str = "local"
    """How records are read: "local" (this module's streaming reader, in each reader stage) or
    "ray_data" (Ray Data tasks list, read and check the shards: ``actors.offline.dataset``)."""
    seed: int | None = None
    modules: tuple[str, ...] | None = None
    """A multi-agent run's modules: ``input_`` is a multi-agent recording and each module's recording
    (``input_/<module_id>``) is read; its chunks carry their module ids to the learners. None: single-agent."""


def resolve_modules_input(input_: str, modules: tuple[str, ...]) -> list[str]:
    """Shard files of these modules' recordings in a multi-agent run's recording ``input_``
    (``actors.offline.module_recorders``); a module it does not hold is a FileNotFoundError naming it."""
    directory = os.path.expanduser(str(input_))
    manifest = read_json_manifest(directory)
    if manifest.get("format") != MULTI_AGENT_FORMAT:
        raise ValueError(f"offline input {input_!r} is not a multi-agent recording (no {MANIFEST} listing modules): "
                         f"a multi-agent run reads the directory a multi-agent run recorded into")
    missing = [m for m in modules if m not in manifest.get("modules", [])]
    if missing:
        raise FileNotFoundError(f"offline input {input_!r} holds no recording of modules {missing} (it holds "
                                f"{manifest.get('modules', [])}): train only modules it holds (multi_agent(policies=...))")
    return [f for m in modules for f in resolve_input(os.path.join(directory, m))]


def resolve_input(input_: str | list) -> list[str]:
    """Shard files named by a directory, a glob or a list of them (sorted, deduplicated)."""
    items = [input_] if isinstance(input_, (str, os.PathLike)) else list(input_)
    files: list[str] = []
    for item in items:
        item = os.path.expanduser(str(item))
        if os.path.isdir(item):
            if os.path.exists(os.path.join(item, MANIFEST)):
                read_manifest(item)  # a multi-agent run's recording names the module recordings to read instead
            found = sorted(glob.glob(os.path.join(item, "**", f"*{SUFFIX}"), recursive=True))
        elif any(ch in item for ch in "*?["):
            found = sorted(glob.glob(item, recursive=True))
        elif os.path.isfile(item):
            found = [item]
        else:
            raise FileNotFoundError(f"offline input {item!r} is neither a directory, a file nor a glob that matches")
        files.extend(found)
    files = list(dict.fromkeys(os.path.abspath(f) for f in files))
    if not files:
        raise FileNotFoundError(f"offline input {input_!r} holds no {SUFFIX} shard files")
    return files


SAMPLER = "sampler"
"""In an ``input_`` dict, the live env runners (RLlib's name): ``{"sampler": 0.5, "DIR": 0.5}``."""


def input_sources(input_: Any) -> list[tuple[Any, float]]:
    """The recordings ``input_`` names with the probability of reading each (normalized over the
    recordings; a ``"sampler"`` entry is the env runners' share, mixed in by the off-policy plan)."""
    if not isinstance(input_, dict):
        return [(input_, 1.0)]
    recorded = [(src, float(p)) for src, p in input_.items() if src != SAMPLER]
    total = sum(p for _, p in recorded)
    return [(src, p / total) for src, p in recorded] if total > 0 else []


def manifest_for(files: list[str]) -> dict[str, Any] | None:
    """The manifest of the recording the first shard belongs to (None when there is none)."""
    for f in files:
        d = os.path.dirname(f)
        while True:
            if os.path.exists(os.path.join(d, MANIFEST)):
                return read_manifest(d)
            parent = os.path.dirname(d)
            if parent == d:
                break
            d = parent
    return None


class OfflineReader(EnvRunnerRole):
    """Hands out recorded chunks through the env runner role (``sample``/``sample_encoded``)."""

    def __init__(self, settings: Any, worker_index: int = 0, recreated: bool = False, *,
                 offline: ReaderSettings, num_readers: int = 1) -> None:
        self.s = settings
        self.r = offline
        self.worker_index = worker_index
        self.sources: list[tuple[list[str], float]] = []
        self.module_of: dict[str, str] = {}
        """A multi-agent recording's shard file -> the module whose recording holds it: its chunks are stamped
        with that module id, whatever they say (a file moved into another module's directory trains that one)."""
        for source, weight in input_sources(offline.input_):
            if offline.modules:
                per_module = {mid: resolve_modules_input(source, (mid,)) for mid in offline.modules}
                files = [f for fs in per_module.values() for f in fs]
                self.module_of.update({f: mid for mid, fs in per_module.items() for f in fs})
            else:
                files = resolve_input(source)
            if num_readers > 1:  # readers 1..n take disjoint shares of the shards
                files = files[worker_index - 1::num_readers] or files
            self.sources.append((files, weight))
        self.files = [f for files, _ in self.sources for f in files]
        manifest = manifest_for(self.files)
        normalized = offline.actions_in_input_normalized
        if normalized is None:
            normalized = bool(manifest.get("actions_normalized", True)) if manifest else True
        self._rescale = None
        space = settings.action_space
        if (not normalized and getattr(settings, "normalize_actions", True) and space is not None
                and type(space).__name__ == "Box"):
            low, high = space.low.astype(np.float32), space.high.astype(np.float32)
            self._rescale = lambda a: (2.0 * (np.asarray(a, np.float32) - low) / (high - low) - 1.0)
        seed = (offline.seed if offline.seed is not None else (settings.seed or 0)) * 1000 + worker_index
        self.rng = random.Random(seed + (7919 if recreated else 0))
        self.metrics = MetricsLogger()
        self.weights: dict[str, Any] = {}
        self.weights_version = 0
        self._buffer: list[EpisodeChunk] = []
        self._buffered_steps = 0
        self._epochs = [0] * len(self.sources)
        self.epoch = 0
        """Passes completed over the recording (with several sources: over each, the fewest)."""
        self._stream = self._mixed()
        self._accepted_epoch = 0
        self.counts = {"records": 0, "steps": 0, "damaged_records": 0, "torn_tails": 0, "skipped_records": 0}

    # --- the data stream ----------------------------------------------------------------------
    def _mixed(self) -> Iterator[list[EpisodeChunk]]:
        """Records from the sources, each drawn with its probability (one source: its records in turn)."""
        streams = [self._records(files, i) for i, (files, _) in enumerate(self.sources)]
        weights = [w for _, w in self.sources]
        while True:
            i = self.rng.choices(range(len(streams)), weights)[0] if len(streams) > 1 else 0
            yield next(streams[i])

    def _records(self, files: list[str], source: int = 0) -> Iterator[list[EpisodeChunk]]:
        while True:
            order = list(files)
            self.rng.shuffle(order)
            pending = iter(order)
            active: list[tuple[ShardReader, Iterator[EpisodeChunk]]] = []
            got_any = False
            while True:
                while len(active) < max(1, self.r.shards_in_flight):
                    path = next(pending, None)
                    if path is None:
                        break
                    reader = ShardReader(path)
                    active.append((reader, self._shard_records(reader)))
                if not active:
                    break
                i = self.rng.randrange(len(active))
                record = next(active[i][1], None)
                if record is None:
                    self._account(active.pop(i)[0])
                    continue
                got_any = True
                yield record
            self._end_pass(source, got_any)

    def _end_pass(self, source: int, got_any: bool) -> None:
        """A pass over one source's shards is done: count the epoch (readers of several sources
        report the fewest passes), and refuse a source with nothing readable in it."""
        self._epochs[source] += 1
        self.epoch = min(self._epochs)
        self.metrics.log_value("offline_data/epochs", 1, reduce="lifetime_sum")
        if not got_any:
            raise RuntimeError(f"offline input {self.r.input_!r} holds no readable records "
                               f"(all shards empty or damaged; inspect with `runnel inspect`)")

    def _shard_records(self, reader: ShardReader) -> Iterator[list[EpisodeChunk]]:
        """One record's chunks at a time (a shard's chunks are grouped back into its records)."""
        module = self.module_of.get(reader.path)
        for off, frame in reader.frames():
            try:
                chunks = decode_record(frame, reader.limits, f"{reader.path} at byte {off}")
            except ProtocolError:
                self.counts["damaged_records"] += 1
                self.metrics.log_value("offline_data/damaged_records", 1, reduce="lifetime_sum")
                continue
            if module is not None:
                for c in chunks:
                    c.module_id = module
            yield chunks

    def _account(self, reader: ShardReader) -> None:
        if reader.scan.damaged_records:
            self.counts["damaged_records"] += reader.scan.damaged_records
            self.metrics.log_value("offline_data/damaged_records", reader.scan.damaged_records, reduce="lifetime_sum")
        if reader.scan.damaged_bytes:
            self.counts["torn_tails"] += 1
            self.metrics.log_value("offline_data/torn_tails", 1, reduce="lifetime_sum")

    def _next_chunk(self) -> EpisodeChunk:
        size = self.r.shuffle_buffer_size
        while not self._buffer or self._buffered_steps < size:
            for c in next(self._stream):
                if self.r.input_read_episodes and not (c.chunk_index == 0 and c.is_done):
                    self.counts["skipped_records"] += 1
                    if self.epoch - self._accepted_epoch >= 2:  # a whole pass found nothing to hand out
                        raise RuntimeError(
                            f"input_read_episodes=True, but {self.r.input_!r} holds no whole episodes (each "
                            f"record is a piece of one): record with output_write_episodes=True, or read "
                            f"with input_read_episodes=False")
                    continue
                self._accepted_epoch = self.epoch
                self._buffer.append(self._prepared(c))
                self._buffered_steps += len(c)
            if size <= 0 and self._buffer:
                break
        i = self.rng.randrange(len(self._buffer)) if size > 0 else 0
        self._buffer[i], self._buffer[-1] = self._buffer[-1], self._buffer[i]
        c = self._buffer.pop() if size > 0 else self._buffer.pop(0)
        self._buffered_steps -= len(c)
        return c

    def _prepared(self, c: EpisodeChunk) -> EpisodeChunk:
        if self._rescale is not None:
            c.actions = self._rescale(c.actions)
        return c

    # --- the env runner role ------------------------------------------------------------------
    def sample(self, num_timesteps: int | None = None, num_episodes: int | None = None,
               explore: bool | None = None) -> list[EpisodeChunk]:
        """Recorded chunks of at least ``num_timesteps`` steps (default: one round of the runner
        settings), or ``num_episodes`` records that end an episode."""
        out: list[EpisodeChunk] = []
        if num_episodes is not None:
            while sum(c.is_done for c in out) < num_episodes:
                out.append(self._next_chunk())
        else:
            target = num_timesteps or self.s.rollout_fragment_length * self.s.num_envs
            steps = 0
            while steps < target:
                c = self._next_chunk()
                out.append(c)
                steps += len(c)
        n = sum(len(c) for c in out)
        self.counts["steps"] += n
        self.counts["records"] += len(out)
        self.metrics.log_value("num_env_steps_sampled", n, reduce="sum")
        self.metrics.log_value("num_env_steps_sampled_lifetime", n, reduce="lifetime_sum")
        if self.r.modules:  # a recorded step is one agent's: what a multi-agent run counts in agent steps
            self.metrics.log_value("num_agent_steps_sampled", n, reduce="sum")
        self.metrics.log_value("offline_data/num_env_steps_read_lifetime", n, reduce="lifetime_sum")
        return out

    def sample_encoded(self, num_timesteps: int | None = None, explore: bool | None = None,
                       compress: bool = False) -> tuple[bytes, dict[str, Any]]:
        return encode(self.sample(num_timesteps=num_timesteps), compress=compress), self.get_metrics()

    def set_weights(self, weights: dict[str, Any], weights_version: int = 0, timestep: int | None = None) -> None:
        self.weights, self.weights_version = weights, weights_version  # kept for get_weights only

    def get_weights(self) -> dict[str, Any]:
        return self.weights

    def get_metrics(self) -> dict[str, Any]:
        return self.metrics.export()

    def get_state(self) -> dict[str, Any]:
        return {"epoch": self.epoch, "counts": dict(self.counts)}

    def set_state(self, state: dict[str, Any]) -> None:
        self.epoch = int(state.get("epoch", 0))
        self.counts.update(state.get("counts", {}))

    def ping(self) -> str:
        return "ok"

    def apply(self, fn: Callable[["OfflineReader"], Any]) -> Any:
        return fn(self)

    def start_streaming(self, address: str, hwm: int = 4, compress: bool = True, sndbuf: int = 0,
                        stall_timeout_s: float = 60.0, window: int | None = None) -> None:
        raise NotImplementedError("offline readers serve synchronous plans (BC, MARWIL, CQL, PPO, DQN, SAC); "
                                  "IMPALA/APPO do not train from recordings yet")

    def stop_streaming(self, timeout_s: float = 10.0) -> bool:
        return True

    def is_streaming(self) -> bool:
        return False

    def stop(self) -> None:
        self._stream.close()
