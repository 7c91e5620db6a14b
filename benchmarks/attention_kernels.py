"""GPU micro-benchmark of the triton attention backend against the torch backend, one layer, on
Llama-3.1-8B-like shapes: 32 query heads, 8 KV heads, head_dim 128, block_size 16, bf16, block ids
shuffled over the pool.

    python3 benchmarks/attention_kernels.py [--kv-dtypes auto,fp8,int8]

Decode: batch 1 / 64 / 256 at context 512 / 2048 / 8192 (where memory allows); reports the time of
the decode kernels alone (split + combine) and of a whole backend forward (store included) for both
backends, and the K/V bandwidth the decode kernels achieve (bytes of K and V read / time).
Prefill: 1x512, 8x512, 1x4096 fresh, and a 512 chunk after a 3584-token context; reports TFLOP/s
over the causal work (4 * head_dim * heads per visible query-key pair).
--prefill-sweep: instead, the prefill kernel's launch shapes (rows a program, key tile, warps, stages:
prefill.block_m_for / launch_config replaced) on 16x512 (a MoE batch's 8,192-token prefill step), 8x512
and 1x4096, the current rule's first; --kv-heads 4 for Qwen3-30B-A3B's 32 / 4 heads.
--kv-dtypes: the decode cases also over fp8 / int8 pools (kv_quant.py; the torch backend's column is
then its gather-and-dequantize path, which the Triton backend took for such pools before its kernels
read codes; KV GB/s counts the codes' and scales' bytes).
Times are medians of triton.testing.do_bench. Prints a table, then one JSON object as the last line.
"""

from __future__ import annotations

import itertools
import json
import math
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

HEADS, KV_HEADS, HEAD_DIM, BS = 32, 8, 128, 16
DTYPE = torch.bfloat16
SCALE = 1 / math.sqrt(HEAD_DIM)


def make_step(seqs, seed=0):
    """(context, new tokens) per sequence -> (batch, cache, q, k, v) on the GPU, blocks shuffled."""
    from foveal.attention.base import AttentionBatch

    g = torch.Generator(device="cuda").manual_seed(seed)
    need = [math.ceil((c + n) / BS) for c, n in seqs]
    num_blocks = sum(need) + 1
    order = (torch.randperm(num_blocks - 1, device="cuda", generator=g) + 1).tolist()
    tables = []
    for n in need:
        tables.append(order[:n])
        order = order[n:]
    cache = torch.randn(2, num_blocks * BS, KV_HEADS, HEAD_DIM, device="cuda", dtype=DTYPE, generator=g)
    slots = [t[p // BS] * BS + p % BS for (c, n), t in zip(seqs, tables) for p in range(c, c + n)]
    total = sum(n for _, n in seqs)
    qkv = torch.randn(total, HEADS + 2 * KV_HEADS, HEAD_DIM, device="cuda", dtype=DTYPE, generator=g)
    q, k, v = qkv.split([HEADS, KV_HEADS, KV_HEADS], dim=1)
    batch = AttentionBatch(
        query_lens=[n for _, n in seqs],
        context_lens=[c for c, _ in seqs],
        block_tables=tables,
        num_decodes=sum(1 for _, n in seqs if n == 1),
        slot_mapping=torch.tensor(slots, dtype=torch.long, device="cuda"),
        block_size=BS,
    )
    return batch, cache, q, k, v


def bench(fn) -> float:
    """Median milliseconds."""
    from triton.testing import do_bench

    return do_bench(fn, warmup=10, rep=40, return_mode="median")


def quantized_pool(cache: torch.Tensor, kind: str):
    """The pool's contents in an fp8 / int8 pool (kv_quant.py), written through its store."""
    from foveal.attention.kv_quant import QuantizedKVCache

    pool = QuantizedKVCache(kind, cache.shape[1], KV_HEADS, HEAD_DIM, device="cuda")
    pool.store(torch.arange(cache.shape[1], device="cuda"), cache[0], cache[1])
    return pool


def decode_case(batch_size: int, ctx: int, triton_be, torch_be, kind: str = "auto") -> dict:
    from foveal.attention.kernels import paged_decode

    batch, cache, q, k, v = make_step([(ctx, 1)] * batch_size)
    pool = cache if kind == "auto" else quantized_pool(cache, kind)
    codes, kv_scale = (cache, None) if kind == "auto" else (pool.data, pool.scale)
    tmeta = triton_be.plan(batch, torch.device("cuda"))
    rmeta = torch_be.plan(batch, torch.device("cuda"))
    out = triton_be.forward(q, k, v, pool, tmeta, SCALE)  # stores this step's k/v; compiles
    ref = torch_be.forward(q, k, v, pool, rmeta, SCALE)
    err = (out.float() - ref.float()).abs().max().item()
    splits = triton_be.decode_splits(tmeta, KV_HEADS, q.device)
    qd, o = q.contiguous(), torch.empty_like(q)

    def kernels():
        paged_decode(
            qd,
            codes,
            tmeta.decode_block_table,
            tmeta.decode_seq_lens,
            o,
            SCALE,
            block_size=BS,
            num_splits=splits,
            workspace=tmeta.workspace,
            kv_scale=kv_scale,
        )

    t_kern = bench(kernels)
    t_tri = bench(lambda: triton_be.forward(q, k, v, pool, tmeta, SCALE))
    t_ref = bench(lambda: torch_be.forward(q, k, v, pool, rmeta, SCALE))
    per_token = KV_HEADS * HEAD_DIM * codes.element_size()
    if kv_scale is not None:
        per_token += KV_HEADS * kv_scale.shape[-1] * kv_scale.element_size()
    kv_bytes = batch_size * (ctx + 1) * 2 * per_token
    return dict(
        kv_dtype=kind,
        batch=batch_size,
        ctx=ctx,
        splits=splits,
        kernel_ms=t_kern,
        triton_ms=t_tri,
        torch_ms=t_ref,
        kv_gbps=kv_bytes / t_kern / 1e6,
        max_abs_err=err,
    )


def prefill_case(num: int, q_len: int, ctx: int, triton_be, torch_be, time_torch: bool = True) -> dict:
    batch, cache, q, k, v = make_step([(ctx, q_len)] * num)
    tmeta = triton_be.plan(batch, torch.device("cuda"))
    rmeta = torch_be.plan(batch, torch.device("cuda"))
    out = triton_be.forward(q, k, v, cache, tmeta, SCALE)
    ref = torch_be.forward(q, k, v, cache, rmeta, SCALE)
    err = (out.float() - ref.float()).abs().max().item()
    t_tri = bench(lambda: triton_be.forward(q, k, v, cache, tmeta, SCALE))
    t_ref = bench(lambda: torch_be.forward(q, k, v, cache, rmeta, SCALE)) if time_torch else float("nan")
    pairs = num * sum(ctx + i + 1 for i in range(q_len))  # causal query-key pairs
    flops = 4 * HEAD_DIM * HEADS * pairs
    return dict(
        seqs=num,
        q_len=q_len,
        ctx=ctx,
        triton_ms=t_tri,
        torch_ms=t_ref,
        triton_tflops=flops / t_tri / 1e9,
        torch_tflops=flops / t_ref / 1e9,
        max_abs_err=err,
    )


def prefill_sweep(triton_be, torch_be) -> list[dict]:
    """prefill_case under each launch shape (block_m, block_n, warps, stages), the rule's first."""
    import triton

    from foveal.attention.kernels import prefill as pk

    rule_m, rule_cfg = pk.block_m_for, pk.launch_config
    group = HEADS // KV_HEADS
    shapes = [None] + [s for s in itertools.product((64, 128), (64, 128), (4, 8), (2, 3)) if s[0] >= group]
    out = []
    print("sweep   seqs  q_len  block_m block_n warps stages  triton ms  TFLOP/s  max err")
    for num, q_len in ((16, 512), (8, 512), (1, 4096)):
        for shape in shapes:
            is_rule = shape is None
            if not is_rule:
                pk.block_m_for = lambda max_q, g, bm=shape[0]: bm
                pk.launch_config = lambda block_m, head_pad, size, c=shape[1:]: c
            try:
                r = prefill_case(num, q_len, 0, triton_be, torch_be, time_torch=False)
            except triton.runtime.errors.OutOfResources:
                continue
            finally:
                pk.block_m_for, pk.launch_config = rule_m, rule_cfg
            if is_rule:
                bm = rule_m(q_len, group)
                shape = (bm, *rule_cfg(bm, triton.next_power_of_2(HEAD_DIM), 2))
            r.update(block_m=shape[0], block_n=shape[1], warps=shape[2], stages=shape[3], rule=is_rule)
            out.append(r)
            print(
                f"        {num:4d}  {q_len:5d}  {shape[0]:7d} {shape[1]:7d} {shape[2]:5d} {shape[3]:6d}"
                f"  {r['triton_ms']:9.3f}  {r['triton_tflops']:7.1f}  {r['max_abs_err']:.2e}"
            )
        torch.cuda.empty_cache()
    return out


def main() -> None:
    import argparse

    global KV_HEADS
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--kv-dtypes", default="auto", help="comma-separated: auto, fp8, int8 (decode cases)")
    ap.add_argument("--kv-heads", type=int, default=KV_HEADS, help="KV heads (32 query heads)")
    ap.add_argument("--prefill-sweep", action="store_true", help="the prefill kernel's launch shapes")
    a = ap.parse_args()
    kinds = a.kv_dtypes.split(",")
    KV_HEADS = a.kv_heads
    if not torch.cuda.is_available():
        print("attention_kernels.py needs a CUDA GPU (the triton backend's kernels); nothing to do")
        sys.exit(0)
    import triton

    from foveal.attention.torch_backend import TorchAttentionBackend
    from foveal.attention.triton_backend import TritonAttentionBackend

    triton_be, torch_be = TritonAttentionBackend(), TorchAttentionBackend()
    if a.prefill_sweep:
        print(f"{torch.cuda.get_device_name()}  triton {triton.__version__}  heads {HEADS} / {KV_HEADS}")
        print(json.dumps(dict(device=torch.cuda.get_device_name(), heads=HEADS, kv_heads=KV_HEADS,
                              sweep=prefill_sweep(triton_be, torch_be))))  # fmt: skip
        return
    free = torch.cuda.mem_get_info()[0]
    decode = []
    print(f"{torch.cuda.get_device_name()}  torch {torch.__version__}  triton {triton.__version__}")
    print("decode  kv     batch   ctx  splits  kernels ms  triton fwd ms  torch fwd ms  KV GB/s  max err")
    for kind, b, ctx in itertools.product(kinds, (1, 64, 256), (512, 2048, 8192)):
        # pool + the torch backend's gathered copy of every block, with room to spare
        if 3 * b * (ctx + BS) * KV_HEADS * HEAD_DIM * 2 * 2 > 0.6 * free:
            continue
        r = decode_case(b, ctx, triton_be, torch_be, kind)
        decode.append(r)
        print(
            f"        {kind:5s}  {b:5d} {ctx:5d}  {r['splits']:6d}  {r['kernel_ms']:10.3f}"
            f"  {r['triton_ms']:13.3f}  {r['torch_ms']:12.3f}  {r['kv_gbps']:7.0f}  {r['max_abs_err']:.2e}"
        )
        torch.cuda.empty_cache()
    prefill = []
    print("prefill seqs  q_len   ctx  triton ms  torch ms  triton TFLOP/s  torch TFLOP/s  max err")
    for num, q_len, ctx in ((1, 512, 0), (8, 512, 0), (1, 4096, 0), (1, 512, 3584)):
        r = prefill_case(num, q_len, ctx, triton_be, torch_be)
        prefill.append(r)
        print(
            f"        {num:4d}  {q_len:5d} {ctx:5d}  {r['triton_ms']:9.3f}  {r['torch_ms']:8.3f}"
            f"  {r['triton_tflops']:14.1f}  {r['torch_tflops']:13.1f}  {r['max_abs_err']:.2e}"
        )
        torch.cuda.empty_cache()
    print(
        json.dumps(
            dict(
                device=torch.cuda.get_device_name(),
                torch=torch.__version__,
                triton=triton.__version__,
                shape=dict(heads=HEADS, kv_heads=KV_HEADS, head_dim=HEAD_DIM, block_size=BS, dtype="bf16"),
                decode=decode,
                prefill=prefill,
            )
        )
    )


if __name__ == "__main__":
    main()
