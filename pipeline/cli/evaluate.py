"""``runnel evaluate``: load a checkpoint in this process and play whole episodes with its policy."""
from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Any

from pipeline.run_dirs import env_label
from pipeline.cli.train_spec import EXIT_FAILURE, EXIT_OK, CLIError, describe_exc


def _check_render(algo: Any, label: str) -> None:
    """Fail with a clear message where render_mode='human' cannot work."""
    from actors.env import EnvContext

    if sys.platform.startswith("linux") and not (os.environ.get("DISPLAY") or os.environ.get("WAYLAND_DISPLAY")):
        raise CLIError("--render needs a display, and there is none (DISPLAY and WAYLAND_DISPLAY are unset); "
                       "run it on a desktop session or with X forwarding, or evaluate without --render", EXIT_FAILURE)
    env_config = dict(algo.config.env_config)
    env_config["render_mode"] = "human"
    try:
        env = algo.env_creator(EnvContext(env_config))
    except Exception as err:  # noqa: BLE001
        raise CLIError(f"cannot render {label}: creating it with render_mode='human' failed: "
                       f"{describe_exc(err)}", EXIT_FAILURE) from None
    try:
        modes = list((getattr(env, "metadata", None) or {}).get("render_modes", []))
        mode = getattr(env, "render_mode", None)
    finally:
        env.close()
    if mode != "human":
        raise CLIError(f"{label} does not support render_mode='human' (its render modes: {modes or 'none'}); "
                       f"evaluate without --render", EXIT_FAILURE)


def _evaluate_with_evaluators(algo: Any) -> dict[str, Any]:
    result = algo.evaluate()["evaluation"]
    returns, lengths = result["hist_stats"]["episode_return"], result["hist_stats"]["episode_lengths"]
    if not returns:
        raise RuntimeError(f"no episode finished: {result['num_failed_env_runners']} evaluator(s) failed "
                           f"(see the warnings above)")
    return {"episode_returns": returns, "episode_lengths": lengths,
            "episode_return_mean": sum(returns) / len(returns), "episode_len_mean": sum(lengths) / len(lengths)}


def cmd_evaluate(args: argparse.Namespace) -> int:
    import ray

    from pipeline.algorithm import Algorithm
    from pipeline.registry import get_algorithm
    from pipeline.checkpoints.directory import read_manifest
    from pipeline.results import to_json_safe

    path = os.path.abspath(os.path.expanduser(args.checkpoint))
    manifest = read_manifest(path)  # CheckpointError (missing, not a checkpoint, other format) -> exit 1
    if args.algo is not None:
        _, wanted = get_algorithm(args.algo)
        if wanted.__name__ != manifest["algorithm"]:
            raise CLIError(f"--algo {args.algo} does not match the checkpoint, which is of {manifest['algorithm']}")
    if args.num_env_runners < 0:
        raise CLIError(f"--num-env-runners must be >= 0, got {args.num_env_runners}")
    overrides: dict[str, Any] = {"num_env_runners": 0, "num_learners": 0, "num_gpus_per_learner": 0,
                                 "num_envs_per_env_runner": 1, "evaluation_interval": None,
                                 "evaluation_num_env_runners": args.num_env_runners,
                                 "evaluation_duration": args.episodes, "evaluation_duration_unit": "episodes",
                                 "evaluation_parallel_to_training": False, "evaluation_config": {"explore": args.explore},
                                 "env_task_fn": None, "custom_evaluation_function": None,
                                 # the Ray of where this command runs (RAY_ADDRESS, else its own), not the training's
                                 "ray_address": None}
    if args.env is not None:
        overrides["env"] = args.env
    if args.seed is not None:
        overrides["seed"] = args.seed
    ray_was_up = ray.is_initialized()
    algo = None
    try:
        from pipeline.checkpoints.errors import CheckpointError
        from pipeline.config.base import ConfigError

        try:
            algo = Algorithm.from_checkpoint(path, **overrides)
        except (CheckpointError, ConfigError, CLIError, KeyboardInterrupt):
            raise
        except Exception as err:  # noqa: BLE001
            raise CLIError(f"loading checkpoint {path!r} failed: {describe_exc(err)}", EXIT_FAILURE) from err
        label = env_label(algo.config.env)
        if args.render:
            _check_render(algo, label)
        try:
            if args.render:  # a window needs the env in this process
                out = algo.evaluate_episodes(args.episodes, explore=args.explore, render=True)
            else:
                out = _evaluate_with_evaluators(algo)
        except KeyboardInterrupt:
            raise
        except Exception as err:  # noqa: BLE001
            raise CLIError(f"evaluating on {label} failed: {describe_exc(err)}", EXIT_FAILURE) from err
    finally:
        if algo is not None:
            algo.stop()
        if not ray_was_up and ray.is_initialized():
            ray.shutdown()

    returns, lengths = out["episode_returns"], out["episode_lengths"]
    if args.json:
        print(json.dumps(to_json_safe({
            "checkpoint": path, "algorithm": manifest["algorithm"], "env": label, "episodes": len(returns),
            "explore": args.explore, "episode_returns": returns, "episode_lengths": lengths,
            "episode_return_mean": out["episode_return_mean"], "episode_len_mean": out["episode_len_mean"],
        })), flush=True)
        return EXIT_OK
    print(f"Evaluating {manifest['algorithm']} checkpoint {path} on {label} "
          f"({'sampled' if args.explore else 'greedy'} actions)")
    for i, (ret, length) in enumerate(zip(returns, lengths), 1):
        print(f"  episode {i:>3}: return {ret:10.2f}   length {length}")
    print(f"mean return over {len(returns)} episode{'s' if len(returns) != 1 else ''}: "
          f"{out['episode_return_mean']:.2f} (min {min(returns):.2f}, max {max(returns):.2f}; "
          f"mean length {out['episode_len_mean']:.1f})", flush=True)
    return EXIT_OK
