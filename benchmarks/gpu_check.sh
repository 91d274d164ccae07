#!/usr/bin/env bash
# One device call: the GPU test suite, then the nanobench throughput figure and a step profile.
# Run from the repo root on the GPU machine: bash benchmarks/gpu_check.sh [test files...]
# (logs under $OUT; with no arguments, every test file with GPU-marked tests).
set -o pipefail
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
OUT=${OUT:-/tmp/pagoda-gpu}; mkdir -p "$OUT"
nvidia-smi --query-gpu=name,memory.total --format=csv | tee "$OUT/gpu.txt"
python -c "import torch, triton, transformers; print('torch', torch.__version__, 'triton', triton.__version__, 'transformers', transformers.__version__)" | tee -a "$OUT/gpu.txt"
tests=("$@")
[ ${#tests[@]} -eq 0 ] && tests=(tests)
python -m pytest -q -m gpu "${tests[@]}" -W ignore::FutureWarning 2>&1 | tee "$OUT/gpu_tests.log" | tail -15
python -m pagoda.benchmarks.throughput --model qwen3-0.6b --load-format dummy --workload nanobench --log-level INFO 2>&1 \
  | tee "$OUT/nanobench.log" | grep -v "^INFO pagoda.model" | tail -14
python benchmarks/profile_steps.py 2>&1 | grep -v "^INFO pagoda.model" > "$OUT/profile.log"; tail -4 "$OUT/profile.log"
