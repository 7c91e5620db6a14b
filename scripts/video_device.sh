#!/usr/bin/env bash
# Issue 39's GPU acceptance run for videos on the GPU machine (.whl/ beside the tree, with the PyAV
# wheel av-*.whl in it, made by scripts/device_wheels.sh: the GPU image has no PyAV): benchmarks/video.py
# on dummy Qwen2.5-VL-7B - a 30 s 640x360 clip decoded at 2 fps (decode, preprocess and encoder time,
# TTFT, decode tok/s), then 16 video requests beside 64 text streams (the text streams' token gaps).
# The whole log goes to $OUT/video.txt; the human lines and the JSON line are printed.
# Usage: FOVEAL_COMMIT=$(git rev-parse --short HEAD) bash scripts/video_device.sh [video.py arguments]
set -uo pipefail
cd "$(dirname "$0")/.."
source scripts/device_env.sh
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
python3 -c "import av" 2>/dev/null || { echo "no PyAV here: bring .whl/ with the av wheel in it"; exit 1; }
timeout ${T_VIDEO:-540} python3 benchmarks/video.py "$@" > "$OUT/video.txt" 2>&1
rc=$?
grep -v " INFO \|^\[transformers\]\|USDT\|^$" "$OUT/video.txt" | tail -${TAIL:-14} | cut -c1-3000
echo "=== rc $rc"
