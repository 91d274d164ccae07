#!/usr/bin/env bash
# One device call for the KV-cache groups work: nanobench and batch-1 decode before and after
# (alternating, twice), then the GPU tests twice.
# Run from the repo root on the GPU machine: bash benchmarks/kv_groups_gpu.sh BASE (benchmarks), or
# KV_GROUPS_PART=tests bash benchmarks/kv_groups_gpu.sh BASE [test files...] (the GPU tests, twice).
# BASE holds the earlier commit's `pagoda` package (git archive <commit> pagoda | tar -x -C BASE).
set -o pipefail
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/pagoda-gpu}; mkdir -p "$OUT"
base=$1; shift
summary="$OUT/summary.txt"
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | tee "$summary"
run() {  # label, package root, models for batch-1 decode
  local label=$1 root=$2; shift 2
  PYTHONPATH=$root python -m pagoda.benchmarks.throughput --model qwen3-0.6b --load-format dummy --workload nanobench \
    > "$OUT/nanobench_$label.log" 2>&1
  echo "$label nanobench: $(grep -E "^pagoda: |floor: " "$OUT/nanobench_$label.log" | sed "s/.*shared by [0-9]* GPU(s): /floor /" | head -2 | tr '\n' ' ')" | tee -a "$summary"
  for model in "$@"; do
    PYTHONPATH=$root python -m pagoda.benchmarks.latency --model $model --load-format dummy --batch-sizes 1 \
      --prefill-lens 1024 --repeats 3 > "$OUT/latency_${model}_$label.log" 2>&1
    echo "$label $model: $(grep -E "decode/token b=1" "$OUT/latency_${model}_$label.log" | head -2 | tr '\n' ' ')" | tee -a "$summary"
  done
}
if [ "${KV_GROUPS_PART:-bench}" = bench ]; then
  run before "$base" qwen3-0.6b llama-3.1-8b; run after "$PWD" qwen3-0.6b llama-3.1-8b
  run before2 "$base" qwen3-0.6b; run after2 "$PWD" qwen3-0.6b
  exit 0
fi
export PYTHONPATH=$PWD
for i in 1 2; do
  python -m pytest -q -m gpu "$@" -W ignore::FutureWarning -p no:cacheprovider > "$OUT/gpu_tests_$i.log" 2>&1
  echo "gpu tests run $i: $(tail -1 "$OUT/gpu_tests_$i.log")" | tee -a "$summary"
done
cat "$summary"
