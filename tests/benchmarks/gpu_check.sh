#!/usr/bin/env bash
# The GPU checks of issue 28 (central inference, learners on CUDA), for a lent GPU machine: one short run,
# under 6 minutes, that prints JSON lines and one PASS/FAIL line per check.
#
#   1. environment: the wheels from .whl/ installed into /tmp/site (the machine has Python 3.12 and torch
#      with CUDA but no Ray, gymnasium, pyzmq or lz4); torch sees a GPU.
#   2. engine: tests/test_inference_server.py in full (the CUDA server among them).
#   3. cuda tests: every test selected by -k cuda in the test files that skip without CUDA (grep
#      'cuda.is_available'): learners of PPO/APPO/DQN/SAC on CUDA whose weights reach the runner or an
#      inference server on CUDA (tests/test_gpu_paths.py, no Ray), a CUDA server answering as the CPU module
#      does, APPO with a remote learner and two servers sharing the GPU through Ray. FAIL if one fails, or
#      if one skips other than the CPU-only '..._without_cuda_...' tests.
#   4. benchmark: tests/benchmarks/inference.py on the frame env with the default CNN (8 runners x 4
#      envs, 2 s a point): local inference, central on the GPU with 1, 2 and 4 servers sharing it,
#      observations through shared memory (GPU_CHECK_BENCH_ARGS="... --cpu-modes
#      local,central" adds central on 8 CPU servers, ~30 s more), the server's
#      round trips at batch 32 and 256 (CPU and CUDA; shared memory and inline), APPO end to end with learner and server on the
#      GPU. Its JSON lines, then the issue's targets as PASS/FAIL lines: central on CUDA >= 2x local CPU
#      inference, p50 round trip <= 2 ms at batch 256 on CUDA.
#
# Here, from the repository root:   bash tests/benchmarks/gpu_wheels.sh     (fills .whl/, about 50 MiB)
# There (device run, carry [".whl"], timeout_s 480):   bash tests/benchmarks/gpu_check.sh
#   3b. learner profile: tests/benchmarks/learner_profile.py, APPO and PPO updates on the frame env (the Pong
#      file's batch sizes) on the GPU in float32 and bfloat16: wall time per update, the device's busy share,
#      ops and host-device syncs per update, the top ops (the Pong run of 2026-12-04 was bound by a 61-ms update).
# Expected about 5 minutes; each step has its own time limit (60 + 60 + 160 + 120 + 220 s at most), so a hang
# costs one step, never the run. GPU_CHECK_PONG_S=N adds a 5th step: APPO on Pong (tuned/pong-appo.yaml, needs
# ale-py among the wheels) for N seconds at most; its log and learning curve come back as pong.log and
# pong_progress.csv. GPU_CHECK_DEADLINE_S=S shortens it so the whole run ends S seconds after it started.
# GPU_CHECK_PONG_CONFIG='{"learner_precision": "bfloat16", "inference_config": {"precision": "bfloat16"}}' (any
# JSON of config settings) overrides the tuned file's for that run.
# What it wrote comes back from $OUT: gpu_check.log (everything), cuda_tests.xml, learner_profile.jsonl,
# inference_bench.jsonl.
# A dry run without a GPU (the CUDA cases skip, the benchmark runs on CPU only, smaller):
#   GPU_CHECK_DRY=1 GPU_CHECK_BENCH_ARGS="--runners 2 --envs 2 --servers 1" PYTHON=.venv/bin/python \
#       bash tests/benchmarks/gpu_check.sh
set -uo pipefail
cd "$(dirname "$0")/../.."
PY=${PYTHON:-python3}
OUT=${OUT:-/tmp/gpu_check_out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 PYTHONDONTWRITEBYTECODE=1 RAY_DEDUP_LOGS=0
unset RAY_ADDRESS
DRY=${GPU_CHECK_DRY:-0}
GPU_CHECK_BENCH_ARGS=${GPU_CHECK_BENCH_ARGS:---runners 8 --envs 4 --servers 8 --cpu-modes local --gpu-servers 1,2 --double-buffer off}
PONG_S=${GPU_CHECK_PONG_S:-0}  # > 0: then APPO on Pong (tuned/pong-appo.yaml) for at most this many seconds
failed=()
started=$(date +%s)

elapsed() { echo $(( $(date +%s) - started )); }
result() {  # result NAME ok|fail DETAIL
    local name=$1 ok=$2 detail=$3
    if [ "$ok" = ok ]; then echo "PASS $name: $detail"; else echo "FAIL $name: $detail"; failed+=("$name"); fi
    echo "{\"check\": \"$name\", \"ok\": $([ "$ok" = ok ] && echo true || echo false), \"elapsed_s\": $(elapsed)}"
}

main() {
# --- 1. environment ---------------------------------------------------------------------------------
if compgen -G ".whl/*.whl" > /dev/null; then
    if timeout 60 "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
            --target /tmp/site .whl/*.whl; then
        export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
    else
        result wheels fail "pip could not install .whl/*.whl into /tmp/site"
    fi
fi
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>/dev/null || echo "no nvidia-smi"
if "$PY" - "$DRY" <<'EOF'
import json, platform, sys
import gymnasium, lz4, ray, torch, zmq
cuda = torch.cuda.is_available()
print(json.dumps({"check": "environment_info", "python": platform.python_version(), "torch": torch.__version__,
                  "ray": ray.__version__, "gymnasium": gymnasium.__version__, "pyzmq": zmq.__version__,
                  "lz4": lz4.__version__, "cuda": torch.cuda.get_device_name(0) if cuda else None}))
sys.exit(0 if cuda or sys.argv[1] == "1" else 3)
EOF
then
    result environment ok "the packages import$([ "$DRY" = 1 ] && echo ' (dry run: a GPU is not required)')"
else
    result environment fail "a package does not import, or torch sees no CUDA device (output above)"
    echo "RESULT FAIL (${failed[*]}) after $(elapsed) s"
    return 1
fi

# --- 2. the engine, in full ---------------------------------------------------------------------------
if timeout 60 "$PY" -m pytest -q -p no:cacheprovider --timeout=30 -rs tests/test_inference_server.py; then
    result engine ok "tests/test_inference_server.py"
else
    result engine fail "tests/test_inference_server.py (output above)"
fi

# --- 3. every CUDA test --------------------------------------------------------------------------------
mapfile -t cuda_files < <(grep -l "cuda.is_available" tests/test_*.py)
echo "cuda test files: ${cuda_files[*]}"
timeout 160 "$PY" -m pytest -q -p no:cacheprovider --timeout=100 -rs -k cuda --junitxml="$OUT/cuda_tests.xml" \
    "${cuda_files[@]}"
if "$PY" - "$OUT/cuda_tests.xml" "$DRY" <<'EOF'
import json, sys
import xml.etree.ElementTree as ET
try:
    cases = ET.parse(sys.argv[1]).getroot().iter("testcase")
except (OSError, ET.ParseError) as err:
    sys.exit(f"no test report: {err}")
passed, failed, skipped = [], [], []
for case in cases:
    name = f"{case.get('classname')}::{case.get('name')}"
    if case.find("failure") is not None or case.find("error") is not None:
        failed.append(name)
    elif case.find("skipped") is not None:
        skipped.append(name)
    else:
        passed.append(name)
unexpected = [n for n in skipped if "without_cuda" not in n]
print(json.dumps({"check": "cuda_tests_detail", "passed": passed, "failed": failed, "skipped": skipped}))
dry = sys.argv[2] == "1"
sys.exit(1 if failed or (not dry and (unexpected or not passed)) else 0)
EOF
then
    result cuda_tests ok "every selected CUDA test passed (names in cuda_tests_detail)"
else
    result cuda_tests fail "a CUDA test failed or skipped (cuda_tests_detail above)"
fi

# --- 3b. where a learner update's time goes (APPO and PPO on frames, the Pong file's batch sizes) ----------
: > "$OUT/learner_profile.jsonl"
for precision in float32 bfloat16; do
    timeout 60 "$PY" tests/benchmarks/learner_profile.py --algos appo,ppo --workloads frames_cnn \
        --precision "$precision" --top 10 | tee -a "$OUT/learner_profile.jsonl"
done
if grep -q '"bench": "profile"' "$OUT/learner_profile.jsonl"; then
    result learner_profile ok "update times and their profiles in learner_profile.jsonl"
else
    result learner_profile fail "tests/benchmarks/learner_profile.py printed no profile (output above)"
fi

# --- 4. the inference benchmark -------------------------------------------------------------------------
skip=()
[ "$DRY" = 1 ] && skip=(--skip-gpu)
# shellcheck disable=SC2086
timeout 220 "$PY" tests/benchmarks/inference.py --workloads frames_cnn --seconds 2 --repeats 1 \
    --gpu-precisions float32,bfloat16 ${GPU_CHECK_BENCH_ARGS} \
    "${skip[@]}" | tee "$OUT/inference_bench.jsonl"
if "$PY" - "$OUT/inference_bench.jsonl" "$DRY" <<'EOF'
import json, sys
rows = [json.loads(line) for line in open(sys.argv[1]) if line.startswith("{")]
summary = next((r for r in rows if r.get("bench") == "summary"), None)
if summary is None:
    sys.exit("the benchmark printed no summary")
dry = sys.argv[2] == "1"
if not dry:
    ratios = {k: v for k, v in summary.items() if k.startswith("frames_cnn_central") and "_cuda" in k
              and k.endswith("_over_local") and "double" not in k}  # float32 and bfloat16 servers
    double = {k: v for k, v in summary.items() if k.startswith("frames_cnn_central_double_cuda")}
    ratio = max(ratios.values()) if ratios else None
    print(f"INFO central on CUDA / local, by servers sharing the GPU: {ratios}")
    print(f"INFO the same with runners double-buffering: {double}")
    trip = next((r for r in rows if r.get("bench") == "round_trip" and r["device"] == "cuda" and r["batch"] == 256
                 and r.get("transport", "shm") == "shm"), {})
    appo = next((r for r in rows if r.get("bench") == "appo_frames"), {})
    print(("PASS" if ratio is not None and ratio >= 2.0 else "FAIL")
          + f" target: frames_cnn env steps/s, central on CUDA / local CPU inference = {ratio} (issue: >= 2)")
    print(("PASS" if trip.get("p50_ms", 1e9) <= 2.0 else "FAIL")
          + f" target: round trip p50 at batch 256 on CUDA = {trip.get('p50_ms')} ms (issue: <= 2 ms)")
    print(f"INFO APPO on frames, learner and server on the GPU: {appo.get('env_steps_per_s')} env steps/s, "
          f"{appo.get('per_cpu_core')} per CPU core (Sample Factory: ~3.8k FPS/core on Atari)")
EOF
then
    result benchmark ok "tests/benchmarks/inference.py ran to its summary (targets: the PASS/FAIL target lines)"
else
    result benchmark fail "tests/benchmarks/inference.py did not finish (output above)"
fi

# --- 5. optional: APPO on Pong, learner on the GPU, for what time is left ------------------------------
if [ -n "${GPU_CHECK_DEADLINE_S:-}" ] && [ "$PONG_S" -gt $((GPU_CHECK_DEADLINE_S - $(elapsed))) ]; then
    PONG_S=$((GPU_CHECK_DEADLINE_S - $(elapsed)))  # what is left before the run's own deadline
    [ "$PONG_S" -lt 90 ] && { echo "INFO pong skipped: ${PONG_S} s left before GPU_CHECK_DEADLINE_S"; PONG_S=0; }
fi
if [ "$PONG_S" -gt 0 ]; then
    rm -rf /tmp/pong
    stop_s=$((PONG_S - 60))  # building (12 runner actors) and the final checkpoint fit in the rest
    dry=()
    [ -n "${GPU_CHECK_PONG_CONFIG:-}" ] && dry=(--config "$GPU_CHECK_PONG_CONFIG")
    [ "$DRY" = 1 ] && dry=(--config '{"num_gpus_per_learner": 0, "num_env_runners": 1}')
    timeout -k 20 -s INT "$PONG_S" "$PY" -m pipeline.cli train file tuned/pong-appo.yaml --output-dir /tmp/pong "${dry[@]}" \
        --stop "{\"env_runners/episode_return_mean\": 18, \"num_env_steps_sampled_lifetime\": 2500000, \"time_total_s\": $stop_s}" \
        > "$OUT/pong.log" 2>&1
    code=$?
    progress=$(find /tmp/pong -name progress.csv 2>/dev/null | head -1)
    [ -n "$progress" ] && cp "$progress" "$OUT/pong_progress.csv"
    tail -25 "$OUT/pong.log"
    if [ -n "$progress" ]; then
        result pong ok "ran ${PONG_S} s at most (exit $code); its curve in pong_progress.csv"
    else
        result pong fail "no progress.csv (exit $code; pong.log above)"
    fi
fi

if [ ${#failed[@]} -eq 0 ]; then
    echo "RESULT PASS after $(elapsed) s"
else
    echo "RESULT FAIL (${failed[*]}) after $(elapsed) s"
    return 1
fi
}

main 2>&1 | tee "$OUT/gpu_check.log"
exit "${PIPESTATUS[0]}"
