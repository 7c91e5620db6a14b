"""native.release_openmp_threads: the OpenMP workers the main thread made while the engine was built
are let go before the engine thread runs the kernels (EngineLoop.start), so libgomp does not manage
more threads than CPUs (it then stops spinning between parallel regions, and every kernel call paid a
wake-up: a single stream's served decode step was ~45% slower). The kernel gives the same result on
the new thread."""

from __future__ import annotations

import os
import threading

import pytest
import torch

from foveal import native
from foveal.layers import quant

pytestmark = [
    pytest.mark.alone,  # `make test` runs its parallel part on one thread a worker
    pytest.mark.skipif(
        quant.kernel() is None or torch.get_num_threads() < 2, reason="needs the native kernel and 2 threads"
    ),
]


def _threads() -> int:
    return len(os.listdir("/proc/self/task"))


def test_release_lets_the_workers_go_and_kernels_still_run_elsewhere():
    from gguf import GGMLQuantizationType
    from gguf.quants import quantize

    w = torch.randn(256, 128, generator=torch.Generator().manual_seed(0)) * 0.05
    qw = quant.QuantWeight.from_gguf(
        torch.from_numpy(quantize(w.numpy(), GGMLQuantizationType.Q4_1)), "Q4_1", 256, 128
    )
    x = torch.randn(3, 128, generator=torch.Generator().manual_seed(1))
    want = qw.linear(x)  # opens a parallel region here: this thread's pool gets its worker
    before = _threads()
    assert native.release_openmp_threads()
    assert _threads() < before
    got = []
    t = threading.Thread(target=lambda: got.append(qw.linear(x)))
    t.start()
    t.join()
    torch.testing.assert_close(got[0], want, rtol=0, atol=0)
