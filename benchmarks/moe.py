"""Issue 37's mixture-of-experts figures: the experts' kernel on its own, and Qwen3-30B-A3B and
gpt-oss-20b through Foveal's engine on random weights of the real shapes (`--load-format dummy` with
benchmarks/configs/*.json), against their memory floors measured in the same run.

    python3 benchmarks/moe.py --parts ceilings,kernel,qwen3,qwen3fp8,gptoss [--smoke] [--profile]
    python3 benchmarks/moe.py --parts tiles [--tile-tokens 1,64,256]

kernel   the experts of one layer, bf16, shapes Qwen3-30B-A3B (E 128, k 8, H 2048, I 768) and
         gpt-oss-20b (E 32, k 4, H 2880, I 2880), at 1, 64 and 256 tokens: the Triton kernel
         (layers/moe_triton.py), torch's grouped GEMMs (layers/moe.py experts_grouped) and the loop over
         experts (the reference): us per call, and the bytes of the experts those tokens touch (each
         distinct expert read once) over that time; on CUDA the Triton kernel and the grouped GEMMs
         also captured in a CUDA graph and replayed (`*_graph_us`, or why one cannot be captured);
         the routing and row layout by torch's route then align (`route_then_align`) and by route_align
         (`route_align_fused_w*`: its one program at 1, 2, 4 and 8 warps, or past FUSED_MAX align's
         two launches routing in the first, whatever the warps), the router's GEMV (cuBLAS) then
         route_align, and the GEMV inside the routing's launch (`router_route_align_w*`, up to 8
         tokens, 1, 2, 4 warps), eager and 8 launches from a graph.
tiles    the Triton kernel's tile shapes (rows, columns, depth, warps, stages[, split K[, columns first]])
         for gate/up and down apart, at the same shapes and token counts (past ACT_APART_PAIRS pairs
         down on the silu's output, as the models run it) (--tile-weights bf16,fp8: FP8 experts too, in
         128 x 128 blocks): us per launch of each (8 launches on 8 routings,
         disjoint experts at one token, replayed from a CUDA graph), the default's (moe_triton._tiles)
         first, then the three fastest (what a per-shape table would pick)
qwen3    Qwen3-30B-A3B: batch-1 decode, 512 prompt / 256 output, against its floor: the bytes a step
         reads (every dense weight, the k experts of each layer, the KV cache of the mean context)
         over the measured copy bandwidth; then 256 requests of 512 / 256 at once: output tok/s
         against the floor of a step that reads every expert a step's tokens touch (expected distinct
         experts of B tokens x k draws: E (1 - (1 - k/E)^B)) and the KV cache.
qwen3fp8 Qwen3-30B-A3B-FP8 (configs/qwen3-30b-a3b-fp8.json: the experts kept in FP8 with 128 x 128
         block scales, layers/fp8.py; the dense weights bf16): as qwen3, its floor from the bytes it holds.
gptoss   gpt-oss-20b (bf16 experts: dummy weights): batch 1 and 64, the same floors.
         Each model's batch runs after the same number of prompts of its length with 8 tokens out: the
         timed run's prefill steps then compile nothing (a fresh machine's first run otherwise did).
small    the experts of a decode-sized step in one launch (moe_triton._moe_small_kernel) against gate/up's
         and down's launches, at --small-tokens (1,2,4,8,16), with the small kernel's tile shapes at the
         fewest tokens (CUDA; the interpreter on the CPU with --smoke).
--small-pairs 0,8  qwen3 / gptoss once per value of moe_triton.SMALL_PAIRS (steps of at most that many
         pairs take the small kernel where the experts are at most SMALL_MAX_INTER wide; 0: off), an
         engine each, in that order.
--pdl 0,1  qwen3 / gptoss without and with programmatic dependent launch of the small Triton kernels
         (layers/pdl.py ENABLED; default: FOVEAL_PDL's), an engine each, in that order.
--cuda-experts triton,grouped  qwen3 and gptoss once per CUDA experts path (layers/moe.py CUDA_EXPERTS:
         the Triton kernel, torch's grouped GEMMs), an engine each, in that order.
--profile  the largest CUDA kernels of a decode step (what a step's time goes to), at the batches of
         --profile-batches (1).
--prefill  after each model's batches, 256 prompts of 512 tokens with one token out: prompt tok/s and the
         TFLOP/s of the weights a token touches against the bf16 ceiling (with --profile, a second such
         run profiled: where a prefill step's time goes).
--prefill-tiles "rule;128,128,64,8,3/64,128,64,4,4"  the experts' tiles for steps of more than 2,048
         pairs (gate/up / down: rows, columns, depth, warps, stages[, split K, columns first]; "rule":
         moe_triton._tiles' own; "best:qwen3-30b-a3b": the fastest of this process's tiles sweep at its
         most tokens, with --parts tiles,...), one variant each.
--act-apart-above 2048,1000000000  one variant per value: steps of more pairs take the experts'
         activation in a pass of its own (moe_triton.ACT_APART_PAIRS), the rest inside down's loads.
--silu-in-gate-up 1,0  one variant per value: past ACT_APART_PAIRS the silu in gate/up's epilogue (1) or
         in a pass of its own (0) (moe_triton.SILU_IN_GATE_UP).
         The variants (apart x tiles x silu) act on prefill steps alone (> 2,048 pairs, eager), so one engine
         runs them all, each warmed first, in turn per batch (--reps N: the whole round N times).

`--smoke` runs the code paths on the CPU with tiny configs and counts: it checks the script, not the
speed (GPU time is scarce; run it before a device call). Ends with one JSON line.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import sys
import tempfile
import time
from functools import partial

import torch
import torch.nn.functional as F

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.dirname(HERE))

import gpu_workloads as gw  # noqa: E402

from foveal.layers.moe import experts_grouped, experts_reference, route, silu_glu  # noqa: E402

RESULTS: dict = {}
# the models' prompts: every run its own seed, so the prefix cache finds none of an earlier run's prompts
# (gw.profile's are seed 7)
SEEDS = itertools.count(10_000)
SHAPES = {"qwen3-30b-a3b": (128, 8, 2048, 768), "gpt-oss-20b": (32, 4, 2880, 2880)}  # E, k, H, I


def log(msg: str) -> None:
    print(msg, flush=True)


def _time(fn, reps: int) -> float:
    if torch.cuda.is_available():
        return gw._time_cuda(fn, reps)
    fn()
    t0 = time.perf_counter()
    for _ in range(reps):
        fn()
    return (time.perf_counter() - t0) / reps


def _route_then_align(logits, k, bm):
    from foveal.layers.moe_triton import align

    return align(route(logits, k)[1], logits.shape[1], bm)


# -- the experts on their own -------------------------------------------------------------------------
def _layers(smoke: bool, tokens: tuple[int, ...] = (1, 64, 256), shapes: tuple[str, ...] = tuple(SHAPES)):
    """Per shape of SHAPES and token count (1, 64, 256): (name, E, k, H, I, T, generator, w13, w2, x,
    weights, ids) of one random bf16 layer (CUDA; float32 on the CPU), the same ones for every part."""
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = torch.bfloat16 if dev == "cuda" else torch.float32
    for name, (E, k, H, inter) in SHAPES.items():
        if name not in shapes:
            continue
        if smoke:
            E, H, inter = min(E, 16), 64, 32
        g = torch.Generator().manual_seed(0)
        w13 = (torch.randn(E, 2 * inter, H, generator=g) * 0.02).to(dtype).to(dev)
        w2 = (torch.randn(E, H, inter, generator=g) * 0.02).to(dtype).to(dev)
        for T in tokens:
            x = torch.randn(T, H, generator=g).to(dtype).to(dev)
            weights, ids = route(torch.randn(T, E, generator=g).to(dev), k)
            yield name, E, k, H, inter, T, g, w13, w2, x, weights, ids


def kernel(smoke: bool) -> None:
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    out = {}
    for name, E, k, H, inter, T, g, w13, w2, x, weights, ids in _layers(smoke):
        touched = len(torch.unique(ids))
        nbytes = touched * 3 * H * inter * w13.element_size()
        args = (x, w13, w2, weights, ids, silu_glu)
        paths = {"grouped": partial(experts_grouped, *args), "loop": partial(experts_reference, *args)}
        if dev == "cuda":
            from foveal.layers.moe_triton import experts_triton

            paths["triton"] = partial(experts_triton, *args)
        row = {"experts_touched": touched, "MB": round(nbytes / 1e6, 1)}
        for p, fn in paths.items():
            s = _time(fn, 3 if smoke else 20)
            row[f"{p}_us"] = round(s * 1e6, 1)
            row[f"{p}_GBps"] = round(nbytes / s / 1e9, 1)
            if dev == "cuda" and p != "loop":  # inside a CUDA graph, as the decode steps run them
                try:
                    s = _time(gw.captured(fn), 3 if smoke else 20)
                    row[f"{p}_graph_us"] = round(s * 1e6, 1)
                    row[f"{p}_graph_GBps"] = round(nbytes / s / 1e9, 1)
                except Exception as e:  # a host sync inside: it cannot be captured
                    row[f"{p}_graph"] = f"not capturable: {type(e).__name__}: {str(e)[:80]}"
        if dev == "cuda" or os.environ.get("TRITON_INTERPRET") == "1":  # the routing and row layout
            from foveal.layers.moe_triton import block_m, route_align, router_route_align

            logits = torch.randn(T, E, generator=g).to(w13.dtype).to(dev)
            bm = block_m(T * k, w13, x)
            routing = {"route_then_align": partial(_route_then_align, logits, k, bm)}
            for warps in (1, 2, 4, 8):
                routing[f"route_align_fused_w{warps}"] = partial(route_align, logits, k, True, bm, warps)
            # with the router's GEMV: cuBLAS's then route_align, or inside the routing's launch
            xr = torch.randn(T, H, generator=g).to(w13.dtype).to(dev)
            wr = (torch.randn(E, H, generator=g) / H**0.5).to(w13.dtype).to(dev)
            done = torch.zeros((), dtype=torch.int32, device=dev)
            routing["router_then_route_align"] = partial(_router_then_route_align, xr, wr, k, bm)
            if router_route_align(xr, wr, None, done, k, True, bm) is not None:
                for warps in (1, 2, 4):
                    routing[f"router_route_align_w{warps}"] = partial(
                        router_route_align, xr, wr, None, done, k, True, bm, warps
                    )
            for p, fn in routing.items():  # eager, and 8 launches replayed from a graph (per launch)
                row[f"{p}_us"] = round(_time(fn, 3 if smoke else 20) * 1e6, 1)
                if dev == "cuda":
                    row[f"{p}_graph_us"] = round(_launches_us([fn] * 8, 20), 1)
        out[f"{name}/T{T}"] = row
        log(f"kernel {name} T={T}: {row}")
    RESULTS["kernel"] = out


def _router_then_route_align(x, w, k: int, bm: int):
    from foveal.layers.moe_triton import route_align

    return route_align(F.linear(x, w), k, True, bm)


def _routings(T: int, E: int, k: int, g, dev, count: int = 8) -> list:
    """`count` routings [T, k] of T tokens, one token's experts disjoint between routings where E allows:
    consecutive launches then read other experts' weights, as a model's layers do, not the L2's copy."""
    out = []
    for i in range(count):
        if T == 1:
            start = (i * k) % (E - k + 1)
            out.append(torch.arange(start, start + k, device=dev).reshape(1, k))
        else:
            out.append(torch.argsort(torch.rand(T, E, generator=g), dim=1)[:, :k].to(dev))
    return out


def _launches_us(fns: list, reps: int) -> float:
    """us per launch of fns run back to back: on CUDA captured in one graph and replayed (a launch's host
    cost is not the kernel's; the decode steps replay graphs too), on the CPU called."""
    if not torch.cuda.is_available():
        return _time(lambda: [f() for f in fns], reps) * 1e6 / len(fns)
    return _time(gw.captured(lambda: [f() for f in fns]), reps) * 1e6 / len(fns)


def _fp8(w: torch.Tensor, block: int) -> tuple[torch.Tensor, tuple[torch.Tensor, int]]:
    """w [E, N, K] as FP8 experts for timing: e4m3 values of w / 0.02 and every block's scale 0.02."""
    E, N, K = w.shape
    scales = torch.full((E, -(-N // block), -(-K // block)), 0.02, dtype=torch.float32, device=w.device)
    return (w.float() / 0.02).to(torch.float8_e4m3fn), (scales, block)


def tiles(
    smoke: bool, tokens: tuple[int, ...], kinds: tuple[str, ...] = ("bf16",), shapes=tuple(SHAPES)
) -> None:
    import itertools

    import triton

    from foveal.layers import moe_triton as mt

    out = {}
    for (name, E, k, H, inter, T, g, w13, w2, x, _weights, _ids), kind in itertools.product(
        _layers(smoke, tokens, shapes), kinds
    ):
        n = T * k
        h = torch.randn(n, 2 * inter, generator=g).to(w13)
        d = torch.empty(4 * n, H, dtype=w13.dtype, device=w13.device)  # room for down's split-K partials
        scale = torch.rand(n, generator=g).to(w13.device)
        routings = _routings(T, E, k, g, w13.device)
        (w_up, q_up), (w_down, q_down) = ((w13, None), (w2, None))
        if kind == "fp8":  # Qwen3-30B-A3B-FP8's 128 x 128 blocks (16 on the smoke run's small shapes)
            (w_up, q_up), (w_down, q_down) = _fp8(w13, 16 if smoke else 128), _fp8(w2, 16 if smoke else 128)
        # down's A: gate/up's output with the silu inside its loads, or past ACT_APART_PAIRS the silu's
        # own output [pairs, inter] (its pass not timed here)
        apart = n > mt.ACT_APART_PAIRS
        down_a, act = (h[:, :inter].contiguous(), (0, 0.0, 0.0)) if apart else (h, (1, 0.0, 0.0))
        gemms = {  # (a, w, wq, c, scale, gather, act, N, K)
            "gate_up": (x, w_up, q_up, h.clone(), None, True, (0, 0.0, 0.0), 2 * inter, H),
            "down": (down_a, w_down, q_down, d, scale, False, act, H, inter),
        }
        label = name if kind == "bf16" else f"{name} {kind}"
        timed = {}
        for gemm, (a, w, wq, c, sc, gather, act, N, K) in gemms.items():
            default = mt._tiles(n, E, N, K, gemm == "down", a.element_size())
            if T == 1:  # one row an expert: bytes in flight (narrow columns, deep K, more stages, split K)
                grid = itertools.product((default.block_m,), (32, 64, 128), (64, 128, 256), (4, 8), (3, 4))
                if gemm == "down":
                    splits = itertools.product((default.block_m,), (64, 128), (64, 128), (4,), (3, 4), (2, 4))
                    grid = itertools.chain(grid, splits)
            elif n <= 2048:
                grid = itertools.product((16, 32, 64), (64, 128), (64, 128), (4, 8), (3, 4))
                if gemm == "down":  # where split K stops paying (moe_triton.SPLIT_K_PROGRAMS)
                    splits = itertools.product((16, 64), (128,), (64,), (4,), (3,), (2, 4))
                    grid = itertools.chain(grid, splits)
            else:  # prefill-sized: compute-bound, larger row tiles, fewer stages (shared memory, occupancy),
                # and the columns-first order (a row tile's A read once) against rows-first
                grid = itertools.chain(
                    itertools.product((64, 128), (128,), (64, 128), (4, 8), (2, 3, 4), (1,), (0, 1)),
                    itertools.product((64, 128), (256,), (64,), (8,), (2, 3), (1,), (0, 1)),
                )
            shapes = [default] + [mt.Tiles(*t) for t in grid if mt.Tiles(*t) != default]
            if smoke:
                shapes = shapes[:3] + [t for t in shapes if t.split_k > 1][:1]
            aligned = {}
            times = []
            for t in shapes:
                if t.block_m not in aligned:
                    aligned[t.block_m] = [mt.align(ids, E, t.block_m) for ids in routings]
                if wq is not None and wq[1] % min(t.block_k, wq[1]):
                    continue  # a K tile must divide the scales' block
                runs = [
                    partial(mt._gemm, a, w, None, c, sc, rows, experts, n, k, gather, t, act, wq)
                    for rows, experts in aligned[t.block_m]
                ]
                try:
                    times.append((round(_launches_us(runs, 3 if smoke else 20), 1), t))
                except triton.runtime.errors.OutOfResources:  # its stages' shared memory: not a candidate
                    continue
            best = sorted(times)[:3]
            distinct = sum(len(torch.unique(ids)) for ids in routings) / len(routings)
            touched = distinct * N * K * w.element_size()
            row = {"default": [times[0][0], list(times[0][1])], "best": [[us, list(t)] for us, t in best]}
            row["best_GBps"] = round(touched / best[0][0] / 1e3, 1)
            out[f"{label}/T{T}/{gemm}"] = row
            log(f"tiles {label} T={T} {gemm}: default {row['default']}, best {row['best']}")
            timed[gemm] = times
        # the best pair per shared row tile (one alignment; different rows align twice)
        joint = {}
        for bm in sorted({t.block_m for _, t in timed["gate_up"]} & {t.block_m for _, t in timed["down"]}):
            up = min((us, t) for us, t in timed["gate_up"] if t.block_m == bm)
            dn = min((us, t) for us, t in timed["down"] if t.block_m == bm)
            joint[bm] = [round(up[0] + dn[0], 1), list(up[1]), list(dn[1])]
        out[f"{label}/T{T}/joint"] = joint
        log(f"tiles {label} T={T} joint (us, gate_up, down) by rows: {joint}")
    RESULTS["tiles"] = out


# -- through the engine ----------------------------------------------------------------------------
def _bytes(llm) -> tuple[int, int, int, int]:
    """(dense bytes a decode step reads, bytes of one layer's one expert, experts per layer, layers
    with experts): the text model's parameters, the expert stacks apart (the embedding table only when
    it doubles as the LM head)."""
    from foveal.layers.moe import FusedMoE

    model = llm.engine.model
    moes = [m for m in model.modules() if isinstance(m, FusedMoE)]
    expert_params = {id(p) for m in moes for p in m.parameters()}
    dense = sum(p.numel() * p.element_size() for p in model.parameters() if id(p) not in expert_params)
    if getattr(model, "lm_head", None) is not None:
        dense -= model.embed_tokens.weight.numel() * model.embed_tokens.weight.element_size()
    m = moes[0]
    per_expert = sum(p.numel() * p.element_size() for p in m.parameters()) // m.num_experts
    return dense, per_expert, m.num_experts, len(moes)


def _floor_row(llm, r: dict, batch: int, context: int, top_k: int) -> dict:
    """The step's bytes and the floor they give (tok/s at the measured copy bandwidth)."""
    dense, per_expert, E, layers = _bytes(llm)
    distinct = E * (1 - (1 - top_k / E) ** batch)
    step = dense + layers * distinct * per_expert + batch * gw.kv_bytes_per_token(llm) * context
    out = {"step_MB": round(step / 1e6, 1), "experts_per_layer": round(distinct, 1)}
    if "ceilings" in gw.RESULTS:
        bw = gw.RESULTS["ceilings"]["copy_GBps"] * 1e9
        floor = batch * bw / step  # tokens per second when a step costs only its reads
        got = r["decode_tok_s"] if batch == 1 else r["output_tok_s"]
        out.update(floor_tok_s=round(floor, 1), share_of_floor=round(got / floor, 3))
    return out


def _experts_layers(x, w13, w2, aligned, limit: int, tiles=None):
    """A call that runs experts_triton on each of `aligned`'s (ids, weights, (rows, experts)) with
    moe_triton.SMALL_PAIRS = limit and the small kernel's tiles `tiles` (its rule's where None)."""
    from foveal.layers import moe_triton as mt

    def run():
        pairs, inter, rule = mt.SMALL_PAIRS, mt.SMALL_MAX_INTER, mt._small_tiles
        mt.SMALL_PAIRS, mt.SMALL_MAX_INTER = limit, 10**9 if limit else inter
        if tiles is not None:
            mt._small_tiles = lambda *_: tiles
        try:
            for ids, w, rows in aligned:
                mt.experts_triton(x, w13, w2, w, ids, silu_glu, aligned=rows)
        finally:
            mt.SMALL_PAIRS, mt.SMALL_MAX_INTER, mt._small_tiles = pairs, inter, rule

    return run


def small(smoke: bool, tokens: tuple[int, ...], shapes=tuple(SHAPES)) -> None:
    """The experts of a decode-sized step in one launch (moe_triton._moe_small_kernel, then pair_sum over
    its slices) against gate/up's and down's launches (then pair_sum), both on the rows route_align makes:
    us a layer, 8 layers on 8 routings replayed from a CUDA graph; at the fewest tokens also the small
    kernel's tile shapes (slice, depth, down's columns, warps, stages), the default's first."""
    import triton

    from foveal.layers import moe_triton as mt

    out = {}
    for name, E, k, H, inter, T, g, w13, w2, x, _weights, _ids in _layers(smoke, tokens, shapes):
        n = T * k
        routings = _routings(T, E, k, g, w13.device)
        bm = mt.block_m(n, w13, x)
        aligned = [(ids, route(torch.randn(T, E, generator=g).to(x.device), k)[0], mt.align(ids, E, bm))
                   for ids in routings]  # fmt: skip
        layers = partial(_experts_layers, x, w13, w2, aligned)
        reps = 3 if smoke else 20
        row = {"two_launches_us": round(_launches_us([layers(0)], reps) / 8, 1)}
        default = mt._small_tiles(n, inter, 0)
        shapes_ = [default]
        if T == min(tokens):
            grid = itertools.product((32, 64, 128), (64, 128, 256), (64, 128, 256), (4, 8), (3, 4))
            shapes_ += [t for t in (mt.SmallTiles(*v) for v in grid) if t != default]
            if smoke:
                shapes_ = shapes_[:3]
        times = []
        for t in shapes_:
            try:
                times.append((round(_launches_us([layers(10**9, t)], reps) / 8, 1), t))
            except triton.runtime.errors.OutOfResources:
                continue
        touched = sum(len(torch.unique(ids)) for ids in routings) / len(routings) * 3 * H * inter * 2
        row["small_default_us"] = times[0][0]
        row["small_best"] = [[us, list(t)] for us, t in sorted(times)[:3]]
        row["GBps_two_launches"] = round(touched / row["two_launches_us"] / 1e3, 1)
        row["GBps_small_best"] = round(touched / sorted(times)[0][0] / 1e3, 1)
        out[f"{name}/T{T}"] = row
        log(f"small {name} T={T}: {row}")
    RESULTS["small"] = out


RULE = None  # moe_triton._tiles as imported: the rule the prefill variants replace


def _prefill_tiles(spec: str):
    """moe_triton._tiles for --prefill-tiles' "bm,bn,bk,warps,stages[,split,cols_first]/..." (gate/up's /
    down's tiles for steps of more than 2,048 pairs; rows that differ: down aligns the pairs again), or
    the rule itself for "rule"."""
    import triton

    from foveal.layers import moe_triton as mt

    global RULE
    RULE = RULE or mt._tiles
    rule = RULE
    if spec == "rule":
        return rule
    if spec.startswith("best:"):  # this process's sweep: the fastest gate/up and down at its most tokens
        sweep = RESULTS.get("tiles", {})
        shape = spec.split(":", 1)[1]
        T = max((int(key.split("/")[1][1:]) for key in sweep if key.startswith(shape + "/")), default=None)
        if T is None or T * SHAPES[shape][1] <= 2048:
            raise SystemExit(f"--prefill-tiles {spec}: --parts tiles swept no prefill-sized step of {shape}")
        spec = "/".join(
            ",".join(map(str, sweep[f"{shape}/T{T}/{g}"]["best"][0][1])) for g in ("gate_up", "down")
        )
        log(f"prefill tiles {spec} (the sweep's fastest, {shape} at {T} tokens)")
    up, down = (mt.Tiles(*(int(v) for v in part.split(","))) for part in spec.split("/"))

    def tiles(n_pairs, num_experts, N, K, is_down, itemsize=2, fused_act=False, glu_out=False):
        if n_pairs <= 2048:
            return rule(n_pairs, num_experts, N, K, is_down, itemsize, fused_act, glu_out)
        t = down if is_down else up
        return t._replace(
            block_n=min(t.block_n, triton.next_power_of_2(N // 2 if glu_out else N)),
            block_k=min(t.block_k, triton.next_power_of_2(K)),
        )

    return tiles


def _variants(a) -> list[tuple[str, dict]]:
    """The prefill variants one engine runs in turn (--act-apart-above x --prefill-tiles x
    --silu-in-gate-up): (label, the moe_triton attributes to set). All act only on steps of more than
    2,048 pairs, which run eagerly, so the decode steps' CUDA graphs are the same for all."""
    aparts = [int(v) for v in a.act_apart_above.split(",")] if a.act_apart_above else [None]
    specs = a.prefill_tiles.split(";") if a.prefill_tiles else [None]
    silus = [bool(int(v)) for v in a.silu_in_gate_up.split(",")] if a.silu_in_gate_up else [None]
    out = []
    for apart, spec, silu in itertools.product(aparts, specs, silus):
        knobs = {}
        if apart is not None:
            knobs["ACT_APART_PAIRS"] = apart
        if spec is not None:
            knobs["_tiles"] = _prefill_tiles(spec)
        if silu is not None:
            knobs["SILU_IN_GATE_UP"] = silu
        label = " ".join(
            [f"apart>{apart}"] * (len(aparts) > 1)
            + [f"tiles {spec}"] * (spec is not None)
            + [f"silu {'in gate/up' if silu else 'apart'}"] * (silu is not None)
        )
        out.append((label, knobs))
    return out


def prefill(llm, V: int, prompt: int, profile: bool) -> dict:
    """N(256) prompts of `prompt` tokens, one token out: the prefill's prompt tok/s and the FLOP/s of the
    weights a token touches (gw.forward_flops: 2 a weight, the dense ones and its k experts a layer, the
    LM head's for each prompt's last token only), against the bf16 ceiling; with `profile`, the largest
    CUDA kernels of a second such run (device time a step = CUDA total / its steps)."""
    dense, per_expert, _E, layers = _bytes(llm)
    top_k = llm.engine.model.config.num_experts_per_tok
    weights = (dense + layers * top_k * per_expert) / llm.engine.dtype.itemsize
    n = gw.N(256)
    r = gw.run(llm, gw.random_prompts(n, prompt, V, next(SEEDS)), [gw.greedy(1)] * n)
    tflops = gw.forward_flops(llm, weights, r["prompt_tokens"], n) / r["wall_s"] / 1e12
    out = {
        "prompt_tokens": r["prompt_tokens"],
        "prompt_tokens_cached": r["prompt_tokens_cached"],  # (0: every token computed)
        "wall_s": round(r["wall_s"], 3),
        "steps": r["steps"],
        "prompt_tok_s": round(r["prompt_tokens"] / r["wall_s"], 1),
        "TFLOPs": round(tflops, 1),
        "host_ms_per_step": r["ms_per_step"],
    }
    if "ceilings" in gw.RESULTS:
        out["share_of_bf16_ceiling"] = round(tflops / gw.RESULTS["ceilings"]["bf16_TFLOPs"], 3)
    log(f"prefill only: {out}")
    if profile:
        from torch.profiler import ProfilerActivity
        from torch.profiler import profile as tprof

        from foveal.layers import moe_triton as mt

        gemm = mt._gemm

        def named(*args, **kw):  # (a, w, bias, c, scale, rows, experts, n_pairs, top_k, gather, ...)
            with torch.profiler.record_function("experts gate_up" if args[9] else "experts down"):
                gemm(*args, **kw)

        prompts = gw.random_prompts(n, prompt, V, next(SEEDS))
        mt._gemm = named  # the two GEMMs' launches apart in the table (one kernel name)
        try:
            with tprof(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
                rp = gw.run(llm, prompts, [gw.greedy(1)] * n)
        finally:
            mt._gemm = gemm
        log(f"profile: the prefill of {n} x {prompt} tokens ({rp['steps']} steps, {rp['wall_s']:.3f} s)")
        log(prof.key_averages().table(sort_by="cuda_time_total", row_limit=20, max_name_column_width=60))
        log(prof.key_averages().table(sort_by="cpu_time_total", row_limit=10, max_name_column_width=60))
    return out


def model(name: str, config: str, batches: list[int], a) -> None:
    from foveal.layers import moe_triton

    prompt, output = gw.L(512), gw.L(256)
    llm = gw.engine(config, a, max_model_len=2048, max_num_seqs=max(batches), max_num_batched_tokens=8192)
    V = llm.processor.info.vocab_size
    top_k = llm.engine.model.config.num_experts_per_tok
    variants = _variants(a)
    warm = max(4, 8192 // prompt)  # a full prefill step too: its kernels compile outside the timings
    for _label, knobs in variants:
        for attr, value in knobs.items():
            setattr(moe_triton, attr, value)
        gw.run(llm, gw.random_prompts(warm, prompt, V, next(SEEDS)), [gw.greedy(8)] * warm)
    out = {}
    for rep, b, (label, knobs) in itertools.product(range(a.reps), batches, variants):
        for attr, value in knobs.items():
            setattr(moe_triton, attr, value)
        n = gw.N(b) if b > 1 else 1
        # the same prompts' shapes first, 8 tokens out: every prefill step's kernels (a step's token and
        # sequence counts pick the experts' tiles and Triton's specializations) compile outside the timing
        gw.run(llm, gw.random_prompts(n, prompt, V, next(SEEDS)), [gw.greedy(8)] * n)
        if a.profile and n in a.profile_batches and rep == 0:
            gw.profile(llm, V, batch=n, context=prompt)
        r = gw.run(llm, gw.random_prompts(n, prompt, V, next(SEEDS)), [gw.greedy(output)] * n)
        r.update(_floor_row(llm, r, n, prompt + output // 2, top_k))
        tag = " ".join(v for v in (name, label, f"rep {rep + 1}" if a.reps > 1 else "") if v)
        gw.report(f"{tag} batch {n}", r, f"floor {r.get('floor_tok_s')} tok/s ({r.get('share_of_floor')})")
        out[f"{label} batch{b} rep{rep + 1}".strip()] = r
        if a.prefill:
            out[f"{label} prefill rep{rep + 1}".strip()] = prefill(llm, V, prompt, a.profile and rep == 0)
    RESULTS[name] = out
    del llm
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def _smoke_config(name: str) -> str:
    """A tiny config of the family (the script's code paths on CPU)."""
    from tests.tiny import tiny_config

    qwen3 = name.startswith("qwen3")
    cfg = tiny_config("qwen3_moe_unnormed" if qwen3 else "gpt_oss")
    cfg.architectures = ["Qwen3MoeForCausalLM" if qwen3 else "GptOssForCausalLM"]
    if name == "qwen3fp8":  # 16-blocks: the tiny experts' 48 rows and 64 columns fill them
        cfg.quantization_config = {"quant_method": "fp8", "weight_block_size": [16, 16]}
    path = os.path.join(tempfile.mkdtemp(), "config.json")
    with open(path, "w") as f:
        f.write(cfg.to_json_string())
    return path


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--parts", default="ceilings,kernel,qwen3,gptoss")
    ap.add_argument("--smoke", action="store_true")
    ap.add_argument("--profile", action="store_true")
    ap.add_argument("--profile-batches", default="1", help="--profile: the batches whose decode is profiled")
    ap.add_argument("--prefill", action="store_true", help="a prefill-only run (profiled)")
    ap.add_argument("--enforce-eager", action="store_true")
    ap.add_argument("--async-scheduling", default="auto", choices=["auto", "on", "off"])
    ap.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    ap.add_argument("--batches", default="", help="qwen3/gptoss batch sizes (default: 1,256 / 1,64)")
    ap.add_argument(
        "--prefill-tiles", default="", help="gate/up/down tiles above 2,048 pairs: 'rule;a,b,c,d,e/a,b,c,d,e'"
    )
    ap.add_argument(
        "--silu-in-gate-up", default="", help="the models: 1,0 = a variant each (SILU_IN_GATE_UP)"
    )
    ap.add_argument("--reps", type=int, default=1, help="the models: each batch and variant this many times")
    ap.add_argument("--tile-tokens", default="1,64,256", help="tiles: the token counts to sweep")
    ap.add_argument(
        "--tile-shapes", default=",".join(SHAPES), help="tiles: the layers' shapes, of " + ",".join(SHAPES)
    )
    ap.add_argument("--tile-weights", default="bf16", help="tiles: the experts' weights, bf16 and/or fp8")
    ap.add_argument("--cuda-experts", default="triton", help="paths, comma-separated: triton, grouped")
    ap.add_argument("--small-tokens", default="1,2,4,8,16", help="small: the token counts")
    ap.add_argument(
        "--pdl",
        default="",
        help="the models: 0,1 = an engine each without / with programmatic dependent launch",
    )
    ap.add_argument(
        "--small-pairs", default="", help="the models: an engine per value of moe_triton.SMALL_PAIRS (0: off)"
    )
    ap.add_argument(
        "--act-apart-above", default="", help="the models: steps of more pairs take the experts' activation "
        "in a pass of its own (moe_triton.ACT_APART_PAIRS; comma-separated: a run each, in one process)"
    )  # fmt: skip
    a = ap.parse_args()
    a.profile_batches = {int(b) for b in a.profile_batches.split(",")}
    gw.SMOKE = a.smoke
    parts = a.parts.split(",")
    if "ceilings" in parts and torch.cuda.is_available():
        gw.RESULTS["ceilings"] = RESULTS["ceilings"] = gw.ceilings()
    if "kernel" in parts:
        kernel(a.smoke)
    if "tiles" in parts:
        tokens = tuple(int(t) for t in a.tile_tokens.split(","))
        tiles(a.smoke, tokens, tuple(a.tile_weights.split(",")), tuple(a.tile_shapes.split(",")))
    if "small" in parts:
        small(a.smoke, tuple(int(t) for t in a.small_tokens.split(",")), tuple(a.tile_shapes.split(",")))
    runs = (
        ("qwen3", "qwen3-30b-a3b.json", [1, 256]),
        ("qwen3fp8", "qwen3-30b-a3b-fp8.json", [1, 256]),
        ("gptoss", "gpt-oss-20b.json", [1, 64]),
    )
    if a.batches:
        runs = tuple((n, c, [int(b) for b in a.batches.split(",")]) for n, c, _ in runs)
    from foveal.layers import moe, moe_triton, pdl

    paths = a.cuda_experts.split(",")
    smalls = [int(v) for v in a.small_pairs.split(",")] if a.small_pairs else [moe_triton.SMALL_PAIRS]
    pdls = [bool(int(v)) for v in a.pdl.split(",")] if a.pdl else [pdl.ENABLED]
    for name, config, batches in runs:
        for path, pairs, on in itertools.product(paths if name in parts else (), smalls, pdls):
            moe.CUDA_EXPERTS = path
            moe_triton.SMALL_PAIRS = pairs  # before the engine: its decode graphs are captured with it
            pdl.ENABLED = on
            label = " ".join(
                [name]
                + [path] * (len(paths) > 1)
                + [f"small<={pairs}"] * (len(smalls) > 1)
                + [f"pdl {int(on)}"] * (len(pdls) > 1)
            )
            model(label, _smoke_config(name) if a.smoke else config, batches, a)
    print(json.dumps({"benchmark": "moe", "smoke": a.smoke, **RESULTS}))


if __name__ == "__main__":
    main()
