#!/usr/bin/env bash
# Run on the GPU machine (device tool): the CPU suite minus the embedded-model tests (the 98 MB model
# cannot travel), plus the CUDA tests. Wheels for packages missing there travel in .whl/ (git-ignored;
# see the device README); make them with scripts/device_wheels.sh.
# Usage (device tool, carry [".whl"]): bash scripts/device_check.sh
set -uo pipefail
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
  export PYTHONPATH=/tmp/site:$PWD
else
  export PYTHONPATH=$PWD
fi
export FOVEAL_TESTS_WITHOUT_MODEL=1 HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1
python3 -c "import sys, torch, transformers; print(sys.version.split()[0], torch.__version__, transformers.__version__, torch.cuda.get_device_name(0))"
python3 -m pytest -q -p no:cacheprovider tests/test_gpu.py tests/test_model_parity.py tests/test_scheduler.py \
  tests/test_sampler.py tests/test_layers.py tests/test_loader.py tests/test_detokenizer.py \
  tests/test_vlm_parity.py tests/test_media.py tests/test_attention_masks.py tests/test_kv_quant.py \
  tests/test_prefix_cache.py tests/test_gemma3_text.py 2>&1 | tail -25
