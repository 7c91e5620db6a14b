"""Issue 36's GPU workloads on dummy Llama-3.1-8B, in one process:

    python3 benchmarks/sampling.py [--workloads mixed,prefix] [--reps 2] [--profile DIR] [--smoke]

mixed   256 requests x (512 in / 256 out), greedy and mixed sampling alternating (--reps each): every
        row of the mixed runs has its own temperature (0 to 1.3), top_p (1, 0.9, 0.5), top_k (0, 20, 50),
        min_p (0, 0.05), repetition / presence / frequency penalties, a seed on half of the rows and
        logprobs=5 on a quarter. Reports both tok/s and mixed / greedy (the target: >= 0.97): best of
        each mode, each rep's pair and their median; and the decode steps alone (wall time a step once
        every request has its first token: no prefill, no first-use costs): greedy's over mixed's, the
        mean step's (best of each) and by rep the median step's in each quarter of the decode steps.
kernel  the sampler alone on [256, 128256] random logits with the mixed rows' parameters (no penalties,
        no logprobs): Sampler.sample (CUDA: the Triton kernel) against the torch path (sort_filter and
        the noise), CUDA events, median of 20 after 3 warm-ups, at two logit scales; the same rows
        with their penalties too, read from a device history (512 prompt + 256 drawn tokens a slot),
        on bf16 logits (penalties_bf16_ms); and (CUDA) the logprobs' pass alone (row_logprobs: every
        4th row, 5 alternatives; parts x warps swept on bf16).
tiles   the Triton kernel alone at several (column block, warps per program, lanes, register cap) shapes,
        by filter (fp32), and the mixed rows on bf16 with their penalties (the decode step's case).
        SAMPLING_TILES="block,warps,lanes[,maxnreg];...": these shapes instead.
SAMPLING_TILE="block,warps,lanes[,maxnreg]" sets the kernel's shape for every workload (the engine's too).
host    the Sampler's host work a step for the mixed rows, the kernel's launch stubbed (any machine).
prefix  256 requests sharing a 3,584-token prefix, each with 512 tokens of its own, 128 out, greedy,
        prefix caching on (the shared blocks are computed once): output tok/s; the prompt tokens the
        runs compute and their time at the matmul ceiling (a bound on the prefill); with --profile the
        largest kernels of 8 decode steps, plain and shared-prefix decode.

Every run goes through the engine's step loop (gpu_workloads.run: all requests at t0) and prints the
host's time per step phase. --profile: for each mode, a few decode steps timed without a profiler
(host ms per phase) and a torch.profiler trace of a few more (GPU busy / idle, GPU ms per phase, top
kernels; kernels launched by Triton count as "other"). --smoke runs it on the CPU with a tiny config
(checks the script, not the speed). Ends with one JSON line.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import time

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))

import benchmarks.gpu_workloads as gw  # noqa: E402
from foveal import SamplingParams  # noqa: E402

TEMPS = (0.0, 0.3, 0.7, 1.0, 1.3)
TOP_P = (1.0, 0.9, 0.5)
TOP_K = (0, 20, 50)
MIN_P = (0.0, 0.05)


def mixed_params(n: int, max_tokens: int) -> list[SamplingParams]:
    """Row i's mix: the lists above cycled with co-prime strides, so the combinations spread."""
    out = []
    for i in range(n):
        out.append(
            SamplingParams(
                temperature=TEMPS[i % 5],
                top_p=TOP_P[i % 3],
                top_k=TOP_K[(i // 3) % 3],
                min_p=MIN_P[(i // 2) % 2],
                repetition_penalty=(1.0, 1.1)[(i // 4) % 2],
                presence_penalty=(0.0, 0.5)[(i // 7) % 2],
                frequency_penalty=(0.0, 0.3)[(i // 5) % 2],
                seed=i if i % 2 else None,
                logprobs=5 if i % 4 == 1 else None,
                max_tokens=max_tokens,
                ignore_eos=True,
            )
        )
    return out


def mixed(a) -> dict:
    llm = gw.engine("llama-3.1-8b.json", a, max_model_len=2048, max_num_seqs=256, max_num_batched_tokens=8192)
    V = llm.processor.info.vocab_size
    n, out_len = gw.N(256), gw.L(256)
    # warm: both paths' shapes, and each variant of the sampling kernel the runs meet (it compiles for
    # seconds): rows 0-3 of the mix have no penalties, so a step of them alone takes the variant without
    gw.run(llm, gw.random_prompts(4, gw.L(512), V, 97), mixed_params(4, 8))
    gw.run(llm, gw.random_prompts(8, gw.L(512), V, 99), mixed_params(8, 8))
    gw.run(llm, gw.random_prompts(8, gw.L(512), V, 98), [gw.greedy(8)] * 8)
    prompts = gw.random_prompts(n, gw.L(512), V, 1)
    # and the full batch of each mode for a few tokens: a fresh machine's first timed mixed run still
    # compiled inside its timing (TTFT p50 11-18 s against 1.7 s after, RESULTS session 31)
    for mode in ("greedy", "mixed"):
        llm.engine.reset_prefix_cache()
        gw.run(llm, prompts, [gw.greedy(4)] * n if mode == "greedy" else mixed_params(n, 4))
    res: dict = {"greedy": [], "mixed": []}
    for rep in range(a.reps):
        for mode in ("greedy", "mixed"):
            params = [gw.greedy(out_len)] * n if mode == "greedy" else mixed_params(n, out_len)
            llm.engine.reset_prefix_cache()  # each run prefills its prompts: no mode rides on another's
            r = gw.run(llm, prompts, params)
            gw.report(f"{mode} {rep}", r)
            res[mode].append(r)
    best = {m: max(r["output_tok_s"] for r in rs) for m, rs in res.items()}
    res["best_tok_s"] = best
    res["mixed_over_greedy"] = best["mixed"] / best["greedy"]
    gw.log(f"mixed / greedy (best of {a.reps}): {best['mixed']:.1f} / {best['greedy']:.1f} = "
           f"{res['mixed_over_greedy']:.3f}")  # fmt: skip
    # each rep's pair (greedy then mixed, back to back), and the decode steps' medians by quarter: the
    # best of each mode can pair runs a few long steps favoured
    pairs = [m["output_tok_s"] / g["output_tok_s"] for g, m in zip(res["greedy"], res["mixed"])]
    quarters = [
        [gq / mq for gq, mq in zip(g["decode_step_ms_quarters"], m["decode_step_ms_quarters"])]
        for g, m in zip(res["greedy"], res["mixed"])
    ]
    res["pair_ratios"], res["quarter_step_ratios"] = pairs, quarters
    mid = sorted(pairs)[len(pairs) // 2]
    gw.log(f"mixed / greedy by rep: {[round(r, 3) for r in pairs]} (median {mid:.3f}); greedy step / "
           f"mixed step by quarter: {[[round(q, 3) for q in qs] for qs in quarters]}")  # fmt: skip
    # the decode steps alone (every request past its first token): greedy's step time over mixed's
    step = {m: min(r["decode_step_ms"] or float("inf") for r in rs) for m, rs in res.items() if m in best}
    res["decode_step_ms"], res["decode_greedy_over_mixed"] = step, step["greedy"] / step["mixed"]
    gw.log(f"decode step greedy / mixed (best of {a.reps}): {step['greedy']:.2f} / {step['mixed']:.2f} ms = "
           f"{res['decode_greedy_over_mixed']:.3f}")  # fmt: skip
    if a.profile:  # both modes' decode steps: host phases without a profiler, then a trace
        os.makedirs(a.profile, exist_ok=True)
        for mode in ("greedy", "mixed"):
            params = [gw.greedy(48)] * n if mode == "greedy" else mixed_params(n, 48)
            llm.engine.reset_prefix_cache()
            trace = os.path.join(a.profile, f"{mode}.json")
            from benchmarks.step_profile import decode_window

            res[f"profile_{mode}"] = decode_window(llm, prompts, params, trace)
            print(json.dumps({"profile": mode, **res[f"profile_{mode}"]}))
    del llm
    return res


def kernel(a) -> dict:
    from foveal.sample.sampler import Sampler, SamplingRow

    dev = "cuda" if torch.cuda.is_available() else "cpu"
    V, n = (128256, 256) if dev == "cuda" else (4096, 16)
    params = [
        SamplingParams(temperature=p.temperature, top_p=p.top_p, top_k=p.top_k, min_p=p.min_p, seed=p.seed)
        for p in mixed_params(n, 1)
    ]
    rows = [SamplingRow(p, [], [], frozenset()) for p in params]
    s = Sampler(V)
    ng = [i for i, p in enumerate(params) if not p.greedy]

    def torch_path(x):
        y = s.process_logits(x, rows)
        tokens = y.argmax(-1)
        idx = torch.tensor(ng, device=y.device)
        sub = [rows[i] for i in ng]
        tokens[idx] = s._draw(s.sort_filter(y[idx], [r.params for r in sub]).softmax(-1), sub)
        return tokens

    def timed(fn, x) -> float:
        return median_ms(lambda: fn(x), reps=20)

    # the mixed workload's own rows, penalties included, their history kept on the device (a 512-token
    # prompt and 256 drawn tokens a slot): the kernel reads it as the rows load
    pen_s = Sampler(V, dev)
    pen_params = [dataclasses.replace(p, logprobs=None) for p in mixed_params(n, 1)]  # the draw alone
    lists = _start_histories(pen_params, V, pen_s.history)
    pen_rows = [SamplingRow(p, prompt, out, frozenset(), None, i if p.needs_penalties else None)
                for i, (p, (prompt, out)) in enumerate(zip(pen_params, lists))]  # fmt: skip

    res = {}
    for scale in (1.0, 4.0):
        g = torch.Generator().manual_seed(0)
        x = (torch.randn(n, V, generator=g) * scale).to(dev)
        res[f"scale_{scale}"] = {
            "kernel_ms": timed(lambda x: s.sample(x, rows)[0], x),
            "torch_ms": timed(torch_path, x),
            "greedy_ms": timed(lambda x: x.argmax(-1), x),
            # bf16 logits (the model's) with the rows' penalties from the device history
            "penalties_bf16_ms": timed(lambda x: pen_s.sample(x, pen_rows)[0], x.bfloat16()),
        }
        if dev == "cuda":  # the logprobs of a quarter of the rows with 5 alternatives (the mixed workload's)
            from foveal.sample.triton_sample import row_logprobs

            asked, drawn = torch.arange(0, n, 4, device=dev), torch.zeros(n, dtype=torch.long, device=dev)
            lp = lambda x, a=asked, d=drawn: row_logprobs(x, a, d, 5)  # noqa: E731
            res[f"scale_{scale}"]["logprobs_ms"] = timed(lp, x)
            from foveal.sample import triton_sample as ts

            if scale == 1.0 and hasattr(ts, "_LSE_PARTS"):  # parts a row x warps a part, bf16 logits
                xb, sweep, keep = x.bfloat16(), {}, (ts._LSE_PARTS, ts._LSE_WARPS)
                for parts in (8, 16, 32):
                    for warps in (4, 8, 16):
                        ts._LSE_PARTS, ts._LSE_WARPS = parts, warps
                        sweep[f"{parts}x{warps}"] = round(timed(lp, xb), 4)
                ts._LSE_PARTS, ts._LSE_WARPS = keep
                res["logprobs_parts_x_warps_ms"] = sweep
                gw.log(f"logprobs' pass, bf16, parts x warps: {sweep} ms")
        gw.log(f"sampler alone, scale {scale}: {res[f'scale_{scale}']}")
    return res


def median_ms(run, reps: int = 10) -> float:
    """run()'s median time in ms over `reps` calls after 3 warm-ups (CUDA events on a GPU)."""
    for _ in range(3):
        run()
    times = []
    for _ in range(reps):
        if torch.cuda.is_available():
            t0, t1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            t0.record()
            run()
            t1.record()
            t1.synchronize()
            times.append(t0.elapsed_time(t1))
        else:
            t = time.perf_counter()
            run()
            times.append((time.perf_counter() - t) * 1e3)
    return sorted(times)[len(times) // 2]


def tiles(a) -> dict:
    """The Triton kernel alone at several (column block, warps per program, lanes) shapes,
    for the filters whose cost the shape moves (temperature only, top_k 50, top_p 0.9, both, the mixed
    rows in their order and heavy first): one program a row, its warps keep loads in flight, its lanes
    (the block unless set apart) hold top_k's and the draws' candidates (4 registers of values and 4 of
    columns each). CUDA events, median of 10 after 3 warm-ups, fp32 logits of scale 1, and (the decode
    step's case) the same in bf16 with the rows' penalties; with each shape, the compiled kernel's
    registers a thread and spills (CUDA)."""
    from foveal.sample import noise
    from foveal.sample import triton_sample as ts

    dev = "cuda" if torch.cuda.is_available() else "cpu"
    V, n = (128256, 256) if dev == "cuda" else (4096, 4)
    keys = noise.key_halves(noise.row_keys(list(range(n)), [0] * n), dev)
    ps = mixed_params(n, 1)
    cases = {  # name: per-row (temperature, min_p, top_k, top_p)
        "temperature": [(0.7, 0.0, 0, 1.0)] * n,
        "top_k 50": [(0.7, 0.0, 50, 1.0)] * n,
        "top_p 0.9": [(0.7, 0.0, 0, 0.9)] * n,
        "top_k 50 + top_p 0.9": [(0.7, 0.0, 50, 0.9)] * n,
        "mixed rows": [(p.temperature, p.min_p, p.top_k, p.top_p) for p in ps],
    }
    cases["mixed, heavy first"] = cases["mixed rows"]
    # the decode step's case: the model's bf16 logits, the rows' penalties read from a device history
    # (a 512-token prompt and 256 drawn tokens a penalized row), heavy first
    cases["bf16 mixed, heavy first"] = cases["bf16 + penalties, heavy first"] = cases["mixed rows"]
    heavy = torch.tensor(ts.row_order(*zip(*cases["mixed rows"])), dtype=torch.float32, device=dev)
    pen = _device_history(ps, V, dev)
    # (block, warps, lanes (0: the block), registers a thread at most (0: Triton's choice))
    shapes = [(2048, 16, 512, 64), (4096, 16, 0, 0), (2048, 16, 1024, 64), (1024, 16, 1024, 64)]
    shapes += [(4096, 16, 1024, 0), (2048, 8, 1024, 128)]
    shapes = shapes if dev == "cuda" else [(512, 4, 0, 0), (512, 4, 128, 0)]
    if os.environ.get("SAMPLING_TILES"):  # "block,warps,lanes[,maxnreg];...": these shapes instead
        shapes = [(*(int(v) for v in s.split(",")), 0)[:4] for s in os.environ["SAMPLING_TILES"].split(";")]
    saved, res = (ts._BLOCK, ts._WARPS, ts._LANES, ts._MAXNREG), {}
    x = (torch.randn(n, V, generator=torch.Generator().manual_seed(0))).to(dev)
    xb = x.bfloat16()
    for block, warps, lanes, maxnreg in shapes:
        ts._BLOCK, ts._WARPS, ts._LANES, ts._MAXNREG = block, warps, lanes, maxnreg
        cap = f" regs <= {maxnreg}" if maxnreg else ""
        shape = f"block {block} warps {warps} lanes {lanes or block}{cap}"
        for name, rows in cases.items():
            c = torch.tensor(list(zip(*rows)), dtype=torch.float32, device=dev)
            o = heavy if name.endswith("first") else None
            xs, p = (xb if name.startswith("bf16") else x), (pen if "penalties" in name else None)
            run = lambda c=c, o=o, xs=xs, p=p: ts.sample_rows(xs, c[0], c[1], c[2], c[3], keys, V, p, o)  # noqa: E731
            res[f"{shape} {name}"] = median_ms(run)
        row = {name: round(res[f"{shape} {name}"], 3) for name in cases}
        gw.log(f"kernel, {shape}: {row} ms; {_registers(ts)}")
    ts._BLOCK, ts._WARPS, ts._LANES, ts._MAXNREG = saved
    return res


def _start_histories(params: list[SamplingParams], V: int, hist) -> list[tuple[list[int], list[int]]]:
    """Each row's (prompt, output) token lists, 512 and 256 seeded random ids, and slot i of `hist` (a
    TokenHistory) started with row i's where its params have penalties."""
    g, lists = torch.Generator().manual_seed(1), []
    for i, p in enumerate(params):
        prompt, out = (torch.randint(0, V, (n,), generator=g).tolist() for n in (512, 256))
        if p.needs_penalties:
            hist.start(i, prompt, out, p.repetition_penalty != 1.0)
        lists.append((prompt, out))
    return lists


def _device_history(params: list[SamplingParams], V: int, dev) -> tuple:
    """sample_rows' penalties argument for rows of these params (_start_histories' device history), as
    the Sampler passes it."""
    from foveal.sample.history import TokenHistory

    hist = TokenHistory(V, dev)
    _start_histories(params, V, hist)
    slots = [float(i if p.needs_penalties else -1) for i, p in enumerate(params)]
    vals = [[p.repetition_penalty for p in params], [p.frequency_penalty for p in params]]
    vals.append([p.presence_penalty for p in params])
    as_dev = lambda v: torch.tensor(v, dtype=torch.float32, device=dev)  # noqa: E731
    return as_dev(slots), as_dev(vals), hist.counts, hist.prompt


def _registers(ts) -> str:
    """The sampling kernel's compiled variants' registers a thread and spilled bytes (CUDA; Triton's
    cache of the jit function, newest last)."""
    try:
        compiled = list(ts._kernel.device_caches[0][0].values())
        return ", ".join(f"{k.n_regs} regs / {k.n_spills} spilled" for k in compiled[-1:])
    except Exception as e:  # the cache's layout is Triton's own: report what failed, never stop the sweep
        return f"registers unknown ({type(e).__name__})"


def filters(a) -> dict:
    """The Triton sampling kernel alone with every row on one filter (temperature 0.7 and the named
    filter; fp32 and bf16 logits), then the mixed rows in their order and in the Sampler's (row_order:
    the heavy rows' programs first): where the kernel's time goes by filter. CUDA events, median of 10
    after 3 warm-ups, logits of scale 1 and 4."""
    from foveal.sample import noise
    from foveal.sample import triton_sample as ts

    dev = "cuda" if torch.cuda.is_available() else "cpu"
    V, n = (128256, 256) if dev == "cuda" else (4096, 4)
    keys = noise.key_halves(noise.row_keys(list(range(n)), [0] * n), dev)
    cases = {  # name: (temperature, min_p, top_k, top_p)
        "greedy": (0.0, 0.0, 0, 1.0),
        "temperature": (0.7, 0.0, 0, 1.0),
        "min_p 0.05": (0.7, 0.05, 0, 1.0),
        "top_k 50": (0.7, 0.0, 50, 1.0),
        "top_p 0.9": (0.7, 0.0, 0, 0.9),
        "top_p 0.5": (0.7, 0.0, 0, 0.5),
        "top_k 50 + top_p 0.9": (0.7, 0.0, 50, 0.9),
    }
    ps = mixed_params(n, 1)
    mixed_cols = [[p.temperature for p in ps], [p.min_p for p in ps], [p.top_k for p in ps]]
    mixed_cols.append([p.top_p for p in ps])
    heavy = torch.tensor(ts.row_order(*mixed_cols), dtype=torch.float32, device=dev)  # the Sampler's order
    res = {}
    g = torch.Generator().manual_seed(0)
    for scale in (1.0, 4.0):
        x32 = (torch.randn(n, V, generator=g) * scale).to(dev)
        for dtype, x in (("fp32", x32), ("bf16", x32.to(torch.bfloat16))):
            for name, vals in [*cases.items(), ("mixed rows", None), ("mixed rows, heavy first", None)]:
                cols = mixed_cols if vals is None else [[v] * n for v in vals]
                c = torch.tensor(cols, dtype=torch.float32, device=dev)
                order = heavy if name.endswith("first") else None
                run = lambda x=x, c=c, o=order: ts.sample_rows(x, c[0], c[1], c[2], c[3], keys, V, order=o)  # noqa: E731
                key = f"scale {scale} {dtype} {name}"
                res[key] = median_ms(run)
                gw.log(f"kernel, {key}: {res[key]:.3f} ms")
    return res


def prefix(a) -> dict:
    llm = gw.engine("llama-3.1-8b.json", a, max_model_len=4096 + 256, max_num_seqs=256,
                    max_num_batched_tokens=8192, enable_prefix_caching=True)  # fmt: skip
    V = llm.processor.info.vocab_size
    n = gw.N(256)
    shared = gw.random_prompts(1, gw.L(3584), V, 7)[0]
    own = gw.random_prompts(n, gw.L(512), V, 8)
    gw.run(llm, [shared[:64] + o[:16] for o in own[:4]], [gw.greedy(4)] * 4)  # warm
    backend = llm.engine.runner.backend
    on = getattr(backend, "shared_min_rows", 0)  # Triton's shared-prefix decode (its default rule)
    res: dict = {"plain": [], "shared": []}
    for rep in range(a.reps):
        for mode in ("plain", "shared") if on else ("plain",):  # alternating: the host's speed varies
            backend.shared_min_rows = on if mode == "shared" else 0
            r = gw.run(llm, [shared + o for o in own], [gw.greedy(gw.L(128))] * n)
            gw.report(f"prefix {mode} {rep}", r)
            res[mode].append(r)
            llm.engine.reset_prefix_cache()
    if a.profile and torch.cuda.is_available():  # where a decode step's time goes, plain then shared
        for mode in ("plain", "shared") if on else ("plain",):
            backend.shared_min_rows = on if mode == "shared" else 0
            gw.log(f"prefix, {mode} decode:")
            gw.profile(llm, V, n, 0, prompts=[shared + o for o in own])
            llm.engine.reset_prefix_cache()
    backend.shared_min_rows = on
    # the prompt tokens a run computes (the cache's hits subtracted) at the matmul ceiling: a bound on
    # its prefill's time that no attention kernel moves (2 FLOPs a weight a token)
    r = res["plain"][-1]
    computed = r["prompt_tokens"] - r["prompt_tokens_cached"]
    bound: dict = {"prompt_tokens_computed": computed}
    flops = gw.forward_flops(llm, gw.decode_bytes(llm) / llm.engine.dtype.itemsize, computed, len(own))
    del llm
    if torch.cuda.is_available():  # the ceiling's buffers measured with the engine's memory released
        torch.cuda.empty_cache()
        bound["prefill_floor_s"] = flops / (gw.ceilings()["bf16_TFLOPs"] * 1e12)
        gw.log(f"prefix: {computed} prompt tokens computed of {r['prompt_tokens']}; at the matmul "
               f"ceiling {bound['prefill_floor_s']:.2f} s of a run")  # fmt: skip
    best = {m: max(r["output_tok_s"] for r in runs) for m, runs in res.items() if runs}
    if len(best) == 2:
        gw.log(f"prefix shared / plain (best of {a.reps}): {best['shared']:.1f} / {best['plain']:.1f} = "
               f"{best['shared'] / best['plain']:.3f}")  # fmt: skip
    return {"runs": res, "best_tok_s": best, **bound}


def prefix_sweep(a) -> dict:
    """Where shared-prefix decode pays (the rule's data): for rows x prefix lengths, requests sharing a
    prefix (each with 128 tokens of its own, 64 out, greedy), the decode step in ms with the shared-prefix
    kernel off and on (graphs captured for buckets from 16 rows up), alternating in one process."""
    rows_set = (16, 64, 256) if not a.smoke else (4,)
    prefixes = (512, 2048) if not a.smoke else (64,)
    llm = gw.engine(
        "llama-3.1-8b.json", a, max_model_len=2048 + 256, max_num_seqs=256, max_num_batched_tokens=8192,
        enable_prefix_caching=True, shared_prefix_min_rows=16, shared_prefix_min_tokens=256,
    )  # fmt: skip
    backend = llm.engine.runner.backend
    on = getattr(backend, "shared_min_rows", 0)
    V = llm.processor.info.vocab_size
    res: dict = {}
    for n in rows_set:
        for plen in prefixes:
            shared = gw.random_prompts(1, plen, V, 11)[0]
            own = gw.random_prompts(n, gw.L(128), V, 12)
            for mode in ("plain", "shared") if on else ("plain",):
                backend.shared_min_rows, backend.shared_min_prefix = (
                    (on, 256) if mode == "shared" else (0, 256)
                )
                gw.run(llm, [shared[:64]], [gw.greedy(2)])  # warm, and the prefix's first blocks cached
                gw.run(llm, [shared], [gw.greedy(2)])
                r = gw.run(llm, [shared + o for o in own], [gw.greedy(gw.L(64))] * n)
                res[f"rows {n} prefix {plen} {mode}"] = r["decode_step_ms"]
                gw.log(f"prefix sweep, {n} rows behind {plen} keys, {mode}: decode step "
                       f"{r['decode_step_ms'] or 0:.2f} ms")  # fmt: skip
                llm.engine.reset_prefix_cache()
    backend.shared_min_rows = on
    del llm
    return res


def host(a) -> dict:
    """The Sampler's host work a step for the mixed rows (256, penalties in the device history), its
    kernel launch stubbed: the Python a GPU step waits on (CPU; median of 5 rounds of 200 calls); then
    three of its parts alone the same way: the rows' noise keys (row_keys), the heavy-first order
    (row_order) and the columns' table."""
    import array

    from foveal.sample import noise
    from foveal.sample import sampler as sm
    from foveal.sample.sampler import Sampler, SamplingRow

    prompt, out = list(range(512)), list(range(100))
    rows = [SamplingRow(p, prompt, out, frozenset([2]), 100, i if p.needs_penalties else None)
            for i, p in enumerate(mixed_params(256, 1))]  # fmt: skip
    s, x = Sampler(8, "cpu"), torch.zeros(len(rows), 8)
    saved, sm.triton_sample.sample_rows = sm.triton_sample.sample_rows, lambda *a, **k: None
    sm._kernel_ok["sample"] = True
    try:
        rounds = []
        for _ in range(6):
            t = time.perf_counter()
            for _ in range(200):
                s._draw_kernel(x, rows, penalties=True)
            rounds.append((time.perf_counter() - t) / 200 * 1e6)
    finally:
        sm.triton_sample.sample_rows = saved
    res = {"draw_kernel_host_us": sorted(rounds[1:])[2]}
    columns = list(zip(*[r.params.kernel_columns for r in rows]))

    def table():
        t = array.array("f")
        for c in columns:
            t.fromlist(list(c))

    parts = {
        "row_keys": lambda: noise.row_keys([r.params.seed for r in rows], [r.draw_index for r in rows]),
        "row_order": lambda: sm.triton_sample.row_order(*columns[:4]),
        "table": table,
    }
    for name, fn in parts.items():
        rounds = []
        for _ in range(6):
            t = time.perf_counter()
            for _ in range(200):
                fn()
            rounds.append((time.perf_counter() - t) / 200 * 1e6)
        res[f"{name}_us"] = sorted(rounds[1:])[2]
    gw.log(f"sampler host work, 256 mixed rows: {res}")
    return res


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--workloads", default="mixed,prefix")
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument("--profile", default=None, help="a folder for traces of a few decode steps of each mode")
    gw.engine_options(ap)
    a = ap.parse_args()
    gw.setup(a, "sampling.py")
    if os.environ.get("SAMPLING_TILE"):  # the kernel's shape in this process (tiles sets its own)
        from foveal.sample import triton_sample as ts

        tile = [int(v) for v in os.environ["SAMPLING_TILE"].split(",")]
        ts._BLOCK, ts._WARPS, ts._LANES, ts._MAXNREG = (*tile, 0)[:4]
        gw.log(f"sampling kernel's shape: {tile}")
    out: dict = {"benchmark": "sampling", "commit": os.environ.get("FOVEAL_COMMIT", "?")}
    parts = (
        ("kernel", kernel), ("tiles", tiles), ("filters", filters), ("mixed", mixed), ("prefix", prefix),
        ("prefix_sweep", prefix_sweep), ("host", host),
    )  # fmt: skip
    for name, fn in parts:
        if name in a.workloads.split(","):
            out[name] = fn(a)
            if torch.cuda.is_available():
                torch.cuda.empty_cache()
    print(json.dumps(out, default=lambda x: round(x, 4) if isinstance(x, float) else str(x)))


if __name__ == "__main__":
    main()
