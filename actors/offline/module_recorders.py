"""Recording a multi-agent run: each module's chunks into a single-agent recording of its own.

A multi-agent runner (or policy server) samples per-agent chunks, each tagged with the module that acted
(``EpisodeChunk.module_id``) and an episode id of its own per agent (``"<episode id>.<n>"``). A run with
``offline_data(output=DIR)`` writes each module's chunks to ``DIR/<module_id>/``: an ordinary recording --
shards and a manifest with that module's spaces -- so each one trains BC, MARWIL or CQL, prefills a replay
buffer and reads with ``runnel inspect`` as a single-agent recording does, each agent's episode one episode.
``DIR/manifest.json`` lists the modules (format ``runnel-multi-agent-recording``); single-agent readers
given ``DIR`` itself say to pick a module's directory.

``ModuleRecorders`` offers what a stage's ``Recorder`` offers (``record``, ``flush``, ``close``,
``log_metrics``, ``get_metrics``) over one ``Recorder`` per module, each made when that module's first chunk
arrives, so modules added while training are recorded too.
"""
from __future__ import annotations

import dataclasses
import os
import re
import time
from typing import Any

from actors.offline.recorder import (MANIFEST, MULTI_AGENT_FORMAT, Recorder, RecordingSettings, read_json_manifest,
                                     write_json_atomically, write_manifest)
from protocols.episode import EpisodeChunk

MULTI_AGENT_VERSION = 1
_SAFE_ID = re.compile(r"\w[\w\-]{0,127}")  # config checks already keep '/' and '.' out of module ids


def module_directory(output: str, module_id: str) -> str:
    """``output/<module_id>``; a module id that cannot name a directory on every OS is a ValueError naming it."""
    if not isinstance(module_id, str) or not _SAFE_ID.fullmatch(module_id):
        raise ValueError(f"module id {module_id!r} cannot name its recording's directory: recording a multi-agent "
                         f"run (offline_data(output=...)) needs module ids of letters, digits, '_' and '-', not "
                         f"starting with '-', at most 128 characters; rename the module")
    return os.path.join(output, module_id)


def write_multi_agent_manifest(directory: str, spaces: dict[str, tuple[Any, Any]], algorithm: str,
                               config: dict[str, Any], version: str, actions_normalized: bool = True) -> dict[str, Any]:
    """Each module's recording manifest (``write_manifest``: spaces checked against a recording already
    there) and the directory's own, which lists the modules (those of earlier runs into it kept)."""
    dirs = {mid: module_directory(directory, mid) for mid in spaces}  # every id checked before anything is written
    os.makedirs(directory, exist_ok=True)
    path = os.path.join(directory, MANIFEST)
    modules: set[str] = set()
    if os.path.exists(path):
        old = read_json_manifest(directory)
        if old.get("format") != MULTI_AGENT_FORMAT:
            raise ValueError(f"{directory} already holds a single-agent recording: record the multi-agent run into "
                             f"a new directory")
        modules.update(old.get("modules", []))
    for mid, (obs_space, act_space) in sorted(spaces.items()):
        write_manifest(dirs[mid], obs_space, act_space, algorithm, config, version, actions_normalized)
    manifest = {"format": MULTI_AGENT_FORMAT, "format_version": MULTI_AGENT_VERSION,
                "modules": sorted(modules | set(spaces)), "algorithm": algorithm, "runnel_version": version,
                "created": time.strftime("%Y-%m-%dT%H:%M:%S%z")}
    return write_json_atomically(directory, manifest)


class ModuleRecorders:
    """One ``Recorder`` per module, each writing that module's chunks under ``settings.output/<module_id>``."""

    def __init__(self, settings: RecordingSettings, name: str) -> None:
        self.settings, self.name = settings, name
        self.recorders: dict[str, Recorder] = {}

    def record(self, chunks: list[EpisodeChunk]) -> None:
        by_module: dict[str, list[EpisodeChunk]] = {}
        for c in chunks:
            by_module.setdefault(c.module_id, []).append(c)
        for mid, group in by_module.items():
            self._recorder(mid).record(group)

    def _recorder(self, module_id: str) -> Recorder:
        recorder = self.recorders.get(module_id)
        if recorder is None:
            output = module_directory(self.settings.output, module_id)
            recorder = Recorder(dataclasses.replace(self.settings, output=output), self.name)
            self.recorders[module_id] = recorder
        return recorder

    def flush(self) -> None:
        for recorder in self.recorders.values():
            recorder.flush()

    def close(self) -> None:
        for recorder in self.recorders.values():
            recorder.close()

    def log_metrics(self, metrics: Any) -> None:
        """Each module's counters' growth under ``offline_data/`` (summed over modules, as over runners)."""
        for recorder in self.recorders.values():
            recorder.log_metrics(metrics)

    def get_metrics(self) -> dict[str, Any]:
        total: dict[str, Any] = {}
        for recorder in self.recorders.values():
            for key, value in recorder.get_metrics().items():
                total[key] = total.get(key, 0) + value
        return total
