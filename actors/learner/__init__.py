"""The learner role: the shared mechanics (``Learner``), batch layout, and the stream loader."""
from actors.learner.batch import Batch, ChunkBatch, as_batch, chunks_to_batch, step_rows
from actors.learner.learner import Learner, LearnerSettings, Optimizer
from actors.schedules import piecewise

__all__ = ["Batch", "ChunkBatch", "Learner", "LearnerSettings", "Optimizer", "as_batch", "chunks_to_batch",
           "piecewise", "step_rows"]
