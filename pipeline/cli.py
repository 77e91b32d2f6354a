"""runnel's command line, shaped like RLlib's ``rllib train`` / ``rllib evaluate``.

::

    runnel train --algo PPO --env CartPole-v1 --stop '{"env_runners/episode_return_mean": 450}'
    runnel train file tuned/cartpole-ppo.yaml [flags that override the file]
    runnel evaluate ~/runnel_results/PPO_CartPole-v1_2025-01-01_12-00-00/checkpoint_000012 --episodes 10

``train`` writes a run directory ``<output-dir>/<ALGO>_<env>_<YYYY-mm-dd_HH-MM-SS>`` holding
``params.json``, ``result.json``, ``progress.csv``, TensorBoard event files (see
``pipeline.results``) and ``checkpoint_<iteration>`` directories; it prints one progress line per
iteration, a summary, the final checkpoint and the ``runnel evaluate`` command for it.

Stop criteria (``--stop`` or the file's ``stop``) map result keys — ``"a/b"`` paths into the
nested result, e.g. ``env_runners/episode_return_mean`` — to thresholds; training stops as soon as
ANY key's value is >= its threshold (Tune's semantics). Without criteria it stops after
``DEFAULT_STOP``. A key missing from the first result draws a warning with close matches.

Tuned-example files (``runnel train file X.yaml`` or ``X.json``), a mapping with these keys::

    algo: PPO                     # required (``run:`` is accepted as RLlib's old name for it)
    env: CartPole-v1              # required unless config has ``env``
    stop: {env_runners/episode_return_mean: 450, num_env_steps_sampled_lifetime: 200000}
    config: {num_env_runners: 2}  # optional; any key of the algorithm's config (PPOConfig...)
    checkpoint_freq: 0            # optional; save every N iterations (0: only at the end)
    checkpoint_at_end: true       # optional
    output_dir: ~/runnel_results  # optional
    framework: torch              # optional; accepted for RLlib files, only torch runs

RLlib's experiment layout — the same mapping nested under one experiment name — is also read.
Files are read with ``yaml.safe_load`` (JSON is YAML too); ``1e-5``-style numbers in ``config``
and ``stop``, which YAML 1.1 reads as strings, are read as numbers. Flags given beside the file
override it: ``--algo``, ``--env``, ``--stop`` (replaces the file's stop), ``--checkpoint-freq``,
``--checkpoint-at-end``, ``--output-dir``, ``--num-env-runners``, ``--seed``; ``--config`` is
applied on top of the file's ``config``. ``"framework": "torch"`` inside a config is accepted
and dropped.

Exit status: 0 done, 1 runtime failure (training crashed, a checkpoint cannot be read, rendering
impossible), 2 usage or config error, 130 interrupted (Ctrl-C). Errors are one line on stderr,
``runnel: error: ...``; set ``RUNNEL_DEBUG=1`` to see tracebacks.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import re
import shlex
import shutil
import signal
import sys
import threading
import time
import traceback
from datetime import datetime
from typing import Any, Sequence

from pipeline.train_spec import (DEFAULT_OUTPUT_DIR, DEFAULT_STOP, EXIT_FAILURE, EXIT_INTERRUPTED, EXIT_OK,
                                  EXIT_USAGE, CLIError, TrainSpec, check_stop_keys, describe_exc, stop_reason,
                                  train_spec)





# --- parser ----------------------------------------------------------------------------------------
class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # one line instead of usage + message, and no sys.exit
        raise CLIError(f"{message} (see '{self.prog} --help')", EXIT_USAGE)


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog="runnel", description="Train and evaluate reinforcement-learning agents with runnel.",
        epilog="Exit status: 0 done, 1 runtime failure, 2 usage/config error, 130 interrupted. "
               "RUNNEL_DEBUG=1 shows tracebacks.")
    sub = parser.add_subparsers(dest="command", metavar="{train,evaluate}")

    t = sub.add_parser(
        "train", help="train an algorithm on an environment",
        usage="runnel train --algo ALGO --env ENV [options]\n       runnel train file FILE.yaml [options]",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        description="Train ALGO on ENV until a stop criterion is met, logging results and checkpoints to\n"
                    "<output-dir>/<ALGO>_<env>_<date>_<time>/ (params.json, result.json, progress.csv,\n"
                    "TensorBoard events, checkpoint_NNNNNN/). 'train file X.yaml' reads algo, env, stop,\n"
                    "config, checkpoint_freq... from a tuned-example file; flags given beside it override it.\n"
                    "Ctrl-C stops after the current iteration and saves (Ctrl-C twice: at once).",
        epilog="examples:\n"
               "  runnel train --algo PPO --env CartPole-v1 --stop '{\"env_runners/episode_return_mean\": 450}'\n"
               "  runnel train --algo PPO --env Pendulum-v1 --config '{\"lr\": 0.0003, \"num_env_runners\": 4}'\n"
               "  runnel train file tuned/cartpole-ppo.yaml --output-dir /tmp/runs\n\n"
               "tuned-example file (YAML or JSON), keys:\n"
               "  algo: PPO                      # or run: (RLlib's name)\n"
               "  env: CartPole-v1\n"
               "  stop: {env_runners/episode_return_mean: 450, num_env_steps_sampled_lifetime: 200000}\n"
               "  config: {num_env_runners: 2}   # optional: any key of the algorithm's config\n"
               "  checkpoint_freq: 0             # optional; also checkpoint_at_end, output_dir, framework\n"
               "--stop replaces the file's stop; --config is applied on top of its config.")
    t.add_argument("target", nargs="*", metavar="file FILE", help="train from a tuned-example YAML/JSON file")
    t.add_argument("-f", dest="file", metavar="FILE", help="same as 'file FILE'")
    t.add_argument("--algo", "--run", dest="algo", metavar="ALGO", help="algorithm name, e.g. PPO (--run: RLlib's old name)")
    t.add_argument("--env", metavar="ENV",
                   help="gymnasium id, a name given to pipeline.register_env, or 'package.module:Class'")
    t.add_argument("--stop", metavar="JSON",
                   help="JSON object of result keys ('a/b' paths into the result) to thresholds; training stops "
                        "when ANY value reaches its threshold (>=). Default: "
                        f"{json.dumps(DEFAULT_STOP)}. Example: "
                        "'{\"env_runners/episode_return_mean\": 450, \"num_env_steps_sampled_lifetime\": 200000}'")
    t.add_argument("--config", metavar="JSON",
                   help="JSON object of algorithm config settings, e.g. '{\"lr\": 0.0005, \"num_epochs\": 10}'; "
                        "unknown keys are an error naming close matches")
    t.add_argument("--checkpoint-freq", type=_nonneg_int, metavar="N",
                   help="save a checkpoint every N iterations (default 0: only at the end)")
    t.add_argument("--checkpoint-at-end", action=argparse.BooleanOptionalAction, default=None,
                   help="save a checkpoint when training ends (default: on)")
    t.add_argument("--output-dir", metavar="DIR", help=f"where run directories go (default {DEFAULT_OUTPUT_DIR})")
    t.add_argument("--num-env-runners", type=_nonneg_int, metavar="N",
                   help="env runner actors (0: sample in this process, no Ray needed)")
    t.add_argument("--seed", type=int, metavar="N", help="seed torch, numpy and the environments")
    t.add_argument("--framework", metavar="torch", help="accepted for RLlib compatibility; only torch exists")
    t.set_defaults(func=cmd_train)

    e = sub.add_parser(
        "evaluate", help="play episodes with a trained checkpoint",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        description="Load CHECKPOINT (a checkpoint_NNNNNN directory written by 'runnel train' or\n"
                    "Algorithm.save()) in this process and play whole episodes with its policy.",
        epilog="example:\n"
               "  runnel evaluate ~/runnel_results/PPO_CartPole-v1_2025-01-01_12-00-00/checkpoint_000012 --episodes 10")
    e.add_argument("checkpoint", metavar="CHECKPOINT", help="checkpoint directory")
    e.add_argument("--episodes", type=_pos_int, default=10, metavar="N", help="episodes to play (default 10)")
    e.add_argument("--render", action="store_true", help="show the env (render_mode='human'; needs a display)")
    e.add_argument("--explore", action="store_true", help="sample actions instead of taking the most likely one")
    e.add_argument("--json", action="store_true", help="print one JSON object instead of text")
    e.add_argument("--seed", type=int, metavar="N", help="seed the episodes (default: the checkpoint's seed)")
    e.add_argument("--algo", "--run", dest="algo", metavar="ALGO",
                   help="accepted for RLlib compatibility: must match the checkpoint's algorithm")
    e.add_argument("--env", metavar="ENV", help="evaluate on this env instead of the checkpoint's (same spaces)")
    e.set_defaults(func=cmd_evaluate)
    return parser


def _nonneg_int(text: str) -> int:
    try:
        v = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer >= 0, got {text!r}") from None
    if v < 0:
        raise argparse.ArgumentTypeError(f"expected an integer >= 0, got {v}")
    return v


def _pos_int(text: str) -> int:
    v = _nonneg_int(text)
    if v < 1:
        raise argparse.ArgumentTypeError(f"expected an integer >= 1, got {v}")
    return v


# --- entry point -----------------------------------------------------------------------------------
def main(argv: Sequence[str] | None = None) -> int:
    """``runnel`` console script; returns the exit status."""
    from pipeline.checkpoint import CheckpointError
    from pipeline.config import ConfigError

    debug = bool(os.environ.get("RUNNEL_DEBUG"))
    try:
        parser = build_parser()
        args = parser.parse_args(list(sys.argv[1:] if argv is None else argv))
        if args.command is None:
            parser.print_help(sys.stderr)
            return EXIT_USAGE
        return args.func(args)
    except SystemExit as exc:  # --help
        return exc.code if isinstance(exc.code, int) else (0 if exc.code is None else EXIT_USAGE)
    except CLIError as err:
        _error(str(err), debug)
        return err.code
    except ConfigError as err:
        _error(_one_line_config_error(str(err)), debug)
        return EXIT_USAGE
    except CheckpointError as err:
        _error(str(err), debug)
        return EXIT_FAILURE
    except KeyboardInterrupt:
        print("\nrunnel: interrupted", file=sys.stderr, flush=True)
        return EXIT_INTERRUPTED


def _error(message: str, debug: bool = False) -> None:
    if debug and sys.exc_info()[0] is not None:
        traceback.print_exc()
    print(f"runnel: error: {message}", file=sys.stderr, flush=True)


def _warn(message: str) -> None:
    print(f"runnel: warning: {message}", file=sys.stderr, flush=True)


def _one_line_config_error(message: str) -> str:
    head, *problems = message.split("\n  - ")
    if not problems:
        return " ".join(message.split())
    if len(problems) == 1:
        return f"{head.rstrip(':')}: {problems[0]}"
    return f"{head.rstrip(':')} ({len(problems)} problems): " + " ".join(
        f"({i}) {p}" for i, p in enumerate(problems, 1))




# --- parsing inputs --------------------------------------------------------------------------------














# --- train -----------------------------------------------------------------------------------------
def _env_label(env: Any) -> str:
    if isinstance(env, str):
        return env
    return getattr(env, "__name__", type(env).__name__)


def _path_safe(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9._-]+", "_", text).strip("_.") or "env"


def _run_dir_name(algo_name: str, env: Any) -> str:
    return f"{algo_name}_{_path_safe(_env_label(env))}_{datetime.now():%Y-%m-%d_%H-%M-%S}"


def _make_run_dir(path: str) -> str:
    """Create ``path`` (or ``path_2``, ``path_3``... if taken) and return the one created."""
    os.makedirs(os.path.dirname(path), exist_ok=True)
    candidate, n = path, 1
    while True:
        try:
            os.mkdir(candidate)
            return candidate
        except FileExistsError:
            n += 1
            candidate = f"{path}_{n}"


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

    from pipeline.algorithm import get_algorithm
    from pipeline.config import ConfigError

    spec = train_spec(args)
    config_cls, algo_cls = get_algorithm(spec.algo)
    config = config_cls()
    config.update_from_dict(spec.config)
    if spec.env is not None:
        config.environment(spec.env)
    if spec.num_env_runners is not None:
        config.env_runners(num_env_runners=spec.num_env_runners)
    if spec.seed is not None:
        config.debugging(seed=spec.seed)
    _validate(config)  # ConfigError -> exit 2, before anything is started or written

    algo_name = algo_cls.__name__
    output_dir = os.path.abspath(os.path.expanduser(spec.output_dir))
    run_dir = os.path.join(output_dir, _run_dir_name(algo_name, config.env))
    ray_was_up = ray.is_initialized()
    algo = None
    try:
        try:
            algo = config.build(logdir=run_dir)
        except ConfigError:
            raise
        except Exception as err:  # noqa: BLE001 - Ray, actors, the env itself
            raise CLIError(f"building {algo_name} on {_env_label(config.env)} failed: {describe_exc(err)}",
                           EXIT_FAILURE) from err
        run_dir = _make_run_dir(run_dir)
        algo.logdir = run_dir
        return _train_loop(algo, spec, run_dir, algo_name)
    finally:
        if algo is not None:
            try:
                algo.stop()
            except Exception as err:  # noqa: BLE001 - shutting down; report, do not mask the result
                _warn(f"stopping the algorithm's actors failed: {describe_exc(err)}")
        if not ray_was_up and ray.is_initialized():
            ray.shutdown()


def _train_loop(algo: Any, spec: TrainSpec, run_dir: str, algo_name: str) -> int:
    from pipeline.results import ResultLogger

    env_label = _env_label(algo.config.env)
    try:
        logger = ResultLogger(run_dir)
        logger.write_params(algo.config.to_dict())
    except BaseException:
        shutil.rmtree(run_dir, ignore_errors=True)
        raise
    stop_text = ", ".join(f"{k} >= {v:g}" for k, v in spec.stop.items()) or "none (runs until Ctrl-C)"
    print(f"runnel: training {algo_name} on {env_label}; results in {run_dir}", flush=True)
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
                ret = result.get("env_runners", {}).get("episode_return_mean")
                if isinstance(ret, (int, float)) and math.isfinite(ret) and (best is None or ret > best[0]):
                    best = (float(ret), result.get("training_iteration", num_results))
                _print_progress(result, time.monotonic() - t0)
                if num_results == 1:
                    for w in check_stop_keys(result, spec.stop):
                        _warn(w)
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


def _print_progress(result: dict, elapsed: float) -> None:
    env_runners = result.get("env_runners", {})
    steps = result.get("num_env_steps_sampled_lifetime", env_runners.get("num_env_steps_sampled_lifetime"))
    sps = result.get("num_env_steps_sampled_per_s")
    if sps is None and result.get("time_this_iter_s"):
        sps = env_runners.get("num_env_steps_sampled", 0) / result["time_this_iter_s"]
    print(f"iter {result.get('training_iteration', '?'):>4} | env steps {_fmt_num(steps, ',d'):>10} | "
          f"return {_fmt_num(env_runners.get('episode_return_mean')):>9} | {_fmt_num(sps, ',.0f'):>7} steps/s | "
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
        ret = result.get("env_runners", {}).get("episode_return_mean")
        best_text = f" (best {best[0]:.2f} at iteration {best[1]})" if best else ""
        print(f"  env steps sampled: {_fmt_num(steps, ',d')}   episode_return_mean: {_fmt_num(ret)}{best_text}")
    print(f"  results:    {run_dir}   (tensorboard --logdir {shlex.quote(run_dir)})")
    if checkpoint:
        print(f"  checkpoint: {checkpoint}")
        print(f"\nEvaluate it with:\n  runnel evaluate {shlex.quote(checkpoint)} --episodes 10")
    else:
        print("  no checkpoint saved (--no-checkpoint-at-end)")
    sys.stdout.flush()


# --- evaluate --------------------------------------------------------------------------------------
def _check_render(algo: Any, env_label: str) -> None:
    """Fail with a clear message where render_mode='human' cannot work."""
    from actors.vector_env import EnvContext

    if sys.platform.startswith("linux") and not (os.environ.get("DISPLAY") or os.environ.get("WAYLAND_DISPLAY")):
        raise CLIError("--render needs a display, and there is none (DISPLAY and WAYLAND_DISPLAY are unset); "
                       "run it on a desktop session or with X forwarding, or evaluate without --render", EXIT_FAILURE)
    env_config = dict(algo.config.env_config)
    env_config["render_mode"] = "human"
    try:
        env = algo.runner_settings.env_creator(EnvContext(env_config))
    except Exception as err:  # noqa: BLE001
        raise CLIError(f"cannot render {env_label}: creating it with render_mode='human' failed: "
                       f"{describe_exc(err)}", EXIT_FAILURE) from None
    try:
        modes = list((getattr(env, "metadata", None) or {}).get("render_modes", []))
        mode = getattr(env, "render_mode", None)
    finally:
        env.close()
    if mode != "human":
        raise CLIError(f"{env_label} does not support render_mode='human' (its render modes: {modes or 'none'}); "
                       f"evaluate without --render", EXIT_FAILURE)


def cmd_evaluate(args: argparse.Namespace) -> int:
    import ray

    from pipeline.algorithm import Algorithm, get_algorithm
    from pipeline.checkpoint import read_manifest
    from pipeline.results import to_json_safe

    path = os.path.abspath(os.path.expanduser(args.checkpoint))
    manifest = read_manifest(path)  # CheckpointError (missing, not a checkpoint, other format) -> exit 1
    if args.algo is not None:
        _, wanted = get_algorithm(args.algo)
        if wanted.__name__ != manifest["algorithm"]:
            raise CLIError(f"--algo {args.algo} does not match the checkpoint, which is of {manifest['algorithm']}")
    overrides: dict[str, Any] = {"num_env_runners": 0, "num_learners": 0, "num_gpus_per_learner": 0,
                                 "num_envs_per_env_runner": 1}
    if args.env is not None:
        overrides["env"] = args.env
    if args.seed is not None:
        overrides["seed"] = args.seed
    ray_was_up = ray.is_initialized()
    algo = None
    try:
        from pipeline.checkpoint import CheckpointError
        from pipeline.config import ConfigError

        try:
            algo = Algorithm.from_checkpoint(path, **overrides)
        except (CheckpointError, ConfigError, CLIError, KeyboardInterrupt):
            raise
        except Exception as err:  # noqa: BLE001
            raise CLIError(f"loading checkpoint {path!r} failed: {describe_exc(err)}", EXIT_FAILURE) from err
        env_label = _env_label(algo.config.env)
        if args.render:
            _check_render(algo, env_label)
        try:
            out = algo.evaluate_episodes(args.episodes, explore=args.explore, render=args.render)
        except KeyboardInterrupt:
            raise
        except Exception as err:  # noqa: BLE001
            raise CLIError(f"evaluating on {env_label} failed: {describe_exc(err)}", EXIT_FAILURE) from err
    finally:
        if algo is not None:
            algo.stop()
        if not ray_was_up and ray.is_initialized():
            ray.shutdown()

    returns, lengths = out["episode_returns"], out["episode_lengths"]
    if args.json:
        print(json.dumps(to_json_safe({
            "checkpoint": path, "algorithm": manifest["algorithm"], "env": env_label, "episodes": len(returns),
            "explore": args.explore, "episode_returns": returns, "episode_lengths": lengths,
            "episode_return_mean": out["episode_return_mean"], "episode_len_mean": out["episode_len_mean"],
        })), flush=True)
        return EXIT_OK
    print(f"Evaluating {manifest['algorithm']} checkpoint {path} on {env_label} "
          f"({'sampled' if args.explore else 'greedy'} actions)")
    for i, (ret, length) in enumerate(zip(returns, lengths), 1):
        print(f"  episode {i:>3}: return {ret:10.2f}   length {length}")
    print(f"mean return over {len(returns)} episode{'s' if len(returns) != 1 else ''}: "
          f"{out['episode_return_mean']:.2f} (min {min(returns):.2f}, max {max(returns):.2f}; "
          f"mean length {out['episode_len_mean']:.1f})", flush=True)
    return EXIT_OK


if __name__ == "__main__":
    sys.exit(main())
