#!/usr/bin/env bash
# Issue 18 on the H200 (.whl/, .vocab/ and before/ beside the tree): parts, each fitting one call.
#   tests   the structured-output tests on CUDA (the bitmask kernel, guided decoding through the engine with
#           async scheduling and CUDA graphs, the think block), plus the async/speculative/graph tests
#   bench   benchmarks/structured.py: JSON-schema vs unconstrained TPOT at batch 1 and 64 on the dummy
#           Llama-3.1-8B (.vocab/llama3: the Llama 3 tokenizer, llama.cpp's models/ggml-vocab-llama-bpe.gguf
#           from the llama-cpp-python 0.3.36 sdist, converted here by transformers and saved: the GPU
#           machine's older transformers converts it differently), mask time per row, compile time
#           (the held-out schemas travel in .vocab/heldout/ for this: they are not in the repository)
#   w3      W3 alone, this checkout and before/ (`git archive <base> foveal benchmarks | tar -x -C before`)
#           alternating, twice each: the engine split's before/after
# Usage: FOVEAL_COMMIT=$(git rev-parse --short HEAD) bash scripts/structured_device.sh tests bench
set -uo pipefail
cd "$(dirname "$0")/.."
source scripts/device_env.sh
for part in "$@"; do
  echo "=== $part $(date -u +%H:%M:%S)"
  case $part in
    tests)
      timeout ${T_TESTS:-240} python3 -m pytest -q -p no:cacheprovider tests/test_structured.py \
        tests/test_structured_outputs.py tests/test_async_scheduling.py tests/test_cuda_graphs.py \
        tests/test_speculative.py -k "not real_model" 2>&1 | tail -15
      ;;
    bench)
      timeout ${T_BENCH:-330} python3 benchmarks/structured.py --schemas .vocab/heldout \
        --model benchmarks/configs/llama-3.1-8b.json --load-format dummy \
        --tokenizer .vocab/llama3 --batches 1,64 --max-tokens 256 2>&1 \
        | grep -v " INFO \|^\[transformers\]" | tail -8
      ;;
    w3)
      for i in 1 2; do
        echo "-- after $i"; timeout 100 python3 benchmarks/gpu_workloads.py --workloads w3 2>&1 | grep "^W3:"
        echo "-- before $i"; (cd before && PYTHONPATH=/tmp/site:$PWD FOVEAL_COMMIT=before timeout 100 \
          python3 benchmarks/gpu_workloads.py --workloads w3 2>&1 | grep "^W3:")
      done
      ;;
  esac
done
