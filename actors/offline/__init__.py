"""Recorded experience: recorders that write what stages sample, readers that hand it back."""
from typing import Any

from actors.offline.reader import OfflineReader, ReaderSettings, manifest_for, resolve_input
from actors.offline.recorder import Recorder, RecordingSettings, read_manifest, write_manifest

READERS = ("local", "ray_data")
"""Reading stages: "local" (``OfflineReader``) and "ray_data" (``actors.offline.dataset.RayDataReader``)."""


def reader_class(offline: ReaderSettings) -> Any:
    """The stage class that reads ``offline`` in an env runner slot (by ``offline.input_reader``)."""
    if offline.input_reader == "local":
        return OfflineReader
    if offline.input_reader == "ray_data":
        from actors.offline.dataset import RayDataReader

        return RayDataReader
    raise ValueError(f"offline_data input_reader={offline.input_reader!r} is not one of {list(READERS)}")


__all__ = ["OfflineReader", "READERS", "ReaderSettings", "Recorder", "RecordingSettings", "manifest_for",
           "read_manifest", "reader_class", "resolve_input", "write_manifest"]
