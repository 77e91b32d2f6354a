"""ReplayIntake: a replay algorithm's learner pipeline, applied to chunks as they enter the replay stage.

PPO's and IMPALA's learners run their ``learner_connector`` on the chunks of each train batch. DQN, SAC
and CQL train on transitions drawn from a buffer (n-step returns computed at the draw), so their pipeline
runs one step earlier, on the chunks the replay stage stores: what the buffer holds is what the
learner trains on (clipped rewards, rewritten observations), every transition of a chunk goes
through the pipeline once (not once per draw), and a stateful piece's state travels with the buffer's
(snapshots, checkpoints, a remote replay stage's restarts).

What a piece returns is checked like a learner's batch (``BatchCheck``: observations and actions in
their spaces, finite rewards) before anything is stored. A piece that raises, or output that is
refused, costs those chunks -- dropped, counted (``learner_connector/num_chunks_refused``), logged --
never the job.
"""
from __future__ import annotations

import logging
from typing import Any

from actors.connectors.learner import LearnerPipeline
from actors.batch_checks import BatchCheck
from protocols.episode import EpisodeChunk

log = logging.getLogger("runnel")


class ReplayIntake:
    def __init__(self, pipeline: LearnerPipeline, observation_space: Any, action_space: Any,
                 allow_nonfinite_observations: bool = False) -> None:
        """``observation_space``: what chunks hold (the recorded observations: one frame per step where a
        view stacks them)."""
        self.pipeline = pipeline
        self.check = BatchCheck(observation_space, action_space, allow_nonfinite_observations)
        self.num_chunks_refused = 0

    def __call__(self, chunks: list[EpisodeChunk]) -> list[EpisodeChunk]:
        """The pipeline's chunks, checked; [] when the pipeline fails on them or its output is refused."""
        try:
            out = self.pipeline(chunks)
            problem = self.check.problem(out)
            if problem is None:
                out = [c.validate() for c in out]
        except Exception as err:  # a user's piece: its failure costs these chunks, not the job
            out, problem = [], f"{type(err).__name__}: {err}"
        if problem is None:
            return out
        self.num_chunks_refused += len(chunks)
        log.warning("replay intake refused %d chunk(s) (%d so far): the learner connector %s: %s", len(chunks),
                    self.num_chunks_refused, self.pipeline, problem)
        return []

    def get_state(self) -> dict[str, Any]:
        return {"pipeline": self.pipeline.get_state(), "num_chunks_refused": self.num_chunks_refused}

    def set_state(self, state: dict[str, Any]) -> None:
        self.pipeline.set_state(state["pipeline"])
        self.num_chunks_refused = int(state.get("num_chunks_refused", 0))
