#!/usr/bin/env bash
# One device call after the sampling work: engine GPU tests (graphs on), sampling GPU tests, sampler timing.
set -o pipefail
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
OUT=${OUT:-/tmp/pagoda-gpu}; mkdir -p "$OUT"
python -m pytest -q -m gpu tests/engine/test_engine_e2e.py tests/engine/test_sampling_e2e.py tests/sample/test_logits_processing.py tests/sample/test_sampler.py -W ignore::FutureWarning 2>&1 | tee "$OUT/gpu_tests.log" | tail -4
python benchmarks/sampler_bench.py 2>&1 | tee "$OUT/sampler_bench.log" | tail -12
