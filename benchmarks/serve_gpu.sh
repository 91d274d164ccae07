#!/usr/bin/env bash
# The serving benchmark on the GPU machine: `pagoda serve` + `pagoda bench serve` over loopback,
# then the same workload through the engine in-process (`pagoda bench offline`), so the table
# shows what HTTP, the engine-core process hop and streaming add to TTFT and TPOT.
#
# The GPU image has torch, httpx, anyio, h11, click and prometheus-client but not the server's
# other dependencies, and nothing can be fetched there. So, in two steps:
#
#   1. Here (a machine with pip), from the repo root:
#        bash benchmarks/serve_gpu.sh download
#      fetches manylinux wheels for Python 3.12 into .whl/ (ignored by git).
#   2. On the GPU machine (the device tool with carry [".whl"]), from the repo root:
#        bash benchmarks/serve_gpu.sh run
#      installs them under /tmp/site and runs the benchmark; logs and JSON land under $OUT.
#
# The model is the Qwen3-0.6B shape with dummy weights (no tokenizer is on that machine), so the
# prompts are random token ids (--prompt-format token-ids) and the outputs carry no text.
set -euo pipefail

WHEELS=(
  fastapi==0.165.0 starlette==1.10.0 opentelemetry-api==1.45.2
  pydantic==2.13.4 pydantic-core==2.46.4 annotated-types==0.7.0 typing-inspection==0.4.2
  uvicorn==0.54.0 pyzmq==27.3.0
)
MODEL_ARGS=(--model qwen3-0.6b --load-format dummy)
WORKLOAD_ARGS=(--prompt-format token-ids --num-prompts 256 --input-len 512 --output-len 256 --range-ratio 0.5 --ignore-eos)
PORT=8000

download() {
  grep -qxF /.whl/ .git/info/exclude || echo /.whl/ >> .git/info/exclude
  python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64 \
    --platform manylinux2014_x86_64 --platform manylinux1_x86_64 -d .whl "${WHEELS[@]}"
}

run() {
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
  export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
  OUT=${OUT:-/tmp/pagoda-serve}; mkdir -p "$OUT"
  nvidia-smi --query-gpu=name,memory.total --format=csv | tee "$OUT/gpu.txt"

  python3 -m pagoda.entrypoints.cli serve "${MODEL_ARGS[@]}" --port $PORT > "$OUT/server.log" 2>&1 &
  server=$!
  trap 'kill $server 2>/dev/null; wait $server 2>/dev/null' EXIT
  for _ in $(seq 1 300); do
    python3 -c "import httpx,sys; sys.exit(httpx.get('http://127.0.0.1:$PORT/health').status_code != 200)" 2>/dev/null && break
    kill -0 $server || { cat "$OUT/server.log"; exit 1; }
    sleep 1
  done
  for rate in inf 32; do
    python3 -m pagoda.entrypoints.cli bench serve --base-url http://127.0.0.1:$PORT "${WORKLOAD_ARGS[@]}" \
      --request-rate $rate --result-json "$OUT/serve_rate_$rate.json" 2>&1 | tee "$OUT/serve_rate_$rate.log"
  done
  python3 -c "import httpx; print(httpx.get('http://127.0.0.1:$PORT/metrics').text)" > "$OUT/metrics.txt" || true
  kill $server; wait $server || true
  trap - EXIT

  for rate in inf 32; do
    python3 -m pagoda.entrypoints.cli bench offline "${MODEL_ARGS[@]}" "${WORKLOAD_ARGS[@]}" \
      --request-rate $rate --result-json "$OUT/offline_rate_$rate.json" 2>&1 | grep -v "^INFO" | tee "$OUT/offline_rate_$rate.log"
  done
}

case "${1:-}" in
  download) download ;;
  run) run ;;
  *) echo "usage: bash benchmarks/serve_gpu.sh download|run" >&2; exit 2 ;;
esac
