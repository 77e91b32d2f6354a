"""What one CPU core does with the default Nature CNN: its acting forward pass on uint8 84x84x4 frames, per frame.

The figure behind two open bars: central inference over local on 2 cores (issue 28: batching across runners can
save at most what a bigger batch saves per frame) and Pong sampling over the bare ALE loop (issue 30: the CNN's
cost per env step beside the emulator's). One thread, ``torch.inference_mode``; for each case the median of
``--rounds`` timings of ``--passes`` forward passes, the cases alternating round by round, frames converted as runnel's module does (permute, float, 1/255).

Cases: ``eager`` at each ``--batches`` size (runnel's path); at batch 8 also ``channels_last`` (weights and input in
oneDNN's preferred order), ``jit_frozen`` (TorchScript trace, ``torch.jit.freeze`` and
``optimize_for_inference``) and, with ``--compile``, ``compiled`` (``torch.compile``, inductor; its compile time is
reported, not timed). Prints JSON lines: ``machine``, one ``cnn`` line per case, and ``summary`` with the eager
per-frame cost at the smallest batch over the largest (the most batching can save) and the arithmetic rate.

    python tests/benchmarks/cnn_forward.py [--batches 4,8,32] [--rounds 5] [--passes 50] [--compile]
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import time

import torch
from torch import nn

# multiply-adds per frame of the Nature CNN on 84x84x4: conv 8x8/4 -> 20x20x32, 4x4/2 -> 9x9x64, 3x3/1 -> 7x7x64,
# then 3136 -> 512 -> actions
MACS_PER_FRAME = 20 * 20 * 32 * 8 * 8 * 4 + 9 * 9 * 64 * 4 * 4 * 32 + 7 * 7 * 64 * 3 * 3 * 64 + 3136 * 512 + 512 * 6


def emit(**fields) -> None:
    print(json.dumps(fields), flush=True)


def nature_cnn(num_actions: int = 6) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv2d(4, 32, 8, 4), nn.ReLU(), nn.Conv2d(32, 64, 4, 2), nn.ReLU(),
                         nn.Conv2d(64, 64, 3, 1), nn.ReLU(), nn.Flatten(), nn.Linear(3136, 512), nn.ReLU(),
                         nn.Linear(512, num_actions)).eval()


def frames_in(frames: torch.Tensor) -> torch.Tensor:
    return frames.permute(0, 3, 1, 2).float().mul_(1.0 / 255.0)


def time_case(forward, frames: torch.Tensor, rounds: int, passes: int) -> float:
    """Median seconds per pass."""
    times = []
    with torch.inference_mode():
        for _ in range(5):
            forward(frames)
        for _ in range(rounds):
            t0 = time.perf_counter()
            for _ in range(passes):
                forward(frames)
            times.append((time.perf_counter() - t0) / passes)
    return statistics.median(times)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--batches", default="4,8,32")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--passes", type=int, default=50)
    p.add_argument("--compile", action="store_true", help="also time torch.compile's module (about 20 s to compile)")
    args = p.parse_args()
    torch.set_num_threads(1)
    flags = sorted({f for line in open("/proc/cpuinfo") if line.startswith("flags") for f in line.split()
                    if f.startswith(("avx512", "amx", "avx2", "avx_vnni"))}) if os.path.exists("/proc/cpuinfo") else []
    emit(bench="machine", cpus=os.cpu_count(), platform=platform.platform(), torch=torch.__version__, cpu_flags=flags)
    model = nature_cnn()
    # (case, batch, forward): every case is timed once a round, the cases alternating, so a host whose speed drifts
    # moves them all alike; each case's median over the rounds is reported
    cases = [("eager", int(b), lambda f: model(frames_in(f))) for b in args.batches.split(",")]
    frames8 = torch.randint(0, 256, (8, 84, 84, 4), dtype=torch.uint8)
    last = nature_cnn().to(memory_format=torch.channels_last)
    cases.append(("channels_last", 8, lambda f: last(frames_in(f).contiguous(memory_format=torch.channels_last))))
    with torch.inference_mode():
        frozen = torch.jit.optimize_for_inference(torch.jit.freeze(torch.jit.trace(nature_cnn(), frames_in(frames8))))
    cases.append(("jit_frozen", 8, lambda f: frozen(frames_in(f))))
    if args.compile:
        compiled = torch.compile(nature_cnn())
        t0 = time.perf_counter()
        with torch.inference_mode():
            compiled(frames_in(frames8))
        emit(bench="compile", seconds=round(time.perf_counter() - t0, 1))
        cases.append(("compiled", 8, lambda f: compiled(frames_in(f))))
    inputs = {b: torch.randint(0, 256, (b, 84, 84, 4), dtype=torch.uint8) for _, b, _ in cases}
    times: dict[tuple[str, int], list[float]] = {(name, b): [] for name, b, _ in cases}
    for _ in range(args.rounds):
        for name, b, forward in cases:
            times[(name, b)].append(time_case(forward, inputs[b], 1, args.passes))
    per_frame = {}
    for (name, b), ts in times.items():
        sec = statistics.median(ts)
        if name == "eager":
            per_frame[b] = sec / b
        emit(bench="cnn", case=name, batch=b, ms_per_pass=round(sec * 1e3, 3), ms_per_frame=round(sec / b * 1e3, 4),
             gmacs_per_s=round(MACS_PER_FRAME * b / sec / 1e9, 1), rounds_ms_per_pass=[round(t * 1e3, 3) for t in ts])
    small, large = min(per_frame), max(per_frame)
    emit(bench="summary", macs_per_frame=MACS_PER_FRAME,
         eager_ms_per_frame={str(b): round(v * 1e3, 4) for b, v in per_frame.items()},
         batching_saves_at_most=round(per_frame[small] / per_frame[large], 2))


if __name__ == "__main__":
    main()
