#!/usr/bin/env bash
# The GPU check: one prepared run of at most 8 minutes on one CUDA device, for whoever is lent a
# GPU. Prepare here (`bash scripts/gpu_wheels.sh`), then on the device:
#     bash scripts/gpu_check.sh          (with .gpu_wheels carried along)
# It runs the CUDA tests, one bf16 training run per ZeRO stage at world size 1 (NCCL) with CPU
# and NVMe offload, fused decoding with and without CUDA graphs, and benchmarks/bench_gpu.py's
# figures (tokens/s, MFU, peak memory against plain PyTorch / Hugging Face eager), then
# benchmarks/bench_alst_gpu.py's (ALST at 16K-256K tokens against HF gradient checkpointing).
# Each part has its own time limit; a failing part does not stop the others. Everything lands
# in $OUT (or a temporary folder): gpu_summary.md (one line a part), bench_*.json, and the
# parts' logs in gpu_check_logs.tgz (a device run returns at most 8 files).
# GPU_CHECK_ONLY=serving runs, after the install and import parts, only inference v2's check
# instead (issue 29): its engine, attention, scheduler and CUDA-graph tests on the GPU, then
# benchmarks/bench_serving.py (v2 vs HF static batches vs v1 fused) with and without v2's CUDA
# graphs in bf16 and fp32, one decoding step timed alone, bursts of 128 requests and bf16's
# greedy tokens against fp32's; figures in
# bench_serving.jsonl, one line a run (GPU_CHECK_SERVING_RUNS names a subset, see below). The
# whole list takes longer than a device call may: run it with GPU_CHECK_DEADLINE=500 (the first
# H200 run of the first six parts took 452 s, most of it the bf16 cuDNN bug fixed since).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-$(mktemp -d)}
mkdir -p "$OUT"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
# the lent machines have python3 (the one holding torch) and may have no plain `python`
PY=${PYTHON:-$(command -v python3 || command -v python)}
summary="$OUT/gpu_summary.md"
started=$(date +%s)

# GPU_CHECK_DEADLINE (seconds from the start, default none) caps every part's limit at the time
# left and skips the parts that would get under 20 s, so a device call ends inside its timeout
deadline=${GPU_CHECK_DEADLINE:-0}
part() {  # part NAME SECONDS COMMAND...: run with a limit, log it, add a summary line
  local name=$1 limit=$2 begin rc left
  shift 2
  begin=$(date +%s)
  if [ "$deadline" -gt 0 ]; then
    left=$((started + deadline - begin))
    if [ "$left" -lt 20 ]; then
      echo "| $name | skipped | 0 s | ${left} s left before GPU_CHECK_DEADLINE |" >>"$summary"
      echo "skipped: ${left} s left" >"$OUT/$name.log"
      return
    fi
    [ "$left" -lt "$limit" ] && limit=$left
  fi
  timeout --kill-after=10 "$limit" "$@" >"$OUT/$name.log" 2>&1
  rc=$?
  echo "| $name | exit $rc | $(($(date +%s) - begin)) s | $(tail -n 1 "$OUT/$name.log" | cut -c1-160) |" >>"$summary"
}

{
  echo "# shardspeed GPU check $(date -u +%FT%TZ) on $(git rev-parse --short HEAD 2>/dev/null || echo '?')"
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>&1 | head -2
  "$PY" -c "import sys, torch; print(sys.version.split()[0], torch.__version__, torch.version.cuda, torch.cuda.is_available())"
  echo
  echo "| part | status | time | last line |"
  echo "|---|---|---|---|"
} >"$summary"

# shardspeed's own dependencies the device may lack, from the carried wheelhouse (no network)
missing=$("$PY" - <<'PY'
import importlib.util
names = {"pydantic": "pydantic>=2", "hjson": "hjson", "pytest": "pytest", "pytest_timeout": "pytest-timeout"}
print(" ".join(spec for mod, spec in names.items() if importlib.util.find_spec(mod) is None))
PY
)
if [ -n "$missing" ]; then
  part install 120 "$PY" -m pip install --no-index --find-links .gpu_wheels $missing
fi
part import 60 "$PY" -c "import shardspeed, shardspeed.runtime.engine; from shardspeed.accelerator import get_accelerator; print('shardspeed', shardspeed.__version__, 'accelerator', get_accelerator().device_name())"

if [ "${GPU_CHECK_ONLY:-}" = serving ]; then
  part v2_tests 200 "$PY" -m pytest -q -p no:cacheprovider --timeout 120 tests/inference/v2 \
    --ignore tests/inference/v2/test_server.py --ignore tests/inference/v2/test_pipeline.py \
    --ignore tests/inference/v2/test_server_choices.py \
    --ignore tests/inference/v2/test_server_logprobs.py \
    --ignore tests/inference/v2/test_server_penalties.py \
    --ignore tests/inference/v2/test_server_ops.py \
    --ignore tests/inference/v2/test_server_tp.py --ignore tests/inference/v2/test_engine_v2_tp.py
  # (GPU_CHECK_DEVICE=cpu GPU_CHECK_BENCH_ARGS=--tiny tries it on a CPU machine)
  serving() {  # serving NAME ARGS...: one bench_serving run on the small Llama, its JSON kept
    local name=$1
    shift
    part "$name" 150 "$PY" benchmarks/bench_serving.py --device "${GPU_CHECK_DEVICE:-cuda}" \
      --rounds 3 --hidden 1024 --heads 16 --kv-heads 8 "$@" ${GPU_CHECK_BENCH_ARGS:-}
    tail -n 1 "$OUT/$name.log" >>"$OUT/bench_serving.jsonl"
  }
  # the runs, by name (GPU_CHECK_SERVING_RUNS picks some, in its order; *_graph: v2 decodes
  # from CUDA graphs): the CPU table's workload (100 requests/s) in both dtypes; a saturating
  # one (all 128 requests at once) at the default token budget and at a short step's budget;
  # the first at that budget; one decoding step timed alone (bench_v2_step.py: v2 against HF
  # and v1 at 8 and 64 sequences); tokens_bfloat16: how often HF alone, HF's static batches
  # and v2 keep float32's greedy tokens in bf16 (bench_v2_tokens.py). Run with
  # GPU_CHECK_DEADLINE, the later ones may not fit.
  serving_run() {
    case $1 in
      fp32) serving bench_serving_fp32 --dtype float32 --rate 100 --requests 64 ;;
      bf16) serving bench_serving_bf16 --dtype bfloat16 --rate 100 --requests 64 ;;
      fp32_graph)
        serving bench_serving_fp32_graph --dtype float32 --rate 100 --requests 64 --cuda-graph ;;
      bf16_graph)
        serving bench_serving_bf16_graph --dtype bfloat16 --rate 100 --requests 64 --cuda-graph ;;
      bf16_burst_graph)
        serving bench_serving_bf16_burst_graph --dtype bfloat16 --rate 5000 --requests 128 \
          --kv-blocks 4096 --cuda-graph ;;
      bf16_burst)
        serving bench_serving_bf16_burst --dtype bfloat16 --rate 5000 --requests 128 \
          --kv-blocks 4096 ;;
      bf16_burst_b128)
        serving bench_serving_bf16_burst_b128 --dtype bfloat16 --rate 5000 --requests 128 \
          --kv-blocks 4096 --token-budget 128 ;;
      bf16_b128)
        serving bench_serving_bf16_b128 --dtype bfloat16 --rate 100 --requests 64 \
          --token-budget 128 ;;
      tokens_*)  # how often each path keeps float32's greedy tokens (bench_v2_tokens.py)
        part "bench_v2_$1" 120 "$PY" benchmarks/bench_v2_tokens.py --device "${GPU_CHECK_DEVICE:-cuda}" \
          --dtype "${1#tokens_}" --hidden 1024 --heads 16 --kv-heads 8 ${GPU_CHECK_BENCH_ARGS:-}
        tail -n 1 "$OUT/bench_v2_$1.log" >>"$OUT/bench_serving.jsonl" ;;
      step_*_graph)
        dtype=${1#step_}
        part "bench_v2_$1" 90 "$PY" benchmarks/bench_v2_step.py --cuda-graph \
          --device "${GPU_CHECK_DEVICE:-cuda}" --dtype "${dtype%_graph}" ${GPU_CHECK_BENCH_ARGS:-}
        tail -n 1 "$OUT/bench_v2_$1.log" >>"$OUT/bench_serving.jsonl" ;;
      step_*)
        part "bench_v2_$1" 90 "$PY" benchmarks/bench_v2_step.py \
          --device "${GPU_CHECK_DEVICE:-cuda}" --dtype "${1#step_}" ${GPU_CHECK_BENCH_ARGS:-}
        tail -n 1 "$OUT/bench_v2_$1.log" >>"$OUT/bench_serving.jsonl" ;;
      *) echo "| $1 | unknown run | 0 s | |" >>"$summary" ;;
    esac
  }
  # graphs first: the fp32 run repeats the first H200 run's table with them (eager fp32 was
  # measured there), then bf16 with and without them
  runs="fp32_graph bf16_graph bf16 step_bfloat16_graph step_bfloat16 bf16_burst_graph fp32"
  runs="$runs bf16_burst bf16_burst_b128 bf16_b128 tokens_bfloat16"
  for run in ${GPU_CHECK_SERVING_RUNS:-$runs}; do
    serving_run "$run"
  done
  echo "total $(($(date +%s) - started)) s" >>"$summary"
  (cd "$OUT" && tar czf gpu_check_logs.tgz ./*.log && rm -f ./*.log)
  cat "$summary"
  exit 0
fi

# the tests that skip without CUDA, and the ones that touch the accelerator
part cuda_tests 150 "$PY" -m pytest -q -p no:cacheprovider --timeout 120 \
  tests/accelerator tests/runtime/precision/test_overflow.py tests/ops/test_optimizers.py \
  tests/inference/test_cuda_graph.py tests/compat/test_op_builder.py

# training per stage (bf16, world 1, NCCL) with CPU/NVMe offload, then decoding; figures as JSON
# (GPU_CHECK_BENCH_ARGS=--tiny tries the script on a CPU machine in seconds)
nvme="${NVME_DIR:-/tmp}"
extra=${GPU_CHECK_BENCH_ARGS:-}
part bench_train 210 "$PY" benchmarks/bench_gpu.py --only train --nvme_dir "$nvme" $extra
part bench_decode 90 "$PY" benchmarks/bench_gpu.py --only decode $extra
# ALST's single-device parts (tiled MLP and loss, hidden states offloaded) against HF checkpointing
part bench_alst 150 "$PY" benchmarks/bench_alst_gpu.py $extra
for what in train decode alst; do
  tail -n 1 "$OUT/bench_$what.log" >"$OUT/bench_$what.json"
done

echo >>"$summary"
echo "total $(($(date +%s) - started)) s; figures in bench_train.json / bench_decode.json / bench_alst.json" >>"$summary"
# a device run returns at most 8 files: the logs travel as one archive beside the summary and JSON
(cd "$OUT" && tar czf gpu_check_logs.tgz ./*.log && rm -f ./*.log)
cat "$summary"
