"""``CheckpointError``, in a module of its own: the CLI catches it without importing torch, which the
checkpoint directory code needs (``runnel --help`` answers in a fraction of a second)."""


class CheckpointError(ValueError):
    """A checkpoint is missing, corrupted, or of a format this runnel cannot read."""
