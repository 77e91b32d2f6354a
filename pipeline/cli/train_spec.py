"""What ``runnel train`` should do: tuned-example files, ``--stop``/``--config`` JSON, stop criteria.

Everything here turns user input into a ``TrainSpec`` or a one-line ``CLIError``; running it is
``pipeline.cli.main``'s job.
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
import sys
from typing import Any

EXIT_OK, EXIT_FAILURE, EXIT_USAGE, EXIT_INTERRUPTED = 0, 1, 2, 130
DEFAULT_STOP: dict[str, float] = {"training_iteration": 100}
DEFAULT_OUTPUT_DIR = "~/runnel_results"
FILE_KEYS = ("algo", "run", "env", "stop", "config", "checkpoint_freq", "checkpoint_at_end", "output_dir",
             "framework", "checkpoint_config", "num_samples")
CHECKPOINT_CONFIG_KEYS = ("num_to_keep", "checkpoint_score_attribute", "checkpoint_score_order",
                          "checkpoint_frequency", "checkpoint_at_end")
"""``checkpoint_config:`` in a tuned file (Tune's ``CheckpointConfig`` names)."""
RUN_FILE = "run.json"
"""What a run was asked to do (algo, env, stop, checkpoint settings), kept in its directory for ``--resume``."""


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


def say(text: str = "", err: bool = False) -> None:
    """Print a line; if the reader has gone (``runnel train | tee log`` after Ctrl-C, ``| head``),
    go on silently instead of failing the run on a BrokenPipeError."""
    stream = sys.stderr if err else sys.stdout
    try:
        print(text, file=stream, flush=True)
    except (BrokenPipeError, ValueError):
        try:  # later writes (and the flush at exit) go nowhere instead of raising again
            os.dup2(os.open(os.devnull, os.O_WRONLY), stream.fileno())
        except (OSError, ValueError):
            pass


def runnel_command() -> str:
    """How to run ``runnel`` again from a fresh shell: ``runnel`` when that is this program on PATH,
    else this program's absolute path (e.g. ``.venv/bin/runnel`` of a venv that is not activated)."""
    import shutil

    me = os.path.abspath(sys.argv[0]) if sys.argv and sys.argv[0] else ""
    if os.path.basename(me) != "runnel" or not os.path.isfile(me):
        return "runnel"  # called from Python (tests, notebooks): the command's name
    on_path = shutil.which("runnel")
    if on_path and os.path.realpath(on_path) == os.path.realpath(me):
        return "runnel"
    return shlex.quote(me)


def warn(message: str) -> None:
    say(f"runnel: warning: {message}", err=True)


def describe_exc(err: BaseException) -> str:
    text = str(err).strip().splitlines()
    return f"{type(err).__name__}: {text[0]}" if text else type(err).__name__


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
    input_: str | None = None
    keep_checkpoints: int | None = None
    """Checkpoints kept (None: all); the best by ``checkpoint_score_attribute``, else the latest."""
    checkpoint_score_attribute: str | None = None
    checkpoint_score_order: str = "max"
    num_samples: int = 1
    """Trials (through Ray Tune when > 1 or when the config holds search spaces)."""

    def to_json(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> "TrainSpec":
        names = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in data.items() if k in names})


def checkpoint_settings(data: dict[str, Any], source: str) -> dict[str, Any]:
    """A tuned file's ``checkpoint_config:`` -> TrainSpec fields, checked."""
    cc = data.get("checkpoint_config") or {}
    if not isinstance(cc, dict):
        raise CLIError(f"{source}: 'checkpoint_config' must be a mapping with keys {list(CHECKPOINT_CONFIG_KEYS)}")
    unknown = [k for k in cc if k not in CHECKPOINT_CONFIG_KEYS]
    if unknown:
        raise CLIError(f"{source}: unknown checkpoint_config key(s) {unknown}; valid: {list(CHECKPOINT_CONFIG_KEYS)}")
    out: dict[str, Any] = {}
    if cc.get("num_to_keep") is not None:
        out["keep_checkpoints"] = _positive(cc["num_to_keep"], f"{source}: checkpoint_config.num_to_keep")
    if cc.get("checkpoint_score_attribute") is not None:
        out["checkpoint_score_attribute"] = str(cc["checkpoint_score_attribute"])
    if cc.get("checkpoint_score_order") is not None:
        if cc["checkpoint_score_order"] not in ("max", "min"):
            raise CLIError(f"{source}: checkpoint_config.checkpoint_score_order must be 'max' or 'min', "
                           f"got {cc['checkpoint_score_order']!r}")
        out["checkpoint_score_order"] = cc["checkpoint_score_order"]
    if cc.get("checkpoint_frequency") is not None:
        out["checkpoint_freq"] = _positive(cc["checkpoint_frequency"], f"{source}: checkpoint_config.checkpoint_frequency", 0)
    if cc.get("checkpoint_at_end") is not None:
        out["checkpoint_at_end"] = bool(cc["checkpoint_at_end"])
    return out


def _positive(value: Any, what: str, low: int = 1) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise CLIError(f"{what} must be an integer >= {low}, got {value!r}")
    return value


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
    input_ = getattr(args, "input", None)
    if env is None and config.get("env") is None and input_ is None:
        raise CLIError("--env is required (a gymnasium id such as CartPole-v1, a registered name, or "
                       "'package.module:Class')")
    if args.stop is not None:
        stop = flatten_stop(parse_json_arg(args.stop, "--stop"), "--stop")
    elif data.get("stop") is not None:
        stop = flatten_stop(data["stop"], f"{src}: stop")
    else:
        stop = dict(DEFAULT_STOP)
    stop = map_old_stop_keys(stop)
    ckpt = checkpoint_settings(data, src)
    num_samples = getattr(args, "num_samples", None) or data.get("num_samples") or 1
    _positive(num_samples, "num_samples")
    return TrainSpec(
        algo=str(algo), env=env, stop=stop, config=config,
        checkpoint_freq=(args.checkpoint_freq if args.checkpoint_freq is not None
                         else int(data.get("checkpoint_freq") or ckpt.get("checkpoint_freq") or 0)),
        checkpoint_at_end=(args.checkpoint_at_end if args.checkpoint_at_end is not None
                           else bool(data.get("checkpoint_at_end", ckpt.get("checkpoint_at_end", True)))),
        output_dir=args.output_dir or data.get("output_dir") or DEFAULT_OUTPUT_DIR,
        num_env_runners=args.num_env_runners, seed=args.seed, input_=input_,
        keep_checkpoints=getattr(args, "keep_checkpoints", None) or ckpt.get("keep_checkpoints"),
        checkpoint_score_attribute=(getattr(args, "checkpoint_score", None)
                                    or ckpt.get("checkpoint_score_attribute")),
        checkpoint_score_order=ckpt.get("checkpoint_score_order", "max"),
        num_samples=num_samples,
    )


def map_old_stop_keys(stop: dict[str, float]) -> dict[str, float]:
    """RLlib's old result names (``episode_reward_mean``...) -> runnel's, said once at start: an old
    name would never appear in the results, and the run would go on forever."""
    out = {}
    for key, value in stop.items():
        if key in _OLD_KEYS:
            warn(f"stop key {key!r} is RLlib's old name: stopping on {_OLD_KEYS[key]!r} instead")
            key = _OLD_KEYS[key]
        out[key] = min(value, out[key]) if key in out else value
    return out


def resume_spec(args: argparse.Namespace, run_dir: str) -> TrainSpec:
    """The spec a run was started with (its ``run.json``), with the flags given beside ``--resume``."""
    path = os.path.join(run_dir, RUN_FILE)
    if not os.path.isfile(path):
        raise CLIError(f"--resume {run_dir!r}: no {RUN_FILE} there; give a run directory made by 'runnel train' "
                       f"(it holds params.json, progress.csv and checkpoint_NNNNNN/)")
    try:
        with open(path, encoding="utf-8") as f:
            spec = TrainSpec.from_json(json.load(f))
    except (OSError, ValueError, TypeError) as err:
        raise CLIError(f"--resume {run_dir!r}: cannot read {RUN_FILE}: {err}") from None
    given = [flag for flag, value in (("--algo", args.algo), ("--env", args.env), ("--config", args.config),
                                      ("--input", getattr(args, "input", None)), ("file", args.target or args.file))
             if value]
    if given:
        raise CLIError(f"--resume continues the run as it was set up; {', '.join(given)} cannot change it (the "
                       f"checkpoint holds its config). Start a new run instead, or leave {given[0]} out")
    if args.stop is not None:
        spec.stop = map_old_stop_keys(flatten_stop(parse_json_arg(args.stop, "--stop"), "--stop"))
    for name, value in (("checkpoint_freq", args.checkpoint_freq), ("checkpoint_at_end", args.checkpoint_at_end),
                        ("num_env_runners", args.num_env_runners),
                        ("keep_checkpoints", getattr(args, "keep_checkpoints", None)),
                        ("checkpoint_score_attribute", getattr(args, "checkpoint_score", None))):
        if value is not None:
            setattr(spec, name, value)
    return spec


def stop_reason(result: dict, stop: dict[str, float]) -> str | None:
    from pipeline.algorithm_results import lookup

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
    from pipeline.algorithm_results import lookup
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

