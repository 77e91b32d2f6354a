"""runnel's command line, shaped like RLlib's ``rllib train`` / ``rllib evaluate``.

::

    runnel train --algo PPO --env CartPole-v1 --stop '{"env_runners/episode_return_mean": 450}'
    runnel train file tuned/cartpole-ppo.yaml [flags that override the file]
    runnel evaluate ~/runnel_results/PPO_CartPole-v1_2025-01-01_12-00-00/checkpoint_000012 --episodes 10
    runnel keys server sim-1 --dir keys/     (CURVE key pairs for a policy server and its clients)
    runnel record CHECKPOINT --episodes 50 --output expert/     (record a trained policy)
    runnel train --algo BC --input expert/ --env CartPole-v1     (learn from it; the env evaluates)
    runnel inspect expert/                   (episodes, steps, spaces, damaged records)
    runnel plot ~/runnel_results/PPO_CartPole-v1_2025-01-01_12-00-00     (a PNG learning curve of a run)

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
import os
import sys
import traceback
from typing import Sequence

from pipeline.cli.evaluate import cmd_evaluate
from pipeline.cli.offline import add_parsers as add_offline_parsers
from pipeline.cli.plot import add_parser as add_plot_parser
from pipeline.cli.train import cmd_train
from pipeline.cli.train_spec import DEFAULT_OUTPUT_DIR, DEFAULT_STOP, EXIT_FAILURE, EXIT_INTERRUPTED, EXIT_USAGE, CLIError


# --- parser ----------------------------------------------------------------------------------------
class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # one line instead of usage + message, and no sys.exit
        raise CLIError(f"{message} (see '{self.prog} --help')", EXIT_USAGE)


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog="runnel", description="Train and evaluate reinforcement-learning agents with runnel.",
        epilog="Exit status: 0 done, 1 runtime failure, 2 usage/config error, 130 interrupted. "
               "RUNNEL_DEBUG=1 shows tracebacks.")
    sub = parser.add_subparsers(dest="command", metavar="{train,evaluate,record,inspect,import,plot,keys}")

    t = sub.add_parser(
        "train", help="train an algorithm on an environment",
        usage="runnel train --algo ALGO --env ENV [options]\n       runnel train file FILE.yaml [options]",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        description="Train ALGO on ENV until a stop criterion is met, logging results and checkpoints to\n"
                    "<output-dir>/<ALGO>_<env>_<date>_<time>/ (params.json, result.json, progress.csv,\n"
                    "TensorBoard events, checkpoint_NNNNNN/). 'train file X.yaml' reads algo, env, stop,\n"
                    "config, checkpoint_freq... from a tuned-example file; flags given beside it override it.\n"
                    "Ctrl-C or SIGTERM stops after the current iteration and saves (twice: at once, still saving).\n"
                    "--resume RUN_DIR continues a run from its latest checkpoint.",
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
    t.add_argument("--input", metavar="DIR",
                   help="train from a recording (a directory, shard glob or file) instead of an env; --env, "
                        "if given, serves evaluation only (e.g. --algo BC --input expert/ --env CartPole-v1)")
    t.add_argument("--framework", metavar="torch", help="accepted for RLlib compatibility; only torch exists")
    t.add_argument("--resume", metavar="RUN_DIR",
                   help="continue a run from its latest checkpoint, in the same directory (results appended, "
                        "counters continuous); --stop, --checkpoint-freq, --keep-checkpoints may change")
    t.add_argument("--keep-checkpoints", type=_pos_int, metavar="N",
                   help="keep only N checkpoints: the best by --checkpoint-score, else the latest (default: all)")
    t.add_argument("--checkpoint-score", metavar="KEY",
                   help="result key that ranks checkpoints for --keep-checkpoints (higher is better), "
                        "e.g. env_runners/episode_return_mean")
    t.add_argument("--num-samples", type=_pos_int, metavar="N",
                   help="run N trials through Ray Tune (also when the config holds grid_search/choice spaces)")
    t.set_defaults(func=cmd_train)

    e = sub.add_parser(
        "evaluate", help="play episodes with a trained checkpoint",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        description="Load CHECKPOINT (a checkpoint_NNNNNN directory written by 'runnel train' or\n"
                    "Algorithm.save()) and play whole episodes with its policy, with the same evaluators\n"
                    "as evaluation during training (in this process, or --num-env-runners actors).",
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
    e.add_argument("--num-env-runners", type=int, default=0, metavar="N",
                   help="evaluator actors playing the episodes in parallel (default 0: in this process)")
    e.set_defaults(func=cmd_evaluate)

    add_offline_parsers(sub, _pos_int)
    add_plot_parser(sub)

    k = sub.add_parser(
        "keys", help="make CURVE key pairs for policy servers and their clients",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        description="Write NAME.key (the public key: give it to the other side) and NAME.key_secret (keep it,\n"
                    "mode 0600) for each NAME into --dir. The server is configured with its .key_secret and\n"
                    "the clients' .key files (allowed_client_keys); each client with the server's .key and\n"
                    "its own .key_secret.",
        epilog="example:\n  runnel keys server sim-1 sim-2 --dir keys/")
    k.add_argument("names", nargs="+", metavar="NAME", help="one key pair per name (e.g. server, client-1)")
    k.add_argument("--dir", default=".", help="where to write the files (default: the current directory)")
    k.add_argument("--force", action="store_true", help="overwrite existing key files")
    k.set_defaults(func=cmd_keys)
    return parser


def cmd_keys(args: argparse.Namespace) -> int:
    from actors.external.security import make_keys

    for name in args.names:
        if not name or "/" in name or name.startswith("."):
            raise CLIError(f"key name {name!r} must be a plain file name (letters, digits, '-', '_')", EXIT_USAGE)
        existing = [p for p in (f"{name}.key", f"{name}.key_secret") if os.path.exists(os.path.join(args.dir, p))]
        if existing and not args.force:
            raise CLIError(f"{os.path.join(args.dir, existing[0])} exists; pick another name or pass --force", EXIT_USAGE)
    for name in args.names:
        public, secret = make_keys(args.dir, name)
        print(f"{name}: public {public}  secret {secret}")
    return 0


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
    from pipeline.checkpoints.errors import CheckpointError
    from pipeline.config.checks import ConfigError

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


def _one_line_config_error(message: str) -> str:
    head, *problems = message.split("\n  - ")
    if not problems:
        return " ".join(message.split())
    if len(problems) == 1:
        return f"{head.rstrip(':')}: {problems[0]}"
    return f"{head.rstrip(':')} ({len(problems)} problems): " + " ".join(
        f"({i}) {p}" for i, p in enumerate(problems, 1))


if __name__ == "__main__":
    sys.exit(main())
