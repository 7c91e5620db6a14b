"""`foveal serve` in a fresh process, for the tests that need one: first-use paths (kernel builds,
packed weights, first recorded steps) run once per process, and signals and a dying model thread need a
process of their own. The server's log goes to a file the test can read."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from contextlib import contextmanager

import httpx


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Spawned:
    def __init__(self, proc: subprocess.Popen, url: str, log_path: str):
        self.proc, self.url, self.log_path = proc, url, log_path

    def log(self) -> str:
        with open(self.log_path, errors="replace") as f:
            return f.read()

    def stop(self, sig=signal.SIGTERM, timeout: float = 30.0) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        return self.proc.returncode


@contextmanager
def spawn_server(*args: str, startup_timeout: float = 120.0, env: dict | None = None):
    """Start `foveal serve ARGS` on a free loopback port; yield once /health answers 200."""
    port = free_port()
    fd, log_path = tempfile.mkstemp(prefix="foveal-serve-", suffix=".log")
    cmd = [sys.executable, "-m", "foveal.cli", "serve", "--port", str(port), *args]
    proc = subprocess.Popen(
        cmd,
        stdout=fd,
        stderr=subprocess.STDOUT,
        stdin=subprocess.DEVNULL,
        env={**os.environ, "HF_HUB_OFFLINE": "1", **(env or {})},
    )
    os.close(fd)
    s = Spawned(proc, f"http://127.0.0.1:{port}", log_path)
    try:
        deadline = time.monotonic() + startup_timeout
        while True:
            if proc.poll() is not None:
                raise AssertionError(f"server exited with {proc.returncode}:\n{s.log()[-3000:]}")
            try:
                if httpx.get(s.url + "/health", timeout=2).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            if time.monotonic() > deadline:
                raise AssertionError(f"server did not start in {startup_timeout} s:\n{s.log()[-3000:]}")
            time.sleep(0.2)
        yield s
    finally:
        s.stop(signal.SIGKILL, timeout=10)
        os.unlink(log_path)
