#!/usr/bin/env bash
# Everything issue 5 checks and times on the H200, in parts that each fit one device call (10 min):
#   tests    the CUDA tests + the Triton kernel and fused-op tests on real kernels, then the kernel
#            micro-benchmark (benchmarks/attention_kernels.py)
#   foveal   W1-W4 through the engine (benchmarks/gpu_workloads.py, ceilings measured first)
#   serve    W5: `foveal serve` on the W2 model, 256 streams of 512/256 (benchmarks/serving.py)
#   hf       transformers on the same workloads (benchmarks/hf_baseline.py; reduced request counts)
# Usage (on the GPU machine, .whl/ beside the tree): FOVEAL_COMMIT=<sha> bash scripts/gpu_bench.sh tests foveal serve
# Wheels for packages the GPU image lacks travel in .whl/ (make them with scripts/device_wheels.sh).
# Logs go to $OUT (when set) as well as stdout. Check the scripts on CPU first:
#   .venv/bin/python benchmarks/gpu_workloads.py --smoke --profile
set -uo pipefail
cd "$(dirname "$0")/.."
source scripts/device_env.sh
LOG=${OUT:-/tmp}
for part in "$@"; do
  echo "=== $part $(date -u +%H:%M:%S)"
  case $part in
    tests)
      TESTS=${TESTS:-tests/test_gpu.py tests/test_triton_attention.py tests/test_fused_ops.py tests/test_cuda_graphs.py tests/test_async_scheduling.py}
      timeout ${T_TESTS:-300} python3 -m pytest -q -p no:cacheprovider $TESTS 2>&1 | tee "$LOG/tests.txt" | tail -15
      if [ "${KERNEL_BENCH:-1}" = 1 ]; then
        timeout 180 python3 benchmarks/attention_kernels.py 2>&1 | tee "$LOG/attention_kernels.txt" | tail -30
      fi
      ;;
    foveal)
      timeout ${T_FOVEAL:-540} python3 benchmarks/gpu_workloads.py ${WORKLOADS:+--workloads $WORKLOADS} ${PROFILE:+--profile} ${ASYNC:+--async-scheduling $ASYNC} \
        2>&1 | tee "$LOG/gpu_workloads.txt" | grep -v "^\[transformers\]" | tail -80
      ;;
    serve)
      PORT=8765
      python3 -m foveal.cli serve --model ${SERVE_MODEL:-benchmarks/configs/llama-3.1-8b.json} --load-format dummy \
        --port $PORT --max-model-len 2048 --max-num-seqs 256 --max-num-batched-tokens 8192 \
        --log-level WARNING > "$LOG/serve.txt" 2>&1 &
      SERVER=$!
      for _ in $(seq 240); do
        curl -sf "http://127.0.0.1:$PORT/health" | grep -q ready && break
        sleep 1
      done
      cpu0=$(awk '{print $14+$15}' /proc/$SERVER/stat); t0=$(date +%s.%N)
      timeout ${T_SERVE:-300} python3 benchmarks/serving.py --base-url "http://127.0.0.1:$PORT/v1" --concurrency 256 \
        --num-requests 256 --input-len 512 --output-len 256 2>&1 | tee "$LOG/serving.txt" | tail -9
      cpu1=$(awk '{print $14+$15}' /proc/$SERVER/stat); t1=$(date +%s.%N)
      python3 -c "print(f'server process CPU {($cpu1-$cpu0)/100:.1f} s over {$t1-$t0:.1f} s wall (bench incl.)')"
      kill $SERVER; wait $SERVER 2>/dev/null
      tail -5 "$LOG/serve.txt"
      ;;
    hf)
      timeout 540 python3 benchmarks/hf_baseline.py ${HF_ARGS:-} 2>&1 | tee "$LOG/hf_baseline.txt" \
        | grep -v "^\[transformers\]" | tail -30
      ;;
    *) echo "unknown part $part" ;;
  esac
done
