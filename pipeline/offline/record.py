"""Recording a trained policy (``runnel record``) and describing a recording (``runnel inspect``).

``record_policy`` plays whole episodes with an algorithm's current weights in one env runner in
this process, recording every episode into ``output`` exactly as training runners record (same
shards, same manifest), so the result trains BC/MARWIL/CQL or prefills replay. ``inspect_recording``
reads every shard of a recording -- each record decoded, so checksum failures and torn tails are
found -- and sums up episodes, steps, returns and damage without loading more than one record.
"""
from __future__ import annotations

import dataclasses
import json
import os
from typing import Any

import numpy as np

from actors.env import EnvRunner
from actors.offline import RecordingSettings, manifest_for, resolve_input, write_manifest
from actors.offline.module_recorders import write_multi_agent_manifest
from pipeline.algorithm_results import json_safe
from pipeline.config.base import ConfigError
from pipeline.version import runnel_version
from protocols.errors import ProtocolError
from protocols.shards import ShardReader, decode_record


def write_run_manifest(algo: Any, module_ids: list[str] | None = None) -> None:
    """A training run's recording manifest (``offline_data(output=...)``); in a multi-agent run each module's
    recording's (``module_ids``: these only, e.g. a module added while training) and the directory's list of
    them (``actors.offline.module_recorders``)."""
    config = algo.config
    args = (algo.name, json_safe(config.to_dict()), runnel_version(), bool(config.normalize_actions))
    if algo.multi_agent is None:
        write_manifest(algo.recording.output, algo.chunk_observation_space, algo.action_space, *args)
        return
    try:
        write_multi_agent_manifest(algo.recording.output, algo.multi_agent.recorded_spaces(module_ids), *args)
    except ValueError as err:  # a module id that cannot name a directory, a single-agent recording there
        raise ConfigError(f"offline_data(output={algo.recording.output!r}): {err}") from None


def record_policy(algo: Any, num_episodes: int, output: str, explore: bool = False,
                  max_file_size: int = 64 * 1024 * 1024) -> dict[str, Any]:
    """Play ``num_episodes`` episodes with ``algo``'s policy (greedy unless ``explore``) and record
    them into ``output`` (a multi-agent algorithm's: each module's agents into ``output/<module_id>``).
    Returns the episodes' returns (summed over agents) and lengths (env steps)."""
    if num_episodes < 1:
        raise ValueError(f"num_episodes must be >= 1, got {num_episodes}")
    if algo.env_creator is None:
        raise ValueError("recording a policy needs an env to play in: the algorithm's config has none "
                         "(pass --env, or .environment(...))")
    config, multi = algo.config, algo.multi_agent
    args = (algo.name, json.loads(json.dumps(config.to_dict(), default=repr)), _version(),
            bool(config.normalize_actions))
    if multi is None:
        write_manifest(output, algo.observation_space, algo.action_space, *args)
    else:
        write_multi_agent_manifest(output, multi.recorded_spaces(), *args)
    settings = dataclasses.replace(
        algo.env_runner_settings(in_evaluation=True), num_envs=1, explore=explore,
        recording=RecordingSettings(output=output, output_max_file_size=max_file_size, output_write_episodes=True))
    if multi is None:
        runner = EnvRunner(settings, worker_index=1)
    else:  # an evaluator's runner, with every module and the mapping
        runner_args = multi.runner_group_args(evaluation=True)
        runner = runner_args["runner_class"](settings, worker_index=1, **runner_args["runner_kwargs"])
    try:
        runner.set_weights(algo.get_weights(), algo.weights_version)
        chunks = runner.sample(num_episodes=num_episodes, explore=explore)
        runner.flush_recording()
    finally:
        runner.stop()
    returns: dict[str, float] = {}
    lengths: dict[str, int] = {}
    for c in chunks:  # an agent's chunks carry "<episode id>.<agent's number>"
        episode = c.episode_id if multi is None else c.episode_id.rsplit(".", 1)[0]
        returns[episode] = returns.get(episode, 0.0) + float(np.sum(c.rewards))
        lengths[episode] = max(lengths.get(episode, 0), c.t_started + len(c))
    rets, lens = list(returns.values()), list(lengths.values())
    return {"output": output, "episodes": len(rets), "steps": int(sum(lens)), "episode_returns": rets,
            "episode_lengths": lens, "episode_return_mean": float(np.mean(rets)) if rets else float("nan")}


def inspect_recording(input_: str | list) -> dict[str, Any]:
    """Shards, records, episodes, steps, returns of whole episodes, spaces and damage of a recording."""
    files = resolve_input(input_)
    manifest = manifest_for(files)
    out: dict[str, Any] = {
        "shards": len(files), "complete_shards": 0, "records": 0, "chunks": 0, "steps": 0, "episodes": 0,
        "bytes": 0, "damaged_records": 0, "torn_tails": 0, "damage": [], "episode_returns": [],
        "observation_space": manifest.get("observation_space") if manifest else None,
        "action_space": manifest.get("action_space") if manifest else None,
        "algorithm": manifest.get("algorithm") if manifest else None,
        "runnel_version": manifest.get("runnel_version") if manifest else None,
    }
    open_returns: dict[str, float] = {}
    for path in files:
        out["bytes"] += os.path.getsize(path)
        reader = ShardReader(path)
        for off, frame in reader.frames():
            try:
                chunks = decode_record(frame, reader.limits, f"{path} at byte {off}")
            except ProtocolError as err:
                out["damaged_records"] += 1
                out["damage"].append(f"{path}: record at byte {off}: {err}")
                continue
            out["records"] += 1
            for c in chunks:
                out["chunks"] += 1
                out["steps"] += len(c)
                ret = open_returns.pop(c.episode_id, 0.0) + float(np.sum(c.rewards))
                if c.is_done:
                    out["episodes"] += 1
                    out["episode_returns"].append(ret)
                else:
                    open_returns[c.episode_id] = ret
        out["complete_shards"] += int(reader.scan.complete)
        out["damaged_records"] += reader.scan.damaged_records
        if reader.scan.damaged_bytes:
            out["torn_tails"] += 1
            out["damage"].append(f"{path}: {reader.scan.damaged_bytes} bytes unreadable at the end ({reader.scan.damage})")
    rets = out["episode_returns"]
    out["episode_return_mean"] = float(np.mean(rets)) if rets else None
    out["open_episodes"] = len(open_returns)
    return out


def _version() -> str:
    from pipeline.version import runnel_version

    return runnel_version()
