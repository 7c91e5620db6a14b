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


def test_generate_answers_on_default_model_dense():
    r = run(
        "generate",
        "--quantization",
        "none",
        "--prompt",
        "What is the capital of France?",
        "--max-tokens",
        "16",
    )
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "The capital of France is Paris."
    assert "tok/s" in r.stderr and "loaded" in r.stderr  # load time is logged
    assert "dense weights" in r.stderr


def test_generate_runs_gguf_weights_quantized_by_default():
    """The default on a CPU with the kernel: the Q4_1 / Q8_0 weights as stored. Its greedy answer to
    this prompt is not the dense model's (the first token flips at a 0.24-nat margin): it is the one
    llama.cpp's llama-server gives on the same file ("L'Étoile, la ...", measured in session 19)."""
    from foveal.layers import quant

    if quant.kernel() is None:
        pytest.skip("no AVX2 CPU or C compiler")
    r = run("generate", "--prompt", "What is the capital of France?", "--max-tokens", "16")
    assert r.returncode == 0, r.stderr
    assert "121 quantized weights (120 Q4_1, 1 Q8_0;" in r.stderr
    assert r.stdout.strip().startswith("L'Étoile, la ")


@pytest.mark.parametrize(
    "args, message",
    [
        (["--model", "/nonexistent/model.gguf"], "does not exist"),
        (["--top-p", "0"], "top_p"),
        (["--max-tokens", "0"], "max_tokens"),
        (["--quantization", "int4"], "invalid choice"),
    ],
)
def test_generate_reports_bad_input_cleanly(args, message):
    r = run("generate", "--prompt", "hi", *args)
    assert r.returncode == 2
    assert message in r.stderr and "Traceback" not in r.stderr


def test_serve_loads_then_answers_and_stops_on_sigterm():
    import signal
    import socket
    import time

    import httpx

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    p = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "foveal.cli",
            "serve",
            "--port",
            str(port),
            "--dtype",
            "float32",
            "--kv-cache-memory",
            str(64 * 2**20),
            "--drain-timeout",
            "2",
        ],
        env={**ENV, "FOVEAL_API_KEY": "k"},
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        deadline = time.monotonic() + 120
        while True:
            assert p.poll() is None and time.monotonic() < deadline, "server did not come up"
            try:
                if httpx.get(f"http://127.0.0.1:{port}/health").status_code == 200:
                    break
            except httpx.TransportError:
                time.sleep(0.2)
        url = f"http://127.0.0.1:{port}/v1/completions"
        assert httpx.post(url, json={"prompt": "Hi", "max_tokens": 2}).status_code == 401  # env key applies
        r = httpx.post(url, json={"prompt": "Hi", "max_tokens": 2}, headers={"Authorization": "Bearer k"})
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 2
    finally:
        p.send_signal(signal.SIGTERM)
        out, _ = p.communicate(timeout=30)
    assert p.returncode in (0, -signal.SIGTERM), out  # uvicorn re-raises the signal after a clean stop
    assert "Application shutdown complete" in out and "Traceback" not in out
    from foveal.attention import cpu_native

    backend = "torch" if cpu_native.kernel() is None else "cpu"
    assert f"attention backend {backend}; 128 tokens per step" in out  # the serving defaults on CPU
