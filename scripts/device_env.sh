# Sourced by the device scripts (device_check.sh, gpu_bench.sh) on the GPU machine, from the repo root:
# installs the carried wheels (.whl/, made by scripts/device_wheels.sh) into /tmp/site, puts them and
# the repo on PYTHONPATH, sets the test/run environment and prints the versions in use.
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
  export PYTHONPATH=/tmp/site:$PWD
else
  export PYTHONPATH=$PWD
fi
export FOVEAL_TESTS_WITHOUT_MODEL=1 FOVEAL_TESTS_WITHOUT_HELDOUT=1 HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
python3 -c "import sys, torch, transformers, triton; print(sys.version.split()[0], torch.__version__, transformers.__version__, triton.__version__, torch.cuda.get_device_name(0))"
