"""Shared by the adversarial scripts: start `foveal serve` on a free 127.0.0.1 port and stop it, read the
KV-block and request counters, scan the server log, print the table and the final JSON line.

Nothing here talks to anything but 127.0.0.1, and every wait has a deadline.
"""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import tempfile
import time

import httpx

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
# The source tree to test: this checkout, or $FOVEAL_SRC (e.g. a `git archive` snapshot of a commit,
# so a run does not pick up half-finished edits in the work tree). It goes first on PYTHONPATH.
SRC = os.path.abspath(os.environ.get("FOVEAL_SRC") or REPO)
API_KEY = "sk-adv"

WORDS = (
    "time year people way day man thing woman life child world school state family student group country "
    "problem hand part place case week company system program question work government number night point "
    "home water room mother area money story fact month lot right study book eye job word business issue "
    "side kind head house service friend father power hour game line end member law car city community name"
).split()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    """`python -m foveal.cli serve` in its own process group, its output in a log file.

    with Server(["--max-num-seqs", "32"]) as srv: ...   # started, /health == 200; always stopped
    """

    def __init__(
        self,
        extra_args: list[str] | None = None,
        api_key: str | None = API_KEY,
        start_timeout: float = 180.0,
        log_level: str = "WARNING",
    ):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.api_key = api_key
        self.headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.start_timeout = start_timeout
        self.args = [
            sys.executable,
            "-m",
            "foveal.cli",
            "serve",
            "--host",
            "127.0.0.1",
            "--port",
            str(self.port),
            "--log-level",
            log_level,
        ]
        if api_key:
            self.args += ["--api-key", api_key]
        self.args += list(extra_args or [])
        fd, self.log_path = tempfile.mkstemp(prefix="foveal-adv-", suffix=".log")
        os.close(fd)
        self.proc: subprocess.Popen | None = None
        self.startup_s: float | None = None
        self.exit_code: int | None = None

    def start(self) -> Server:
        t0 = time.monotonic()
        log = open(self.log_path, "wb")
        env = {**os.environ, "PYTHONUNBUFFERED": "1", "TQDM_DISABLE": "1"}
        env["PYTHONPATH"] = os.pathsep.join([SRC] + [p for p in [env.get("PYTHONPATH")] if p])
        self.proc = subprocess.Popen(
            self.args,
            cwd=SRC,
            stdout=log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            start_new_session=True,
            env=env,
        )
        log.close()
        deadline = t0 + self.start_timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(
                    f"server exited with {self.proc.returncode} before it was ready:\n" + self.log_tail()
                )
            try:
                if httpx.get(self.url + "/health", timeout=2.0).status_code == 200:
                    self.startup_s = time.monotonic() - t0
                    return self
            except httpx.HTTPError:
                pass
            time.sleep(0.25)
        raise RuntimeError(f"server not healthy after {self.start_timeout:.0f} s:\n" + self.log_tail())

    @property
    def pid(self) -> int:
        assert self.proc is not None
        return self.proc.pid

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def stop(self) -> None:
        """SIGTERM to the server's process group, SIGKILL after 15 s (only the group we started)."""
        p = self.proc
        if p is None:
            return
        if p.poll() is None:
            try:
                os.killpg(p.pid, signal.SIGTERM)
            except ProcessLookupError:
                pass
            try:
                p.wait(15)
            except subprocess.TimeoutExpired:
                try:
                    os.killpg(p.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
                p.wait(10)
        self.exit_code = p.returncode

    def __enter__(self) -> Server:
        try:
            return self.start()
        except BaseException:
            self.stop()
            raise

    def __exit__(self, *exc) -> None:
        self.stop()

    def log_text(self) -> str:
        with open(self.log_path, "rb") as f:
            return f.read().decode("utf-8", "replace")

    def log_tail(self, n: int = 40) -> str:
        return "\n".join(self.log_text().splitlines()[-n:])

    def log_findings(self) -> dict:
        """Tracebacks and ERROR lines in the server log (what the server itself thought went wrong)."""
        text = self.log_text()
        errors = [ln for ln in text.splitlines() if re.search(r"\bERROR\b|unhandled error", ln)]
        excs = re.findall(r"^(\w+(?:\.\w+)*(?:Error|Exception|Exit)\b.*)$", text, re.M)
        return {
            "log": self.log_path,
            "src": SRC,
            "tracebacks": text.count("Traceback (most recent call last)"),
            "error_lines": len(errors),
            "first_error_line": errors[0][:300] if errors else None,
            "exception_kinds": sorted({e.split(":")[0] for e in excs})[:10],
        }

    # -- counters ---------------------------------------------------------------------------------
    def cache_stats(self) -> dict:
        return httpx.get(self.url + "/v1/cache/stats", headers=self.headers, timeout=10).json()

    def summary(self) -> dict:
        return httpx.get(self.url + "/v1/metrics", headers=self.headers, timeout=10).json()["summary"]

    def kv_usage_gauge(self) -> float | None:
        text = httpx.get(self.url + "/metrics", headers=self.headers, timeout=10).text
        m = re.search(r"^foveal_kv_cache_usage_ratio(?:\{[^}]*\})? ([0-9.eE+-]+)$", text, re.M)
        return float(m.group(1)) if m else None


def used_blocks(stats: dict) -> tuple[int | None, str]:
    """Blocks held by requests (ref count > 0), and how that was found.

    `prefix_cache.used_blocks` is usable - free (foveal/cache/kv_cache_manager.py); blocks that are
    merely cached sit in the free queue (ref count 0) and do not count. Without that field: total
    blocks - 1 (the null block) - free, when a total is reported; else None."""
    pc = stats.get("prefix_cache", stats)
    if isinstance(pc.get("used_blocks"), int):
        return pc["used_blocks"], "prefix_cache.used_blocks"
    for total_key in ("total_blocks", "num_blocks"):
        if isinstance(pc.get(total_key), int) and isinstance(pc.get("free_blocks"), int):
            return pc[total_key] - 1 - pc["free_blocks"], f"{total_key} - 1 - free_blocks"
    return None, "no used_blocks field and no total in /v1/cache/stats"


def wait_idle(srv: Server, timeout: float = 60.0) -> dict:
    """Poll until no request is in flight and no KV block is held (or the deadline): returns what was
    seen last. A block still held once nothing is in flight (for a few seconds) is a leak."""
    deadline = time.monotonic() + timeout
    t0 = time.monotonic()
    last: dict = {}
    quiet_since = None
    while True:
        try:
            s = srv.summary()
            st = srv.cache_stats()
        except (httpx.HTTPError, ValueError) as e:
            last = {**last, "poll_error": f"{type(e).__name__}: {e}"[:200]}
            if time.monotonic() > deadline:
                break
            time.sleep(0.5)
            continue
        used, how = used_blocks(st)
        last = {
            "in_flight": s.get("requests_in_flight"),
            "running": s.get("num_running"),
            "waiting": s.get("num_waiting"),
            "used_blocks": used,
            "used_blocks_from": how,
            "free_blocks": st.get("prefix_cache", {}).get("free_blocks"),
            "cached_blocks": st.get("prefix_cache", {}).get("cached_blocks"),
            "requests_started": s.get("requests_started"),
            "requests_completed": s.get("requests_completed"),
            "requests_failed": s.get("requests_failed"),
        }
        if used is None:
            last["kv_usage_ratio"] = srv.kv_usage_gauge()
        if last["in_flight"] == 0 and (used == 0 or (used is None and last.get("kv_usage_ratio") == 0)):
            break
        if last["in_flight"] == 0:
            quiet_since = quiet_since or time.monotonic()
            if time.monotonic() - quiet_since > min(10.0, timeout):  # idle, blocks still held: a leak
                break
        else:
            quiet_since = None
        if time.monotonic() > deadline:
            break
        time.sleep(0.25)
    last["idle_wait_s"] = round(time.monotonic() - t0, 2)
    return last


def rss_bytes(pid: int) -> int:
    """Resident set of a process plus all its children."""
    import psutil

    p = psutil.Process(pid)
    total = p.memory_info().rss
    for c in p.children(recursive=True):
        try:
            total += c.memory_info().rss
        except psutil.Error:
            pass
    return total


def table(rows: list[tuple], header: tuple | None = None) -> None:
    rows = [tuple(str(x) for x in r) for r in rows]
    if header:
        rows = [tuple(str(h) for h in header)] + rows
    if not rows:
        return
    widths = [max(len(r[i]) for r in rows if i < len(r)) for i in range(max(len(r) for r in rows))]
    for j, r in enumerate(rows):
        print("  ".join(c.ljust(widths[i]) for i, c in enumerate(r)).rstrip())
        if header and j == 0:
            print("  ".join("-" * w for w in widths))


def emit(result: dict) -> None:
    """The project's convention: one JSON object as the last stdout line."""
    sys.stdout.flush()
    print(json.dumps(result, default=str), flush=True)
