"""GPU micro-benchmark: skinny GEMMs (decode at batch 1-8) on the projection shapes of Llama-3.1-8B
and Qwen2.5-VL-7B's language model, bf16: cuBLAS through F.linear and torch.mv, against a plain
Triton GEMV (one program per BLOCK_N output columns over the whole K, no split-K, no reduce kernel),
swept over its tile sizes. Reports achieved weight bandwidth (weight bytes / time) per shape.

    python3 benchmarks/gemv.py            # GPU
    python3 benchmarks/gemv.py --check    # CPU, TRITON_INTERPRET=1: the kernel against F.linear only

Question it answers: is batch-1 decode (W1/W4 of issue 5) losing time in cuBLAS's choice of kernel
for the smaller projections (qkv, o_proj: measured ~3.1 TB/s against 4.1 TB/s on gate_up)?
Prints a table, then one JSON object as the last line.
"""

from __future__ import annotations

import argparse
import functools
import itertools
import json
import os

import torch
import torch.nn.functional as F

SHAPES = {  # name: (N out, K in)
    "llama8b.qkv": (6144, 4096),
    "llama8b.o": (4096, 4096),
    "llama8b.gate_up": (28672, 4096),
    "llama8b.down": (4096, 14336),
    "llama8b.lm_head": (128256, 4096),
    "qwen7b.qkv": (4608, 3584),
    "qwen7b.o": (3584, 3584),
    "qwen7b.gate_up": (37888, 3584),
    "qwen7b.down": (3584, 18944),
}


def kernel():
    import triton
    import triton.language as tl

    @triton.jit
    def _gemv(
        x_ptr,
        w_ptr,
        o_ptr,
        M,
        N,
        K,
        stride_xm,
        stride_wn,
        stride_om,
        BLOCK_M: tl.constexpr,
        BLOCK_N: tl.constexpr,
        BLOCK_K: tl.constexpr,
    ):
        pid = tl.program_id(0)
        rn = pid * BLOCK_N + tl.arange(0, BLOCK_N)
        rm = tl.arange(0, BLOCK_M)
        acc = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
        for k0 in range(0, K, BLOCK_K):
            rk = k0 + tl.arange(0, BLOCK_K)
            w = tl.load(
                w_ptr + rn[:, None] * stride_wn + rk[None, :],
                mask=(rn[:, None] < N) & (rk[None, :] < K),
                other=0.0,
            )
            x = tl.load(
                x_ptr + rm[:, None] * stride_xm + rk[None, :],
                mask=(rm[:, None] < M) & (rk[None, :] < K),
                other=0.0,
            )
            acc += tl.sum(x[:, None, :].to(tl.float32) * w[None, :, :].to(tl.float32), axis=2)
        tl.store(
            o_ptr + rm[:, None] * stride_om + rn[None, :],
            acc.to(o_ptr.dtype.element_ty),
            mask=(rm[:, None] < M) & (rn[None, :] < N),
        )

    def gemv(x, w, block_n, block_k, warps, stages):
        m, k = x.shape
        n = w.shape[0]
        out = torch.empty(m, n, dtype=x.dtype, device=x.device)
        bm = max(1, triton.next_power_of_2(m))
        _gemv[(triton.cdiv(n, block_n),)](
            x, w, out, m, n, k, x.stride(0), w.stride(0), out.stride(0),
            BLOCK_M=bm, BLOCK_N=block_n, BLOCK_K=block_k, num_warps=warps, num_stages=stages,
        )  # fmt: skip
        return out

    return gemv


def check() -> None:
    os.environ.setdefault("TRITON_INTERPRET", "1")
    gemv = kernel()
    g = torch.Generator().manual_seed(0)
    for m, n, k in [(1, 96, 256), (3, 80, 192), (8, 64, 512)]:
        x = torch.randn(m, k, generator=g).to(torch.bfloat16)
        w = torch.randn(n, k, generator=g).to(torch.bfloat16)
        ref = F.linear(x.float(), w.float())
        got = gemv(x, w, 16, 64, 4, 2).float()
        err = (got - ref).abs().max().item()
        assert err < 0.1 * ref.abs().max().item(), err
        print(f"check m={m} n={n} k={k}: max abs err {err:.3g}")


def bench() -> dict:
    import triton

    gemv = kernel()
    sweep = list(itertools.product((8, 16, 32), (256, 512, 1024), (4, 8), (3, 4)))
    out = {}
    for name, (n, k) in SHAPES.items():
        w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02
        for m in (1, 4):
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            gb = n * k * 2 / 1e9
            t_lin = triton.testing.do_bench(functools.partial(F.linear, x, w), warmup=25, rep=100)
            row = {"linear_us": t_lin * 1e3, "linear_TBps": gb / t_lin}
            if m == 1:
                xv = x[0]
                t_mv = triton.testing.do_bench(functools.partial(torch.mv, w, xv), warmup=25, rep=100)
                row.update(mv_us=t_mv * 1e3, mv_TBps=gb / t_mv)
            ref = F.linear(x.float(), w.float())
            best = None
            for bn, bk, warps, stages in sweep:
                if bk > k:
                    continue
                try:
                    got = gemv(x, w, bn, bk, warps, stages)
                except Exception:  # out of resources for this tile
                    continue
                if (got.float() - ref).abs().max().item() > 0.05 * ref.abs().max().item():
                    raise AssertionError(f"{name} m={m}: wrong result at {(bn, bk, warps, stages)}")
                t = triton.testing.do_bench(
                    functools.partial(gemv, x, w, bn, bk, warps, stages), warmup=10, rep=50
                )
                if best is None or t < best[0]:
                    best = (t, (bn, bk, warps, stages))
            row.update(triton_us=best[0] * 1e3, triton_TBps=gb / best[0], triton_cfg=best[1])
            out[f"{name} m={m}"] = row
            print(
                f"{name:18s} m={m}  {gb * 1e3:7.1f} MB  linear {row['linear_us']:7.1f} us "
                f"{row['linear_TBps']:.2f} TB/s"
                + (f"  mv {row['mv_us']:7.1f} us {row['mv_TBps']:.2f}" if m == 1 else " " * 23)
                + f"  triton {row['triton_us']:7.1f} us {row['triton_TBps']:.2f} TB/s {row['triton_cfg']}",
                flush=True,
            )
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--check", action="store_true")
    a = ap.parse_args()
    if a.check:
        check()
        return
    res = bench()
    print(json.dumps({"device": torch.cuda.get_device_name(0), "gemv": res}))


if __name__ == "__main__":
    main()
