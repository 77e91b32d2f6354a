"""``runnel plot RUN_DIR``: a PNG learning curve from a run directory's ``progress.csv``.

::

    runnel plot ~/runnel_results/PPO_CartPole-v1_2025-01-01_12-00-00
    runnel plot RUN_DIR --metric env_runners/episode_len_mean --metric learners/default_policy/vf_loss
    runnel plot RUN_DIR --output curve.png

The x axis is the env steps sampled so far (``num_env_steps_sampled_lifetime``; runs that sample no
env, such as BC from a recording, fall back to ``training_iteration``). The default metric is the
mean episode return (``env_runners/episode_return_mean``), with the evaluation return
(``evaluation/env_runners/episode_return_mean``) beside it when the run evaluated. Metrics that
end in the same name share a panel; others get a panel each. Empty cells and NaN (an iteration in
which no episode ended) are gaps, not zeros. The figure goes to ``RUN_DIR/learning_curve.png``
unless ``--output`` names another file (``.png``; ``.svg`` and ``.pdf`` work too).

``plot_learning_curve(run_dir, metrics=None, output=None)`` does the same from Python and returns
what it wrote.
"""
from __future__ import annotations

import argparse
import csv
import difflib
import math
import os
from dataclasses import dataclass
from typing import Any, Sequence

from pipeline.cli.train_spec import EXIT_FAILURE, EXIT_USAGE, CLIError

DEFAULT_METRIC = "env_runners/episode_return_mean"
EVALUATION_METRIC = "evaluation/env_runners/episode_return_mean"
X_KEYS = ("num_env_steps_sampled_lifetime", "env_runners/num_env_steps_sampled_lifetime", "training_iteration")
X_LABELS = {"training_iteration": "training iteration", "row": "result"}
DEFAULT_FILENAME = "learning_curve.png"

__all__ = ["DEFAULT_FILENAME", "DEFAULT_METRIC", "EVALUATION_METRIC", "Plot", "PlotError", "add_parser",
           "cmd_plot", "plot_learning_curve", "read_progress"]


class PlotError(ValueError):
    """A run directory, progress.csv or metric that cannot be plotted; the message says why and what would work.
    ``code`` is the CLI's exit status for it: 2 for a bad argument, 1 for a file that cannot be read or written."""

    def __init__(self, message: str, code: int = EXIT_USAGE) -> None:
        super().__init__(message)
        self.code = code


@dataclass
class Plot:
    """What ``plot_learning_curve`` wrote."""
    path: str
    metrics: list[str]
    x_key: str
    num_rows: int


# --- reading -----------------------------------------------------------------------------------
def _progress_path(run_dir: str) -> str:
    shown = run_dir
    run_dir = os.path.expanduser(run_dir)
    if os.path.isfile(run_dir):
        if os.path.basename(run_dir).endswith(".csv"):
            return run_dir
        raise PlotError(f"{shown!r} is a file, not a run directory: give the directory that 'runnel train' or "
                        f"algo.train() wrote (it holds progress.csv)")
    if not os.path.isdir(run_dir):
        raise PlotError(f"no such run directory: {shown!r}; give a directory written by 'runnel train' or algo.train(), "
                        f"e.g. ~/runnel_results/PPO_CartPole-v1_<date>")
    path = os.path.join(run_dir, "progress.csv")
    if os.path.isfile(path):
        return path
    parent = os.path.dirname(os.path.abspath(run_dir))
    if os.path.isfile(os.path.join(parent, "progress.csv")):
        raise PlotError(f"{shown!r} holds no progress.csv; it looks like a checkpoint: plot its run directory "
                        f"{parent!r}")
    runs = sorted(d for d in os.listdir(run_dir) if os.path.isfile(os.path.join(run_dir, d, "progress.csv")))
    if runs:
        listed = ", ".join(runs[-5:]) + (f" (and {len(runs) - 5} more)" if len(runs) > 5 else "")
        raise PlotError(f"{shown!r} holds no progress.csv; it holds run directories: plot one of them: {listed}")
    raise PlotError(f"{shown!r} holds no progress.csv: is it a run directory written by 'runnel train' or "
                    f"algo.train()? (the CLI prints it as 'results:' at the end of a run)")


def _number(text: Any) -> float:
    try:
        value = float(text)
    except (TypeError, ValueError):
        return math.nan
    return value if math.isfinite(value) else math.nan


def read_progress(run_dir: str) -> tuple[str, dict[str, list[float]], int]:
    """-> (path of progress.csv, {column: values with NaN for empty/non-numeric cells}, number of rows).
    Only columns with at least one finite number are kept, in the file's order."""
    path = _progress_path(run_dir)
    try:
        with open(path, newline="", encoding="utf-8") as f:
            reader = csv.DictReader(f)
            fields = list(reader.fieldnames or [])
            rows = list(reader)
    except (OSError, UnicodeDecodeError, csv.Error) as err:
        raise PlotError(f"cannot read {path}: {err}", EXIT_FAILURE) from err
    if not fields or not rows:
        raise PlotError(f"{path} holds no results yet: the run has not finished an iteration")
    columns = {}
    for name in fields:
        values = [_number(row.get(name)) for row in rows]
        if any(not math.isnan(v) for v in values):
            columns[name] = values
    return path, columns, len(rows)


# --- plotting ----------------------------------------------------------------------------------
def _choose_metrics(metrics: Sequence[str] | None, columns: dict[str, list[float]], path: str) -> list[str]:
    available = [c for c in columns if c not in X_KEYS]
    if metrics:
        unknown = [m for m in metrics if m not in columns]
        if unknown:
            bad = unknown[0]
            close = difflib.get_close_matches(bad, available, n=3, cutoff=0.5)
            hint = f"; did you mean {' or '.join(map(repr, close))}?" if close else ""
            raise PlotError(f"no metric {bad!r} in {path}{hint} Metrics with values in this run: {', '.join(available)}")
        return list(dict.fromkeys(metrics))
    if DEFAULT_METRIC not in columns:
        raise PlotError(f"{path} has no values of {DEFAULT_METRIC} (no episode ended yet, or the run sampled no env): "
                        f"pick metrics with --metric; metrics with values in this run: {', '.join(available)}")
    return [DEFAULT_METRIC] + ([EVALUATION_METRIC] if EVALUATION_METRIC in columns else [])


def _panels(metrics: list[str]) -> list[list[str]]:
    """Metrics ending in the same name (``.../episode_return_mean``) share a panel, in first-seen order."""
    groups: dict[str, list[str]] = {}
    for m in metrics:
        groups.setdefault(m.rpartition("/")[2], []).append(m)
    return list(groups.values())


def plot_learning_curve(run_dir: str, metrics: Sequence[str] | None = None, output: str | None = None) -> Plot:
    """Write a learning curve of ``run_dir``'s progress.csv (see the module docstring); raises PlotError."""
    path, columns, num_rows = read_progress(run_dir)
    chosen = _choose_metrics(metrics, columns, path)
    x_key = next((k for k in X_KEYS if k in columns), None)
    if output is None:
        output = os.path.join(os.path.dirname(path), DEFAULT_FILENAME)
    output = os.path.expanduser(output)
    out_dir = os.path.dirname(os.path.abspath(output))
    if not os.path.isdir(out_dir):
        raise PlotError(f"cannot write {output!r}: the directory {out_dir!r} does not exist")
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ImportError as err:  # pragma: no cover - matplotlib is a dependency
        raise PlotError(f"runnel plot needs matplotlib ({err}): pip install 'matplotlib>=3.7'") from err

    panels = _panels(chosen)
    fig = Figure(figsize=(8, 2.2 + 2.6 * len(panels)), layout="constrained")
    canvas = FigureCanvasAgg(fig)
    ext = os.path.splitext(output)[1].lstrip(".").lower() or "png"
    if ext not in canvas.get_supported_filetypes():
        raise PlotError(f"cannot write {output!r}: unknown image type {ext!r}; use .png (or one of "
                        f"{', '.join(sorted(canvas.get_supported_filetypes()))})")
    xs = columns[x_key] if x_key else [float(i) for i in range(1, num_rows + 1)]
    axes = fig.subplots(len(panels), 1, sharex=True, squeeze=False)[:, 0]
    for ax, group in zip(axes, panels):
        for metric in group:
            points = [(x, y) for x, y in zip(xs, columns[metric]) if not (math.isnan(x) or math.isnan(y))]
            if points:
                px, py = zip(*points)
                ax.plot(px, py, marker="o" if len(points) <= 30 else None, markersize=3, label=metric)
        ax.set_ylabel(group[0].rpartition("/")[2])
        ax.grid(True, alpha=0.3)
        ax.legend(loc="best", fontsize="small")
    axes[-1].set_xlabel(X_LABELS.get(x_key or "row", "env steps sampled"))
    fig.suptitle(os.path.basename(os.path.dirname(os.path.abspath(path))) or path, fontsize="medium")
    try:
        fig.savefig(output, format=ext, dpi=100)
    except OSError as err:
        raise PlotError(f"cannot write {output!r}: {err}", EXIT_FAILURE) from err
    return Plot(path=os.path.abspath(output), metrics=chosen, x_key=x_key or "row", num_rows=num_rows)


# --- command line ------------------------------------------------------------------------------
def add_parser(sub: Any) -> None:
    p = sub.add_parser(
        "plot", help="write a PNG learning curve of a run",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        description="Read RUN_DIR/progress.csv (written by 'runnel train' or algo.train()) and write a learning\n"
                    "curve: the metrics against env steps sampled. Default metric: the mean episode return,\n"
                    f"with the evaluation return when the run evaluated. Default output: RUN_DIR/{DEFAULT_FILENAME}.",
        epilog="examples:\n"
               "  runnel plot ~/runnel_results/PPO_CartPole-v1_2025-01-01_12-00-00\n"
               "  runnel plot RUN_DIR --metric env_runners/episode_len_mean --metric learners/default_policy/vf_loss\n"
               "  runnel plot RUN_DIR --output /tmp/curve.png")
    p.add_argument("run_dir", metavar="RUN_DIR", help="run directory holding progress.csv (or the CSV file itself)")
    p.add_argument("--metric", action="append", metavar="KEY",
                   help=f"a progress.csv column to plot, repeatable (default: {DEFAULT_METRIC}, and "
                        f"{EVALUATION_METRIC} when present)")
    p.add_argument("--output", "-o", metavar="FILE", help=f"image to write (default: RUN_DIR/{DEFAULT_FILENAME})")
    p.set_defaults(func=cmd_plot)


def cmd_plot(args: argparse.Namespace) -> int:
    try:
        plot = plot_learning_curve(args.run_dir, metrics=args.metric, output=args.output)
    except PlotError as err:
        raise CLIError(str(err), err.code) from err
    x = X_LABELS.get(plot.x_key, "env steps sampled")
    print(f"wrote {plot.path}: {', '.join(plot.metrics)} against {x} ({plot.num_rows} results)")
    return 0
