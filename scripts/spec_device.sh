#!/usr/bin/env bash
# Issue 17 on the H200 (.whl/ and before/ beside the tree): parts, each fitting one call.
#   tests    the speculative tests (greedy with speculation == plain greedy, draft = target accepts all,
#            the rejection sampler's statistics) and the CUDA/async/graph tests, on CUDA
#   oracle   benchmarks/speculative.py --oracle: k = 4, acceptance 100/70/40%, batch 1/8/64, in float32
#            (lossless: on random weights bfloat16's greedy token depends on the batch shape)
#   forced   the same in bfloat16 with --forced: the oracle's runs are accepted by construction (cost)
#   adaptive issue 19: --forced with the load-aware k policy (the default) at batch 1/8/64/256
#            (BATCHES, REPS), 32 GiB of KV per engine; adaptive-tests: its tests and the grammar's on CUDA
#   control  a plain engine in the speculating engine's place, same driver (the matrix's noise floor)
#   heads    issue 19: full-size random EAGLE-3 (dummy Llama-3.1-8B) and DFlash (5 layers, block 8, dummy
#            Qwen3-8B) heads (METHODS; mtp: dummy MiMo-7B shape): the drafter's cost per step at batch 1
#            and 64, and the speedup with the head drafting for cost and the oracle's drafts forced accepted
#   heads-tests  the hidden-state drafters' tests (greedy == plain, drafts == dense reference) on CUDA
#   gemm     time one Llama-3.1-8B MLP projection (4096 -> 14336) at 1..320 rows, fp32 and bf16: the
#            verify step's extra rows are free only while the GEMM stays bandwidth-bound
#   w3       W3 alone in its own process, this checkout and before/ alternating, 3 times each (the first
#            run on a fresh machine also fills Triton's kernel cache: compare the later ones)
#   w13      W1-W3 (benchmarks/gpu_workloads.py) at this checkout, then at the checkout in before/
#            (`git archive <base> foveal benchmarks | tar -x -C before`): the step contract's before/after
# Usage: FOVEAL_COMMIT=$(git rev-parse --short HEAD) bash scripts/spec_device.sh tests oracle
set -uo pipefail
cd "$(dirname "$0")/.."
source scripts/device_env.sh
for part in "$@"; do
  echo "=== $part $(date -u +%H:%M:%S)"
  case $part in
    tests)
      timeout ${T_TESTS:-300} python3 -m pytest -q -p no:cacheprovider tests/test_spec_verify.py tests/test_speculative.py \
        tests/test_gpu.py tests/test_cuda_graphs.py tests/test_async_scheduling.py tests/test_triton_attention.py \
        -k "not real_model" 2>&1 | tail -15
      ;;
    oracle)
      timeout ${T_ORACLE:-280} python3 benchmarks/speculative.py --oracle --dtype float32 2>&1 | grep -v " INFO " | tail -22
      ;;
    adaptive)
      # issue 19: the load-aware policy (the default) against plain decoding, bf16, forced acceptance
      timeout ${T_ORACLE:-540} python3 benchmarks/speculative.py --oracle --forced --batches ${BATCHES:-1,8,64,256} \
        --reps ${REPS:-1} --kv-memory-gib 32 2>&1 | grep -v " INFO " | grep '^{"batch' | cut -c1-900
      ;;
    control)
      # the adaptive matrix's engine-to-engine noise: a second plain engine where the speculating one was
      timeout ${T_ORACLE:-540} python3 benchmarks/speculative.py --oracle --control --batches ${BATCHES:-1,8,64,256} \
        --rates 1.0 --reps ${REPS:-3} --kv-memory-gib 32 2>&1 | grep -v " INFO " | grep '^{"batch' | cut -c1-300
      ;;
    heads)
      timeout ${T_HEADS:-560} python3 benchmarks/speculative.py --heads --methods ${METHODS:-eagle3,dflash} \
        --batches ${BATCHES:-1,64} --reps ${REPS:-2} --kv-memory-gib 24 2>&1 | grep -v " INFO " | grep '^{"method' 
      ;;
    heads-tests)
      timeout ${T_TESTS:-300} python3 -m pytest -q -p no:cacheprovider tests/test_spec_heads.py \
        tests/test_cuda_graphs.py tests/test_speculative.py -k "not real_model" 2>&1 | tail -8
      ;;
    adaptive-tests)
      timeout ${T_TESTS:-300} python3 -m pytest -q -p no:cacheprovider tests/test_spec_adaptive.py \
        tests/test_speculative.py tests/test_tool_grammar.py tests/test_structured_outputs.py -k "not real_model" 2>&1 | tail -5
      ;;
    forced)
      timeout ${T_ORACLE:-280} python3 benchmarks/speculative.py --oracle --forced 2>&1 | grep -v " INFO " | tail -22
      ;;
    gemm)
      python3 - <<'PY'
import torch
for dt in (torch.float32, torch.bfloat16):
    w = torch.randn(14336, 4096, device="cuda", dtype=dt)
    for m in (1, 5, 8, 40, 64, 320):
        x = torch.randn(m, 4096, device="cuda", dtype=dt)
        for _ in range(10):
            x @ w.t()
        s, e = torch.cuda.Event(True), torch.cuda.Event(True)
        s.record()
        for _ in range(100):
            x @ w.t()
        e.record()
        torch.cuda.synchronize()
        print(f"{str(dt):15} rows {m:4d}  {s.elapsed_time(e) * 10:8.1f} us")
PY
      ;;
    w3)
      for i in 1 2 3; do
        echo "-- after $i"; timeout 100 python3 benchmarks/gpu_workloads.py --workloads w3 2>&1 | grep "^W3:"
        echo "-- before $i"; (cd before && PYTHONPATH=/tmp/site:$PWD FOVEAL_COMMIT=before timeout 100 \
          python3 benchmarks/gpu_workloads.py --workloads w3 2>&1 | grep "^W3:")
      done
      ;;
    w13)
      timeout 270 python3 benchmarks/gpu_workloads.py --workloads w1,w2,w3 2>&1 | grep -v "^\[transformers\]" | tail -25
      (cd before && PYTHONPATH=/tmp/site:$PWD timeout 270 python3 benchmarks/gpu_workloads.py --workloads w1,w2,w3 2>&1 \
        | grep -v "^\[transformers\]" | tail -25)
      ;;
    *) echo "unknown part $part" ;;
  esac
done
