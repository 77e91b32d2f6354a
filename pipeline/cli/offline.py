"""``runnel record``, ``runnel inspect`` and ``runnel import minari``: the command line of recorded experience."""
from __future__ import annotations

import argparse
import json
import os
from typing import Any

from pipeline.cli.train_spec import EXIT_FAILURE, EXIT_USAGE, CLIError

EXIT_OK = 0


def cmd_record(args: argparse.Namespace) -> int:
    import ray

    from pipeline.algorithm import Algorithm
    from pipeline.offline.record import record_policy

    path = os.path.abspath(os.path.expanduser(args.checkpoint))
    if not os.path.isdir(path):
        raise CLIError(f"checkpoint {args.checkpoint!r} is not a directory (give a checkpoint_NNNNNN directory)", EXIT_USAGE)
    overrides: dict[str, Any] = {"num_env_runners": 0, "num_learners": 0, "num_gpus_per_learner": 0,
                                 "num_envs_per_env_runner": 1, "evaluation_interval": None,
                                 "evaluation_num_env_runners": 0, "offline_data_config": None}
    if args.env is not None:
        overrides["env"] = args.env
    if args.seed is not None:
        overrides["seed"] = args.seed
    ray_was_up = ray.is_initialized()
    algo = None
    try:
        algo = Algorithm.from_checkpoint(path, **overrides)
        try:
            out = record_policy(algo, args.episodes, args.output, explore=args.explore)
        except (ValueError, OSError) as err:
            raise CLIError(f"recording failed: {err}", EXIT_FAILURE) from err
    finally:
        if algo is not None:
            algo.stop()
        if not ray_was_up and ray.is_initialized():
            ray.shutdown()
    if args.json:
        print(json.dumps(out), flush=True)
    else:
        print(f"recorded {out['episodes']} episodes ({out['steps']} steps, mean return "
              f"{out['episode_return_mean']:.2f}) into {args.output}", flush=True)
    return EXIT_OK


def cmd_inspect(args: argparse.Namespace) -> int:
    from actors.offline.recorder import MULTI_AGENT_FORMAT, read_json_manifest
    from pipeline.offline.record import inspect_recording

    try:
        top = read_json_manifest(os.path.expanduser(args.input)) if isinstance(args.input, str) else {}
        modules = [str(m) for m in top.get("modules", [])] if top.get("format") == MULTI_AGENT_FORMAT else []
        if modules:  # a multi-agent run's recording: one recording per module
            outs = {m: inspect_recording(os.path.join(os.path.expanduser(args.input), m)) for m in modules}
        else:
            outs = {"": inspect_recording(args.input)}
    except (FileNotFoundError, ValueError) as err:
        raise CLIError(str(err), EXIT_USAGE) from err
    if args.json:
        print(json.dumps({"multi_agent": True, "modules": outs} if modules else outs[""]), flush=True)
        return EXIT_OK
    if modules:
        print(f"multi-agent recording {args.input}: modules {modules}, each a recording of its own")
    for module, out in outs.items():
        _print_summary(os.path.join(args.input, module) if module else args.input, out)
    return EXIT_OK


def _print_summary(where: str, out: dict[str, Any]) -> None:
    rets = out.pop("episode_returns")
    print(f"recording {where}: {out['shards']} shards ({out['complete_shards']} closed), "
          f"{out['bytes'] / 1e6:.1f} MB, made by {out['algorithm']} with runnel {out['runnel_version']}")
    print(f"  records {out['records']:,}   chunks {out['chunks']:,}   steps {out['steps']:,}   "
          f"episodes {out['episodes']:,} (+{out['open_episodes']} unfinished)")
    if rets:
        print(f"  episode return mean {out['episode_return_mean']:.2f} (min {min(rets):.2f}, max {max(rets):.2f})")
    print(f"  observation space {json.dumps(out['observation_space'])}")
    print(f"  action space      {json.dumps(out['action_space'])}")
    print(f"  damaged records {out['damaged_records']}   torn tails {out['torn_tails']}")
    for line in out["damage"]:
        print(f"    {line}")


def cmd_import(args: argparse.Namespace) -> int:
    from pipeline.offline.import_minari import MinariImportError, import_minari

    if args.source != "minari":
        raise CLIError(f"cannot import from {args.source!r}: runnel imports 'minari' datasets", EXIT_USAGE)
    try:
        out = import_minari(os.path.expanduser(args.dataset), os.path.expanduser(args.output), infos=args.infos)
    except MinariImportError as err:
        raise CLIError(str(err), EXIT_USAGE) from err
    except (OSError, RuntimeError) as err:
        raise CLIError(f"importing {args.dataset!r} failed: {err}", EXIT_FAILURE) from err
    if args.json:
        print(json.dumps(out), flush=True)
    else:
        notes = [f"{out[k]} {k.replace('_', ' ')}" for k in ("unfinished_episodes", "empty_episodes") if out[k]]
        print(f"imported Minari dataset {out['dataset_id']}: {out['episodes']} episodes, {out['steps']:,} steps "
              f"into {args.output}" + (f" ({', '.join(notes)}: unfinished ones are written as truncated, empty "
                                        f"ones skipped)" if notes else "")
              + f"\n  observation space {out['observation_space']}\n  action space      {out['action_space']}"
              f"\n  train on it:  runnel train --algo BC --input {args.output} --env ENV", flush=True)
    return EXIT_OK


def add_parsers(sub: Any, pos_int: Any) -> None:
    r = sub.add_parser(
        "record", help="record episodes of a trained checkpoint's policy",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        description="Load CHECKPOINT and play --episodes whole episodes with its policy (greedy unless\n"
                    "--explore), recording them into --output as a runnel recording (shard files and\n"
                    "manifest.json) that BC, MARWIL and CQL train from (--input) and that replay can be\n"
                    "prefilled from.",
        epilog="example:\n  runnel record ~/runnel_results/PPO_CartPole-v1_.../checkpoint_000012 --episodes 50 --output expert/")
    r.add_argument("checkpoint", metavar="CHECKPOINT", help="checkpoint directory")
    r.add_argument("--episodes", type=pos_int, default=10, metavar="N", help="episodes to record (default 10)")
    r.add_argument("--output", required=True, metavar="DIR", help="recording directory (created if missing)")
    r.add_argument("--explore", action="store_true", help="sample actions instead of taking the most likely one")
    r.add_argument("--env", metavar="ENV", help="record on this env instead of the checkpoint's (same spaces)")
    r.add_argument("--seed", type=int, metavar="N", help="seed the episodes")
    r.add_argument("--json", action="store_true", help="print one JSON object instead of text")
    r.set_defaults(func=cmd_record)

    i = sub.add_parser("inspect", help="summarize a recording: episodes, steps, spaces, damage",
                       description="Read every record of a recording (a directory, a glob of .rshard files or one "
                                   "file) and report its episodes, steps, returns, spaces and any damaged records "
                                   "or torn tails.")
    i.add_argument("input", metavar="DIR", help="recording directory, shard glob or shard file")
    i.add_argument("--json", action="store_true", help="print one JSON object instead of text")
    i.set_defaults(func=cmd_inspect)

    m = sub.add_parser("import", help="import a dataset of another format as a runnel recording",
                       description="Convert a Minari dataset (its on-disk HDF5 format; needs h5py) into a runnel "
                                   "recording that BC, MARWIL and CQL train from and replay can be prefilled from.",
                       epilog="example:\n  runnel import minari ~/.minari/datasets/D4RL/door/human-v2 door-human/",
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    m.add_argument("source", choices=["minari"], help="the dataset's format")
    m.add_argument("dataset", metavar="DATASET_DIR", help="the dataset directory (holding data/metadata.json)")
    m.add_argument("output", metavar="OUT", help="the recording directory to create (new or empty)")
    m.add_argument("--infos", action="store_true", help="also import each step's info dict (when recorded)")
    m.add_argument("--json", action="store_true", help="print one JSON object instead of text")
    m.set_defaults(func=cmd_import)
