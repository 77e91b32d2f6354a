"""Recorded experience: recorders that write what stages sample, readers that hand it back."""
from actors.offline.reader import OfflineReader, ReaderSettings, manifest_for, resolve_input
from actors.offline.recorder import Recorder, RecordingSettings, read_manifest, write_manifest

__all__ = ["OfflineReader", "ReaderSettings", "Recorder", "RecordingSettings", "manifest_for", "read_manifest",
           "resolve_input", "write_manifest"]
