#!/usr/bin/env bash
# Run on the GPU machine: the tests with CUDA paths first (the kernels, the sampler, graphs,
# speculation heads, MoE), then the rest of the CPU suite that has CUDA cases, minus the embedded-model
# tests (the 98 MB model cannot travel). A fresh machine spends minutes compiling Triton kernels: give
# it the whole call (T_CHECK seconds, 560 by default); a timeout cuts the list's tail, not its head.
# test_shared_prefix.py goes last: on an H100 it alone outran two 400 s calls (session 30).
# Wheels for packages missing there travel in .whl/ (git-ignored; see the device README); make them
# with scripts/device_wheels.sh.
# Usage (on the GPU machine, with .whl/ beside the tree): bash scripts/device_check.sh [pytest args, e.g. -x]
set -uo pipefail
cd "$(dirname "$0")/.."
source scripts/device_env.sh
timeout ${T_CHECK:-560} python3 -m pytest -q -p no:cacheprovider -k "not real_model" "$@" \
  tests/test_sample_kernel.py tests/test_sampler.py tests/test_spec_verify.py \
  tests/test_triton_attention.py tests/test_kv_quant.py tests/test_cuda_graphs.py tests/test_spec_heads.py \
  tests/test_moe_kernels.py tests/test_moe.py tests/test_gpt_oss.py tests/test_async_scheduling.py \
  tests/test_fused_ops.py tests/test_lora_kernels.py tests/test_gpu.py tests/test_onevision.py \
  tests/test_vision_attention.py tests/test_video_inputs.py tests/test_smolvlm_video.py tests/test_omni.py \
  tests/test_attention_masks.py tests/test_model_parity.py tests/test_vlm_parity.py tests/test_gemma3_text.py \
  tests/test_prefix_cache.py tests/test_scheduler.py tests/test_layers.py tests/test_loader.py \
  tests/test_detokenizer.py tests/test_media.py tests/test_shared_prefix.py 2>&1 | tail -30
