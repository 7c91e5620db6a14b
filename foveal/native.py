"""Native CPU kernels: C sources in the package, built with the system C compiler at first use and
loaded with ctypes (no torch headers: a build takes about a second; ctypes releases the GIL during a
call). Each build is cached in foveal.config.cache_dir()/kernels, keyed by source, compiler, flags and
the CPU's flags, so later processes load it directly. Where no compiler works, `load` returns None and
logs why once per source; callers keep a PyTorch path for that case.

    lib = load(Path(__file__).with_name("my_kernel.c"), "my kernel")
    fn = Entry(lib.foveal_my_op, [ctypes.c_void_p, ctypes.c_int64])   # calls a tape can record
    fn = entry(Path(__file__).with_name("my_kernel.c"), "foveal_my_op", "my kernel", [...])  # the two at once

While worker.cpu_graphs records a decode step, every Entry call is appended to its tape (the function and
its arguments: data pointers as ints), and `keep` holds tensors made before the recording whose memory
a recorded call uses (so they outlive any later replacement). One-time work that a step happens to
trigger (a weight's packed copy made at first use) runs `outside_recording()`: it belongs to no step.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import hashlib
import logging
import os
import shutil
import subprocess
import tempfile
import threading
from pathlib import Path

from foveal.config import c_compiler_override, cache_dir

log = logging.getLogger(__name__)

# reassociation lets reductions vectorize; no -ffast-math (softmax needs -inf, NaN must propagate)
FLAGS = (
    "-O3",
    "-march=native",
    "-fopenmp",
    "-fassociative-math",
    "-fno-signed-zeros",
    "-fno-trapping-math",
    "-shared",
    "-fPIC",
)


@functools.cache
def cpu_flags() -> frozenset[str]:
    try:
        with open("/proc/cpuinfo") as f:
            line = next((line for line in f if line.startswith("flags")), "")
    except OSError:
        return frozenset()
    return frozenset(line.partition(":")[2].split())


def compiler() -> str | None:
    return c_compiler_override() or shutil.which("cc") or shutil.which("gcc")


def _build(cc: str, source: Path, target: Path, flags: tuple[str, ...]) -> None:
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=target.parent)
    os.close(fd)
    try:
        subprocess.run(
            [cc, *flags, "-o", tmp, str(source), "-lm"], check=True, capture_output=True, timeout=300
        )
        os.replace(tmp, target)  # atomic: a concurrent process sees the old state or the whole library
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


HEADER = Path(__file__).with_name("native.h")  # helpers every kernel includes


def load(source: Path, what: str, extra_flags: tuple[str, ...] = ()) -> ctypes.CDLL | None:
    """The built library of `source` (FLAGS + extra_flags), or None (no compiler, a failed build:
    logged)."""
    flags = (*FLAGS, f"-I{HEADER.parent}", *extra_flags)
    cc = compiler()
    if cc is None:
        log.info("no C compiler found: the %s runs on PyTorch", what)
        return None
    parts = [cc, " ".join(flags), " ".join(sorted(cpu_flags()))]
    code = source.read_bytes() + HEADER.read_bytes()
    key = hashlib.sha256(b"\0".join([code, *(p.encode() for p in parts)])).hexdigest()[:16]
    target = Path(cache_dir()) / "kernels" / f"{source.stem}-{key}.so"
    try:
        if not target.exists():
            _build(cc, source, target, flags)
        return ctypes.CDLL(str(target))
    except (OSError, subprocess.SubprocessError) as e:
        detail = getattr(e, "stderr", b"") or b""
        log.warning("%s unavailable (%s %s): using PyTorch", what, e, detail.decode()[-500:])
        return None


def release_openmp_threads() -> bool:
    """Let go of the OpenMP worker threads the calling process made so far (omp_pause_resource_all, soft),
    before another thread (the engine loop's) becomes the one that runs the kernels.

    libgomp keeps one pool of workers per thread that ever opened a parallel region, and once it manages
    more threads than there are CPUs it stops spinning between regions (a futex wake-up per region
    instead): building the engine in the main thread and stepping it in the engine thread made every
    native kernel call ~2x slower on the 2-vCPU host (a Q4_1 gate_up GEMV of one row: 50-63 us on the
    main thread, 97-116 us on a second one, 54-63 us there after this; benchmarks/openmp_threads.py).
    True when the runtime took it; harmless where there is none."""
    try:
        gomp = ctypes.CDLL("libgomp.so.1")  # the copy already loaded (torch's), not a second runtime
        return gomp.omp_pause_resource_all(1) == 0  # omp_pause_soft
    except (OSError, AttributeError):
        return False


recording = threading.local()  # .tape: the recording in progress on this thread (worker.cpu_graphs)
recording.tape = None


class Entry:
    """A native function (a ctypes function, restype void) whose calls a recording tape sees."""

    __slots__ = ("fn",)

    def __init__(self, fn, argtypes: list):
        fn.argtypes, fn.restype = argtypes, None
        self.fn = fn

    def __call__(self, *args) -> None:
        tape = getattr(recording, "tape", None)
        if tape is not None:
            tape.append((self.fn, args, None, None))
        self.fn(*args)


def entry(source: Path, symbol: str, what: str, argtypes: list) -> Entry | None:
    """The function `symbol` of the library built from `source` (load's cache), or None where no
    compiler built it (the caller's torch path runs; `what` names it in the log)."""
    lib = load(source, what)
    return None if lib is None else Entry(getattr(lib, symbol), argtypes)


def keep(*tensors) -> None:
    """Tensors the recording in progress must keep alive (made before it, used by its native calls)."""
    tape = getattr(recording, "tape", None)
    if tape is not None:
        tape.append((None, tensors, None, None))


@contextlib.contextmanager
def outside_recording():
    """Run one-time work (caches, packed weights) unrecorded, even inside a recorded step: neither the
    native tape nor a TorchDispatchMode sees it, and what it makes is no part of the tape."""
    from torch.utils._python_dispatch import _disable_current_modes

    tape, recording.tape = getattr(recording, "tape", None), None
    try:
        with _disable_current_modes():
            yield
    finally:
        recording.tape = tape
