"""A pytest plugin: the process's resident memory after each test, to find where the suite's memory
grows. Usage: `PYTHONPATH=scripts .venv/bin/python -m pytest -q -p rss_per_test`; writes
`rss_per_test.tsv` (MiB gained, MiB after, test id) to RSS_OUT (default /tmp) and prints the peak and the
test files that gained most."""

from __future__ import annotations

import os
from collections import defaultdict

_rows: list[tuple[int, int, str]] = []


def _rss_mib() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) // 1024
    return 0


def pytest_runtest_logfinish(nodeid, location):
    rss = _rss_mib()
    _rows.append((rss - (_rows[-1][1] if _rows else 0), rss, nodeid))


def pytest_terminal_summary(terminalreporter):
    if not _rows:
        return
    path = os.path.join(os.environ.get("RSS_OUT", "/tmp"), "rss_per_test.tsv")
    with open(path, "w") as f:
        f.writelines(f"{gain}\t{rss}\t{node}\n" for gain, rss, node in _rows)
    per_file: dict[str, int] = defaultdict(int)
    for gain, _, node in _rows[1:]:  # the first test's figure is the interpreter's start-up
        per_file[node.split("::")[0]] += gain
    top = sorted(per_file.items(), key=lambda kv: -kv[1])[:8]
    terminalreporter.write_line(f"RSS: peak {max(r for _, r, _ in _rows)} MiB after a test ({path})")
    for name, gain in top:
        terminalreporter.write_line(f"  {gain:+6d} MiB  {name}")
