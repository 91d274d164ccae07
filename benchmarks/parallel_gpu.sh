#!/usr/bin/env bash
# Tensor/pipeline parallelism on a multi-GPU machine, one device call per part:
#   bash benchmarks/parallel_gpu.sh check   # GPU topology, all-reduce NCCL vs one-shot, the GPU tests
#   bash benchmarks/parallel_gpu.sh bench   # Llama-3.1-8B batch-1/32 decode at TP=1/2(/4), nanobench at
#                                           # TP=2 beside TP=1, Qwen3-0.6B batch-1 decode
# Logs under $OUT.
set -o pipefail
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
OUT=${OUT:-/tmp/pagoda-gpu}; mkdir -p "$OUT"
gpus=$(python -c "import torch; print(torch.cuda.device_count())")
case "$1" in
check)
  nvidia-smi topo -m | tee "$OUT/topo.txt"
  env | grep -E "NCCL|SYMM|NVSHMEM" | tee -a "$OUT/topo.txt"
  python benchmarks/allreduce.py 2>&1 | tee "$OUT/allreduce.log" | tail -12
  python -m pytest -q -s -m gpu tests/executor/test_parallel_gpu.py tests/model/test_triton_gemv.py -W ignore::FutureWarning 2>&1 \
    | tee "$OUT/parallel_tests.log" | tail -15
  ;;
bench)
  sizes=(1 2); [ "$gpus" -ge 4 ] && sizes+=(4)
  for tp in "${sizes[@]}"; do
    python -m pagoda.benchmarks.latency --model llama-3.1-8b --load-format dummy -tp "$tp" --batch-sizes 1 32 \
      --prefill-lens 1024 --repeats 3 --result-json "$OUT/latency_tp$tp.json" 2>&1 | tee "$OUT/latency_tp$tp.log" | tail -5
  done
  for tp in 2 1; do
    python -m pagoda.benchmarks.throughput --model llama-3.1-8b --load-format dummy --workload nanobench -tp "$tp" \
      --result-json "$OUT/nanobench_tp$tp.json" 2>&1 | tee "$OUT/nanobench_tp$tp.log" | tail -3
  done
  python -m pagoda.benchmarks.latency --model qwen3-0.6b --load-format dummy --batch-sizes 1 --prefill-lens 1024 \
    --repeats 3 --result-json "$OUT/latency_qwen3.json" 2>&1 | tee "$OUT/latency_qwen3.log" | tail -4
  ;;
*) echo "usage: $0 check|bench"; exit 2 ;;
esac
