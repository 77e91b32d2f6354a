"""Recordings as Ray Data datasets: for data larger than one machine, and for Ray Data pipelines.

``record_dataset(files)``: one row per record -- the shard files are listed, each is read by a
Ray Data task (``flat_map``), and ``map_batches`` checks every frame (checksum, bounds, schema:
a full decode) so that damaged records are dropped and counted there, in parallel, not in the
learner's process. ``transition_dataset(files)``: the same records decoded (``map_batches``) into
per-step columns (``obs``, ``actions``, ``rewards``, ``terminated``, ``truncated``, ``episode_id``,
``t``, and the extra model outputs such as ``action_logp``), for ``iter_batches``/
``iter_torch_batches`` training loops of one's own; Box/Discrete/MultiDiscrete observations.

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


def _shard_frames(row: dict[str, Any]) -> list[dict[str, Any]]:
    """One shard -> its records (torn tails and unreadable records are counted in the row stream)."""
    reader = ShardReader(row["path"])
    out = [{"frame": bytes(frame), "shard": row["path"], "offset": int(off)} for off, frame in reader.frames()]
    if reader.scan.damaged_records or reader.scan.damaged_bytes:
        out.append({"frame": b"", "shard": row["path"], "offset": -1 - int(bool(reader.scan.damaged_bytes))})
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


def record_dataset(files: list[str]) -> Any:
    """One row per record of the shard files (``frame``: the codec frame, b"" for a damaged one)."""
    import ray.data

    _quiet()

    return (ray.data.from_items([{"path": f} for f in files], override_num_blocks=max(1, len(files)))
            .flat_map(_shard_frames)
            .map_batches(_checked, batch_format="numpy"))


def _steps(batch: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    cols: dict[str, list] = {}
    for frame in batch["frame"]:
        if not len(frame):
            continue
        for c in decode_record(bytes(frame)):
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
            for key, value in rows.items():
                cols.setdefault(key, []).append(value)
    return {k: np.concatenate(v) for k, v in cols.items()}


def transition_dataset(files: list[str]) -> Any:
    """Per-step columns of the recording (see the module docstring)."""
    return record_dataset(files).map_batches(_steps, batch_format="numpy")


class RayDataReader(OfflineReader):
    """``input_reader="ray_data"``: records read and checked by Ray Data tasks, then handed out by the
    local reader's machinery (shuffle buffer, epochs, metrics)."""

    def _records(self, files: list[str], source: int = 0) -> Iterator[list[EpisodeChunk]]:
        while True:
            order = list(files)
            self.rng.shuffle(order)
            got_any = False
            for row in record_dataset(order).iter_rows():
                frame = row["frame"]
                if not len(frame):
                    key = "torn_tails" if row["offset"] == -2 else "damaged_records"
                    self.counts[key] += 1
                    self.metrics.log_value(f"offline_data/{key}", 1, reduce="lifetime_sum")
                    continue
                got_any = True
                yield decode_record(bytes(frame))
            self._epochs[source] += 1
            self.epoch = min(self._epochs)
            self.metrics.log_value("offline_data/epochs", 1, reduce="lifetime_sum")
            if not got_any:
                raise RuntimeError(f"offline input {self.r.input_!r} holds no readable records "
                                   f"(all shards empty or damaged; inspect with `runnel inspect`)")
