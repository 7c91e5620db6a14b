#!/usr/bin/env bash
# Download, into .whl/ (git-ignored: `echo /.whl/ >> .git/info/exclude`), the Python 3.12 wheels of the
# packages Foveal needs that the GPU machine's image lacks, at the versions this checkout's .venv has.
# The device scripts (device_check.sh, gpu_bench.sh) install them there with --no-index --target.
set -euo pipefail
cd "$(dirname "$0")/.."
PIP=".venv/bin/pip"
ver() { $PIP show "$1" | awk '/^Version/{print $2}'; }
mkdir -p .whl
specs=()
for p in fastapi starlette pydantic pydantic-core uvicorn annotated-types typing-inspection opentelemetry-api \
         gguf num2words uvloop httptools llguidance jsonschema jsonschema-specifications referencing rpds-py \
         peft accelerate psutil pyyaml av python-multipart openai jiter httpx2 httpcore2 truststore sniffio \
         pytest-xdist execnet; do
  specs+=("$p==$(ver $p)")
done
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_31_x86_64 --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
  --platform manylinux2014_x86_64 \
  -d .whl "${specs[@]}"
# docopt (num2words needs it) is a source distribution only: build its wheel here
python3 -m pip download -q --no-deps -d .whl "docopt==$(ver docopt)"
(cd .whl && for f in docopt-*.tar.gz; do [ -e "$f" ] && ../.venv/bin/pip wheel -q --no-deps "$f" -w . && rm "$f"; done)
ls .whl
