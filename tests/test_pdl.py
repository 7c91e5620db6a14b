"""Programmatic dependent launch (foveal.layers.pdl): off on CPUs and in Triton's interpreter whatever
the switch; on a CUDA device of compute capability 9+, a decode-sized chain of the kernels that take
part gives the same values with it on as off, eager and replayed from a CUDA graph."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from foveal.layers import pdl  # noqa: E402


def test_never_on_for_cpu_tensors(monkeypatch):
    monkeypatch.setattr(pdl, "ENABLED", True)
    assert pdl.launch_args(torch.zeros(1)) == {"PDL": False}
    monkeypatch.setattr(pdl, "ENABLED", False)
    assert pdl.launch_args(torch.zeros(1)) == {"PDL": False}


def _chain(x, w_norm, w13, w2, router):
    """rms_norm -> the router and route_align -> the experts (the small kernel at one token) -> pair_sum
    -> add_rms_norm: the Triton launches of a MoE layer's decode step, back to back."""
    from foveal.layers import fused
    from foveal.layers.moe import silu_glu
    from foveal.layers.moe_triton import block_m, experts_triton, router_route_align

    h = fused.rms_norm(x, w_norm, 1e-6)
    done = torch.zeros((), dtype=torch.int32, device=x.device)
    weights, ids, rows, experts = router_route_align(h, router, None, done, 8, True, block_m(8, w13, h))
    y = experts_triton(h, w13, w2, weights, ids, silu_glu, aligned=(rows, experts))
    return fused.add_rms_norm(y, x, w_norm, 1e-6)


@pytest.mark.skipif(
    not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] < 9, reason="needs sm_90+"
)
def test_a_chain_with_pdl_equals_it_without(monkeypatch):
    g = torch.Generator().manual_seed(0)
    E, H, inter = 64, 512, 256
    dev, bf = "cuda", torch.bfloat16
    x = torch.randn(1, H, generator=g).to(dev, bf)
    w_norm = (1 + 0.1 * torch.randn(H, generator=g)).to(dev, bf)
    w13 = (torch.randn(E, 2 * inter, H, generator=g) / H**0.5).to(dev, bf)
    w2 = (torch.randn(E, H, inter, generator=g) / inter**0.5).to(dev, bf)
    router = (torch.randn(E, H, generator=g) / H**0.5).to(dev, bf)
    monkeypatch.setattr(pdl, "ENABLED", False)
    want = _chain(x, w_norm, w13, w2, router)
    monkeypatch.setattr(pdl, "ENABLED", True)
    assert pdl.launch_args(x)["PDL"]
    eager = _chain(x, w_norm, w13, w2, router)
    graph = torch.cuda.CUDAGraph()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        _chain(x, w_norm, w13, w2, router)
    torch.cuda.current_stream().wait_stream(side)
    with torch.cuda.graph(graph):
        out = _chain(x, w_norm, w13, w2, router)
    for _ in range(3):
        graph.replay()
    torch.cuda.synchronize()
    for got in (eager, out):
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
