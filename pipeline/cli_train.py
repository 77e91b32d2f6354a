"""``runnel train``: build the algorithm, train until a stop criterion, log results and checkpoints.

See ``pipeline.cli`` for the command line and ``pipeline.train_spec`` for how its inputs are read.
"""
from __future__ import annotations

import argparse
import math
import os
import shlex
import shutil
import signal
import sys
import threading
import time
import traceback
from typing import Any

from pipeline.run_dirs import env_label, make_run_dir, run_dir_name
from pipeline.train_spec import (EXIT_FAILURE, EXIT_INTERRUPTED, EXIT_OK, EXIT_USAGE, CLIError, TrainSpec,
                                  check_stop_keys, describe_exc, stop_reason, train_spec, warn)


def _fmt_duration(seconds: float) -> str:
    s = int(seconds)
    return f"{s // 3600}:{s % 3600 // 60:02d}:{s % 60:02d}"


def _fmt_num(value: Any, spec: str = ".2f") -> str:
    if isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value):
        return format(value, spec)
    return "n/a"








def _validate(config: Any) -> None:
    from pipeline.config import ConfigError

    try:
        config.validate()
    except ConfigError:
        raise
    except (TypeError, ValueError) as err:  # a value of the wrong type that validate() trips over
        raise CLIError(f"invalid {config.algo_name} config: {describe_exc(err)}", EXIT_USAGE) from None


class _GracefulInterrupt:
    """First Ctrl-C: ask the loop to stop after the current iteration. Second: KeyboardInterrupt now."""

    def __init__(self) -> None:
        self.requested = False
        self._previous: Any = None
        self._installed = False

    def __enter__(self) -> "_GracefulInterrupt":
        if threading.current_thread() is threading.main_thread():
            previous = signal.getsignal(signal.SIGINT)
            if previous is not signal.SIG_IGN:  # started with Ctrl-C ignored (nohup...): leave it so
                self._previous = previous
                signal.signal(signal.SIGINT, self._handle)
                self._installed = True
        return self

    def _handle(self, signum: int, frame: Any) -> None:
        if self.requested:
            raise KeyboardInterrupt
        self.requested = True
        print("\nrunnel: Ctrl-C: stopping after this iteration (press Ctrl-C again to stop at once)",
              file=sys.stderr, flush=True)

    def __exit__(self, *exc: Any) -> None:
        if self._installed:
            signal.signal(signal.SIGINT, self._previous if self._previous is not None else signal.default_int_handler)
            self._installed = False


def cmd_train(args: argparse.Namespace) -> int:
    import ray

    from pipeline.registry import get_algorithm
    from pipeline.config import ConfigError

    spec = train_spec(args)
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
    _validate(config)  # ConfigError -> exit 2, before anything is started or written

    algo_name = algo_cls.__name__
    output_dir = os.path.abspath(os.path.expanduser(spec.output_dir))
    run_dir = os.path.join(output_dir, run_dir_name(algo_name, config.env))
    ray_was_up = ray.is_initialized()
    algo = None
    try:
        try:
            algo = config.build(logdir=None)  # results: the CLI logs them itself (below)
        except ConfigError:
            raise
        except Exception as err:  # noqa: BLE001 - Ray, actors, the env itself
            raise CLIError(f"building {algo_name} on {env_label(config.env)} failed: {describe_exc(err)}",
                           EXIT_FAILURE) from err
        run_dir = make_run_dir(run_dir)
        algo.logdir = run_dir
        return _train_loop(algo, spec, run_dir, algo_name)
    finally:
        if algo is not None:
            try:
                algo.stop()
            except Exception as err:  # noqa: BLE001 - shutting down; report, do not mask the result
                warn(f"stopping the algorithm's actors failed: {describe_exc(err)}")
        if not ray_was_up and ray.is_initialized():
            ray.shutdown()


def _train_loop(algo: Any, spec: TrainSpec, run_dir: str, algo_name: str) -> int:
    from pipeline.results import ResultLogger

    label = env_label(algo.config.env)
    try:
        logger = ResultLogger(run_dir)
        logger.write_params(algo.config.to_dict())
    except BaseException:
        shutil.rmtree(run_dir, ignore_errors=True)
        raise
    stop_text = ", ".join(f"{k} >= {v:g}" for k, v in spec.stop.items()) or "none (runs until Ctrl-C)"
    print(f"runnel: training {algo_name} on {label}; results in {run_dir}", flush=True)
    print(f"runnel: stop when {stop_text.replace(', ', ' or ')}", flush=True)

    t0 = time.monotonic()
    num_results = 0
    last_result: dict | None = None
    best: tuple[float, int] | None = None
    checkpoint: str | None = None
    checkpoint_iter = -1
    reason: str | None = None
    outcome = "done"
    failure: BaseException | None = None

    def save() -> str:
        nonlocal checkpoint, checkpoint_iter
        checkpoint = algo.save(os.path.join(run_dir, f"checkpoint_{algo.iteration:06d}"))
        checkpoint_iter = algo.iteration
        return checkpoint

    with _GracefulInterrupt() as interrupt:
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
                    save()
                reason = stop_reason(result, spec.stop)
                if reason or interrupt.requested:
                    break
        except KeyboardInterrupt:
            outcome = "interrupted at once"
        except Exception as err:  # noqa: BLE001 - reported as one line; traceback goes to error.txt
            outcome, failure = "failed", err
        if interrupt.requested and outcome == "done" and not reason:
            outcome = "interrupted"
        elapsed = time.monotonic() - t0

        if num_results == 0:  # nothing was trained: leave no run directory behind
            logger.close()
            shutil.rmtree(run_dir, ignore_errors=True)
            if outcome == "failed":
                raise CLIError(f"training failed before the first iteration finished: {describe_exc(failure)}",
                               EXIT_FAILURE) from failure
            print("runnel: interrupted before the first iteration finished; nothing was saved", file=sys.stderr,
                  flush=True)
            return EXIT_INTERRUPTED

        if outcome == "failed":
            logger.close()
            with open(os.path.join(run_dir, "error.txt"), "w", encoding="utf-8") as f:
                f.write("".join(traceback.format_exception(type(failure), failure, failure.__traceback__)))
            last = f"; last checkpoint: {checkpoint}" if checkpoint else ""
            raise CLIError(f"training failed in iteration {algo.iteration + 1}: {describe_exc(failure)} "
                           f"(traceback in {os.path.join(run_dir, 'error.txt')}; results so far in {run_dir}{last})",
                           EXIT_FAILURE) from failure

        try:
            if spec.checkpoint_at_end and checkpoint_iter != algo.iteration:
                save()
        finally:
            logger.close()

    _print_summary(algo, last_result, elapsed, best, reason, outcome, run_dir, checkpoint)
    return EXIT_INTERRUPTED if outcome.startswith("interrupted") else EXIT_OK


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
    print(f"iter {result.get('training_iteration', '?'):>4} | env steps {_fmt_num(steps, ',d'):>10} | "
          f"return {_fmt_num(_return_of(result)):>9} | {_fmt_num(sps, ',.0f'):>7} steps/s | "
          f"elapsed {_fmt_duration(elapsed)}", flush=True)


def _print_summary(algo: Any, result: dict | None, elapsed: float, best: tuple[float, int] | None,
                   reason: str | None, outcome: str, run_dir: str, checkpoint: str | None) -> None:
    iters = algo.iteration
    why = {"done": f"stop criterion met: {reason}" if reason else "done",
           "interrupted": "interrupted (Ctrl-C)",
           "interrupted at once": f"interrupted during iteration {iters + 1} (Ctrl-C twice); the checkpoint "
                                  f"holds the state at that moment"}[outcome]
    print(f"\nTraining {'stopped' if outcome.startswith('interrupted') else 'finished'} after {iters} iteration"
          f"{'s' if iters != 1 else ''} in {_fmt_duration(elapsed)}: {why}")
    if result is not None:
        steps = result.get("num_env_steps_sampled_lifetime")
        ret = _return_of(result)
        best_text = f" (best {best[0]:.2f} at iteration {best[1]})" if best else ""
        print(f"  env steps sampled: {_fmt_num(steps, ',d')}   episode_return_mean: {_fmt_num(ret)}{best_text}")
    print(f"  results:    {run_dir}   (tensorboard --logdir {shlex.quote(run_dir)})")
    if checkpoint:
        print(f"  checkpoint: {checkpoint}")
        print(f"\nEvaluate it with:\n  runnel evaluate {shlex.quote(checkpoint)} --episodes 10")
    else:
        print("  no checkpoint saved (--no-checkpoint-at-end)")
    sys.stdout.flush()
