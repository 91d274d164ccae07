#!/usr/bin/env bash
# One device call: the GPU test suite, then the nanobench throughput figure.
# Run from the repo root on the GPU machine: bash benchmarks/gpu_check.sh  (logs under $OUT)
set -o pipefail
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
OUT=${OUT:-/tmp/pagoda-gpu}; mkdir -p "$OUT"
nvidia-smi --query-gpu=name,memory.total --format=csv | tee "$OUT/gpu.txt"
python -c "import torch, triton, transformers; print('torch', torch.__version__, 'triton', triton.__version__, 'transformers', transformers.__version__)" | tee -a "$OUT/gpu.txt"
python -m pytest -q -m gpu tests/test_engine_e2e.py -W ignore::FutureWarning -x 2>&1 | tee "$OUT/gpu_tests.log" | tail -5
python -m pagoda.benchmarks.throughput --model qwen3-0.6b --load-format dummy --workload nanobench --log-level INFO 2>&1 | tee "$OUT/nanobench.log" | grep -v "^INFO pagoda.model" | tail -12
