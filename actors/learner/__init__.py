"""The learner role: the shared mechanics (``Learner``), batch layout, and the stream loader."""
from actors.learner.batch import Batch, ChunkBatch, as_batch, batch_slices, chunks_to_batch, combined_stats, step_rows
from actors.learner.gradients import grad_if
from actors.learner.learner import Learner, LearnerSettings, Optimizer
from actors.learner.multi_learner import ALL_MODULES, MultiLearner
from actors.schedules import piecewise

__all__ = ["ALL_MODULES", "grad_if", "Batch", "ChunkBatch", "Learner", "LearnerSettings", "MultiLearner", "Optimizer",
           "as_batch", "batch_slices", "chunks_to_batch", "combined_stats", "piecewise", "step_rows"]
