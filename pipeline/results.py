"""Writing training results to a run directory, the way Tune's loggers do.

``ResultLogger(logdir)`` keeps four files in ``logdir``:

- ``params.json``   the algorithm config (``write_params``, once per run);
- ``result.json``   one JSON object per ``train()`` result, one per line; NaN and infinities are
                    written as ``null`` (strict JSON), numpy scalars and arrays as plain numbers/lists;
- ``progress.csv``  one row per result, one column per flattened key (``"env_runners/episode_return_mean"``);
                    a key that first appears in a later result (evaluation results, a new learner stat)
                    adds a column: the file is rewritten with the wider header, older rows left empty there;
- ``events.out.tfevents.*``  TensorBoard scalars (tag = flattened key, step = ``training_iteration``),
                    written with ``tensorboardX``; ``tensorboard --logdir <logdir>`` shows them.
"""
from __future__ import annotations

import csv
import json
import math
import os
import re
import time
import warnings
from typing import Any, Iterable

import numpy as np

Scalar = bool | int | float | str | None
INVALID_TAG_CHARACTERS = re.compile(r"[^-/\w.]")
EVENT_FLUSH_S = 10.0
"""TensorBoard's event file is flushed (and fsynced) at most this often while a run logs, and at close.
result.json and progress.csv are written through every result: a killed driver loses no result."""

__all__ = ["ResultLogger", "flatten_result", "to_json_safe"]


def _scalar(value: Any) -> tuple[bool, Scalar]:
    """-> (is_scalar, plain python value). numpy scalars, 0-d arrays and 0-d tensors count as scalars."""
    if value is None or isinstance(value, (bool, int, float, str)):
        return True, value
    if isinstance(value, np.generic):
        return True, value.item()
    if hasattr(value, "item") and getattr(value, "ndim", None) == 0:  # 0-d numpy array or torch tensor
        try:
            return True, value.item()
        except Exception:  # noqa: BLE001 - not a real scalar after all
            return False, None
    return False, None


def flatten_result(d: dict[str, Any], sep: str = "/", prefix: str = "") -> dict[str, Scalar]:
    """Nested result dict -> ``{"a/b/c": scalar}``.

    Scalars are None, bool, int, float, str (numpy scalars and 0-d arrays/tensors are converted to
    these). Lists, arrays with dimensions and other objects are left out: CSV columns and
    TensorBoard scalars hold single values; ``result.json`` keeps everything.
    """
    out: dict[str, Scalar] = {}
    for key, value in d.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict):
            out.update(flatten_result(value, sep=sep, prefix=f"{name}{sep}"))
            continue
        ok, plain = _scalar(value)
        if ok:
            out[name] = plain
    return out


def to_json_safe(value: Any) -> Any:
    """Plain JSON data: NaN/inf -> None, numpy/torch values -> python numbers and lists, other objects -> str."""
    if isinstance(value, dict):
        return {str(k): to_json_safe(v) for k, v in value.items()}
    if isinstance(value, (list, tuple, set, frozenset)):
        return [to_json_safe(v) for v in value]
    ok, plain = _scalar(value)
    if ok:
        if isinstance(plain, float) and not math.isfinite(plain):
            return None
        return plain
    if hasattr(value, "tolist"):  # numpy arrays, torch tensors
        try:
            return to_json_safe(value.tolist())
        except Exception:  # noqa: BLE001
            pass
    return str(value)


def _csv_value(value: Scalar) -> Any:
    return "" if value is None else value


class ResultLogger:
    """Writes ``params.json``, ``result.json``, ``progress.csv`` and TensorBoard events into ``logdir``.

    Usage::

        logger = ResultLogger(run_dir, params=algo.config.to_dict())  # or logger.write_params(...) later
        for _ in range(n):
            logger.log(algo.train())
        logger.close()

    ``params`` (or a later ``write_params``) writes ``params.json``. ``tensorboard=False`` skips the TensorBoard files (so does a missing ``tensorboardX``, with a warning).
    """

    def __init__(self, logdir: str | os.PathLike, params: dict[str, Any] | None = None,
                 tensorboard: bool = True, resume_after: int | None = None) -> None:
        self.logdir = os.path.abspath(os.fspath(logdir))
        os.makedirs(self.logdir, exist_ok=True)
        self.params_path = os.path.join(self.logdir, "params.json")
        self.result_path = os.path.join(self.logdir, "result.json")
        self.progress_path = os.path.join(self.logdir, "progress.csv")
        self._fields: list[str] = []
        self._num_rows = 0
        self._num_results = 0
        self._params_written = False
        if resume_after is not None:  # a resumed run: keep its results up to the checkpoint it resumes from
            self._keep_results_up_to(resume_after)
            self._params_written = os.path.exists(self.params_path)
        self._json = open(self.result_path, "a" if resume_after is not None else "w", encoding="utf-8")
        self._writer = None
        self._summary = None
        self._last_event_flush = time.monotonic()
        if tensorboard:
            try:
                from tensorboardX.proto.summary_pb2 import Summary
                from tensorboardX.writer import FileWriter
            except ImportError:  # pragma: no cover - tensorboardX is a dependency
                warnings.warn("tensorboardX is not installed: no TensorBoard event files are written", stacklevel=2)
            else:
                self._writer = FileWriter(self.logdir, max_queue=100, flush_secs=EVENT_FLUSH_S)
                self._summary = Summary
        self._closed = False
        if params is not None:
            self.write_params(params)

    def _keep_results_up_to(self, iteration: int) -> None:
        """Drop results after ``iteration`` (trained after the checkpoint a run resumes from, so they
        are trained again) from result.json and progress.csv; later rows continue these."""
        def kept(row_iteration: Any) -> bool:
            try:
                return float(row_iteration) <= iteration
            except (TypeError, ValueError):
                return False

        if os.path.exists(self.result_path):
            with open(self.result_path, encoding="utf-8") as f:
                lines = [line for line in f if line.strip()]
            keep = []
            for line in lines:
                try:
                    if kept(json.loads(line).get("training_iteration")):
                        keep.append(line)
                except json.JSONDecodeError:  # a line torn by a crash
                    continue
            _write_atomically(self.result_path, "".join(keep))
            self._num_results = len(keep)
        if os.path.exists(self.progress_path):
            with open(self.progress_path, newline="", encoding="utf-8") as f:
                reader = csv.DictReader(f)
                self._fields = list(reader.fieldnames or [])
                rows = [row for row in reader if kept(row.get("training_iteration"))]
            self._num_rows = len(rows)
            self._rewrite_csv(rows)

    # --- params -------------------------------------------------------------------------------
    def write_params(self, params: dict[str, Any]) -> None:
        """Write ``params.json`` (the run's config). Only the first call writes."""
        if self._params_written:
            return
        tmp = self.params_path + ".tmp"
        with open(tmp, "w", encoding="utf-8") as f:
            json.dump(to_json_safe(params), f, indent=2, sort_keys=True, allow_nan=False)
            f.write("\n")
        os.replace(tmp, self.params_path)
        self._params_written = True

    # --- results ------------------------------------------------------------------------------
    def log(self, result: dict[str, Any]) -> None:
        """Append one ``train()`` result to every output."""
        if self._closed:
            raise RuntimeError("ResultLogger is closed")
        self._num_results += 1
        self._json.write(json.dumps(to_json_safe(result), allow_nan=False) + "\n")
        self._json.flush()
        flat = flatten_result(result)
        self._write_csv(flat)
        if self._writer is not None:
            step = flat.get("training_iteration")
            step = int(step) if isinstance(step, (int, float)) and not isinstance(step, bool) else self._num_results
            # one event per result, not one per scalar: a run of short iterations (DQN's are ~30 ms)
            # otherwise spends a tenth of its time queueing events
            values = [self._summary.Value(tag=event_tag(tag), simple_value=float(value)) for tag, value in flat.items()
                      if isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)]
            self._writer.add_summary(self._summary(value=values), global_step=step)
            if time.monotonic() - self._last_event_flush >= EVENT_FLUSH_S:
                self.flush()

    on_result = log

    def _write_csv(self, flat: dict[str, Scalar]) -> None:
        new = [k for k in flat if k not in set(self._fields)]
        if new or self._num_rows == 0:
            self._fields.extend(new)
            self._rewrite_csv()
        with open(self.progress_path, "a", newline="", encoding="utf-8") as f:
            w = csv.DictWriter(f, fieldnames=self._fields, restval="")
            w.writerow({k: _csv_value(v) for k, v in flat.items()})
        self._num_rows += 1

    def _rewrite_csv(self, rows: Iterable[dict] | None = None) -> None:
        """Write the header with the current columns, keeping the rows written so far (or ``rows``)."""
        if rows is None:
            rows = []
            if self._num_rows and os.path.exists(self.progress_path):
                with open(self.progress_path, newline="", encoding="utf-8") as f:
                    rows = list(csv.DictReader(f))
        tmp = self.progress_path + ".tmp"
        with open(tmp, "w", newline="", encoding="utf-8") as f:
            w = csv.DictWriter(f, fieldnames=self._fields, restval="", extrasaction="ignore")
            w.writeheader()
            for row in rows:
                w.writerow(row)
        os.replace(tmp, self.progress_path)

    # --- lifecycle ----------------------------------------------------------------------------
    def flush(self) -> None:
        self._json.flush()
        if self._writer is not None:
            self._writer.flush()
        self._last_event_flush = time.monotonic()

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._json.close()
        if self._writer is not None:
            self._writer.close()

    def __enter__(self) -> "ResultLogger":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


def event_tag(key: str) -> str:
    """A flattened result key as a TensorBoard tag (TensorBoard's rule: characters outside ``[-/\\w.]``
    become ``_``, no leading ``/``)."""
    return INVALID_TAG_CHARACTERS.sub("_", key).lstrip("/")


def _write_atomically(path: str, text: str) -> None:
    tmp = path + ".tmp"
    with open(tmp, "w", encoding="utf-8") as f:
        f.write(text)
    os.replace(tmp, path)
