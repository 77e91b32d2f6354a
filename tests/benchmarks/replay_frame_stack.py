"""Frame stacking through the replay stage: memory per stored step and the cost of drawing stacks.

Three buffers of Atari-sized uint8 frames (84 x 84 x 1, as runnel's ALE preprocessing gives them), filled with the same synthetic episodes (chunks of 64
steps from 8 interleaved envs, episodes of 200-500 steps), drawn from at one batch size:

- ``single``: one frame per step, no view (what a DQN without stacking stores and gets);
- ``view4``: one frame per step, with ``FrameStackingEnvToModule(num_frames=4)`` as the buffer's view -- chunks
  carry 3 look-back rows, every draw rebuilds 84 x 84 x 4 stacks for ``obs`` and ``next_obs``;
- ``stacked``: the stacks stored as observations (84 x 84 x 4 per step: gymnasium's ``FrameStackObservation``
  in the env, the way to stack frames for DQN before the view).

Per buffer: ``bytes_per_step`` (the ring's arrays / capacity), ``sample_steps_per_s`` (transitions per second at
``--batch-size``, the median of ``--rounds`` interleaved windows of ``--seconds``). One JSON line per buffer
and a summary with the ratios (the median of each round's ratio). Raw figures, no anchors: RLlib's buffers keep whole episode objects.

    python tests/benchmarks/replay_frame_stack.py [--capacity 100000] [--batch-size 32] [--rounds 5]
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import numpy as np  # noqa: E402
from gymnasium.spaces import Box  # noqa: E402

from actors.connectors import FrameStackingEnvToModule  # noqa: E402
from actors.connectors.base import ObservationView  # noqa: E402
from actors.replay import ReplayBuffer, ReplaySettings  # noqa: E402
from protocols.episode import EpisodeChunk  # noqa: E402

FRAME = Box(0, 255, (84, 84, 1), np.uint8)  # an Atari frame after runnel's preprocessing
K = 4


def view() -> ObservationView:
    piece = FrameStackingEnvToModule(num_frames=K)
    piece.input_observation_space = FRAME
    return ObservationView(piece, FRAME, piece.recompute_output_observation_space(FRAME, None))


def episodes(capacity: int, seed: int, stacked: bool):
    """Chunks enough to fill ``capacity`` rows, as 8 envs deliver them (64 steps per env and round)."""
    rng = np.random.default_rng(seed)
    pool = rng.integers(0, 256, (4096 + 600, 84, 84, 1), dtype=np.uint8)
    envs = [dict(i=i, n=0, len=int(rng.integers(200, 501)), t=0, off=int(rng.integers(0, 4096)), c=0) for i in range(8)]
    written = 0
    while written < capacity * 1.1:
        out = []
        for e in envs:
            left = 64
            while left:
                steps = min(left, e["len"] - e["t"])
                a = e["off"] + e["t"]
                frames = pool[a: a + steps + 1]
                back = pool[[e["off"] + max(e["t"] - j, 0) for j in range(K - 1, 0, -1)]]
                if stacked:  # what FrameStackObservation hands the buffer: every step's stack
                    both = np.concatenate([back, frames])
                    obs, look_back = np.concatenate([both[j: j + steps + 1] for j in range(K)], axis=-1), None
                else:
                    obs, look_back = frames, back
                done = e["t"] + steps == e["len"]
                out.append(EpisodeChunk(f"{e['i']}-{e['n']}", e["c"], obs=obs, actions=np.zeros(steps, np.int64),
                                        rewards=np.ones(steps, np.float32), terminated=done, truncated=False,
                                        look_back=look_back))
                e["t"] += steps
                e["c"] += 1
                left -= steps
                written += steps + 1
                if done:
                    e.update(n=e["n"] + 1, len=int(rng.integers(200, 501)), t=0, off=int(rng.integers(0, 4096)), c=0)
        yield out


def rate(buf: ReplayBuffer, batch_size: int, seconds: float) -> float:
    n, t0 = 0, time.perf_counter()
    while time.perf_counter() - t0 < seconds:
        buf.sample(batch_size)
        n += 1
    return n * batch_size / (time.perf_counter() - t0)


def ratio(a: list[float], b: list[float]) -> float:
    return round(statistics.median(x / y for x, y in zip(a, b)), 3)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--capacity", type=int, default=100_000)
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--seconds", type=float, default=1.0)
    args = p.parse_args()
    settings = ReplaySettings(capacity=args.capacity, n_step=3, seed=0)
    buffers = {"single": ReplayBuffer(settings), "view4": ReplayBuffer(settings, view=view()),
               "stacked": ReplayBuffer(settings)}
    for name, buf in buffers.items():
        for chunks in episodes(args.capacity, 0, name == "stacked"):
            buf.add(chunks)
    rates: dict[str, list[float]] = {name: [] for name in buffers}
    for _ in range(args.rounds):
        for name, buf in buffers.items():
            rates[name].append(rate(buf, args.batch_size, args.seconds))
    rows = {}
    for name, buf in buffers.items():
        batch = buf.sample(2)
        rows[name] = {"bench": "replay_frame_stack", "buffer": name, "capacity": args.capacity,
                      "obs_shape": list(batch["obs"].shape[1:]), "stored_shape": list(buf.storage.obs[0].shape[1:]),
                      "bytes_per_step": round(buf.storage.nbytes() / args.capacity, 1),
                      "sample_steps_per_s": round(statistics.median(rates[name])), "batch_size": args.batch_size,
                      "rounds": [round(r) for r in rates[name]]}
        print(json.dumps(rows[name]), flush=True)
    print(json.dumps({"bench": "replay_frame_stack", "summary": True, "frame_bytes": 84 * 84,
                      "view4_bytes_over_single": round(rows["view4"]["bytes_per_step"] / rows["single"]["bytes_per_step"], 3),
                      "stacked_bytes_over_single": round(rows["stacked"]["bytes_per_step"] / rows["single"]["bytes_per_step"], 3),
                      # each round's ratio (the buffers were drawn from one after another), then the median
                      "view4_sampling_over_stacked": ratio(rates["view4"], rates["stacked"]),
                      "view4_sampling_over_single": ratio(rates["view4"], rates["single"]),
                      "cpu_count": os.cpu_count()}), flush=True)


if __name__ == "__main__":
    main()
