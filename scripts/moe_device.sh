#!/usr/bin/env bash
# Issues 34, 35 and 37 on the GPU machine (.whl/ and before/ beside the tree), parts that each fit a call:
#   tests   the CUDA tests at this commit: the mixtures on CUDA (Triton experts kernel, graphs == eager,
#           == transformers), attention sinks in the Triton kernels, graphs, async scheduling, LoRA,
#           speculation, structured outputs, video inputs against transformers' video processor (it
#           needs torchvision, which the GPU machine has) (-k "not real_model": the embedded model
#           cannot travel)
#   moe     benchmarks/moe.py: the ceilings, the experts kernel at 1 / 64 / 256 tokens, gpt-oss-20b at
#           batch 1 and 64 (dummy bf16 weights of the real shapes)
#   kernel  benchmarks/moe.py --parts kernel: the experts kernel, the routing (route_align's warps, the
#           router's GEMV then route_align, and inside it) at 1 / 64 / 256 tokens
#   tiles   benchmarks/moe.py: the experts kernel's tile shapes for gate/up and down at 1 / 64 / 256 tokens
#           (TILE_TOKENS=1 for one of them: each shape compiles, a fresh machine takes minutes;
#           TILE_WEIGHTS=fp8 or bf16,fp8: FP8 experts)
#   qwen3   benchmarks/moe.py: Qwen3-30B-A3B at batch 1 (with the step's largest kernels) and 256
#   fp8     Qwen3-30B-A3B in bf16 then with its experts in FP8 (Qwen3-30B-A3B-FP8's config), at FP8_BATCHES
#           (1,256), one process
#   paths   the models' decode through each CUDA experts path (the Triton kernel, torch's grouped GEMMs:
#           benchmarks/moe.py --cuda-experts triton,grouped), PATHS_MODELS of gptoss,qwen3 (default: both)
#   ab      Qwen3-30B-A3B batch 1 (the step's kernels profiled) in before/ then here, AB_REPS times (2),
#           one process each (before/: the base's foveal, this checkout's benchmarks: `mkdir before &&
#           git archive <base> foveal | tar -x -C before && git archive HEAD benchmarks | tar -x -C before`)
#   gptoss  gpt-oss-20b at batch 1 and 64, here then in before/ (as for ab), GPTOSS_REPS times (2): a
#           first run on a machine may compile inside its timing (RESULTS.md session 34)
#   prefill PREFILL_MODELS (qwen3; gptoss, qwen3fp8) at PREFILL_BATCHES (256) and a prefill-only run, the
#           tile rule against PREFILL_TILES (";"-separated "gate_up/down" tiles: benchmarks/moe.py
#           --prefill-tiles; session 36's by default) in one engine, alternating, PREFILL_REPS (2) rounds
#   w13     W1-W3 (benchmarks/gpu_workloads.py), this checkout then before/ (`git archive <base> foveal
#           benchmarks scripts | tar -x -C before`), one process each
# BEFORE names another folder than before/ for the base.
# Usage: FOVEAL_COMMIT=$(git rev-parse --short HEAD) bash scripts/moe_device.sh tests moe
# Logs go to $OUT (when set) as well as stdout.
set -uo pipefail
cd "$(dirname "$0")/.."
source scripts/device_env.sh
LOG=${OUT:-/tmp}
for part in "$@"; do
  echo "=== $part $(date -u +%H:%M:%S)"
  case $part in
    tests)
      timeout ${T_TESTS:-300} python3 -m pytest -q -p no:cacheprovider --durations=8 tests/test_gpu.py \
        tests/test_moe_kernels.py tests/test_triton_attention.py tests/test_fused_ops.py tests/test_cuda_graphs.py \
        tests/test_async_scheduling.py tests/test_lora.py tests/test_lora_kernels.py tests/test_spec_verify.py \
        tests/test_structured.py tests/test_speculative.py tests/test_spec_heads.py tests/test_moe.py \
        tests/test_gpt_oss.py tests/test_video_inputs.py -k "not real_model" 2>&1 | tee "$LOG/tests.txt" | tail -30
      ;;
    moe)
      timeout ${T_MOE:-240} python3 benchmarks/moe.py --parts ceilings,kernel,gptoss 2>&1 \
        | grep -v "^\[transformers\]" | tee "$LOG/moe.txt" | tail -30
      ;;
    kernel)
      timeout ${T_KERNEL:-150} python3 benchmarks/moe.py --parts kernel 2>&1 \
        | grep -v "^\[transformers\]" | tee "$LOG/kernel.txt" | grep "^kernel"
      ;;
    tiles)
      timeout ${T_TILES:-400} python3 benchmarks/moe.py --parts tiles --tile-tokens ${TILE_TOKENS:-1,64,256} \
        --tile-weights ${TILE_WEIGHTS:-bf16} 2>&1 \
        | grep -v "^\[transformers\]" | tee "$LOG/tiles.txt" | grep "^tiles"
      ;;
    fp8)
      timeout ${T_FP8:-400} python3 benchmarks/moe.py --parts ceilings,qwen3,qwen3fp8 --batches ${FP8_BATCHES:-1,256} \
        2>&1 | grep -v "^\[transformers\]" | tee "$LOG/fp8.txt" | grep "batch"
      ;;
    paths)
      timeout ${T_PATHS:-500} python3 benchmarks/moe.py --parts ceilings,${PATHS_MODELS:-gptoss,qwen3} \
        --cuda-experts triton,grouped 2>&1 | grep -v "^\[transformers\]" | tee "$LOG/paths.txt" | grep "batch"
      ;;
    qwen3)
      timeout ${T_QWEN3:-300} python3 benchmarks/moe.py --parts ceilings,qwen3 --profile 2>&1 \
        | grep -v "^\[transformers\]" | tee "$LOG/qwen3.txt" | tail -45
      ;;
    ab)
      for rep in $(seq ${AB_REPS:-2}); do
        (cd ${BEFORE:-before} && PYTHONPATH=/tmp/site:$PWD FOVEAL_COMMIT=${BEFORE:-before} timeout ${T_AB:-150} python3 \
          benchmarks/moe.py --parts ceilings,qwen3 --batches 1 --profile 2>&1 | grep -v "^\[transformers\]" \
          | tee "$LOG/ab_before_$rep.txt" | grep "batch")
        timeout ${T_AB:-150} python3 benchmarks/moe.py --parts ceilings,qwen3 --batches 1 --profile 2>&1 \
          | grep -v "^\[transformers\]" | tee "$LOG/ab_after_$rep.txt" | grep "batch"
      done
      ;;
    gptoss)
      for rep in $(seq ${GPTOSS_REPS:-2}); do
        timeout ${T_GPTOSS:-150} python3 benchmarks/moe.py --parts ceilings,gptoss --batches 1,64 2>&1 \
          | grep -v "^\[transformers\]" | tee "$LOG/gptoss_after_$rep.txt" | grep "batch"
        [ -d ${BEFORE:-before} ] && (cd ${BEFORE:-before} && PYTHONPATH=/tmp/site:$PWD FOVEAL_COMMIT=${BEFORE:-before} timeout ${T_GPTOSS:-150} \
          python3 benchmarks/moe.py --parts ceilings,gptoss --batches 1,64 2>&1 | grep -v "^\[transformers\]" \
          | tee "$LOG/gptoss_before_$rep.txt" | grep "batch")
      done
      ;;
    prefill)
      timeout ${T_PREFILL:-400} python3 benchmarks/moe.py --parts ceilings,${PREFILL_MODELS:-qwen3} \
        --batches ${PREFILL_BATCHES:-256} --reps ${PREFILL_REPS:-2} --prefill \
        --prefill-tiles "rule;${PREFILL_TILES:-64,128,64,4,2/64,128,64,4,2}" 2>&1 \
        | grep -v "^\[transformers\]" | tee "$LOG/prefill.txt" | grep -E " batch |prefill only"
      ;;
    w13)
      timeout ${T_W13:-240} python3 benchmarks/gpu_workloads.py --workloads ceilings,w1,w2,w3 2>&1 \
        | grep -v "^\[transformers\]" | tee "$LOG/w13_after.txt" | grep -E "^W[123]|ceil" | tail -12
      (cd ${BEFORE:-before} && PYTHONPATH=/tmp/site:$PWD FOVEAL_COMMIT=${BEFORE:-before} timeout ${T_W13:-240} python3 \
        benchmarks/gpu_workloads.py --workloads ceilings,w1,w2,w3 2>&1 | grep -v "^\[transformers\]" \
        | tee "$LOG/w13_before.txt" | grep -E "^W[123]|ceil" | tail -12)
      ;;
    *) echo "unknown part $part" ;;
  esac
done
