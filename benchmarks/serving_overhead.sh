#!/usr/bin/env bash
# Server CPU per streamed token on this host: `foveal serve` on a tiny random Llama (benchmarks/tiny_configs.py,
# 2 layers, hidden 64) with one torch thread, 256 concurrent streams of IN (default 32) prompt / 256 output
# tokens through benchmarks/serving.py; prints the served throughput, the client's CPU, and the server
# process's CPU time over the run (ticks of 10 ms). The model is nearly free, so the server's CPU is mostly
# HTTP, streaming and the engine's per-token host work. Usage: bash benchmarks/serving_overhead.sh [serve flags]
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
PORT=${PORT:-8799}
DIR=$(mktemp -d)
$PY -c "import sys; sys.path.insert(0, 'benchmarks'); from tiny_configs import write_tiny_configs; write_tiny_configs('$DIR')"
OMP_NUM_THREADS=1 $PY -m foveal.cli serve --model "$DIR/llama-3.1-8b.json" --load-format dummy --port "$PORT" \
  --dtype float32 --max-model-len 2048 --max-num-seqs 256 --max-num-batched-tokens 8192 --log-level WARNING "$@" &
S=$!
trap 'kill $S 2>/dev/null; wait $S 2>/dev/null; rm -rf "$DIR"' EXIT
for _ in $(seq 120); do curl -sf "http://127.0.0.1:$PORT/health" | grep -q ready && break; sleep 1; done
t0=$(awk '{print $14+$15}' /proc/$S/stat)
/usr/bin/time -f "client cpu %U+%S s" $PY benchmarks/serving.py --base-url "http://127.0.0.1:$PORT/v1" \
  --concurrency 256 --num-requests 256 --input-len "${IN:-32}" --output-len 256 ${EXTRA:-} | grep -v "^{"
t1=$(awk '{print $14+$15}' /proc/$S/stat)
echo "server cpu ticks: $((t1 - t0))"
