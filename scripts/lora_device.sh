#!/usr/bin/env bash
# Issue 21 on the H200 (.whl/ beside the tree, from scripts/device_wheels.sh: it has peft):
#   tests   the LoRA tests on CUDA (Triton shrink/expand, mixed adapters through captured graphs and async
#           scheduling == each request alone == PEFT) and the graph/async tests beside them
#   kernels benchmarks/lora.py --kernels: each 8B projection with LoRA vs its plain GEMM (graph replay)
#   bench   benchmarks/lora.py: dummy Llama-3.1-8B, bf16, rank 16 on every linear, batch 64: plain engine,
#           LoRA engine with base rows, 1 adapter, 8 distinct adapters (REPS alternating rounds)
# Usage: FOVEAL_COMMIT=$(git rev-parse --short HEAD) bash scripts/lora_device.sh tests bench
set -uo pipefail
cd "$(dirname "$0")/.."
source scripts/device_env.sh
for part in "$@"; do
  echo "=== $part $(date -u +%H:%M:%S)"
  case $part in
    tests)
      timeout ${T_TESTS:-240} python3 -m pytest -q -p no:cacheprovider tests/test_lora.py tests/test_lora_kernels.py \
        tests/test_cuda_graphs.py tests/test_async_scheduling.py -k "not real_model" 2>&1 | tail -15
      ;;
    kernels)
      timeout ${T_KERNELS:-200} python3 benchmarks/lora.py --kernels --rank 16 --adapters 8 2>&1 | grep -v ' INFO ' | tail -20
      ;;
    bench)
      timeout ${T_BENCH:-420} python3 benchmarks/lora.py --model benchmarks/configs/llama-3.1-8b.json \
        --load-format dummy --dtype bfloat16 --batch ${BATCH:-64} --adapters ${ADAPTERS:-8} --rank 16 \
        --input-len 128 --output-len ${OUT_LEN:-128} --reps ${REPS:-3} 2>&1 | grep -v " INFO " | tail -16
      ;;
  esac
done
