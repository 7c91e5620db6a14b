"""`foveal generate` end to end in a subprocess: real output on the embedded model, clean errors."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

ENV = {**os.environ, "HF_HUB_OFFLINE": "1"}


def run(*args, timeout=300):
    return subprocess.run(
        [sys.executable, "-m", "foveal.cli", *args], capture_output=True, text=True, timeout=timeout, env=ENV
    )


def test_generate_answers_on_default_model():
    r = run("generate", "--prompt", "What is the capital of France?", "--max-tokens", "16")
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "The capital of France is Paris."
    assert "tok/s" in r.stderr and "loaded" in r.stderr  # load time is logged


@pytest.mark.parametrize(
    "args, message",
    [
        (["--model", "/nonexistent/model.gguf"], "does not exist"),
        (["--top-p", "0"], "top_p"),
        (["--max-tokens", "0"], "max_tokens"),
    ],
)
def test_generate_reports_bad_input_cleanly(args, message):
    r = run("generate", "--prompt", "hi", *args)
    assert r.returncode == 2
    assert message in r.stderr and "Traceback" not in r.stderr
