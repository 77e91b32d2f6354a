"""Checkpoints: the directory format (``directory.py``: atomic writes, no pickle), saving and
restoring an algorithm (``save_restore.py``), which of a run's checkpoints to keep (``keeper.py``), and ``CheckpointError`` (``errors.py``)."""
