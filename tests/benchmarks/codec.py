"""Codec benchmark: runnel frames vs pickle (protocol 5) vs bare LZ4 of the same array bytes.

Run: ``.venv/bin/python tests/benchmarks/codec.py [--repeats N]``. Prints one JSON object per
line: first the machine, then one line per payload. Times are medians over repeats of
encode+decode (or dumps+loads, compress+decompress) of the whole payload, in milliseconds,
with the methods' batches interleaved within each repeat, after one warm-up call of every
method on every payload (``--cold`` skips the warm-up). ``minflt_per_call`` counts the page
faults (fresh memory) per call: for large payloads they, not LZ4, dominate decoding.
``checksum_cost`` is the round trip with the CRC-32 trailer over the one without it, minus 1
(timed as a pair on their own, see ``checksum_pair``).
pickle is imported here for comparison only; nothing in runnel pickles what it sends.
"""
from __future__ import annotations

import argparse
import json
import os
import pickle
import platform
import resource
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import lz4  # noqa: E402
import lz4.frame  # noqa: E402
import msgpack  # noqa: E402
import numpy as np  # noqa: E402

from protocols import EpisodeChunk, decode, encode, new_episode_id  # noqa: E402
from protocols import nested  # noqa: E402


def cartpole_chunks(rng: np.random.Generator, n_chunks: int = 16, steps: int = 200) -> list[EpisodeChunk]:
    chunks = []
    for i in range(n_chunks):
        obs = np.cumsum(rng.normal(0, 0.05, (steps + 1, 4)), axis=0).astype(np.float32)
        logits = rng.normal(0, 1, (steps, 2)).astype(np.float32)
        actions = rng.integers(0, 2, steps).astype(np.int64)
        logp = (logits[np.arange(steps), actions] - np.logaddexp(logits[:, 0], logits[:, 1])).astype(np.float32)
        chunks.append(EpisodeChunk(
            episode_id=new_episode_id(), chunk_index=i % 3, obs=obs, actions=actions,
            rewards=np.ones(steps, np.float32), terminated=bool(i % 2),
            extra={"action_logp": logp, "vf_preds": rng.normal(10, 3, steps).astype(np.float32),
                   "action_dist_inputs": logits},
            t_started=200 * (i % 3), weights_version=7, env_runner_index=1, env_index=i % 4,
        ))
    return chunks


def atari_frames(rng: np.random.Generator, n: int) -> np.ndarray:
    """Pong/Breakout-like 84x84 grey frames: static background, moving sprites, a bit of noise."""
    yy, xx = np.mgrid[0:84, 0:84]
    background = np.where((yy // 12) % 2 == 0, 40, 60).astype(np.uint8)
    background[:6] = 120                                  # score bar
    background[:, :3] = background[:, -3:] = 200          # walls
    frames = np.empty((n, 84, 84), np.uint8)
    ball = np.array([40.0, 40.0]); vel = np.array([1.3, -0.9])
    for t in range(n):
        f = background.copy()
        ball += vel
        for k in range(2):
            if not 8 <= ball[k] <= 80:
                vel[k] = -vel[k]
                ball[k] = np.clip(ball[k], 8, 80)
        by, bx = ball.astype(int)
        f[by - 1 : by + 1, bx - 1 : bx + 1] = 236         # ball
        p1 = 20 + int(15 * np.sin(t / 9)); p2 = 30 + int(12 * np.cos(t / 7))
        f[p1 : p1 + 10, 76:78] = 147; f[p2 : p2 + 10, 6:8] = 92     # paddles
        bricks = 8 + (t // 40) % 5
        f[10:16, 10 : 10 + 6 * bricks] = 180              # bricks that change now and then
        noise = rng.integers(0, 84, (12, 2))
        f[noise[:, 0], noise[:, 1]] = rng.integers(0, 256, 12)   # flicker
        frames[t] = f
    return frames


def atari_chunk(rng: np.random.Generator, steps: int = 200) -> EpisodeChunk:
    frames = atari_frames(rng, steps + 1 + 3)
    obs = np.stack([frames[k : k + steps + 1] for k in range(4)], axis=-1)  # obs[t,...,k] = frame[t+k]
    assert np.array_equal(obs[7, ..., 2], frames[9]) and obs.shape == (steps + 1, 84, 84, 4)
    return EpisodeChunk(
        episode_id=new_episode_id(), chunk_index=0, obs=obs,
        actions=rng.integers(0, 6, steps).astype(np.int64),
        rewards=(rng.random(steps) < 0.02).astype(np.float32),
        extra={"action_logp": rng.normal(-1.7, 0.1, steps).astype(np.float32),
               "vf_preds": rng.normal(0, 1, steps).astype(np.float32)},
    )


def dict_chunk(rng: np.random.Generator, steps: int = 200) -> EpisodeChunk:
    pos = np.cumsum(rng.normal(0, 0.01, (steps + 1, 3)), axis=0).astype(np.float32)
    image = np.zeros((steps + 1, 32, 32, 3), np.uint8)
    for t in range(steps + 1):
        image[t, :, :, 2] = 30
        y, x = (t // 3) % 28, (t * 2) % 28
        image[t, y : y + 4, x : x + 4] = (200, 50, 10)
    flags = (rng.random((steps + 1, 5)) < 0.1).astype(np.int8)
    return EpisodeChunk(
        episode_id=new_episode_id(), chunk_index=0,
        obs={"pos": pos, "image": image, "flags": flags},
        actions=rng.normal(0, 1, (steps, 2)).astype(np.float32),
        rewards=rng.normal(0, 1, steps).astype(np.float32),
        extra={"action_logp": rng.normal(-1, 0.2, steps).astype(np.float32),
               "vf_preds": rng.normal(0, 1, steps).astype(np.float32)},
        truncated=True,
    )


def arrays_of(obj) -> list[np.ndarray]:
    chunks = obj if isinstance(obj, list) else [obj]
    out = []
    for c in chunks:
        out += nested.flatten(c.obs) + nested.flatten(c.actions) + [c.rewards]
        out += [leaf for k in sorted(c.extra) for leaf in nested.flatten(c.extra[k])]
    return out


def timed_interleaved(fns: dict, repeats: int, min_s: float = 0.02) -> dict:
    """Median seconds per call of each function. Each repeat runs every function in turn for
    about ``min_s`` (a batch of calls), so that load from elsewhere hits all of them alike."""
    batch = {}
    for key, fn in fns.items():
        fn()
        start, n = time.perf_counter(), 0
        while time.perf_counter() - start < min_s:
            fn()
            n += 1
        batch[key] = n
    samples: dict = {key: [] for key in fns}
    for _ in range(repeats):
        for key, fn in fns.items():
            t0 = time.perf_counter()
            for _ in range(batch[key]):
                fn()
            samples[key].append((time.perf_counter() - t0) / batch[key])
    return {key: statistics.median(v) for key, v in samples.items()}


def methods(obj) -> dict:
    """The round trips compared; bare LZ4 gets the array bytes already joined, for free."""
    raw = b"".join(arrays_of(obj))
    frame = encode(obj)
    return {
        "codec": lambda: decode(encode(obj)),
        "codec_encode": lambda: encode(obj),
        "codec_decode": lambda: decode(frame),
        "codec_uncompressed": lambda: decode(encode(obj, compress=False)),
        "pickle": lambda: pickle.loads(pickle.dumps(obj, protocol=5)),
        "lz4": lambda: lz4.frame.decompress(lz4.frame.compress(raw)),  # default level 0, as the codec
    }


def checksum_pair(obj, repeats: int) -> tuple[float, float]:
    """Round trip with and without the CRC-32 trailer, timed as a pair on their own (in both
    orders, averaged): among the other methods, the allocator state each inherits from the one
    before it (pickle, bare LZ4) moves a 2 ms round trip by more than the checksum costs."""
    with_crc = lambda: decode(encode(obj))  # noqa: E731
    without = lambda: decode(encode(obj, checksum=False))  # noqa: E731
    a = timed_interleaved({"crc": with_crc, "none": without}, repeats)
    b = timed_interleaved({"none": without, "crc": with_crc}, repeats)
    return (a["crc"] + b["crc"]) / 2, (a["none"] + b["none"]) / 2


def minor_faults(fn, calls: int = 5) -> float:
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    for _ in range(calls):
        fn()
    return (resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before) / calls


def bench(name: str, obj, repeats: int) -> dict:
    raw_bytes = sum(a.nbytes for a in arrays_of(obj))
    frame = encode(obj)
    assert isinstance(decode(frame), type(obj))
    plain = encode(obj, compress=False)
    pickled = pickle.dumps(obj, protocol=5)
    lz = lz4.frame.compress(b"".join(arrays_of(obj)))
    t = timed_interleaved(methods(obj), repeats)
    faults = {k: round(minor_faults(methods(obj)[k]), 1) for k in ("codec", "pickle", "lz4")}
    t_enc, t_dec, t_codec, t_plain, t_pickle, t_lz4 = (
        t["codec_encode"], t["codec_decode"], t["codec"], t["codec_uncompressed"], t["pickle"], t["lz4"])
    t_crc, t_nocrc = checksum_pair(obj, repeats)
    return {
        "payload": name,
        "raw_array_bytes": raw_bytes,
        "codec_ms": round(t_codec * 1e3, 4),
        "codec_encode_ms": round(t_enc * 1e3, 4),
        "codec_decode_ms": round(t_dec * 1e3, 4),
        "codec_MBps": round(raw_bytes / t_codec / 1e6, 1),
        "codec_bytes": len(frame),
        "compression_ratio": round(raw_bytes / len(frame), 2),
        "codec_uncompressed_ms": round(t_plain * 1e3, 4),
        "codec_uncompressed_bytes": len(plain),
        "pickle_ms": round(t_pickle * 1e3, 4),
        "pickle_bytes": len(pickled),
        "lz4_ms": round(t_lz4 * 1e3, 4),
        "lz4_bytes": len(lz),
        "size_vs_pickle": round(len(pickled) / len(frame), 2),
        "time_vs_lz4": round(t_codec / t_lz4, 3),
        "time_vs_pickle": round(t_codec / t_pickle, 3),
        "codec_checksum_ms": round(t_crc * 1e3, 4),
        "codec_no_checksum_ms": round(t_nocrc * 1e3, 4),
        "checksum_cost": round(t_crc / t_nocrc - 1, 3),
        "minflt_per_call": faults,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=11)
    parser.add_argument("--cold", action="store_true", help="skip the allocator warm-up")
    args = parser.parse_args()
    print(json.dumps({
        "machine": platform.platform(), "processor": platform.processor() or platform.machine(),
        "cpu_count": os.cpu_count(), "python": platform.python_version(), "numpy": np.__version__,
        "lz4": lz4.__version__, "msgpack": ".".join(map(str, msgpack.version)), "repeats": args.repeats,
        "warm_up": not args.cold,
    }), flush=True)
    rng = np.random.default_rng(0)
    payloads = [("cartpole_16x200", cartpole_chunks(rng)), ("atari_200", atari_chunk(rng)),
                ("dict_obs_200", dict_chunk(rng))]
    # Warm-up: every method once on every payload before any timing, so that each measurement
    # sees the allocator state of a long-running process whatever the payload order. (A fresh
    # glibc process trims and re-faults its heap on every ~100 KiB-1 MiB alloc/free cycle until a
    # large block has been freed once; that would tax whichever method runs first.)
    for _, obj in payloads if not args.cold else []:
        for fn in methods(obj).values():
            fn()
    results = {}
    for name, obj in payloads:
        results[name] = bench(name, obj, args.repeats)
        print(json.dumps(results[name]), flush=True)
    atari, cartpole = results["atari_200"], results["cartpole_16x200"]
    print(json.dumps({"targets": {
        "atari_size_vs_pickle>=3": atari["size_vs_pickle"] >= 3,
        "atari_time_vs_lz4<=1.5": atari["time_vs_lz4"] <= 1.5,
        "cartpole_time_vs_pickle<=2": cartpole["time_vs_pickle"] <= 2,
        "atari_checksum_cost<=0.10": atari["checksum_cost"] <= 0.10,
    }}), flush=True)


if __name__ == "__main__":
    main()
