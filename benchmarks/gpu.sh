#!/usr/bin/env bash
# The benchmarks on a GPU machine, or their reduced CPU versions (CI; `--reduced`, or no GPU found).
#
# GPU mode (nvidia-smi lists a GPU and no --reduced), a Qwen2.5-0.5B-shaped Qwen2 built from its config with random
# weights (speed only, no hub access):
#   1. trainer_precision.py: trainer step time, float32 vs bf16 (+ liger where installed) and the micro-batch
#      layouts (batch_flattening, max_tokens_per_microbatch), as ratios measured in one run (needs no vLLM: where
#      vLLM cannot be imported, as on a machine with torch alone, it runs this one and skips 2-4);
#   2. overlap.py with vLLM and the trainer on the same GPU (vLLM capped at 35% of its memory, gloo weight push);
#   3. overlap.py with vLLM on GPU 0 and the trainer on GPU 1 (NCCL weight push), where 2 GPUs exist;
#   4. weight_sync.py: the Qwen2.5-0.5B-shaped weight push (bfloat16, NCCL) against a raw collective for the same bytes
#      (weight_sync_mode: delta needs the gloo data plane, so only full pushes run here).
# Reduced CPU mode: trainer_precision.py --reduced and overlap.py --reduced (tiny model, vLLM CPU build), which run to
# completion in about a minute or two on 2 cores; the numbers only show that the scripts still measure.
#
#   benchmarks/gpu.sh [--reduced] [--out DIR]     (PYTHON=... picks the interpreter; default .venv/bin/python)
#
# Each benchmark's stdout goes to DIR/<name>.txt (default: a fresh temporary folder) and to this script's stdout.
# Exit status: the first failing benchmark's, after running the rest.
set -u
cd "$(dirname "$0")/.."
PYTHON="${PYTHON:-.venv/bin/python}"
[ -x "$PYTHON" ] || PYTHON="$(command -v python3)"
REDUCED=0
OUT=""
while [ $# -gt 0 ]; do
  case "$1" in
    --reduced) REDUCED=1 ;;
    --out) OUT="$2"; shift ;;
    -h|--help) sed -n '2,19p' "$0"; exit 0 ;;
    *) echo "gpu.sh: unknown argument $1 (use --reduced, --out DIR)" >&2; exit 2 ;;
  esac
  shift
done
OUT="${OUT:-$(mktemp -d -t gpu-bench-XXXXXX)}"
mkdir -p "$OUT"

GPUS=0
if command -v nvidia-smi >/dev/null 2>&1; then
  GPUS=$(nvidia-smi -L 2>/dev/null | grep -c '^GPU' || true)
fi
if [ "$GPUS" -eq 0 ] && [ "$REDUCED" -eq 0 ]; then
  echo "gpu.sh: no GPU found: running the reduced CPU mode"
  REDUCED=1
fi
echo "gpu.sh: mode $([ "$REDUCED" -eq 1 ] && echo reduced-cpu || echo gpu), GPUs $GPUS, results in $OUT"

STATUS=0
bench() {  # bench NAME SCRIPT ARGS...: run one benchmark, keep its output, remember the first failure
  local name="$1"; shift
  echo "=== $name: $*"
  local start=$SECONDS
  "$PYTHON" "$@" > "$OUT/$name.txt" 2> "$OUT/$name.err"
  local rc=$?
  cat "$OUT/$name.txt"
  if [ $rc -ne 0 ]; then
    echo "=== $name FAILED (exit $rc); last lines of $OUT/$name.err:"
    tail -n 20 "$OUT/$name.err"
    [ $STATUS -eq 0 ] && STATUS=$rc
  fi
  echo "=== $name: $((SECONDS - start)) s"
}

if [ "$REDUCED" -eq 1 ]; then
  bench trainer_precision benchmarks/trainer_precision.py --reduced --steps 1
  bench overlap benchmarks/overlap.py --reduced --device cpu
else
  bench trainer_precision benchmarks/trainer_precision.py --steps 3
  if ! "$PYTHON" -c "import vllm" >/dev/null 2>&1; then
    echo "=== overlap and weight_sync: skipped (vLLM is not importable by $PYTHON; they serve the policy with it)"
    echo "gpu.sh: done (exit $STATUS), results in $OUT"
    exit $STATUS
  fi
  bench overlap_same_gpu benchmarks/overlap.py --device cuda --shape qwen0.5b --vllm-gpu 0 --trainer-gpu 0 \
    --max-completion 256 --prompts 16 --micro 16
  if [ "$GPUS" -ge 2 ]; then
    bench overlap_two_gpus benchmarks/overlap.py --device cuda --shape qwen0.5b --vllm-gpu 0 --trainer-gpu 1 \
      --max-completion 256 --prompts 16 --micro 16
  else
    echo "=== overlap_two_gpus: skipped (1 GPU)"
  fi
  bench weight_sync benchmarks/weight_sync.py --shape qwen0.5b --vllm-dtype bfloat16 --pushes 3 --modes full \
    --learning-rate 0
fi
echo "gpu.sh: done (exit $STATUS), results in $OUT"
exit $STATUS
