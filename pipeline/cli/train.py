"""``runnel train``: build the algorithm, train until a stop criterion, log results and checkpoints.

See ``pipeline.cli.main`` for the command line and ``pipeline.cli.train_spec`` for how its inputs are read.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import shlex
import shutil
import signal
import threading
import time
import traceback
from typing import Any

from pipeline.run_dirs import env_label, make_run_dir, run_dir_name
from pipeline.cli.train_spec import (EXIT_FAILURE, EXIT_INTERRUPTED, EXIT_OK, EXIT_USAGE, RUN_FILE, CLIError, TrainSpec,
                                  check_stop_keys, describe_exc, resume_spec, runnel_command, say, stop_reason, train_spec,
                                  warn)


def _fmt_duration(seconds: float) -> str:
    s = int(seconds)
    return f"{s // 3600}:{s % 3600 // 60:02d}:{s % 60:02d}"


def _fmt_num(value: Any, spec: str = ".2f") -> str:
    if isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value):
        return format(value, spec)
    return "n/a"


def _validate(config: Any) -> None:
    from pipeline.config.base import ConfigError

    try:
        config.validate()
    except ConfigError:
        raise
    except (TypeError, ValueError) as err:  # a value of the wrong type that validate() trips over
        raise CLIError(f"invalid {config.algo_name} config: {describe_exc(err)}", EXIT_USAGE) from None


class _GracefulStop:
    """First Ctrl-C or SIGTERM: ask the loop to stop after the current iteration (and checkpoint).
    Second: KeyboardInterrupt now (a checkpoint of the state at that moment is still written).

    Once the loop is over (``finishing``) no signal interrupts: what is left is writing the last checkpoint,
    and a second signal that arrives only then (two sent back to back reach a busy process apart) would
    otherwise abort that write and leave the run with no checkpoint of its last iteration."""

    SIGNALS = (signal.SIGINT, signal.SIGTERM)

    def __init__(self) -> None:
        self.requested: str | None = None
        self.finishing = False
        self._previous: dict[int, Any] = {}

    def __enter__(self) -> "_GracefulStop":
        if threading.current_thread() is threading.main_thread():
            for sig in self.SIGNALS:
                previous = signal.getsignal(sig)
                if previous is not signal.SIG_IGN:  # started with it ignored (nohup...): leave it so
                    self._previous[sig] = previous
                    signal.signal(sig, self._handle)
        return self

    def _handle(self, signum: int, frame: Any) -> None:
        if self.finishing:
            say("\nrunnel: writing the last checkpoint; the run ends once it is written", err=True)
            return
        if self.requested:
            self.finishing = True
            raise KeyboardInterrupt
        self.requested = "Ctrl-C" if signum == signal.SIGINT else signal.Signals(signum).name
        again = "press Ctrl-C again" if signum == signal.SIGINT else f"send {self.requested} again"
        say(f"\nrunnel: {self.requested}: stopping after this iteration ({again} to stop at once)", err=True)

    def __exit__(self, *exc: Any) -> None:
        for sig, previous in self._previous.items():
            signal.signal(sig, previous if previous is not None else signal.SIG_DFL)
        self._previous.clear()


def _build_config(spec: TrainSpec) -> tuple[Any, Any]:
    from pipeline.registry import get_algorithm

    config_cls, algo_cls = get_algorithm(spec.algo)
    config = config_cls()
    config.update_from_dict(spec.config)
    if spec.env is not None:
        config.environment(spec.env)
    if spec.input_ is not None:  # train from a recording; an env, if given, serves evaluation
        config.offline_data(input_=spec.input_)
        if spec.env is not None and not config.evaluation_interval:
            config.evaluation(evaluation_interval=1, evaluation_duration=10, evaluation_duration_unit="episodes")
    if spec.num_env_runners is not None:
        config.env_runners(num_env_runners=spec.num_env_runners)
    if spec.seed is not None:
        config.debugging(seed=spec.seed)
    return config, algo_cls


def cmd_train(args: argparse.Namespace) -> int:
    import ray

    from pipeline.config.base import ConfigError

    from pipeline.tune.run import first_variant, has_search_space, run_with_tune

    resume_dir = os.path.abspath(os.path.expanduser(args.resume)) if getattr(args, "resume", None) else None
    spec = resume_spec(args, resume_dir) if resume_dir else train_spec(args)
    searching = has_search_space(spec.config)
    config, algo_cls = _build_config(dataclasses.replace(spec, config=first_variant(spec.config)) if searching
                                     else spec)
    _validate(config)  # ConfigError -> exit 2, before anything is started or written
    if not resume_dir and (spec.num_samples > 1 or searching):
        return run_with_tune(spec, config, algo_cls)

    algo_name = algo_cls.__name__
    checkpoint = _resume_checkpoint(resume_dir) if resume_dir else None
    run_dir = resume_dir or os.path.join(os.path.abspath(os.path.expanduser(spec.output_dir)),
                                         run_dir_name(algo_name, config.env))
    ray_was_up = ray.is_initialized()
    algo = None
    try:
        try:
            if checkpoint is not None:
                overrides = {} if spec.num_env_runners is None else {"num_env_runners": spec.num_env_runners}
                algo = algo_cls.from_checkpoint(checkpoint, logdir=None, **overrides)
            else:
                algo = config.build(logdir=None)  # results: the CLI logs them itself (below)
        except ConfigError:
            raise
        except Exception as err:  # noqa: BLE001 - Ray, actors, the env itself
            what = f"resuming {algo_name} from {checkpoint}" if checkpoint else \
                f"building {algo_name} on {env_label(config.env)}"
            raise CLIError(f"{what} failed: {describe_exc(err)}", EXIT_FAILURE) from err
        if resume_dir is None:
            run_dir = make_run_dir(run_dir)
        algo.logdir = run_dir
        return _train_loop(algo, spec, run_dir, algo_name, resumed=checkpoint is not None)
    finally:
        if algo is not None:
            try:
                algo.stop()
            except Exception as err:  # noqa: BLE001 - shutting down; report, do not mask the result
                warn(f"stopping the algorithm's actors failed: {describe_exc(err)}")
        if not ray_was_up and ray.is_initialized():
            ray.shutdown()


def _resume_checkpoint(run_dir: str) -> str:
    """The run's latest complete checkpoint. A driver killed while saving (SIGKILL, the OOM killer) leaves
    the checkpoint it was writing half done under a temporary name: removed here, the one before it stands."""
    from pipeline.checkpoints.keeper import checkpoints_in, partial_checkpoints

    if not os.path.isdir(run_dir):
        raise CLIError(f"--resume {run_dir!r}: no such directory")
    found = checkpoints_in(run_dir)
    if not found:
        raise CLIError(f"--resume {run_dir!r}: the run has no complete checkpoint to continue from (it stopped "
                       f"before its first save); start it again without --resume")
    for path in partial_checkpoints(run_dir):
        say(f"runnel: removing {path}, a checkpoint whose writing never finished")
        shutil.rmtree(path, ignore_errors=True)
    return found[-1][1]


def _write_run_file(run_dir: str, spec: TrainSpec) -> None:
    tmp = os.path.join(run_dir, RUN_FILE + ".tmp")
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump(spec.to_json(), f, indent=2, sort_keys=True)
    os.replace(tmp, os.path.join(run_dir, RUN_FILE))


def _train_loop(algo: Any, spec: TrainSpec, run_dir: str, algo_name: str, resumed: bool = False) -> int:
    from pipeline.checkpoints.keeper import CheckpointKeeper, checkpoints_in
    from pipeline.results import ResultLogger

    label = env_label(algo.config.env)
    try:
        logger = ResultLogger(run_dir, resume_after=algo.iteration if resumed else None)
        logger.write_params(algo.config.to_dict())
        _write_run_file(run_dir, spec)
    except BaseException:
        if not resumed:
            shutil.rmtree(run_dir, ignore_errors=True)
        raise
    keeper = CheckpointKeeper(spec.keep_checkpoints, spec.checkpoint_score_attribute, spec.checkpoint_score_order)
    for iteration, path in checkpoints_in(run_dir) if resumed else []:
        keeper.adopt(path, iteration)
    stop_text = ", ".join(f"{k} >= {v:g}" for k, v in spec.stop.items()) or "none (runs until Ctrl-C)"
    verb = f"resuming {algo_name} on {label} at iteration {algo.iteration}" if resumed else \
        f"training {algo_name} on {label}"
    say(f"runnel: {verb}; results in {run_dir}")
    say(f"runnel: stop when {stop_text.replace(', ', ' or ')}")

    t0 = time.monotonic()
    num_results = 0
    last_result: dict | None = None
    best: tuple[float, int] | None = None
    checkpoint: str | None = None
    saved: dict[str, Any] = {}  # what the last checkpoint holds: the summary prints these
    reason: str | None = None
    outcome = "done"
    failure: BaseException | None = None

    def save(result: dict | None) -> str:
        nonlocal checkpoint
        checkpoint = algo.save(os.path.join(run_dir, f"checkpoint_{algo.iteration:06d}"))
        saved.update(iteration=algo.iteration, counters=dict(algo.counters))
        for path in keeper.add(checkpoint, algo.iteration, result):
            say(f"runnel: removed checkpoint {path} (keeping {spec.keep_checkpoints})")
        return checkpoint

    with _GracefulStop() as stopping:
        try:
            while True:
                result = algo.train()
                num_results += 1
                last_result = result
                logger.log(result)
                ret = _return_of(result)
                if isinstance(ret, (int, float)) and math.isfinite(ret) and (best is None or ret > best[0]):
                    best = (float(ret), result.get("training_iteration", num_results))
                _print_progress(result, time.monotonic() - t0)
                if num_results == 1:
                    for w in check_stop_keys(result, spec.stop):
                        warn(w)
                if spec.checkpoint_freq and algo.iteration % spec.checkpoint_freq == 0:
                    save(result)
                reason = stop_reason(result, spec.stop)
                if reason or stopping.requested:
                    stopping.finishing = True
                    break
        except KeyboardInterrupt:
            outcome = "interrupted at once"
        except Exception as err:  # noqa: BLE001 - reported as one line; traceback goes to error.txt
            stopping.finishing = True
            outcome, failure = "failed", err
        if stopping.requested and outcome == "done" and not reason:
            outcome = "interrupted"
        elapsed = time.monotonic() - t0

        if num_results == 0 and not resumed:  # nothing was trained: leave no run directory behind
            logger.close()
            shutil.rmtree(run_dir, ignore_errors=True)
            if outcome == "failed":
                raise CLIError(f"training failed before the first iteration finished: {describe_exc(failure)}",
                               EXIT_FAILURE) from failure
            say("runnel: stopped before the first iteration finished; nothing was saved", err=True)
            return EXIT_INTERRUPTED

        if outcome == "failed":
            logger.close()
            with open(os.path.join(run_dir, "error.txt"), "w", encoding="utf-8") as f:
                f.write("".join(traceback.format_exception(type(failure), failure, failure.__traceback__)))
            saved_text = _save_after_failure(save, algo, last_result, checkpoint)
            raise CLIError(f"training failed in iteration {algo.iteration + 1}: {describe_exc(failure)} "
                           f"(traceback in {os.path.join(run_dir, 'error.txt')}; results so far in {run_dir}"
                           f"{saved_text}; continue with: {runnel_command()} train --resume {shlex.quote(run_dir)})",
                           EXIT_FAILURE) from failure

        try:
            if spec.checkpoint_at_end and saved.get("iteration") != algo.iteration:
                save(last_result)
        finally:
            logger.close()

    _print_summary(algo, last_result, elapsed, best, reason, outcome, run_dir, checkpoint, saved, stopping.requested)
    return EXIT_INTERRUPTED if outcome.startswith("interrupted") else EXIT_OK


def _save_after_failure(save: Any, algo: Any, last_result: dict | None, checkpoint: str | None) -> str:
    """A failed iteration leaves the learner's weights and the counters of what it finished (each
    update and each counted batch is whole): checkpoint them, unless a stage is gone."""
    try:
        path = save(last_result)
    except Exception as err:  # noqa: BLE001 - a dead learner or runner: the last checkpoint stands
        last = f"; last checkpoint: {checkpoint}" if checkpoint else "; no checkpoint"
        return f"; no final checkpoint ({describe_exc(err)}){last}"
    return f"; checkpoint of the state at the failure: {path}"


def _learning_curve(run_dir: str) -> str | None:
    """Write the run's learning curve (``runnel plot``'s default) and return its path; a run whose
    results cannot be plotted (no episode finished yet) gets none, with a one-line note."""
    from pipeline.cli.plot import PlotError, plot_learning_curve

    try:
        return plot_learning_curve(run_dir).path
    except (PlotError, OSError, ImportError) as err:
        say(f"runnel: no learning curve written: {err}", err=True)
        return None


def _return_of(result: dict) -> Any:
    """The training runners' mean return, or the evaluators' where runners play no episodes
    (training from a recording)."""
    ret = result.get("env_runners", {}).get("episode_return_mean")
    if ret is None:
        ret = result.get("evaluation", {}).get("env_runners", {}).get("episode_return_mean")
    return ret


def _print_progress(result: dict, elapsed: float) -> None:
    env_runners = result.get("env_runners", {})
    steps = result.get("num_env_steps_sampled_lifetime", env_runners.get("num_env_steps_sampled_lifetime"))
    sps = result.get("num_env_steps_sampled_per_s")
    if sps is None and result.get("time_this_iter_s"):
        sps = env_runners.get("num_env_steps_sampled", 0) / result["time_this_iter_s"]
    say(f"iter {result.get('training_iteration', '?'):>4} | env steps {_fmt_num(steps, ',d'):>10} | "
        f"return {_fmt_num(_return_of(result)):>9} | {_fmt_num(sps, ',.0f'):>7} steps/s | "
        f"elapsed {_fmt_duration(elapsed)}")


def _print_summary(algo: Any, result: dict | None, elapsed: float, best: tuple[float, int] | None,
                   reason: str | None, outcome: str, run_dir: str, checkpoint: str | None,
                   saved: dict[str, Any], requested: str | None) -> None:
    # The iteration and counters printed are the checkpoint's, so the two always agree.
    iters = saved.get("iteration", algo.iteration)
    counters = saved.get("counters") or dict(algo.counters)
    why = {"done": f"stop criterion met: {reason}" if reason else "done",
           "interrupted": f"stopped by {requested}",
           "interrupted at once": f"interrupted during iteration {iters + 1} ({requested} twice); the checkpoint "
                                  f"holds the state at that moment"}[outcome]
    say(f"\nTraining {'stopped' if outcome.startswith('interrupted') else 'finished'} after {iters} iteration"
        f"{'s' if iters != 1 else ''} in {_fmt_duration(elapsed)}: {why}")
    ret = _return_of(result) if result is not None else None
    best_text = f" (best {best[0]:.2f} at iteration {best[1]})" if best else ""
    say(f"  env steps sampled: {_fmt_num(counters.get('num_env_steps_sampled_lifetime'), ',d')}   "
        f"episode_return_mean: {_fmt_num(ret)}{best_text}")
    say(f"  results:    {run_dir}   (tensorboard --logdir {shlex.quote(run_dir)})")
    plot = _learning_curve(run_dir)
    if plot:
        say(f"  plot:       {plot}")
    if checkpoint:
        say(f"  checkpoint: {checkpoint}")
        say(f"\nEvaluate it with:\n  {runnel_command()} evaluate {shlex.quote(checkpoint)} --episodes 10")
        say(f"Continue training with:\n  {runnel_command()} train --resume {shlex.quote(run_dir)}")
    else:
        say("  no checkpoint saved (--no-checkpoint-at-end)")
