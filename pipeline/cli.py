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
import dataclasses
import difflib
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

EXIT_OK, EXIT_FAILURE, EXIT_USAGE, EXIT_INTERRUPTED = 0, 1, 2, 130
DEFAULT_STOP: dict[str, float] = {"training_iteration": 100}
DEFAULT_OUTPUT_DIR = "~/runnel_results"
FILE_KEYS = ("algo", "run", "env", "stop", "config", "checkpoint_freq", "checkpoint_at_end", "output_dir",
             "framework")
# RLlib's old result names -> runnel's (hints in the "stop key not in results" warning).
_OLD_KEYS = {
    "episode_reward_mean": "env_runners/episode_return_mean",
    "episode_reward_max": "env_runners/episode_return_max",
    "episode_reward_min": "env_runners/episode_return_min",
    "episode_len_mean": "env_runners/episode_len_mean",
    "timesteps_total": "num_env_steps_sampled_lifetime",
    "episodes_total": "num_episodes_lifetime",
    "evaluation/episode_reward_mean": "evaluation/env_runners/episode_return_mean",
    "env_runners/episode_reward_mean": "env_runners/episode_return_mean",
}
_FLOAT_RE = re.compile(r"^[-+]?(\d+\.?\d*|\.\d+)([eE][-+]?\d+)?$")


class CLIError(Exception):
    """A problem to report as one line, with the exit status to return."""

    def __init__(self, message: str, code: int = EXIT_USAGE) -> None:
        super().__init__(message)
        self.code = code


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


def _describe_exc(err: BaseException) -> str:
    text = str(err).strip().splitlines()
    return f"{type(err).__name__}: {text[0]}" if text else type(err).__name__


# --- parsing inputs --------------------------------------------------------------------------------
def parse_json_arg(text: str, flag: str) -> Any:
    """JSON from a flag, with the error position marked (``>>>``) in a one-line message."""
    try:
        return json.loads(text)
    except json.JSONDecodeError as err:
        lo, hi = max(0, err.pos - 40), min(len(text), err.pos + 20)
        snippet = ("..." if lo else "") + text[lo:err.pos] + ">>>" + text[err.pos:hi] + ("..." if hi < len(text) else "")
        snippet = snippet.replace("\n", "\\n")
        raise CLIError(f"{flag} is not valid JSON: {err.msg} at line {err.lineno} column {err.colno} "
                       f"(marked >>>): {snippet}", EXIT_USAGE) from None


def flatten_stop(stop: Any, source: str) -> dict[str, float]:
    """``{"a": {"b": 1}}`` or ``{"a/b": 1}`` -> ``{"a/b": 1.0}``; thresholds must be numbers."""
    if not isinstance(stop, dict):
        raise CLIError(f"{source} must be a JSON object of result keys to thresholds, like "
                       f"{{\"env_runners/episode_return_mean\": 450}}; got {type(stop).__name__} {stop!r}")
    out: dict[str, float] = {}
    for key, value in stop.items():
        if isinstance(value, dict):
            out.update({f"{key}/{k}": v for k, v in flatten_stop(value, source).items()})
            continue
        if isinstance(value, str) and _FLOAT_RE.match(value.strip()):
            value = float(value)
        if isinstance(value, bool) or not isinstance(value, (int, float)) or math.isnan(value):
            raise CLIError(f"{source}: the threshold of {key!r} must be a number, got {value!r}")
        out[str(key)] = value
    return out


def _numbers_from_strings(value: Any) -> Any:
    """YAML 1.1 reads ``1e-5`` as a string; read such strings as floats (inside config/stop only)."""
    if isinstance(value, dict):
        return {k: _numbers_from_strings(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_numbers_from_strings(v) for v in value]
    if isinstance(value, str) and _FLOAT_RE.match(value.strip()) and any(c in value for c in "eE"):
        return float(value)
    return value


def load_train_file(path: str) -> dict[str, Any]:
    """Read a tuned-example file (YAML or JSON) -> its validated top-level mapping."""
    import yaml

    full = os.path.abspath(os.path.expanduser(path))
    if not os.path.isfile(full):
        raise CLIError(f"no such file: {path!r}" + (" (it is a directory)" if os.path.isdir(full) else ""))
    try:
        with open(full, encoding="utf-8") as f:
            text = f.read()
    except (OSError, UnicodeDecodeError) as err:
        raise CLIError(f"cannot read {path!r}: {err}") from None
    if full.endswith(".json"):
        data = parse_json_arg(text, path)
    else:
        try:
            data = yaml.safe_load(text)
        except yaml.YAMLError as err:
            mark = getattr(err, "problem_mark", None)
            where = f" at line {mark.line + 1} column {mark.column + 1}" if mark is not None else ""
            problem = getattr(err, "problem", None) or str(err).splitlines()[0]
            raise CLIError(f"{path!r} is not valid YAML: {problem}{where}") from None
    if not isinstance(data, dict):
        raise CLIError(f"{path!r} must hold a mapping with keys {list(FILE_KEYS)}, got {type(data).__name__}")
    # RLlib's experiment layout: {experiment-name: {run: PPO, env: ..., stop: ..., config: ...}}
    if len(data) == 1:
        (name, inner), = data.items()
        if name not in FILE_KEYS and isinstance(inner, dict) and ("run" in inner or "algo" in inner):
            data = inner
    unknown = [k for k in data if k not in FILE_KEYS]
    if unknown:
        hints = []
        for k in unknown:
            close = difflib.get_close_matches(str(k), FILE_KEYS, n=1)
            hints.append(f"{k!r}" + (f" (did you mean {close[0]!r}?)" if close else ""))
        raise CLIError(f"{path!r}: unknown top-level key{'s' if len(unknown) > 1 else ''} {', '.join(hints)}; "
                       f"valid keys: {', '.join(FILE_KEYS)} (algorithm settings go under 'config:')")
    if "algo" in data and "run" in data:
        raise CLIError(f"{path!r}: give 'algo' or 'run' (its old RLlib name), not both")
    if "run" in data:
        data["algo"] = data.pop("run")
    for key, kind in (("algo", str), ("env", str), ("output_dir", str), ("framework", str), ("config", dict),
                      ("stop", dict), ("checkpoint_at_end", bool)):
        if key in data and data[key] is not None and not isinstance(data[key], kind):
            raise CLIError(f"{path!r}: {key!r} must be a {'mapping' if kind is dict else kind.__name__}, "
                           f"got {data[key]!r}")
    freq = data.get("checkpoint_freq")
    if freq is not None and (isinstance(freq, bool) or not isinstance(freq, int) or freq < 0):
        raise CLIError(f"{path!r}: 'checkpoint_freq' must be an integer >= 0, got {freq!r}")
    for key in ("config", "stop"):
        if data.get(key) is not None:
            data[key] = _numbers_from_strings(data[key])
    return data


def _check_framework(value: Any, source: str) -> None:
    if value is not None and str(value).lower() != "torch":
        raise CLIError(f"{source} {value!r} is not supported: runnel runs on torch only (use 'torch' or leave it out)")


@dataclasses.dataclass
class TrainSpec:
    algo: str
    env: str | None
    stop: dict[str, float]
    config: dict[str, Any]
    checkpoint_freq: int
    checkpoint_at_end: bool
    output_dir: str
    num_env_runners: int | None
    seed: int | None


def train_spec(args: argparse.Namespace) -> TrainSpec:
    """Merge a tuned-example file (if any) with the flags; flags win."""
    file_path = args.file
    if args.target:
        if args.target[0] != "file":
            raise CLIError(f"unexpected argument {args.target[0]!r}; train from a file with "
                           f"'runnel train file {args.target[0]}', or use --algo/--env")
        if len(args.target) != 2:
            raise CLIError("'runnel train file' needs exactly one FILE (a .yaml or .json tuned example)"
                           if len(args.target) == 1 else f"unexpected arguments {args.target[2:]}")
        if file_path is not None:
            raise CLIError("give the file once: 'file FILE' or -f FILE")
        file_path = args.target[1]
    data = load_train_file(file_path) if file_path else {}
    src = repr(file_path)

    config: dict[str, Any] = dict(data.get("config") or {})
    if args.config is not None:
        cli_config = parse_json_arg(args.config, "--config")
        if not isinstance(cli_config, dict):
            raise CLIError(f"--config must be a JSON object of config settings, like {{\"lr\": 0.0005}}; "
                           f"got {type(cli_config).__name__} {cli_config!r}")
        config.update(cli_config)
    _check_framework(data.get("framework"), f"{src}: framework")
    _check_framework(config.pop("framework", None), "config framework")
    _check_framework(args.framework, "--framework")

    algo = args.algo or data.get("algo")
    if not algo:
        raise CLIError("--algo is required (e.g. --algo PPO), or train from a file: runnel train file X.yaml")
    env = args.env or data.get("env")
    if env is None and config.get("env") is None:
        raise CLIError("--env is required (a gymnasium id such as CartPole-v1, a registered name, or "
                       "'package.module:Class')")
    if args.stop is not None:
        stop = flatten_stop(parse_json_arg(args.stop, "--stop"), "--stop")
    elif data.get("stop") is not None:
        stop = flatten_stop(data["stop"], f"{src}: stop")
    else:
        stop = dict(DEFAULT_STOP)
    return TrainSpec(
        algo=str(algo), env=env, stop=stop, config=config,
        checkpoint_freq=args.checkpoint_freq if args.checkpoint_freq is not None else int(data.get("checkpoint_freq") or 0),
        checkpoint_at_end=(args.checkpoint_at_end if args.checkpoint_at_end is not None
                           else bool(data.get("checkpoint_at_end", True))),
        output_dir=args.output_dir or data.get("output_dir") or DEFAULT_OUTPUT_DIR,
        num_env_runners=args.num_env_runners, seed=args.seed,
    )


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


def _stop_reason(result: dict, stop: dict[str, float]) -> str | None:
    from pipeline.algorithm import lookup

    for key, threshold in stop.items():
        value = lookup(result, key)
        if isinstance(value, (int, float)) and not isinstance(value, bool) and not math.isnan(value) \
                and value >= threshold:
            return f"{key} = {value:g} >= {threshold:g}"
    return None


def _suggest_keys(key: str, flat_keys: list[str]) -> list[str]:
    out: list[str] = []
    if key in _OLD_KEYS and _OLD_KEYS[key] in flat_keys:
        out.append(_OLD_KEYS[key])
    out += difflib.get_close_matches(key, flat_keys, n=3, cutoff=0.6)
    leaf = key.rsplit("/", 1)[-1].replace("reward", "return")
    leaves = {k: k.rsplit("/", 1)[-1] for k in flat_keys}
    out += [k for k in flat_keys if difflib.SequenceMatcher(None, leaf, leaves[k]).ratio() >= 0.8]
    seen: list[str] = []
    for k in out:
        if k not in seen and k != key:
            seen.append(k)
    return seen[:4]


def check_stop_keys(result: dict, stop: dict[str, float]) -> list[str]:
    """Warnings for stop keys that the (first) result lacks or that name a section, with close matches."""
    from pipeline.algorithm import lookup
    from pipeline.results import flatten_result

    flat_keys = list(flatten_result(result))
    warnings_ = []
    for key in stop:
        value = lookup(result, key)
        if isinstance(value, dict):
            inner = [k for k in flat_keys if k.startswith(key + "/")][:5]
            warnings_.append(f"stop key {key!r} names a group of results, not a value; use one of {inner}")
        elif value is None:
            close = _suggest_keys(key, flat_keys)
            hint = (f"did you mean {' or '.join(map(repr, close))}?" if close
                    else "see the columns of progress.csv for the keys there are")
            warnings_.append(f"stop key {key!r} is not in the results of iteration 1 (it can only stop training "
                             f"if it appears later, e.g. an evaluation result); {hint}")
    return warnings_


def _validate(config: Any) -> None:
    from pipeline.config import ConfigError

    try:
        config.validate()
    except ConfigError:
        raise
    except (TypeError, ValueError) as err:  # a value of the wrong type that validate() trips over
        raise CLIError(f"invalid {config.algo_name} config: {_describe_exc(err)}", EXIT_USAGE) from None


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
            raise CLIError(f"building {algo_name} on {_env_label(config.env)} failed: {_describe_exc(err)}",
                           EXIT_FAILURE) from err
        run_dir = _make_run_dir(run_dir)
        algo.logdir = run_dir
        return _train_loop(algo, spec, run_dir, algo_name)
    finally:
        if algo is not None:
            try:
                algo.stop()
            except Exception as err:  # noqa: BLE001 - shutting down; report, do not mask the result
                _warn(f"stopping the algorithm's actors failed: {_describe_exc(err)}")
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
                reason = _stop_reason(result, spec.stop)
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
                raise CLIError(f"training failed before the first iteration finished: {_describe_exc(failure)}",
                               EXIT_FAILURE) from failure
            print("runnel: interrupted before the first iteration finished; nothing was saved", file=sys.stderr,
                  flush=True)
            return EXIT_INTERRUPTED

        if outcome == "failed":
            logger.close()
            with open(os.path.join(run_dir, "error.txt"), "w", encoding="utf-8") as f:
                f.write("".join(traceback.format_exception(type(failure), failure, failure.__traceback__)))
            last = f"; last checkpoint: {checkpoint}" if checkpoint else ""
            raise CLIError(f"training failed in iteration {algo.iteration + 1}: {_describe_exc(failure)} "
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
                       f"{_describe_exc(err)}", EXIT_FAILURE) from None
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
            raise CLIError(f"loading checkpoint {path!r} failed: {_describe_exc(err)}", EXIT_FAILURE) from err
        env_label = _env_label(algo.config.env)
        if args.render:
            _check_render(algo, env_label)
        try:
            out = algo.evaluate_episodes(args.episodes, explore=args.explore, render=args.render)
        except KeyboardInterrupt:
            raise
        except Exception as err:  # noqa: BLE001
            raise CLIError(f"evaluating on {env_label} failed: {_describe_exc(err)}", EXIT_FAILURE) from err
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
