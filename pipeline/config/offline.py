"""The ``offline_data`` config group: record what runners sample, or train from a recording.

``config.offline_data(output="DIR")`` makes every training runner (and policy server; evaluators
with ``output_include_evaluation=True``) record the chunks it returns into ``DIR``
(``actors.offline.RecordingSettings``). ``config.offline_data(input_="DIR")`` puts
``actors.offline.OfflineReader`` stages in the env runner slots: the algorithm trains on the
recording and steps no env (an env, if given, serves evaluation only); the spaces come from the
recording's manifest unless given. The keys are the fields of those two settings classes. A multi-agent
config records each module apart (``DIR/<module_id>``, ``actors.offline.module_recorders``) and, with BC,
MARWIL or CQL, reads such a recording module by module (``ReaderSettings.modules``).
"""
from __future__ import annotations

import dataclasses
import os
from typing import Any

from actors.offline import READERS, ReaderSettings, RecordingSettings, manifest_for, read_manifest, resolve_input
from actors.offline.reader import SAMPLER, input_sources, resolve_modules_input
from actors.offline.recorder import FSYNC_CHOICES
from pipeline.config.keys import dict_setting_problems
from pipeline.config.multi_agent import module_ids, settings_used
from protocols.errors import ProtocolError
from protocols.spaces import space_from_dict

OUTPUT_KEYS = tuple(f.name for f in dataclasses.fields(RecordingSettings))
INPUT_KEYS = tuple(f.name for f in dataclasses.fields(ReaderSettings) if f.name not in ("seed", "modules"))
KEYS = OUTPUT_KEYS + INPUT_KEYS


def recording_settings(config: Any) -> RecordingSettings | None:
    d = config.offline_data_config or {}
    if d.get("output") is None:
        return None
    return RecordingSettings(**{k: v for k, v in d.items() if k in OUTPUT_KEYS})


def reader_settings(config: Any) -> ReaderSettings | None:
    d = config.offline_data_config or {}
    if d.get("input_") is None:
        return None
    modules = tuple(sorted(module_ids(config))) if settings_used(config) else None  # a multi-agent recording's
    return ReaderSettings(**{k: v for k, v in d.items() if k in INPUT_KEYS}, seed=config.seed, modules=modules)


def _multi_agent_input_problems(read: ReaderSettings) -> list[str]:
    """A multi-agent run reads multi-agent recordings (``actors.offline.module_recorders``: directories, each
    named alone or in a dict of sources), locally."""
    if not isinstance(read.input_, (str, os.PathLike, dict)):
        return [f"offline_data input_={read.input_!r}: a multi-agent run reads a multi-agent recording, the "
                f"directory a multi-agent run recorded into (offline_data(output=DIR)); give that DIR (or a dict "
                f"{{DIR: p, ...}})"]
    problems = [] if read.input_reader == "local" else [
        f"offline_data input_reader={read.input_reader!r} reads single-agent recordings; a multi-agent run "
        f"reads with input_reader='local'"]
    for source, _ in input_sources(read.input_):
        try:
            resolve_modules_input(source, read.modules)
        except (FileNotFoundError, ValueError, TypeError) as err:
            problems.append(f"offline_data: {err}")
    return problems


def module_recorded_spaces(config: Any) -> dict[str, tuple[Any, Any]]:
    """Each module's (observation, action) spaces as its recording in ``input_`` says (its manifest; with
    several recordings, the first's -- the learners check every chunk against them)."""
    directory = os.path.expanduser(str(input_sources(config.offline_data_config["input_"])[0][0]))
    out = {}
    for mid in sorted(module_ids(config)):  # policies may be a set: the same order (and first error) every run
        manifest = read_manifest(os.path.join(directory, mid))
        out[mid] = (space_from_dict(manifest["observation_space"]), space_from_dict(manifest["action_space"]))
    return out


def recorded_spaces(config: Any) -> tuple[Any, Any]:
    """The observation and action spaces of the recording(s) ``input_`` names (from their manifests;
    mixed recordings must agree)."""
    spaces = None
    for source, _ in input_sources(config.offline_data_config["input_"]):
        manifest = manifest_for(resolve_input(source))
        if manifest is None:
            raise ValueError(f"offline input {source!r} has no manifest.json to take the spaces from: give them "
                             f"with .environment(observation_space=..., action_space=...)")
        these = (manifest["observation_space"], manifest["action_space"])
        if spaces is not None and these != spaces:
            raise ValueError(f"offline input {source!r} was recorded with other spaces than the first recording "
                             f"({these} vs {spaces}): mix recordings of the same env")
        spaces = these
    return space_from_dict(spaces[0]), space_from_dict(spaces[1])


def offline_problems(config: Any) -> list[str]:
    d = config.offline_data_config
    if d is None:
        return []
    problems = dict_setting_problems(d, KEYS, "offline_data")
    if problems:
        return problems
    rec, read = recording_settings(config), reader_settings(config)
    if rec is not None:
        if not isinstance(rec.output, str) or not rec.output:
            problems.append(f"offline_data output={rec.output!r} must be a directory path")
        for key in ("output_max_file_size", "output_max_queue"):
            value = getattr(rec, key)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                problems.append(f"offline_data {key} must be an int >= 1, got {value!r}")
        if rec.output_fsync not in FSYNC_CHOICES:
            problems.append(f"offline_data output_fsync={rec.output_fsync!r} is not one of {list(FSYNC_CHOICES)}")
    elif any(k in d for k in OUTPUT_KEYS if k != "output"):
        problems.append("offline_data output_* settings need output='DIR' (where to record)")
    if read is not None:
        if isinstance(read.input_, dict):
            problems += _mixing_problems(config, read.input_)
            if problems:
                return problems
        if read.modules is not None:
            problems += _multi_agent_input_problems(read)
        for source, _ in input_sources(read.input_) if read.modules is None else []:
            try:
                resolve_input(source)
            except (FileNotFoundError, ValueError) as err:
                problems.append(f"offline_data: {err}")
        if not isinstance(read.shuffle_buffer_size, int) or read.shuffle_buffer_size < 0:
            problems.append(f"offline_data shuffle_buffer_size must be an int >= 0, got {read.shuffle_buffer_size!r}")
        if read.input_reader not in READERS:
            problems.append(f"offline_data input_reader={read.input_reader!r} is not one of {list(READERS)}")
        if not isinstance(read.shards_in_flight, int) or read.shards_in_flight < 1:
            problems.append(f"offline_data shards_in_flight must be an int >= 1, got {read.shards_in_flight!r}")
        if rec is not None:
            problems.append("offline_data: input_ and output together would record the recording again; "
                            "drop output (or record a trained policy with `runnel record`)")
        if config.external_clients_config is not None and not mixes_sampler(config):
            problems.append("offline_data input_ and external_clients both take the env runner slots: pick one")
        if not getattr(config, "synchronous_sampling", True):
            problems.append(f"{config.algo_name} samples by streaming, which offline readers do not do yet: "
                            f"train from recordings with BC, MARWIL, CQL, PPO, DQN or SAC")
        if config.evaluation_interval and config.env is None and not getattr(config, "off_policy_estimation_methods", None):
            problems.append("evaluation runs an env in evaluators, and this config has none: set "
                            ".environment(env=...) (it serves evaluation only) or turn evaluation_interval off (or evaluate off-policy only: off_policy_estimation_methods)")
        if not problems and read.modules is None and (config.observation_space is None or config.action_space is None):
            try:
                recorded_spaces(config)
            except (ValueError, ProtocolError) as err:
                problems.append(f"offline_data: {err}")
    elif any(k in d for k in INPUT_KEYS if k != "input_"):
        problems.append("offline_data input settings need input_='DIR' (what to read)")
    return problems


def mixes_sampler(config: Any) -> bool:
    """``input_`` mixes live sampling with recordings (``{"sampler": p, "DIR": q}``): env runners stay
    in their slots and the off-policy plan adds recorded steps to what they sample."""
    input_ = (config.offline_data_config or {}).get("input_")
    return isinstance(input_, dict) and SAMPLER in input_


def _mixing_problems(config: Any, sources: dict) -> list[str]:
    problems = []
    for source, p in sources.items():
        if not isinstance(source, str) or isinstance(p, bool) or not isinstance(p, (int, float)) or not p > 0:
            problems.append(f"offline_data input_ maps sources (a directory, a glob or 'sampler') to probabilities "
                            f"> 0, like {{'sampler': 0.5, 'recordings/expert': 0.5}}; got {source!r}: {p!r}")
    if not [s for s in sources if s != SAMPLER]:
        problems.append("offline_data input_ names no recording besides 'sampler': give at least one directory")
    if SAMPLER in sources:
        if not hasattr(config, "replay_buffer_config") or config.algo_name == "CQL":
            problems.append(f"offline_data input_ with 'sampler' mixes recorded steps into what the env runners "
                            f"sample, through the replay: DQN and SAC do that; {config.algo_name} cannot (drop "
                            f"'sampler' to train on the recordings alone)")
        elif (getattr(config, "replay_buffer_config", {}) or {}).get("remote", False):
            problems.append("offline_data input_ with 'sampler' needs the in-process replay stage "
                            "(replay_buffer_config remote=False)")
        if config.env is None:
            problems.append("offline_data input_ with 'sampler' samples an env too: set .environment(env=...)")
    return problems


def input_required_problems(config: Any) -> list[str]:
    """What an algorithm that only learns from recordings (BC, MARWIL, CQL) needs of its config."""
    if (config.offline_data_config or {}).get("input_") is None:
        return [f"{config.algo_name} learns from recorded experience: add .offline_data(input_='DIR') "
                f"(a directory recorded with .offline_data(output='DIR') or `runnel record`)"]
    return []
