"""Recording: the chunks a stage produces, appended to shard files by a background writer.

Each recording stage (an env runner, a policy server, an evaluator) owns one ``Recorder``: its own
shard files, named so that no other writer ever picks the same name, so no process locks
anything. ``record(chunks)`` puts the chunks on a bounded queue and returns; the writer thread
encodes them (or first joins each episode's chunks, ``output_write_episodes``), appends records,
and rotates to a new shard past ``output_max_file_size``. When the queue is full, ``record``
waits for the writer -- sampling slows down rather than memory filling up -- and the wait is
counted (``offline_data/record_blocked_s``). A writer that fails (disk full) makes the next
``record`` raise with the cause, instead of silently dropping experience.

Durability: records reach the OS as they are written (a killed process loses only what was
still queued); ``output_fsync`` says when they are forced to disk ("rotation": when a shard is
closed, and at ``close()``; "always": after every record; "never").
"""
from __future__ import annotations

import json
import os
import queue
import threading
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

from protocols.codec import encode
from protocols.episode import EpisodeChunk
from protocols.shards import FORMAT_VERSION as SHARD_FORMAT_VERSION
from protocols.shards import SUFFIX, ShardWriter, fsync_dir
from protocols.spaces import space_to_dict

MANIFEST = "manifest.json"
MANIFEST_FORMAT = "runnel-recording"
MANIFEST_VERSION = 1
MULTI_AGENT_FORMAT = "runnel-multi-agent-recording"
"""The manifest of a multi-agent run's recording: it lists the modules, whose recordings are its subdirectories
(``actors.offline.module_recorders``)."""
FSYNC_CHOICES = ("rotation", "always", "never")


RECORD_STEPS = 2048
"""Whole episodes are grouped into records of up to this many steps (a longer episode is one record)."""


@dataclass
class RecordingSettings:
    """Where and how a stage records what it samples (``config.offline_data(output=...)``)."""

    output: str
    """Directory of the recording (created if missing): shard files and ``manifest.json``."""
    output_max_file_size: int = 64 * 1024 * 1024
    """Bytes after which a writer closes its shard and starts the next."""
    output_write_episodes: bool = True
    """Write each episode as one record once it ends (readers get whole episodes); False: write
    chunks as sampled (an episode may span records and shards)."""
    output_compress_columns: list | bool = field(default_factory=lambda: ["obs", "new_obs"])
    """RLlib's setting; runnel compresses whole records with LZ4, so any non-empty list (or True)
    compresses and ``[]``/False writes uncompressed records (faster to write, larger)."""
    output_fsync: str = "rotation"
    """When records are forced to disk: "rotation" (each closed shard and ``close()``), "always"
    (every record), "never" (left to the OS)."""
    output_max_queue: int = 64
    """Sample rounds waiting for the writer before ``record`` makes sampling wait."""
    output_write_infos: bool = False
    """Record each step's env info dict too (``EpisodeChunk.infos``, T + 1 per chunk: the reset
    info, then each step's); off by default, as infos are often large and rarely trained on."""
    output_include_evaluation: bool = False
    """Evaluators record too (into the same directory, shards named ``eval-...``)."""

    @property
    def compress(self) -> bool:
        return bool(self.output_compress_columns)


def write_manifest(directory: str, observation_space: Any, action_space: Any, algorithm: str,
                   config: dict[str, Any], version: str, actions_normalized: bool = True) -> dict[str, Any]:
    """Create ``directory`` and its manifest; a directory that already holds a recording with other
    spaces is refused (recordings of several runs may share one only when their spaces agree)."""
    os.makedirs(directory, exist_ok=True)
    manifest = {"format": MANIFEST_FORMAT, "format_version": MANIFEST_VERSION,
                "observation_space": space_to_dict(observation_space), "action_space": space_to_dict(action_space),
                "actions_normalized": actions_normalized, "algorithm": algorithm, "config": config,
                "runnel_version": version, "shard_format_version": SHARD_FORMAT_VERSION,
                "created": time.strftime("%Y-%m-%dT%H:%M:%S%z")}
    path = os.path.join(directory, MANIFEST)
    if os.path.exists(path):
        old = read_manifest(directory)
        for key in ("observation_space", "action_space"):
            if old.get(key) != manifest[key]:
                raise ValueError(f"{directory} already holds a recording with another {key.replace('_', ' ')} "
                                 f"({old.get(key)} vs {manifest[key]}): record into a new directory")
        return old
    return write_json_atomically(directory, manifest)


def write_json_atomically(directory: str, manifest: dict[str, Any]) -> dict[str, Any]:
    """``directory/manifest.json``, written whole or not at all (a temporary file renamed, both synced)."""
    path = os.path.join(directory, MANIFEST)
    tmp = f"{path}.{uuid.uuid4().hex[:8]}.tmp"
    with open(tmp, "w") as f:
        json.dump(manifest, f, indent=1, sort_keys=True)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    fsync_dir(directory)
    return manifest


def read_json_manifest(directory: str) -> dict[str, Any]:
    """``directory``'s manifest as it is, whichever kind (empty when it has none or it is not a map)."""
    path = os.path.join(directory, MANIFEST)
    if not os.path.exists(path):
        return {}
    with open(path) as f:
        try:
            data = json.load(f)
        except json.JSONDecodeError as err:
            raise ValueError(f"{path} is not valid JSON ({err})") from None
    return data if isinstance(data, dict) else {}


def read_manifest(directory: str) -> dict[str, Any]:
    path = os.path.join(directory, MANIFEST)
    if not os.path.exists(path):
        raise FileNotFoundError(f"{directory} has no {MANIFEST}: not a runnel recording "
                                f"(record one with config.offline_data(output=...) or `runnel record`)")
    manifest = read_json_manifest(directory)
    if isinstance(manifest, dict) and manifest.get("format") == MULTI_AGENT_FORMAT:
        modules = [str(m) for m in manifest.get("modules", [])]
        example = os.path.join(directory, modules[0] if modules else "<module_id>")
        raise ValueError(f"{directory} is a multi-agent recording of modules {modules}: each module's experience is "
                         f"a recording of its own; read one, e.g. {example}")
    if not isinstance(manifest, dict) or manifest.get("format") != MANIFEST_FORMAT:
        raise ValueError(f"{path} is not a runnel recording manifest")
    if manifest.get("format_version", 0) > MANIFEST_VERSION:
        raise ValueError(f"{path} has manifest version {manifest['format_version']}; this runnel reads up to "
                         f"{MANIFEST_VERSION}: upgrade runnel")
    return manifest


_STOP = object()


class Recorder:
    """Appends one stage's chunks to its own shard files in a background thread."""

    def __init__(self, settings: RecordingSettings, name: str, meta: dict[str, Any] | None = None) -> None:
        self.settings = settings
        self.name = f"{name}-{uuid.uuid4().hex[:8]}"
        self.meta = dict(meta or {})
        os.makedirs(settings.output, exist_ok=True)
        self._queue: queue.Queue = queue.Queue(maxsize=max(1, int(settings.output_max_queue)))
        self._shard: ShardWriter | None = None
        self._seq = 0
        self._open: dict[str, list[EpisodeChunk]] = {}  # episode mode: chunks of episodes still running
        self._error: BaseException | None = None
        self._lock = threading.Lock()
        self.counters = {"recorded_steps": 0, "recorded_chunks": 0, "records": 0, "shards": 0, "bytes": 0,
                         "record_blocked_s": 0.0, "record_waits": 0}
        self._reported: dict[str, float] = {}
        self._thread = threading.Thread(target=self._loop, name=f"recorder-{name}", daemon=True)
        self._thread.start()

    def record(self, chunks: list[EpisodeChunk]) -> None:
        """Queue ``chunks`` for writing; waits (counted) while the queue is full."""
        if self._error is not None:
            raise RuntimeError(f"recording to {self.settings.output} failed: {self._error!r}") from self._error
        if not chunks:
            return
        try:
            self._queue.put_nowait(list(chunks))
        except queue.Full:
            t0 = time.perf_counter()
            while True:
                try:
                    self._queue.put(list(chunks), timeout=1.0)
                    break
                except queue.Full:
                    if self._error is not None or not self._thread.is_alive():
                        raise RuntimeError(f"recording to {self.settings.output} failed: {self._error!r}") from None
            with self._lock:
                self.counters["record_blocked_s"] += time.perf_counter() - t0
                self.counters["record_waits"] += 1

    def flush(self) -> None:
        """Returns once everything queued so far is written to the OS."""
        self._queue.join()
        if self._error is not None:
            raise RuntimeError(f"recording to {self.settings.output} failed: {self._error!r}") from self._error

    def close(self) -> None:
        """Writes everything queued and the episodes still open (as they are), closes the shard."""
        if self._thread.is_alive():
            self._queue.put(_STOP)
            self._thread.join()

    def log_metrics(self, metrics: Any) -> None:
        """The counters' growth since the last call into ``metrics`` (a ``MetricsLogger``), under
        ``offline_data/``: runners report deltas, the driver sums them over runners and time."""
        now = self.get_metrics()
        for key in self.counters:
            delta = now[key] - self._reported.get(key, 0)
            if delta:
                metrics.log_value(f"offline_data/{key}", delta, reduce="lifetime_sum")
            self._reported[key] = now[key]

    def get_metrics(self) -> dict[str, Any]:
        with self._lock:
            c = dict(self.counters)
        c["open_episodes"] = len(self._open)
        c["queued"] = self._queue.qsize()
        return c

    # --- the writer thread ----------------------------------------------------------------------
    def _loop(self) -> None:
        try:
            while True:
                item = self._queue.get()
                try:
                    if item is _STOP:
                        self._finish()
                        return
                    self._write(item)
                    if self._shard is not None:  # once per handed-over batch, not per record: a sample
                        self._shard.flush()      # of short episodes is hundreds of records
                finally:
                    self._queue.task_done()
        except BaseException as err:  # noqa: BLE001 -- surfaced by the next record()/flush()
            self._error = err
            while True:  # keep draining, so producers waiting on the queue see the error instead of hanging
                try:
                    self._queue.get_nowait()
                    self._queue.task_done()
                except queue.Empty:
                    return

    def _write(self, chunks: list[EpisodeChunk]) -> None:
        if not self.settings.output_write_episodes:
            self._append(chunks, sum(c.is_done for c in chunks))
            return
        done: list[EpisodeChunk] = []
        for c in chunks:
            parts = self._open.setdefault(c.episode_id, [])
            parts.append(c)
            if c.is_done:
                del self._open[c.episode_id]
                done.append(EpisodeChunk.concat(parts) if len(parts) > 1 else parts[0])
        # the episodes a batch completed go into records of up to RECORD_STEPS steps each: one frame
        # per short episode would spend more on per-frame work (header, checksum, index) than on data
        record: list[EpisodeChunk] = []
        steps = 0
        for episode in done:
            if record and steps + len(episode) > RECORD_STEPS:
                self._append(record, len(record))
                record, steps = [], 0
            record.append(episode)
            steps += len(episode)
        if record:
            self._append(record, len(record))

    def _append(self, chunks: list[EpisodeChunk], episodes_done: int) -> None:
        frame = encode(chunks, compress=self.settings.compress)
        if self._shard is None:
            path = os.path.join(self.settings.output, f"{self.name}-{self._seq:05d}{SUFFIX}")
            self._shard = ShardWriter(path, {**self.meta, "writer": self.name, "sequence": self._seq})
            self._seq += 1
            with self._lock:
                self.counters["shards"] += 1
        before = self._shard.size
        steps = sum(len(c) for c in chunks)
        self._shard.append(frame, steps, len(chunks), episodes_done)
        if self.settings.output_fsync == "always":
            self._shard.flush(fsync=True)
        with self._lock:
            self.counters["recorded_steps"] += steps
            self.counters["recorded_chunks"] += len(chunks)
            self.counters["records"] += 1
            self.counters["bytes"] += self._shard.size - before
        if self._shard.size >= self.settings.output_max_file_size:
            self._rotate()

    def _rotate(self) -> None:
        if self._shard is not None:
            self._shard.close(fsync=self.settings.output_fsync != "never")
            self._shard = None

    def _finish(self) -> None:
        open_parts = [EpisodeChunk.concat(p) if len(p) > 1 else p[0] for p in self._open.values()]
        self._open.clear()
        if open_parts:  # episodes cut off by the end of the run: kept, marked neither terminated nor truncated
            self._append(open_parts, 0)
        self._rotate()
