"""``runnel train --num-samples N`` and tuned files with ``grid_search`` spaces: trials through Ray Tune.

Each trial is the algorithm itself (every algorithm is a ``ray.tune.Trainable``); Tune keeps the
trials' results and checkpoints under ``<output-dir>/<ALGO>_<env>_<date>_<time>/``.
"""
from __future__ import annotations

import os
import shlex
from typing import Any

from pipeline.run_dirs import env_label, run_dir_name
from pipeline.cli.train_spec import EXIT_FAILURE, EXIT_OK, TrainSpec, runnel_command, say

SEARCH_KEYS = ("grid_search",)
"""Search spaces a tuned file or ``--config`` can hold as plain data: ``{"grid_search": [values]}``."""
SCORE = "env_runners/episode_return_mean"


def is_search_space(value: Any) -> bool:
    return isinstance(value, dict) and len(value) == 1 and next(iter(value)) in SEARCH_KEYS


def has_search_space(settings: dict[str, Any]) -> bool:
    return any(is_search_space(v) or (isinstance(v, dict) and has_search_space(v)) for v in settings.values())


def first_variant(settings: dict[str, Any]) -> dict[str, Any]:
    """The settings with each search space replaced by its first value (to validate before starting)."""
    out = {}
    for key, value in settings.items():
        if is_search_space(value):
            values = value["grid_search"]
            out[key] = values[0] if isinstance(values, list) and values else value
        elif isinstance(value, dict):
            out[key] = first_variant(value)
        else:
            out[key] = value
    return out


def _with_spaces(plain: dict[str, Any], settings: dict[str, Any]) -> dict[str, Any]:
    out = dict(plain)
    for key, value in settings.items():
        if is_search_space(value):
            out[key] = value
        elif isinstance(value, dict) and has_search_space(value) and isinstance(out.get(key), dict):
            out[key] = _with_spaces(out[key], value)
    return out


def run_with_tune(spec: TrainSpec, config: Any, algo_cls: Any) -> int:
    """Run ``spec.num_samples`` trials of every grid point; print each trial and the best checkpoint."""
    import ray
    from ray import tune

    from pipeline.algorithm_results import lookup
    from pipeline.ray_cluster import init_ray_if_needed

    ray_was_up = ray.is_initialized()
    init_ray_if_needed(config)
    output_dir = os.path.abspath(os.path.expanduser(spec.output_dir))
    name = run_dir_name(algo_cls.__name__, config.env)
    param_space = _with_spaces(config.to_dict(), spec.config)
    checkpoints = tune.CheckpointConfig(num_to_keep=spec.keep_checkpoints,
                                        checkpoint_score_attribute=spec.checkpoint_score_attribute,
                                        checkpoint_score_order=spec.checkpoint_score_order,
                                        checkpoint_frequency=spec.checkpoint_freq,
                                        checkpoint_at_end=spec.checkpoint_at_end)
    say(f"runnel: {spec.num_samples} sample(s) of {algo_cls.__name__} on {env_label(config.env)} through Ray Tune; "
        f"results in {os.path.join(output_dir, name)}")
    try:
        tuner = tune.Tuner(algo_cls, param_space=param_space,
                           # a trial that ends hands its process to the next (Algorithm.reset_config): no
                           # second start and imports per trial
                           tune_config=tune.TuneConfig(num_samples=spec.num_samples, reuse_actors=True),
                           run_config=tune.RunConfig(name=name, storage_path=output_dir, stop=spec.stop,
                                                     checkpoint_config=checkpoints, verbose=0))
        results = tuner.fit()
    finally:
        if not ray_was_up:
            ray.shutdown()
    say(f"\n{len(results)} trial(s):")
    best, best_score = None, None
    for r in results:
        score = lookup(r.metrics or {}, SCORE)
        varied = {k: lookup(r.config, k) for k in _space_keys(spec.config)}
        status = f"error: {r.error}" if r.error else f"{SCORE} {score if score is not None else 'n/a'}"
        say(f"  {os.path.basename(r.path)}  {varied}  {status}")
        if r.error is None and isinstance(score, (int, float)) and (best_score is None or score > best_score):
            best, best_score = r, score
    if best is not None and best.checkpoint is not None:
        say(f"\nBest trial: {os.path.basename(best.path)} ({SCORE} {best_score})")
        say(f"  checkpoint: {best.checkpoint.path}")
        say(f"\nEvaluate it with:\n  {runnel_command()} evaluate {shlex.quote(best.checkpoint.path)} --episodes 10")
    return EXIT_FAILURE if results.errors else EXIT_OK


def _space_keys(settings: dict[str, Any], prefix: str = "") -> list[str]:
    keys = []
    for key, value in settings.items():
        if is_search_space(value):
            keys.append(prefix + key)
        elif isinstance(value, dict):
            keys += _space_keys(value, f"{prefix}{key}/")
    return keys
