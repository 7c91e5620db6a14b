#!/usr/bin/env bash
# Start `foveal serve` on the embedded model (bf16 unless DTYPE is set), wait until /health is ready,
# run benchmarks/serving.py at concurrency 1, 8 and 32 (128 prompt words / 128 output tokens), then stop.
# Usage: bash benchmarks/run_serving.sh [extra foveal serve flags]
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
PORT=${PORT:-8765}
DTYPE=${DTYPE:-bfloat16}
$PY -m foveal.cli serve --port "$PORT" --dtype "$DTYPE" --max-num-seqs 32 --log-level WARNING "$@" &
SERVER=$!
trap 'kill $SERVER 2>/dev/null; wait $SERVER 2>/dev/null' EXIT
for _ in $(seq 120); do
  curl -sf "http://127.0.0.1:$PORT/health" | grep -q ready && break
  sleep 1
done
# each level its own prompts (--seed): a level must not find the previous one's in the prefix cache
for spec in "1 8 1" "8 32 8" "32 32 32"; do
  set -- $spec
  $PY benchmarks/serving.py --base-url "http://127.0.0.1:$PORT/v1" --concurrency "$1" --num-requests "$2" \
    --input-len 128 --output-len 128 --seed "$3" | tail -1
done
