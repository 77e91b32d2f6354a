"""Recordings as Ray Data datasets: for data larger than one machine, and for Ray Data pipelines.

``record_dataset(files)``: one row per record -- the shard files are listed, each is read by a
Ray Data task (``flat_map``), and ``map_batches`` checks every frame (checksum, bounds, schema:
a full decode) so that damaged records are dropped and counted there, in parallel, not in the
learner's process; a damaged record or torn tail is a row with an empty frame (``DAMAGED``/``TORN``
offset for what the shard scan found), one per record, as the local reader counts them.
``transition_dataset(files)``: the records decoded once (``map_batches``; a frame that fails to
decode is dropped) into per-step columns (``obs``, ``next_obs``, ``actions``, ``rewards``,
``terminated``, ``truncated``, ``episode_id``, ``t``, and the extra model outputs such as
``action_logp``), for ``iter_batches``/``iter_torch_batches`` training loops of one's own;
Box/Discrete/MultiDiscrete observations.

``RayDataReader`` is the ``input_reader="ray_data"`` stage: an ``OfflineReader`` whose records come
from ``record_dataset`` (so the shuffle buffer, epochs, disjoint shard shares and metrics are the
local reader's).
"""
from __future__ import annotations

from typing import Any, Iterator

import numpy as np

from actors.offline.reader import OfflineReader
from protocols.episode import EpisodeChunk
from protocols.errors import ProtocolError
from protocols.shards import ShardReader, decode_record


DAMAGED = -1
"""``offset`` of a ``record_dataset`` row standing for a damaged record (its ``frame`` is b"")."""
TORN = -2
"""``offset`` of a ``record_dataset`` row standing for a shard's torn tail (its ``frame`` is b"")."""


def _shard_frames(row: dict[str, Any]) -> list[dict[str, Any]]:
    """One shard -> its records (torn tails and unreadable records are counted in the row stream)."""
    reader = ShardReader(row["path"])
    out = [{"frame": bytes(frame), "shard": row["path"], "offset": int(off)} for off, frame in reader.frames()]
    # what the scan found: one DAMAGED row per record whose framing broke (shards with an index), one
    # TORN row for a damaged tail -- counted as the local reader counts them
    out += [{"frame": b"", "shard": row["path"], "offset": DAMAGED}] * reader.scan.damaged_records
    if reader.scan.damaged_bytes:
        out.append({"frame": b"", "shard": row["path"], "offset": TORN})
    return out


def _checked(batch: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """Keep the frames that decode; a damaged one becomes an empty frame (counted by the reader)."""
    frames = []
    for frame, shard, off in zip(batch["frame"], batch["shard"], batch["offset"]):
        if off < 0:
            frames.append(b"")
            continue
        try:
            decode_record(bytes(frame), where=f"{shard} at byte {off}")
            frames.append(bytes(frame))
        except ProtocolError:
            frames.append(b"")
    return {"frame": np.array(frames, dtype=object), "shard": batch["shard"], "offset": batch["offset"]}


def _quiet() -> None:
    """Ray Data logs a progress report per execution at INFO; readers execute once per epoch."""
    import logging

    import ray.data

    ctx = ray.data.DataContext.get_current()
    ctx.enable_progress_bars = False
    logging.getLogger("ray.data").setLevel(logging.WARNING)


def record_dataset(files: list[str], check: bool = True, num_cpus: float | None = None,
                   concurrency: int | None = None) -> Any:
    """One row per record of the shard files: ``frame`` (the codec frame; b"" for a damaged record
    or a torn tail), ``shard`` and ``offset`` (``DAMAGED``/``TORN`` for those). ``check``: decode
    every frame in the Ray Data tasks (checksum, bounds, schema) and blank the ones that fail; without
    it only the shards' framing is checked and a frame may still fail to decode. ``num_cpus`` and
    ``concurrency``: of the reading tasks (Ray Data's defaults: 1 CPU each, as many as fit)."""
    import ray.data

    _quiet()
    task_args: dict[str, Any] = {}
    if num_cpus is not None:
        task_args["num_cpus"] = num_cpus
    if concurrency is not None:
        task_args["compute"] = ray.data.TaskPoolStrategy(size=concurrency)
    ds = (ray.data.from_items([{"path": f} for f in files], override_num_blocks=max(1, len(files)))
          .flat_map(_shard_frames, **task_args))
    return ds.map_batches(_checked, batch_format="numpy", **task_args) if check else ds


STEP_BATCH_BYTES = 16 << 20
"""``transition_dataset`` hands Ray Data its columns in batches of about this many bytes (frames
would otherwise make one batch of a whole shard, gigabytes, copied twice)."""


def _step_columns(c: EpisodeChunk) -> dict[str, np.ndarray]:
    if not isinstance(c.obs, np.ndarray) or not isinstance(c.actions, np.ndarray):
        raise ValueError("transition_dataset reads Box/Discrete/MultiDiscrete recordings; nested "
                         "(Dict/Tuple) spaces are read with the local reader (input_reader='local')")
    n = len(c)
    rows = {"obs": c.obs[:n], "next_obs": c.obs[1:n + 1], "actions": c.actions,
            "rewards": c.rewards, "terminated": np.zeros(n, bool), "truncated": np.zeros(n, bool),
            "episode_id": np.full(n, c.episode_id, dtype=object), "t": c.t_started + np.arange(n)}
    rows["terminated"][-1], rows["truncated"][-1] = c.terminated, c.truncated
    for key, value in c.extra.items():
        if isinstance(value, np.ndarray):
            rows[key] = value
    return rows


def _joined(parts: list[dict[str, np.ndarray]]) -> dict[str, np.ndarray]:
    if len(parts) == 1:
        return parts[0]  # views into the decoded frame: Ray Data copies them into its block once
    return {k: np.concatenate([p[k] for p in parts]) for k in parts[0]}


def _steps(batch: dict[str, np.ndarray]) -> Iterator[dict[str, np.ndarray]]:
    """Records -> per-step columns, yielded in batches of about ``STEP_BATCH_BYTES``."""
    parts: list[dict[str, np.ndarray]] = []
    size = 0
    for frame in batch["frame"]:
        if not len(frame):
            continue
        try:
            chunks = decode_record(bytes(frame))
        except ProtocolError:  # a damaged record: dropped (record_dataset counts them)
            continue
        for c in chunks:
            rows = _step_columns(c)
            if parts and rows.keys() != parts[0].keys():  # another set of extra outputs: a batch of its own
                yield _joined(parts)
                parts, size = [], 0
            parts.append(rows)
            size += sum(v.nbytes for v in rows.values())
            if size >= STEP_BATCH_BYTES:
                yield _joined(parts)
                parts, size = [], 0
    if parts:
        yield _joined(parts)


def transition_dataset(files: list[str]) -> Any:
    """Per-step columns of the recording (see the module docstring)."""
    return record_dataset(files, check=False).map_batches(_steps, batch_format="numpy")  # one decode per frame


class RayDataReader(OfflineReader):
    """``input_reader="ray_data"``: records read and checked by Ray Data tasks, then handed out by the
    local reader's machinery (shuffle buffer, epochs, metrics).

    The reading tasks ask Ray for no CPU of their own and run at most ``shards_in_flight`` at once
    (one shard each): the reader holds its runner slot while it waits on them, and tasks that asked
    for a CPU would wait forever on a cluster whose CPUs the readers and learners hold all of
    (``num_env_runners=2`` on 2 CPUs)."""

    def _records(self, files: list[str], source: int = 0) -> Iterator[list[EpisodeChunk]]:
        while True:
            order = list(files)
            self.rng.shuffle(order)
            got_any = False
            tasks = max(1, min(self.r.shards_in_flight, len(order)))
            rows = record_dataset(order, num_cpus=0, concurrency=tasks).iter_rows()
            for row in rows:
                frame = row["frame"]
                if not len(frame):
                    key = "torn_tails" if row["offset"] == TORN else "damaged_records"
                    self.counts[key] += 1
                    self.metrics.log_value(f"offline_data/{key}", 1, reduce="lifetime_sum")
                    continue
                got_any = True
                yield decode_record(bytes(frame))
            self._end_pass(source, got_any)
