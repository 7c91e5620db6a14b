"""The CUDA mixture-of-experts kernel (foveal.layers.moe_triton) against the plain loop over experts
(foveal.layers.moe.experts_reference), on CPU tensors in Triton's interpreter (or on CUDA where there
is one): random shapes, expert counts, top-k, experts no token chose, and the tile layout itself."""

from __future__ import annotations

import os

import pytest
import torch

pytest.importorskip("triton")

from foveal.layers.moe import ClampedSwiGLU, experts_reference, route, silu_glu  # noqa: E402
from foveal.layers.moe_triton import align, experts_triton  # noqa: E402
from tests.interpreter import interpreter_rounds_to_nearest_even  # noqa: F401 (autouse)
from tests.tiny import fp8_blocks  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"  # CPU tensors need the interpreter
if DEVICE == "cpu":
    assert os.environ.get("TRITON_INTERPRET") == "1", "CPU tensors need Triton's interpreter"


def _silu_layer(seed: int, T: int, E: int, k: int, H: int, inter: int, dtype):
    """(x, w13, w2, weights, ids) of a random layer in `dtype` on DEVICE, its tokens routed to k experts."""
    g = torch.Generator().manual_seed(seed)
    w13 = (torch.randn(E, 2 * inter, H, generator=g) / H**0.5).to(dtype).to(DEVICE)
    w2 = (torch.randn(E, H, inter, generator=g) / inter**0.5).to(dtype).to(DEVICE)
    x = torch.randn(T, H, generator=g).to(dtype).to(DEVICE)
    weights, ids = route(torch.randn(T, E, generator=g).to(DEVICE), k)
    return x, w13, w2, weights, ids


@pytest.mark.parametrize(
    "T,E,k,H,inter",
    [
        (1, 8, 2, 32, 16),
        (5, 4, 1, 48, 40),
        (19, 16, 4, 64, 32),
        (40, 6, 3, 32, 24),
        (3, 32, 8, 16, 16),
        (200, 4, 2, 32, 16),
        (300, 4, 2, 32, 16),
        (1100, 4, 2, 32, 16),
        (700, 64, 4, 32, 16),
    ],  # the last four: 64-row tiles, several an expert (the last two prefill-sized steps': 128-row tiles
    # at 550 pairs an expert, 64-row ones at 44)
)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_kernel_equals_the_loop(T, E, k, H, inter, dtype, monkeypatch):
    """gate/up's and down's launches (the small kernel off: it has tests of its own below)."""
    import foveal.layers.moe_triton as mt

    monkeypatch.setattr(mt, "SMALL_PAIRS", 0)
    x, w13, w2, weights, ids = _silu_layer(T * 7 + E, T, E, k, H, inter, dtype)
    got = experts_triton(x, w13, w2, weights, ids, silu_glu)
    want = experts_reference(x, w13, w2, weights, ids)
    tol = 1e-5 if dtype == torch.float32 else 4e-2
    assert got.shape == (T, H) and got.dtype == dtype
    assert (got.float() - want.float()).abs().max().item() < tol


def _gpt_oss_layer(seed: int, T: int, E: int, k: int, H: int, inter: int, dtype):
    """(x, w13, w2, weights, ids, glu, b13, b2) of a gpt-oss-like layer: biases after each projection,
    the clamped SwiGLU, inputs large enough that its clamps bite."""
    g = torch.Generator().manual_seed(seed)
    w13 = (torch.randn(E, 2 * inter, H, generator=g) / H**0.25).to(dtype).to(DEVICE)
    w2 = (torch.randn(E, H, inter, generator=g) / inter**0.5).to(dtype).to(DEVICE)
    b13 = torch.randn(E, 2 * inter, generator=g).to(dtype).to(DEVICE)
    b2 = torch.randn(E, H, generator=g).to(dtype).to(DEVICE)
    x = (torch.randn(T, H, generator=g) * 3).to(dtype).to(DEVICE)
    weights, ids = route(torch.randn(T, E, generator=g).to(DEVICE), k)
    return x, w13, w2, weights, ids, ClampedSwiGLU(1.702, 7.0), b13, b2


@pytest.mark.parametrize("T", [9, 600])  # 600 x 4 pairs: a prefill's tiles (down's apart from gate/up's)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_biases_and_the_clamped_swiglu(dtype, T):
    """gpt-oss's experts: a bias after each projection, the clamped SwiGLU (large inputs, so the
    clamps bite)."""
    x, w13, w2, weights, ids, glu, b13, b2 = _gpt_oss_layer(4, T, 8, 4, 32, 32, dtype)
    got = experts_triton(x, w13, w2, weights, ids, glu, b13, b2)
    want = experts_reference(x, w13, w2, weights, ids, glu, b13, b2)
    tol = 1e-5 if dtype == torch.float32 else 1e-2  # of the largest output (bf16: an ulp of ~2^-8)
    assert (got.float() - want.float()).abs().max().item() < tol * want.float().abs().max().item()
    assert (experts_reference(x, w13, w2, weights, ids, glu) - want).abs().max().item() > 0.1  # biases count


@pytest.mark.parametrize("split", [2, 3])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_split_k_down_with_biases_equals_the_loop(split, dtype, monkeypatch):
    """Down's K in `split` runs (the last empty at 3: K = 96 is two 64-deep runs), the partial sums
    summed with the k pairs: the bias counted once, the clamped SwiGLU on every run's columns."""
    from foveal.layers import moe_triton as mt

    tiles = mt._tiles

    def split_down(n, E, N, K, down, size=2, **kw):
        return tiles(n, E, N, K, down, size, **kw)._replace(split_k=split if down else 1)

    monkeypatch.setattr(mt, "_tiles", split_down)
    x, w13, w2, weights, ids, glu, b13, b2 = _gpt_oss_layer(5, 7, 8, 3, 48, 96, dtype)
    got = experts_triton(x, w13, w2, weights, ids, glu, b13, b2)
    want = experts_reference(x, w13, w2, weights, ids, glu, b13, b2)
    tol = 1e-5 if dtype == torch.float32 else 2e-2  # of the largest output (bf16: the partials round too)
    assert (got.float() - want.float()).abs().max().item() < tol * want.float().abs().max().item()


def _fp8_blocks(w: torch.Tensor, block: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """w [E, N, K] as block-quantized FP8 checkpoints store it, each expert on its own (tests/tiny.py's
    fp8_blocks): e4m3 values [E, N, K], scales [E, ceil(N / block), ceil(K / block)] and the float32
    weights they give back."""
    q, s, back = zip(*(fp8_blocks(w[e].float(), (block, block)) for e in range(w.shape[0])))
    return torch.stack(q), torch.stack(s), torch.stack(back)


@pytest.mark.parametrize(
    "T,block,gpt_oss",
    [(1, 16, False), (6, 16, True), (40, 32, False), (300, 16, False), (1100, 16, False), (1100, 32, True)],
    # 1: down split in 4 runs of K; 1,100 x 2 pairs: a prefill's tiles
)
def test_fp8_block_scaled_weights_equal_the_loop_on_their_dequantized_values(T, block, gpt_oss, monkeypatch):
    """fp8 experts with one scale per block x block (N and K not multiples of the block: partial edge
    blocks), dequantized tile by tile in the kernel, against the loop on the dequantized bf16 weights;
    the same with the scales ignored is far off (they count). (The small kernel off: its own test.)"""
    import foveal.layers.moe_triton as mt

    monkeypatch.setattr(mt, "SMALL_PAIRS", 0)
    E, k, H, inter = 8, 2, 40, 24
    if gpt_oss:
        x, w13, w2, weights, ids, glu, b13, b2 = _gpt_oss_layer(9, T, E, k, H, inter, torch.float32)
    else:
        g = torch.Generator().manual_seed(T)
        w13 = torch.randn(E, 2 * inter, H, generator=g) / H**0.5
        w2 = torch.randn(E, H, inter, generator=g) / inter**0.5
        x = torch.randn(T, H, generator=g)
        weights, ids = route(torch.randn(T, E, generator=g), k)
        glu, b13, b2 = silu_glu, None, None
    w13, w2 = w13.cpu(), w2.cpu()
    (q13, s13, d13), (q2, s2, d2) = _fp8_blocks(w13, block), _fp8_blocks(w2, block)
    bf = torch.bfloat16
    x, weights, ids = x.to(DEVICE, bf), weights.to(DEVICE), ids.to(DEVICE)
    b13, b2 = [None if b is None else b.to(DEVICE, bf) for b in (b13, b2)]
    q13, q2, s13, s2 = q13.to(DEVICE), q2.to(DEVICE), s13.to(DEVICE), s2.to(DEVICE)
    got = experts_triton(x, q13, q2, weights, ids, glu, b13, b2, wq13=(s13, block), wq2=(s2, block))
    d13, d2 = d13.to(DEVICE, bf), d2.to(DEVICE, bf)
    want = experts_reference(x, d13, d2, weights, ids, glu, b13, b2).float()
    scale = want.abs().max().item()
    assert got.dtype == bf and (got.float() - want).abs().max().item() < 2e-2 * scale
    unscaled = experts_reference(x, q13.to(bf), q2.to(bf), weights, ids, glu, b13, b2).float()
    assert (unscaled - want).abs().max().item() > 0.5 * scale


def test_fp8_weights_without_scales_or_scales_without_fp8_are_refused():
    from foveal.layers.moe_triton import experts_triton

    x = torch.randn(2, 32).to(DEVICE, torch.bfloat16)
    w13 = torch.randn(4, 32, 32).to(DEVICE, torch.bfloat16)
    w2 = torch.randn(4, 32, 16).to(DEVICE, torch.bfloat16)
    weights, ids = route(torch.randn(2, 4).to(DEVICE), 2)
    s = torch.ones(4, 1, 1, device=DEVICE)
    with pytest.raises(ValueError, match="scales go with fp8"):
        experts_triton(x, w13.to(torch.float8_e4m3fn), w2, weights, ids, silu_glu)
    with pytest.raises(ValueError, match="scales go with fp8"):
        experts_triton(x, w13, w2, weights, ids, silu_glu, wq13=(s, 32))


@pytest.mark.parametrize("up_rows,down_rows", [(16, 64), (64, 16)])
def test_down_on_its_own_row_tile_equals_the_loop(up_rows, down_rows, monkeypatch):
    """Tiles whose rows differ between the GEMMs: down's pairs aligned again, on route_align's rows too."""
    from foveal.layers import moe_triton as mt

    tiles = mt._tiles

    def rows_apart(n, E, N, K, down, size=2, **kw):
        return tiles(n, E, N, K, down, size, **kw)._replace(block_m=down_rows if down else up_rows)

    monkeypatch.setattr(mt, "_tiles", rows_apart)
    x, w13, w2, logits = _layer(11, 37, 6, 48, 24)
    weights, ids, rows, experts = mt.route_align(logits, 2, True, mt.block_m(37 * 2, w13, x))
    assert mt.block_m(37 * 2, w13, x) == up_rows
    got = experts_triton(x, w13, w2, weights, ids, silu_glu, aligned=(rows, experts))
    want = experts_reference(x, w13, w2, weights, ids)
    assert (got - want).abs().max().item() < 1e-5


@pytest.mark.parametrize("split", [1, 2])
def test_columns_first_order_equals_the_loop(split, monkeypatch):
    """The grid launched columns first (a row tile's column programs side by side): the same products,
    with down's K split too."""
    from foveal.layers import moe_triton as mt

    tiles = mt._tiles
    seen = []

    def cols_first(n, E, N, K, down, size=2, **kw):
        t = tiles(n, E, N, K, down, size, **kw)._replace(block_n=16, cols_first=1)
        seen.append(t)
        return t._replace(split_k=split) if down else t

    monkeypatch.setattr(mt, "_tiles", cols_first)
    x, w13, w2, logits = _layer(5, 29, 6, 48, 40)
    weights, ids = route(logits, 3)
    got = experts_triton(x, w13, w2, weights, ids, silu_glu)
    want = experts_reference(x, w13, w2, weights, ids)
    assert seen and all(t.cols_first for t in seen)
    assert (got - want).abs().max().item() < 1e-5


def test_split_k_is_refused_for_gate_up():
    from foveal.layers import moe_triton as mt

    x, w13 = torch.zeros(2, 32, device=DEVICE), torch.zeros(4, 64, 32, device=DEVICE)
    rows, experts = align(torch.zeros(2, 1, dtype=torch.long, device=DEVICE), 4, 16)
    c = torch.empty(4, 64, device=DEVICE)
    with pytest.raises(ValueError, match="split-K"):
        mt._gemm(x, w13, None, c, None, rows, experts, 2, 1, True, mt.Tiles(16, 64, 32, split_k=2))


def align_reference(ids: torch.Tensor, E: int, bm: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The layout by its definition: pairs stably sorted by expert, each expert's run padded to whole
    bm-row tiles with the sentinel T*k, each tile's expert (-1 for tiles past the runs)."""
    flat = ids.reshape(-1).cpu()
    n = flat.numel()
    max_rows = -(-(n + min(E, n) * (bm - 1)) // bm) * bm
    rows, tiles = [], []
    for e in range(E):
        run = [p for p in torch.argsort(flat, stable=True).tolist() if flat[p] == e]
        run += [n] * (-len(run) % bm)
        rows += run
        tiles += [e] * (len(run) // bm)
    rows += [n] * (max_rows - len(rows))
    tiles += [-1] * (max_rows // bm - len(tiles))
    return torch.tensor(rows, dtype=torch.int32), torch.tensor(tiles, dtype=torch.int32)


@pytest.mark.parametrize(
    "T,E,k,bm",
    [
        (4, 5, 2, 4),
        (300, 128, 8, 16),  # Qwen3-30B-A3B's shape: 75 blocks of 4 tokens, counts summed in chunks of 32
        (257, 32, 4, 16),  # gpt-oss-20b's: 9 blocks of 32, the last of one token
        (2048, 8, 2, 64),  # 8 blocks of 256
        (3, 60, 6, 32),
    ],
)
def test_align_equals_the_stable_sort(T, E, k, bm):
    """align's two launches (blocks of tokens counted, then placed) against the layout's definition,
    with experts no token chose and skewed choices (a quarter of the pairs on expert 1)."""
    g = torch.Generator().manual_seed(T + E)
    ids = torch.randint(0, E, (T, k), generator=g)
    ids[: T // 4, 0] = 1
    rows, experts = align(ids.to(DEVICE), E, bm)
    want_rows, want_experts = align_reference(ids, E, bm)
    assert torch.equal(rows.cpu(), want_rows) and torch.equal(experts.cpu(), want_experts)


def test_align_sorts_pairs_by_expert_in_padded_tiles():
    """Each expert's pairs in one run of whole tiles (sentinel-padded), tiles past the runs marked -1,
    experts no token chose given no tile; every pair appears once."""
    ids = torch.tensor([[3, 0], [3, 1], [0, 3], [3, 2]])  # 8 pairs: expert 0 x2, 1 x1, 2 x1, 3 x4
    rows, experts = (t.cpu() for t in align(ids.to(DEVICE), 5, 4))
    n = ids.numel()
    assert rows.numel() % 4 == 0 and experts.numel() == rows.numel() // 4
    assert sorted(r for r in rows.tolist() if r < n) == list(range(n))
    flat = ids.reshape(-1).tolist()
    for t, e in enumerate(experts.tolist()):
        tile = [r for r in rows[t * 4 : (t + 1) * 4].tolist() if r < n]
        assert all(flat[r] == e for r in tile) and (e >= 0) == bool(tile)
    assert [e for e in experts.tolist() if e >= 0] == [0, 1, 2, 3]  # expert 4: no pair, no tile


@pytest.mark.parametrize(
    "T,E,k,bm,renorm,fused",
    [
        (1, 128, 8, 16, True, True),  # Qwen3-30B-A3B at batch 1
        (7, 8, 2, 16, True, True),
        (33, 32, 4, 16, False, True),
        (5, 6, 3, 4, True, True),
        (64, 60, 6, 32, True, True),  # exactly FUSED_MAX
        (100, 128, 8, 64, True, False),  # past it: align's two launches, the first routing
        (257, 32, 4, 16, False, False),
    ],
)
def test_route_align_equals_route_then_the_layout(T, E, k, bm, renorm, fused):
    """The routing and layout (one program up to FUSED_MAX, else align's two launches routing as they
    count) against route() and the layout's definition: the same weights and experts per token, the
    same rows and tile experts."""
    from foveal.layers.moe_triton import FUSED_MAX, route_align

    g = torch.Generator().manual_seed(T * 31 + E)
    logits = (torch.randn(T, E, generator=g) * 2).to(DEVICE)
    weights, ids, rows, experts = route_align(logits, k, renorm, bm)
    want_w, want_ids = route(logits, k, renorm)
    assert torch.equal(ids, want_ids) and ids.dtype == torch.long
    torch.testing.assert_close(weights, want_w, rtol=1e-6, atol=1e-7)
    want_rows, want_experts = align_reference(want_ids, E, bm)
    assert torch.equal(rows.cpu(), want_rows) and torch.equal(experts.cpu(), want_experts)
    pads = [1 << (n - 1).bit_length() for n in (T, k, E)]  # the kernel's power-of-two blocks
    assert (pads[0] * pads[1] * pads[2] <= FUSED_MAX) == fused


@pytest.mark.parametrize(
    "T,E,k,H,bias,dtype",
    [
        (1, 128, 8, 256, False, torch.float32),  # Qwen3-30B-A3B's routing at batch 1 (a narrower H)
        (1, 32, 4, 360, True, torch.bfloat16),  # gpt-oss-20b's (a router bias; H not a power of two)
        (3, 8, 2, 64, False, torch.bfloat16),  # Mixtral's
        (8, 60, 6, 96, True, torch.float32),  # ROUTER_FUSED_MAX_T tokens
        (9, 8, 2, 64, False, torch.float32),  # past it: the caller computes the logits
    ],
)
def test_router_in_route_align_equals_the_router_then_route_align(T, E, k, H, bias, dtype):
    """router_route_align (the router's logits by ~16 programs, routed by the last) against the Linear's
    logits rounded to x's type then route_align: the same experts, weights, rows and tile experts, twice
    in a row on one count (the last program sets it back to 0)."""
    from foveal.layers.moe_triton import ROUTER_FUSED_MAX_T, route_align, router_route_align

    g = torch.Generator().manual_seed(T * 7 + E)
    x = torch.randn(T, H, generator=g).to(DEVICE, dtype)
    w = (torch.randn(E, H, generator=g) / H**0.5).to(DEVICE, dtype)
    b = torch.randn(E, generator=g).to(DEVICE, dtype) if bias else None
    done = torch.zeros((), dtype=torch.int32, device=DEVICE)
    logits = torch.nn.functional.linear(x.float(), w.float(), None if b is None else b.float()).to(dtype)
    want = route_align(logits, k, True, 16)
    for _ in range(2):
        got = router_route_align(x, w, b, done, k, True, 16)
        if T > ROUTER_FUSED_MAX_T:
            assert got is None
            return
        assert done.item() == 0
        assert torch.equal(got[1], want[1]), "experts per token"
        torch.testing.assert_close(got[0], want[0], rtol=1e-6, atol=1e-7)
        assert torch.equal(got[2], want[2]) and torch.equal(got[3], want[3])


def _layer(seed: int, T: int, E: int, H: int, inter: int):
    """(x, w13, w2, router logits) of a float32 layer on DEVICE."""
    g = torch.Generator().manual_seed(seed)
    w13 = (torch.randn(E, 2 * inter, H, generator=g) / H**0.5).to(DEVICE)
    w2 = (torch.randn(E, H, inter, generator=g) / inter**0.5).to(DEVICE)
    return torch.randn(T, H, generator=g).to(DEVICE), w13, w2, torch.randn(T, E, generator=g).to(DEVICE)


@pytest.mark.parametrize("T,dtype", [(6, torch.float32), (600, torch.bfloat16)])
def test_experts_on_route_align_equal_the_loop(T, dtype):
    """The experts kernel on route_align's layout (aligned=) equals the loop over experts; so do torch's
    grouped GEMMs on its weights and ids (FusedMoE.routed's grouped CUDA path), whose int64 ids and
    float32 weights they take as route()'s. 600 tokens in bf16: a prefill (150 pairs an expert: the
    128-row tiles, the silu in gate/up's epilogue), rows padded as block_m() says gate/up takes them; a
    layout made for other tiles is refused."""
    from foveal.layers.moe import experts_grouped
    from foveal.layers.moe_triton import block_m, route_align

    k = 4
    x, w13, w2, logits = _layer(12, T, 16, 32, 16)
    x, w13, w2 = x.to(dtype), w13.to(dtype), w2.to(dtype)
    weights, ids, rows, experts = route_align(logits, k, True, block_m(T * k, w13, x))
    want = experts_reference(x, w13, w2, weights, ids)
    got = experts_triton(x, w13, w2, weights, ids, silu_glu, aligned=(rows, experts))
    tol = 1e-5 if dtype == torch.float32 else 2e-2 * want.float().abs().max().item()
    assert (got.float() - want.float()).abs().max().item() < tol
    grouped = experts_grouped(x.cpu(), w13.cpu(), w2.cpu(), weights.cpu(), ids.cpu())
    assert (grouped.float() - want.float().cpu()).abs().max().item() < tol
    other = align(ids, 16, 16 if block_m(T * k, w13, x) != 16 else 64)
    with pytest.raises(ValueError, match="row tiles"):
        experts_triton(x, w13, w2, weights, ids, silu_glu, aligned=other)


def test_fp8_experts_under_fp32_activations_take_route_aligns_rows():
    """block_m() picks the row tile by the activations' type, as experts_triton does (fp8 weights are
    read in it): fp8 experts under fp32 activations at a prefill's size (fp32: 64-row tiles, where the
    weights' one byte would say 128) run on route_align's layout and equal the loop on the dequantized
    weights."""
    from foveal.layers.moe_triton import block_m, route_align

    T, k, E = 600, 4, 16
    x, w13, w2, logits = _layer(13, T, E, 32, 16)
    (q13, s13, d13), (q2, s2, d2) = _fp8_blocks(w13.cpu(), 16), _fp8_blocks(w2.cpu(), 16)
    q13, q2 = q13.to(DEVICE), q2.to(DEVICE)
    weights, ids, rows, experts = route_align(logits, k, True, block_m(T * k, q13, x))
    got = experts_triton(x, q13, q2, weights, ids, silu_glu, aligned=(rows, experts),
                         wq13=(s13.to(DEVICE), 16), wq2=(s2.to(DEVICE), 16))  # fmt: skip
    want = experts_reference(x, d13.to(DEVICE), d2.to(DEVICE), weights, ids)
    assert (got - want).abs().max().item() < 1e-4 * want.abs().max().item()


@pytest.mark.parametrize("gpt_oss", [False, True])
@pytest.mark.parametrize("mode", ["inside", "apart", "epilogue"])
def test_the_activation_inside_down_apart_or_in_gate_up_gives_the_loop(gpt_oss, mode, monkeypatch):
    """Steps of more than ACT_APART_PAIRS pairs (prefills) take the silu in gate/up's epilogue
    (SILU_IN_GATE_UP: it writes silu(gate) * up) or in a pass of its own (on CUDA the fused kernel): here
    every step ("apart", "epilogue": ACT_APART_PAIRS 0) or none ("inside"), bf16, with biases after both
    projections; the clamped SwiGLU stays inside down's loads whatever the mode."""
    import foveal.layers.moe_triton as mt

    monkeypatch.setattr(mt, "ACT_APART_PAIRS", 10**9 if mode == "inside" else 0)
    monkeypatch.setattr(mt, "SILU_IN_GATE_UP", mode == "epilogue")
    passes, epilogues = [], []  # the activation's passes of its own; gate/up launches with the silu in
    apart, gemm = mt._glu_apart, mt._gemm
    monkeypatch.setattr(mt, "_glu_apart", lambda *args: passes.append(1) or apart(*args))

    def counted(*args, **kw):
        epilogues.append(kw.get("glu_out", False))
        return gemm(*args, **kw)

    monkeypatch.setattr(mt, "_gemm", counted)
    x, w13, w2, weights, ids, glu, b13, b2 = _gpt_oss_layer(6, 33, 8, 4, 32, 32, torch.bfloat16)
    if not gpt_oss:  # inputs of the usual scale: silu has no clamp to keep the gate/up rows small
        x, w13, glu, b13, b2 = x / 3, w13 / 32**0.25, silu_glu, b13 / 4, b2 / 4
    got = experts_triton(x, w13, w2, weights, ids, glu, b13, b2)
    want = experts_reference(x, w13, w2, weights, ids, glu, b13, b2)
    silu_out = not gpt_oss and mode != "inside"
    assert len(passes) == (silu_out and mode == "apart")
    assert epilogues == [silu_out and mode == "epilogue", False]  # gate/up's launch, then down's
    # bf16: a few ulps of the largest output (the reference rounds silu's output before the product)
    assert (got.float() - want.float()).abs().max().item() < 2e-2 * want.float().abs().max().item()


def test_the_silu_in_gate_up_equals_gate_up_then_silu_and_mul():
    """GLU_OUT's output is gate/up's, rounded to its type, then silu_and_mul's: fp32 (as exact as the
    loop) and bf16, fp8 weights with block scales and biases, 16 columns a program (several tiles)."""
    from foveal.layers import fused
    from foveal.layers import moe_triton as mt

    x, w13, w2, weights, ids, glu, b13, b2 = _gpt_oss_layer(8, 21, 6, 3, 40, 48, torch.float32)
    n = 21 * 3
    rows, experts = align(ids, 6, 16)
    tiles = mt.Tiles(16, 16, 32)
    for dtype, wq in ((torch.float32, None), (torch.bfloat16, None), (torch.bfloat16, 16)):
        xs, w, b = x.to(dtype), w13.to(dtype), b13.to(dtype)
        q = None
        if wq:
            qs, scales, back = _fp8_blocks(w13.cpu(), wq)
            w, q = qs.to(DEVICE), (scales.to(DEVICE), wq)
        h = torch.empty(n, 96, dtype=dtype, device=DEVICE)
        mt._gemm(xs, w, b, h, None, rows, experts, n, 3, True, tiles, wq=q)
        out = torch.empty(n, 48, dtype=dtype, device=DEVICE)
        mt._gemm(xs, w, b, out, None, rows, experts, n, 3, True, tiles, wq=q, glu_out=True)
        want = (
            fused.silu_and_mul(h) if fused.use_fused(h) else (torch.nn.functional.silu(h[:, :48]) * h[:, 48:])
        )
        tol = 1e-6 if dtype == torch.float32 else 1e-2
        assert (out.float() - want.float()).abs().max().item() <= tol * want.float().abs().max().item()


def test_a_glu_the_kernel_does_not_know_is_applied_apart():
    """silu_glu and the clamped SwiGLU run inside the down kernel's loads; any other glu (here gelu(gate)
    * up) is applied to the gate/up output first, with the same result as the loop."""
    x, w13, w2, logits = _layer(5, 4, 6, 32, 16)
    weights, ids = route(logits, 2)

    def gelu_glu(gate, up):
        return torch.nn.functional.gelu(gate) * up

    got = experts_triton(x, w13, w2, weights, ids, gelu_glu)
    want = experts_reference(x, w13, w2, weights, ids, gelu_glu)
    assert (got - want).abs().max().item() < 1e-5
    assert (want - experts_reference(x, w13, w2, weights, ids)).abs().max().item() > 1e-3  # not silu's


def _small(monkeypatch, tiles=None) -> list:
    """Every step through the small kernel (SMALL_PAIRS unbounded), its tiles `tiles` where given; the
    list collects one entry a launch."""
    from foveal.layers import moe_triton as mt

    monkeypatch.setattr(mt, "SMALL_PAIRS", 10**9)
    monkeypatch.setattr(mt, "SMALL_MAX_INTER", 10**9)
    if tiles is not None:
        monkeypatch.setattr(mt, "_small_tiles", lambda n, inter, qb: tiles)
    launches, small = [], mt._experts_small
    monkeypatch.setattr(mt, "_experts_small", lambda *args: launches.append(1) or small(*args))
    return launches


@pytest.mark.parametrize(
    "T,E,k,H,inter,tiles",
    [
        (1, 8, 2, 32, 16, None),
        (3, 32, 8, 48, 40, (16, 32, 32)),  # slices 16 + 16 + 8; H in 32 + 16: masked edges
        (5, 4, 2, 64, 32, (16, 16, 16, 4, 2)),  # four steps over H each way, several tiles an expert
        (19, 16, 4, 64, 96, (32, 64, 64)),
    ],
)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_small_kernel_equals_the_loop(T, E, k, H, inter, tiles, dtype, monkeypatch):
    """Whole expert MLPs over slices of the intermediate in one launch, the slices' partial sums added
    with the k pairs: the loop's output, fp32 as exact as the two launches."""
    from foveal.layers.moe_triton import SmallTiles

    launches = _small(monkeypatch, None if tiles is None else SmallTiles(*tiles))
    x, w13, w2, weights, ids = _silu_layer(T * 11 + E, T, E, k, H, inter, dtype)
    got = experts_triton(x, w13, w2, weights, ids, silu_glu)
    want = experts_reference(x, w13, w2, weights, ids)
    tol = 1e-5 if dtype == torch.float32 else 2e-2 * want.float().abs().max().item()
    assert launches == [1] and got.shape == (T, H) and got.dtype == dtype
    assert (got.float() - want.float()).abs().max().item() < tol


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_small_kernel_with_biases_and_the_clamped_swiglu(dtype, monkeypatch):
    """gpt-oss's experts in the small kernel: gate/up's bias on every slice, down's once (slice 0's
    partial), the clamped SwiGLU (its clamps bite)."""
    from foveal.layers.moe_triton import SmallTiles

    launches = _small(monkeypatch, SmallTiles(16, 16, 16))
    x, w13, w2, weights, ids, glu, b13, b2 = _gpt_oss_layer(14, 3, 8, 4, 32, 48, dtype)
    got = experts_triton(x, w13, w2, weights, ids, glu, b13, b2)
    want = experts_reference(x, w13, w2, weights, ids, glu, b13, b2)
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    assert launches == [1]
    assert (got.float() - want.float()).abs().max().item() < tol * want.float().abs().max().item()


@pytest.mark.parametrize("gpt_oss", [False, True])
def test_the_small_kernel_on_fp8_block_scaled_weights(gpt_oss, monkeypatch):
    """fp8 experts in 16-blocks (N and K not multiples: partial edge blocks) in the small kernel, against
    the loop on the dequantized weights; the scales count."""
    from foveal.layers.moe_triton import SmallTiles

    launches = _small(monkeypatch, SmallTiles(16, 16, 32))
    E, k, H, inter = 8, 2, 40, 24
    if gpt_oss:
        x, w13, w2, weights, ids, glu, b13, b2 = _gpt_oss_layer(15, 4, E, k, H, inter, torch.float32)
    else:
        x, w13, w2, logits = _layer(15, 4, E, H, inter)
        weights, ids = route(logits, k)
        glu, b13, b2 = silu_glu, None, None
    (q13, s13, d13), (q2, s2, d2) = _fp8_blocks(w13.cpu(), 16), _fp8_blocks(w2.cpu(), 16)
    bf = torch.bfloat16
    x = x.to(bf)
    b13, b2 = [None if b is None else b.to(bf) for b in (b13, b2)]
    got = experts_triton(x, q13.to(DEVICE), q2.to(DEVICE), weights, ids, glu, b13, b2,
                         wq13=(s13.to(DEVICE), 16), wq2=(s2.to(DEVICE), 16))  # fmt: skip
    want = experts_reference(x, d13.to(DEVICE, bf), d2.to(DEVICE, bf), weights, ids, glu, b13, b2).float()
    scale = want.abs().max().item()
    assert launches == [1] and (got.float() - want).abs().max().item() < 2e-2 * scale
    unscaled = experts_reference(x, q13.to(DEVICE, bf), q2.to(DEVICE, bf), weights, ids, glu, b13, b2)
    assert (unscaled.float() - want).abs().max().item() > 0.5 * scale


def test_the_small_kernel_on_route_aligns_rows(monkeypatch):
    """FusedMoE.routed's decode layout (route_align with the router inside) through the small kernel:
    the loop's output."""
    from foveal.layers.moe_triton import block_m, router_route_align

    launches = _small(monkeypatch)
    T, k, E, H = 2, 4, 16, 32
    x, w13, w2, _ = _layer(16, T, E, H, 16)
    router = torch.randn(E, H, generator=torch.Generator().manual_seed(3)).to(DEVICE)
    done = torch.zeros((), dtype=torch.int32, device=DEVICE)
    weights, ids, rows, experts = router_route_align(x, router, None, done, k, True, block_m(T * k, w13, x))
    got = experts_triton(x, w13, w2, weights, ids, silu_glu, aligned=(rows, experts))
    assert launches == [1]
    assert (got - experts_reference(x, w13, w2, weights, ids)).abs().max().item() < 1e-5
