"""The native CPU kernels against the PyTorch code they replace, on SmolLM2-135M shapes, each pair timed
alternately in one process (this host drifts by +-15% between runs):

  quantized linear (layers/cpu_quant.c, Q4_1; the LM head Q8_0) vs oneDNN fp32 on the dequantized
      weights (the dense CPU path), at 1, 16 and 128 rows, bf16 activations
  decode attention (attention/cpu_attention.c) vs the torch backend's gather + SDPA, 16 sequences
  prompt attention (the same kernel, every row of a chunk) vs the torch backend's causal SDPA: a
      fresh prompt of 160 / 700 / 2,000 tokens, and a prefix hit's remainder (the last 500 of 2,000)
  fused glue (layers/cpu_fused.c): residual add + RMSNorm, rotary, SiLU-and-mul vs their PyTorch ops

    python benchmarks/cpu_kernels.py [--rows 1 16 128]
    python benchmarks/cpu_kernels.py --linears-against avx2   # the linears only: this CPU's build
        (AVX-512 and VNNI where it has them) against the AVX2-only build (-DFOVEAL_AVX2_ONLY) in the
        "torch" column
    python benchmarks/cpu_kernels.py --attention [--attention-against OLD/cpu_attention.c]   # the
        attention pairs only; with a path, against the kernel built from that source (an A/B of a
        kernel change) in the "torch" column
    python benchmarks/cpu_kernels.py --plan   # the cpu backend's plan() of a 256-row decode step and of
        one with a 512-token prompt chunk beside it (ms a call); for a before/after, copy this file into
        another checkout's benchmarks/ and run it there, alternating
    python benchmarks/cpu_kernels.py --gemv [--rows 1 4]   # the quantized linear streaming weights from
        DRAM: ~90 MB of random Q4_K weights of one shape, called in turn (GB/s of weights read), for
        shapes with short and long panels; and a mixture's layer (Qwen3-30B-A3B's widths, 8 of 16
        experts, Q4_K gate/up, Q6_K down, six layers in turn) as one quant.moe call against a
        QuantWeight.linear call per expert; same before/after advice as --plan

Prints a table, then one JSON object as the last line.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from foveal.layers import fused, linear, quant  # noqa: E402
from foveal.layers.norm import RMSNorm  # noqa: E402
from foveal.layers.quant import QuantWeight  # noqa: E402
from foveal.layers.rotary import apply_rotary_qk  # noqa: E402

SHAPES = {  # name: (N, K, GGUF type) of SmolLM2-135M's linears (q/k/v and gate/up fused)
    "qkv": (960, 576, "Q4_1"),
    "o": (576, 576, "Q4_1"),
    "gate_up": (3072, 576, "Q4_1"),
    "down": (576, 1536, "Q4_1"),
    "lm_head": (49152, 576, "Q8_0"),
}


def ab(a, b, calls: int, reps: int = 5) -> tuple[float, float]:
    """Median microseconds per call of a and of b, timed alternately."""
    a(), b()
    ta, tb = [], []
    for _ in range(reps):
        for f, out in ((a, ta), (b, tb)):
            t = time.perf_counter()
            for _ in range(calls):
                f()
            out.append((time.perf_counter() - t) / calls * 1e6)
    return sorted(ta)[reps // 2], sorted(tb)[reps // 2]


def linears(rows: list[int], against: str = "torch") -> list[dict]:
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize, quantize

    from foveal.layers import quant

    native_kernel, avx2_kernel, looked_up = quant.build(wide=True), quant.build(wide=False), quant.kernel

    def run_with(kernel, qw, x):
        quant.kernel = lambda: kernel  # QuantWeight.linear looks the kernel up per call
        return qw.linear(x)

    out = []
    for name, (n, k, kind) in SHAPES.items():
        w = torch.randn(n, k, generator=torch.Generator().manual_seed(0)) * 0.05
        raw = quantize(w.numpy(), GGMLQuantizationType[kind])
        qw = QuantWeight.from_gguf(raw, kind, n, k)
        dense = torch.from_numpy(dequantize(raw, GGMLQuantizationType[kind])).bfloat16()
        for m in rows:
            x = torch.randn(m, k).bfloat16()
            calls = max(3, int(3e8 / (m * n * k)))
            if against == "avx2":
                tq, td = ab(
                    lambda: run_with(native_kernel, qw, x),  # noqa: B023
                    lambda: run_with(avx2_kernel, qw, x),  # noqa: B023
                    calls,
                )
            else:
                tq, td = ab(lambda: qw.linear(x), lambda: linear.linear(x, dense), calls)  # noqa: B023
            out.append({"op": f"linear {name}", "rows": m, "native_us": tq, "torch_us": td})
    quant.kernel = looked_up  # as run_with found it
    return out


def _baseline(against):
    """The backend the native kernel is timed against: the torch backend, or (a path) the CPU backend
    on the kernel built from another cpu_attention.c (an older version of it)."""
    from foveal.attention import get_backend

    if against is None:
        return get_backend("torch", torch.device("cpu"))
    from pathlib import Path

    from foveal import native
    from foveal.attention import cpu_native
    from foveal.attention.cpu_backend import CpuAttentionBackend

    return CpuAttentionBackend(cpu_native.AttentionKernel(native.load(Path(against), "the baseline kernel")))


def attention(seqs: int = 16, ctx: int = 200, against=None) -> dict:
    from foveal.attention import get_backend
    from tests.attention_cases import Case

    cpu = torch.device("cpu")
    case = Case([(ctx, 1)] * seqs, num_kv=3, group=3, head_dim=64, bs=16, dtype=torch.bfloat16, device=cpu)
    runs = []
    for backend in (get_backend("cpu", cpu), _baseline(against)):
        meta = backend.plan(case.batch, cpu)  # planned once per step in the engine, not per layer
        runs.append(lambda b=backend, m=meta: case.run(b, case.cache, m))
    tn, tt = ab(*runs, calls=50)
    return {"op": f"decode attention {seqs} seqs x {ctx} keys", "rows": seqs, "native_us": tn, "torch_us": tt}


def prompt_attention(chunks=((0, 160), (0, 700), (0, 2000), (1500, 500)), against=None) -> list[dict]:
    """One layer's attention over a prompt chunk, SmolLM2's shapes, bf16: (cached context, new tokens)."""
    from foveal.attention import get_backend
    from tests.attention_cases import Case

    cpu, out = torch.device("cpu"), []
    for ctx, n in chunks:
        case = Case([(ctx, n)], num_kv=3, group=3, head_dim=64, bs=16, dtype=torch.bfloat16, device=cpu)
        runs = []
        for backend in (get_backend("cpu", cpu), _baseline(against)):
            meta = backend.plan(case.batch, cpu)
            runs.append(lambda b=backend, m=meta, c=case: c.run(b, c.cache, m))
        tn, tt = ab(*runs, calls=max(3, int(2e6 / ((ctx + n) * n))), reps=7)
        what = f"prompt attention {n} tokens" + (f" after {ctx}" if ctx else "")
        out.append({"op": what, "rows": n, "native_us": tn, "torch_us": tt})
    return out


def plans(reps: int = 50) -> list[dict]:
    """The cpu backend's plan() of a step: 256 decode rows of 600 keys (40 blocks of 16 a table), alone and
    with a 512-token prompt chunk after 100 cached tokens; the median of 5 rounds of `reps` calls."""
    import random

    from foveal.attention.base import AttentionBatch
    from foveal.attention.cpu_backend import CpuAttentionBackend

    rng, cpu, backend, out = random.Random(0), torch.device("cpu"), CpuAttentionBackend(), []
    tables = [rng.sample(range(1, 20000), 40) for _ in range(257)]
    for chunk in (0, 512):
        q_lens, ctxs = [1] * 256 + [chunk] * bool(chunk), [600] * 256 + [100] * bool(chunk)
        batch = AttentionBatch(
            query_lens=q_lens, context_lens=ctxs, block_tables=tables[: len(q_lens)], num_decodes=256,
            slot_mapping=torch.zeros(sum(q_lens), dtype=torch.long), block_size=16,
        )  # fmt: skip
        times = []
        for _ in range(5):
            t = time.perf_counter()
            for _ in range(reps):
                backend.plan(batch, cpu)
            times.append((time.perf_counter() - t) / reps * 1e3)
        what = "plan: 256 decode rows" + (f" + a {chunk}-token chunk" if chunk else "")
        out.append({"op": what, "ms": round(sorted(times)[2], 3)})
    return out


def glue(rows: int) -> list[dict]:
    dt = torch.bfloat16
    norm = RMSNorm(576, 1e-5).to(dt)
    x, r = torch.randn(rows, 576).to(dt), torch.randn(rows, 576).to(dt)
    qkv = torch.randn(rows, 960).to(dt)
    q, k = qkv[:, :576].view(rows, 9, 64), qkv[:, 576:768].view(rows, 3, 64)
    cos, sin = torch.randn(rows, 1, 64).to(dt), torch.randn(rows, 1, 64).to(dt)
    gate_up = torch.randn(rows, 3072).to(dt)

    def silu_mul():
        from foveal.layers import cpu_fused

        if cpu_fused.use(gate_up):
            return cpu_fused.silu_and_mul(gate_up)
        g, u = gate_up.split(1536, dim=-1)
        return F.silu(g) * u

    out = []
    for name, f in (
        ("add + RMSNorm", lambda: norm.forward_residual(x, r)),
        ("rotary q, k", lambda: apply_rotary_qk(q, k, cos, sin)),
        ("SiLU-and-mul", silu_mul),
    ):

        def off(f=f):
            fused.set_fused_ops(False)
            try:
                return f()
            finally:
                fused.set_fused_ops(True)

        with torch.no_grad():
            tn, tt = ab(f, off, calls=500)
        out.append({"op": name, "rows": rows, "native_us": tn, "torch_us": tt})
    return out


def gemv(rows: list[int]) -> list[dict]:
    from tests.gguf_blocks import random_blocks

    def packed(kind, n, k, seed):
        raw = torch.from_numpy(random_blocks(kind, n, k, seed=seed, scale=1e-4))
        return QuantWeight.from_gguf(raw, kind, n, k)

    def best(f, reps=5):
        f()
        times = []
        for _ in range(reps):
            t = time.perf_counter()
            f()
            times.append(time.perf_counter() - t)
        return min(times)

    out = []
    for n, k in ((5632, 1024), (1536, 2048), (768, 2048), (4096, 4096)):
        ws = [packed("Q4_K", n, k, i) for i in range(max(1, int(9e7 // (n * k * 0.625))))]
        nbytes = sum(w.nbytes for w in ws)
        for m in rows:
            x = torch.randn(m, k).bfloat16()
            s = best(lambda x=x, ws=ws: [w.linear(x) for w in ws])
            out.append({"op": f"Q4_K {n} x {k}", "rows": m, "GBps": round(nbytes / s / 1e9, 1)})
    if not hasattr(quant, "moe"):  # an older tree (a before/after of the linears)
        return out
    H, inter, E, k = 2048, 768, 16, 8
    layers = []
    for i in range(6):
        gu, dn = packed("Q4_K", E * 2 * inter, H, i), packed("Q6_K", E * H, inter, 50 + i)
        views = (
            [gu.rows(e * 2 * inter, (e + 1) * 2 * inter) for e in range(E)],
            [dn.rows(e * H, (e + 1) * H) for e in range(E)],
        )
        layers.append(quant.ExpertPacks(*views))
    nbytes = sum(p.gate_up[e].nbytes + p.down[e].nbytes for p in layers for e in range(k))
    for m in rows:
        x, weights = torch.randn(m, H).bfloat16(), torch.full((m, k), 1 / k)
        ids = torch.stack([torch.randperm(E)[:k] for _ in range(m)])

        def each(x=x, ids=ids, m=m):
            for p in layers:
                for t in range(m):
                    for j in range(k):
                        e = int(ids[t, j])
                        h = p.gate_up[e].linear(x[t : t + 1])
                        p.down[e].linear(F.silu(h[:, :inter]) * h[:, inter:])

        for what, f in (
            ("quant.moe", lambda x=x, w=weights, ids=ids: [quant.moe(x, w, ids, p) for p in layers]),
            ("a call per expert", each),
        ):
            out.append({"op": f"experts, {what}", "rows": m, "GBps": round(nbytes / best(f) / 1e9, 1)})
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 16, 128])
    ap.add_argument("--linears-against", choices=["torch", "avx2"], default="torch")
    ap.add_argument("--attention", action="store_true", help="the attention pairs only")
    ap.add_argument("--plan", action="store_true", help="the cpu backend's plan() of two steps only")
    ap.add_argument("--attention-against", metavar="SRC", help="with --attention: against the kernel built "
                    "from SRC (another cpu_attention.c) in the torch column")  # fmt: skip
    ap.add_argument("--gemv", action="store_true", help="quantized linears streaming weights; experts")
    a = ap.parse_args()
    if a.gemv:
        timed = gemv(a.rows if a.rows != [1, 16, 128] else [1, 4])
        for r in timed:
            print(f"{r['op']:<36}{r['rows']:>6}{r['GBps']:>8.1f} GB/s")
        print(json.dumps({"benchmark": "cpu_kernels", "gemv": timed}))
        return
    if a.plan:
        timed = plans()
        for r in timed:
            print(f"{r['op']:<48}{r['ms']:>8.3f} ms")
        print(json.dumps({"benchmark": "cpu_kernels", "plans": timed}))
        return
    if a.attention:
        results = [attention(against=a.attention_against)] + prompt_attention(against=a.attention_against)
    elif a.linears_against == "avx2":
        results = linears(a.rows, "avx2")
    else:
        results = linears(a.rows) + [attention()] + prompt_attention() + glue(16)
    print(f"{'op':<36}{'rows':>6}{'native us':>12}{'torch us':>12}{'speed-up':>10}")
    for r in results:
        r["native_us"], r["torch_us"] = round(r["native_us"], 1), round(r["torch_us"], 1)
        r["speedup"] = round(r["torch_us"] / r["native_us"], 2)
        print(
            f"{r['op']:<36}{r['rows']:>6}{r['native_us']:>12.1f}{r['torch_us']:>12.1f}{r['speedup']:>9.2f}x"
        )
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout
    summary = {
        "benchmark": "cpu_kernels",
        "commit": commit.strip(),
        "threads": torch.get_num_threads(),
        "against": a.linears_against,
    }
    print(json.dumps({**summary, "results": results}))


if __name__ == "__main__":
    main()
