"""Checkpoint directories (atomic writes, no pickle) and which of a run's checkpoints to keep."""
