#!/usr/bin/env bash
# Run on the GPU machine: the tests with CUDA paths, minus the embedded-model tests (the 98 MB model
# cannot travel), in three parts that each fit one call on a warm H100:
#   a  the kernels, the sampler, graphs, speculation heads, MoE, async scheduling (session 30: ~270 s
#      warm; session 32: a fresh machine reached ~95% of it in 520 s), in two halves for fresh machines:
#   a1 the sampler's kernels, the sampler, verification, attention kernels, KV quantization, graphs
#   a2 speculation heads, MoE, gpt-oss, async scheduling, fused ops, LoRA kernels, test_gpu.py
#   b  the VLM, video and audio families, parity and the rest of the CPU suite with CUDA cases
#   c  test_shared_prefix.py alone (session 30: it outran two 400 s calls)
#   k  the kernel tests of a (no engine among them: nothing sizes a KV pool from free GPU memory), in
#      WORKERS processes (8 by default; pytest-xdist travels in .whl/): a fresh machine's compiles
#      then run side by side. Parts with engines run in one process.
# A fresh machine spends minutes compiling Triton kernels: give it the whole call (T_CHECK seconds, 560
# by default); a timeout cuts a part's tail, not its head.
# Wheels for packages missing there travel in .whl/ (git-ignored; see the device README); make them
# with scripts/device_wheels.sh.
# Usage (on the GPU machine, with .whl/ beside the tree): bash scripts/device_check.sh a|a1|a2|b|c|k|all [pytest args]
set -uo pipefail
cd "$(dirname "$0")/.."
source scripts/device_env.sh
part=${1:-all}
shift || true
a1="tests/test_sample_kernel.py tests/test_sampler.py tests/test_spec_verify.py tests/test_triton_attention.py
   tests/test_kv_quant.py tests/test_cuda_graphs.py"
a2="tests/test_spec_heads.py tests/test_moe_kernels.py tests/test_moe.py tests/test_gpt_oss.py
   tests/test_async_scheduling.py tests/test_fused_ops.py tests/test_lora_kernels.py tests/test_gpu.py"
a="$a1 $a2"
k="tests/test_sample_kernel.py tests/test_sampler.py tests/test_spec_verify.py tests/test_triton_attention.py
   tests/test_moe_kernels.py tests/test_fused_ops.py tests/test_lora_kernels.py"
b="tests/test_onevision.py tests/test_vision_attention.py tests/test_video_inputs.py tests/test_smolvlm_video.py
   tests/test_omni.py tests/test_attention_masks.py tests/test_model_parity.py tests/test_vlm_parity.py
   tests/test_gemma3_text.py tests/test_prefix_cache.py tests/test_scheduler.py tests/test_layers.py
   tests/test_loader.py tests/test_detokenizer.py tests/test_media.py"
c="tests/test_shared_prefix.py"
case $part in
  a) files=$a ;;
  a1) files=$a1 ;;
  a2) files=$a2 ;;
  b) files=$b ;;
  c) files=$c ;;
  k) files=$k ;;
  all) files="$a $b $c" ;;
  *) echo "unknown part $part: a, a1, a2, b, c, k or all"; exit 2 ;;
esac
workers=()
if [ "$part" = k ] && python3 -c "import xdist" 2>/dev/null; then
  workers=(-n "${WORKERS:-8}" --dist loadfile)
fi
# shellcheck disable=SC2086
timeout ${T_CHECK:-560} python3 -m pytest -q -p no:cacheprovider -k "not real_model" "${workers[@]}" "$@" $files 2>&1 | tail -30
