#!/usr/bin/env bash
# Side by side, same GGUF, same CPU, same load generator: llama.cpp's llama-server (continuous batching,
# 16 slots) and `foveal serve`, at concurrency 16 (32 requests) and 1 (4 requests), 128 prompt words /
# 128 output tokens, streaming /v1/completions, ignore_eos. One server at a time.
# Usage: LLAMA_SERVER=/path/to/llama-server [DTYPES="default bfloat16 float32"] [SKIP_LLAMA=1] \
#          [FOVEAL_ARGS="--max-num-batched-tokens 512"] [GGUF=/path/to/other.gguf] bash benchmarks/run_serving_peer.sh
# GGUF: another file for both servers (e.g. the embedded one requantized by llama.cpp's llama-quantize
# --allow-requantize to Q4_K_M); by default the embedded model.
# DTYPES: one Foveal run per entry; "default" (the default) passes no --dtype: `foveal serve` as a user
# starts it (the embedded GGUF quantized on CPU). llama-server: built from the llama.cpp vendored in
# llama-cpp-python's sdist (cmake -DGGML_NATIVE=ON), e.g. .../vendor/llama.cpp/build/bin/llama-server.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
PORT=${PORT:-8766}
LLAMA_SERVER=${LLAMA_SERVER:-/work/llama.cpp/build/bin/llama-server}
GGUF=${GGUF:-$($PY -c "from foveal.loader.default_model import default_model_path; print(default_model_path())")}

wait_ready() {
  for _ in $(seq 180); do
    curl -sf "http://127.0.0.1:$PORT/health" | grep -q -E '"(ok|ready)"' && return 0
    sleep 1
  done
  echo "server did not become ready" >&2
  return 1
}

wait_closed() {  # the next server must be able to bind the port (not just find /health silent)
  for _ in $(seq 60); do
    $PY -c "import socket, sys; s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1); s.bind(('127.0.0.1', $PORT))" 2>/dev/null && return 0
    sleep 1
  done
}

run_load() {  # $1 = label
  # each level its own prompts (--seed): the 1-stream run must not find the 16-stream run's prompts
  # in a prefix cache (before session 8 it did: Foveal's 1-stream TTFTs were cache hits)
  for spec in "16 32 16" "1 4 1"; do
    set -- "$1" $spec
    echo -n "$1 concurrency $2: "
    $PY benchmarks/serving.py --base-url "http://127.0.0.1:$PORT/v1" --concurrency "$2" --num-requests "$3" \
      --input-len 128 --output-len 128 --seed "$4" | tail -1
  done
}

SERVER=
trap '[ -n "$SERVER" ] && { kill $SERVER 2>/dev/null || true; wait $SERVER 2>/dev/null || true; }' EXIT
if [ -z "${SKIP_LLAMA:-}" ]; then
  "$LLAMA_SERVER" --version 2>&1 | head -2
  "$LLAMA_SERVER" -m "$GGUF" --port "$PORT" -np 16 -c 8192 -t 2 --log-disable >/dev/null 2>&1 &
  SERVER=$!
  wait_ready
  run_load llama-server
  kill $SERVER; wait $SERVER 2>/dev/null || true
  wait_closed
fi

for dtype in ${DTYPES:-default}; do
  dtype_flag=()
  [ "$dtype" != default ] && dtype_flag=(--dtype "$dtype")
  $PY -m foveal.cli serve --model "$GGUF" --port "$PORT" "${dtype_flag[@]}" --max-num-seqs 16 --log-level WARNING ${FOVEAL_ARGS:-} &
  SERVER=$!
  wait_ready
  run_load "foveal-$dtype${FOVEAL_ARGS:+ $FOVEAL_ARGS}"
  kill $SERVER; wait $SERVER 2>/dev/null || true
  wait_closed
done
