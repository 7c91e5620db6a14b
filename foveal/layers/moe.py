"""Mixture of experts: the router's choice per token and the experts' computation.

    route(logits, k, ...)            -> weights [T, k] (float32), ids [T, k]: each token's experts
    FusedMoE(E, H, I)(x, w, ids)     -> [T, H]: sum_j w[t, j] * expert_ids[t, j](x[t])

An expert is a gated MLP, down(glu(gate(x), up(x))) (glu: silu(gate) * up, or gpt-oss's clamped SwiGLU;
gpt-oss's experts also add a bias after each projection). The experts' weights are stored as two stacks,
gate/up [E * 2I, H] (each expert's gate rows, then its up rows) and down [E * H, I], so a checkpoint's
per-expert tensors fill row ranges of them and transformers 5's fused tensors ([E, 2I, H], [E, H, I])
fill them whole.

The computation sorts the (token, expert) pairs by expert and runs one grouped GEMM for gate/up and one
for down over them, scales each row by its weight and adds the rows back per token: on CUDA one Triton
kernel launched twice (foveal/layers/moe_triton.py: no host sync, so a CUDA graph holds it), on a CPU
`torch._grouped_mm` (every expert's rows in one call; on CUDA too, bf16 weights, with CUDA_EXPERTS =
"grouped": it holds no host sync either). `experts_reference` is the plain loop over experts that tests
compare with (what transformers computes).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

# CUDA's experts path for bf16 weights: "triton" (moe_triton.experts_triton) or "grouped" (experts_grouped,
# torch._grouped_mm). Captured in a CUDA graph, the grouped GEMMs took 0.71-0.99x the Triton kernel's time
# for one layer of Qwen3-30B-A3B and gpt-oss-20b at 1, 64 and 256 tokens on an H100 (benchmarks/moe.py
# --parts kernel, RESULTS.md session 32), but through Qwen3-30B-A3B's batch-1 decode they ran 1.5x slower
# than the Triton kernel with its swept tiles (benchmarks/moe.py --cuda-experts, session 33): Triton stays
# the default
CUDA_EXPERTS = "triton"


def _grouped_on_cuda(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor) -> bool:
    """CUDA_EXPERTS asks for the grouped GEMMs and they can take these shapes (else experts_grouped
    would fall back to the loop, whose host sync no CUDA graph can hold)."""
    if not x.is_cuda or CUDA_EXPERTS != "grouped" or w13.dtype != torch.bfloat16:
        return False
    return _aligned(x, w2) and w13.shape[1] * x.element_size() % 16 == 0


def silu_glu(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """The experts' gated activation of most families: silu(gate) * up."""
    return F.silu(gate) * up


class ClampedSwiGLU:
    """gpt-oss's: gate clamped above at `limit`, up to [-limit, limit], (up + 1) * gate * sigmoid(alpha
    gate)."""

    def __init__(self, alpha: float, limit: float):
        self.alpha, self.limit = alpha, limit

    def __call__(self, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        gate = gate.clamp(max=self.limit)
        return (up.clamp(-self.limit, self.limit) + 1) * gate * torch.sigmoid(gate * self.alpha)


def route(
    logits: torch.Tensor, top_k: int, renormalize: bool = True, bias: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax routing: each token's top_k experts by probability and their weights (float32),
    renormalized to sum to 1 when asked (Mixtral always; Qwen3-MoE by `norm_topk_prob`). `bias`: a
    router bias added to the logits first."""
    x = logits.float()
    if bias is not None:
        x = x + bias.float()
    probs = torch.softmax(x, dim=-1)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, ids


class FusedMoE(nn.Module):
    """`fp8_block`: the stacks keep a block-quantized FP8 checkpoint's values (float8_e4m3fn, as uint8
    bytes: casting the model to its dtype leaves them be) and their float32 scales, one per block x
    block (as int32 bits, `<stack>_scale_inv`); CUDA's experts kernel dequantizes them as it reads them,
    other devices run a dequantized copy made on first use (layers/fp8.py says when a model asks)."""

    def __init__(
        self,
        num_experts: int,
        hidden: int,
        intermediate: int,
        glu=silu_glu,
        bias: bool = False,
        fp8_block: int | None = None,
    ):
        super().__init__()
        self.num_experts, self.hidden, self.intermediate = num_experts, hidden, intermediate
        self.glu = glu  # (gate, up) -> the activation the down projection takes
        self.fp8_block = fp8_block
        b = fp8_block
        if b is not None and (hidden % b or intermediate % b):  # each expert's gate, up, down: whole blocks
            raise ValueError(f"FP8 experts in {b}-blocks: hidden {hidden}, intermediate {intermediate}")
        shapes = {
            "gate_up_proj": (num_experts * 2 * intermediate, hidden),
            "down_proj": (num_experts * hidden, intermediate),
        }
        for name, shape in shapes.items():
            if b is None:
                setattr(self, name, nn.Parameter(torch.empty(shape)))
                continue
            setattr(self, name, nn.Parameter(torch.empty(shape, dtype=torch.uint8), requires_grad=False))
            scales = torch.empty(shape[0] // b, shape[1] // b, dtype=torch.int32)
            setattr(self, name + "_scale_inv", nn.Parameter(scales, requires_grad=False))
        if bias:  # per expert, added after each projection (gpt-oss)
            self.gate_up_proj_bias = nn.Parameter(torch.empty(num_experts, 2 * intermediate))
            self.down_proj_bias = nn.Parameter(torch.empty(num_experts, hidden))
        else:
            self.gate_up_proj_bias = self.down_proj_bias = None

    @property
    def w13(self) -> torch.Tensor:
        """[E, 2I, H]: each expert's gate rows, then its up rows (float8_e4m3fn where fp8_block)."""
        return self._stack(self.gate_up_proj, 2 * self.intermediate, self.hidden)

    @property
    def w2(self) -> torch.Tensor:
        """[E, H, I]"""
        return self._stack(self.down_proj, self.hidden, self.intermediate)

    def _stack(self, p: torch.Tensor, rows: int, cols: int) -> torch.Tensor:
        p = p if self.fp8_block is None else p.view(torch.float8_e4m3fn)
        return p.view(self.num_experts, rows, cols)

    def _fp8_scales(self) -> tuple[tuple, tuple] | tuple[None, None]:
        """experts_triton's (wq13, wq2): each stack's scales [E, rows / block, cols / block] and the
        block, or None each for weights in the activations' type."""
        b, E = self.fp8_block, self.num_experts
        if b is None:
            return None, None
        s13 = self.gate_up_proj_scale_inv.view(torch.float32).view(E, 2 * self.intermediate // b, -1)
        s2 = self.down_proj_scale_inv.view(torch.float32).view(E, self.hidden // b, -1)
        return (s13, b), (s2, b)

    def _dense(self, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """(w13, w2) in `dtype`: the FP8 stacks dequantized, made once (off CUDA, where no kernel reads
        FP8), else the stacks themselves."""
        if self.fp8_block is None:
            return self.w13, self.w2
        cached = getattr(self, "_dequantized", None)
        if cached is None or cached[0].dtype != dtype:
            from foveal.layers.fp8 import dequantize_blocks

            b = (self.fp8_block, self.fp8_block)
            (s13, _), (s2, _) = self._fp8_scales()
            cached = tuple(
                torch.stack([dequantize_blocks(w[e], s[e], b).to(dtype) for e in range(self.num_experts)])
                for w, s in ((self.w13, s13), (self.w2, s2))
            )
            self._dequantized = cached
        return cached

    def routed(self, x: torch.Tensor, router: nn.Module, top_k: int, renormalize: bool = True):
        """The layer's output for the router (a Linear: logits [T, E] = router(x)): route() then
        forward(); on CUDA the routing and the experts' row layout in one launch (moe_triton.route_align)
        for the experts kernel, and for decode-sized steps the router's logits in that launch too
        (moe_triton.router_route_align)."""
        if not x.is_cuda:
            return self(x, *route(router(x), top_k, renormalize))
        from foveal.layers.moe_triton import block_m, experts_triton, route_align, router_route_align

        bm = block_m(x.shape[0] * top_k, self.w13, x)
        routing = None
        w = router.weight
        if x.dim() == 2 and getattr(w, "_foveal_quant", None) is None:
            routing = router_route_align(x, w, router.bias, self._router_done(x), top_k, renormalize, bm)
        if routing is None:
            routing = route_align(router(x), top_k, renormalize, bm)
        weights, ids, rows, experts = routing
        if _grouped_on_cuda(x, self.w13, self.w2):  # the routing alone taken from the fused launch
            return self(x, weights, ids)
        args = (self.w13, self.w2, weights, ids, self.glu, self.gate_up_proj_bias, self.down_proj_bias)
        wq13, wq2 = self._fp8_scales()
        return experts_triton(x.contiguous(), *args, aligned=(rows, experts), wq13=wq13, wq2=wq2)

    def _router_done(self, x: torch.Tensor) -> torch.Tensor:
        """The int32 count router_route_align's programs keep (this layer's: two layers' launches never
        share one)."""
        done = getattr(self, "_done", None)
        if done is None or done.device != x.device:
            done = self._done = torch.zeros((), dtype=torch.int32, device=x.device)
        return done

    def forward(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        if x.is_cpu and self._quantized() is not None:  # GGUF blocks, run as stored (layers/quant.py)
            return self._experts_quantized(x, weights, ids)
        biases = (self.glu, self.gate_up_proj_bias, self.down_proj_bias)
        if x.is_cuda and not _grouped_on_cuda(x, self.w13, self.w2):  # the Triton kernel (moe_triton.py)
            from foveal.layers.moe_triton import experts_triton

            wq13, wq2 = self._fp8_scales()
            return experts_triton(
                x.contiguous(), self.w13, self.w2, weights, ids, *biases, wq13=wq13, wq2=wq2
            )
        return experts_grouped(x, *self._dense(x.dtype), weights, ids, *biases)

    def _quantized(self):
        """Per expert (gate/up, down) as QuantWeight row views or dense row slices, when the stacks came
        as GGUF blocks (`_foveal_quant`, models/weights.py); else None."""
        cached = getattr(self, "_per_expert", None)
        stacks = (self.gate_up_proj, self.down_proj)
        if cached is not None or not any(hasattr(p, "_foveal_quant") for p in stacks):
            return cached
        E, two_i, H = self.num_experts, 2 * self.intermediate, self.hidden
        per = []
        for e in range(E):
            pair = []
            for p, n in ((self.gate_up_proj, two_i), (self.down_proj, H)):
                qw = getattr(p, "_foveal_quant", None)
                pair.append(qw.rows(e * n, (e + 1) * n) if qw is not None else p[e * n : (e + 1) * n])
            per.append(tuple(pair))
        self._per_expert = per
        return per

    def _native_packs(self):
        """quant.ExpertPacks of the quantized stacks, where every expert runs packed and quant.moe can
        take the layer (SiLU-gated, no biases, the kernel built); else None (the loop below)."""
        cached = getattr(self, "_packs", False)
        if cached is not False:
            return cached
        from foveal.layers import quant

        per, packs = self._quantized(), None
        plain = self.glu is silu_glu and self.gate_up_proj_bias is None and self.down_proj_bias is None
        packed = all(hasattr(w, "packed") for pair in per for w in pair)
        if plain and packed and quant.moe_kernel() is not None:
            packs = quant.ExpertPacks([p[0] for p in per], [p[1] for p in per])
        self._packs = packs
        return packs

    def _experts_quantized(self, x, weights, ids) -> torch.Tensor:
        """The experts on their quantized rows: in one native call (quant.moe) where it can take them, else
        the loop over the experts some token chose."""
        from foveal.layers.linear import linear

        packs = self._native_packs()
        if packs is not None and x.dim() == 2 and x.dtype in (torch.float32, torch.bfloat16):
            from foveal.layers import quant

            return quant.moe(x, weights, ids, packs)

        def run(w, h):
            return w.linear(h) if hasattr(w, "packed") else linear(h, w)

        out = torch.zeros_like(x)
        per = self._quantized()
        b13, b2 = self.gate_up_proj_bias, self.down_proj_bias
        for e in torch.unique(ids).tolist():
            token, slot = torch.where(ids == e)
            up, down = per[e]
            h = run(up, x[token])
            if b13 is not None:
                h = h + b13[e]
            gate, u = h.split(self.intermediate, dim=-1)
            d = run(down, self.glu(gate, u))
            if b2 is not None:
                d = d + b2[e]
            out.index_add_(0, token, d * weights[token, slot, None].to(x.dtype))
        return out


def _aligned(*ts: torch.Tensor) -> bool:
    """torch._grouped_mm needs 16-byte aligned strides."""
    return all(t.shape[-1] * t.element_size() % 16 == 0 for t in ts)


def experts_grouped(x, w13, w2, weights, ids, glu=silu_glu, b13=None, b2=None) -> torch.Tensor:
    """The experts' output [T, H]: the (token, expert) pairs sorted by expert, one grouped GEMM each
    for gate/up and down (each plus its expert's bias, where there is one), each row scaled by its
    weight and added back to its token."""
    T, k = ids.shape
    E, two_i, _ = w13.shape
    flat = ids.reshape(-1)
    order = torch.argsort(flat, stable=True)
    token = order // k
    if not _aligned(x, w2) or two_i * x.element_size() % 16:
        return experts_reference(x, w13, w2, weights, ids, glu, b13, b2)
    # each expert's pairs counted by index_add_, not bincount (whose CUDA kernel reads the largest id on
    # the host): no host sync, so a CUDA graph can hold it
    per_expert = torch.zeros(E, dtype=torch.int32, device=flat.device).index_add_(
        0, flat, torch.ones_like(flat, dtype=torch.int32)
    )
    offs = torch.cumsum(per_expert, 0, dtype=torch.int32)
    expert = flat[order]
    h = torch._grouped_mm(x[token], w13.transpose(1, 2), offs)
    if b13 is not None:
        h = h + b13[expert]
    gate, up = h.split(two_i // 2, dim=-1)
    d = torch._grouped_mm(glu(gate, up).contiguous(), w2.transpose(1, 2), offs)
    if b2 is not None:
        d = d + b2[expert]
    d = d * weights.reshape(-1)[order, None].to(d.dtype)
    return torch.zeros_like(x).index_add_(0, token, d)


def experts_reference(x, w13, w2, weights, ids, glu=silu_glu, b13=None, b2=None) -> torch.Tensor:
    """The plain loop over experts (transformers' computation): for each expert some token chose,
    its tokens' gated MLP (with its biases), scaled by their weights, added to their rows."""
    out = torch.zeros_like(x)
    inter = w13.shape[1] // 2
    for e in torch.unique(ids).tolist():
        token, slot = torch.where(ids == e)
        gate, up = F.linear(x[token], w13[e], None if b13 is None else b13[e]).split(inter, dim=-1)
        d = F.linear(glu(gate, up), w2[e], None if b2 is None else b2[e])
        out.index_add_(0, token, d * weights[token, slot, None].to(x.dtype))
    return out
