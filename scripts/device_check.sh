#!/usr/bin/env bash
# Run on the GPU machine (device tool): the CPU suite minus the embedded-model tests (the 98 MB model
# cannot travel), plus the CUDA tests. Wheels for packages missing there travel in .whl/ (git-ignored;
# see the device README); make them with scripts/device_wheels.sh.
# Usage (device tool, carry [".whl"]): bash scripts/device_check.sh
set -uo pipefail
cd "$(dirname "$0")/.."
source scripts/device_env.sh
python3 -m pytest -q -p no:cacheprovider tests/test_gpu.py tests/test_model_parity.py tests/test_scheduler.py \
  tests/test_sampler.py tests/test_layers.py tests/test_loader.py tests/test_detokenizer.py \
  tests/test_vlm_parity.py tests/test_media.py tests/test_attention_masks.py tests/test_kv_quant.py \
  tests/test_prefix_cache.py tests/test_gemma3_text.py tests/test_vision_attention.py tests/test_omni.py \
  tests/test_video_inputs.py tests/test_shared_prefix.py tests/test_triton_attention.py tests/test_moe_kernels.py \
  tests/test_sample_kernel.py tests/test_smolvlm_video.py tests/test_onevision.py 2>&1 | tail -25
