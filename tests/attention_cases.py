"""Paged-attention cases shared by the backend tests (tests/test_triton_attention.py,
tests/test_cpu_attention.py): a backend against the torch backend (the oracle) on identical paged
caches and batches.

Every cache starts as large junk in every slot and q/k/v are views of one fused qkv tensor, so a
mask that lets in a wrong slot, or a stride taken for granted, shows.
"""

from __future__ import annotations

import math

import pytest
import torch

from foveal.attention.base import AttentionBatch
from foveal.attention.torch_backend import TorchAttentionBackend

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
SCALE = 0.3


class Case:
    """Sequences as (cached context, new tokens), decodes first; a paged cache of junk holding the
    contexts under shuffled block ids; the step's q/k/v (views of one fused tensor) and its batch."""

    def __init__(
        self,
        seqs,
        *,
        num_kv=2,
        group=2,
        head_dim=32,
        bs=16,
        dtype=torch.float32,
        seed=0,
        nd=None,
        device=None,
    ):
        g = torch.Generator().manual_seed(seed)
        self.num_heads = num_kv * group
        need = [math.ceil((c + n) / bs) for c, n in seqs]
        num_blocks = sum(need) + 3  # block 0 stays unused: the padding block of tables
        order = (torch.randperm(num_blocks - 1, generator=g) + 1).tolist()
        tables = []
        for n in need:
            tables.append(order[:n])
            order = order[n:]
        self.cache = (torch.randn(2, num_blocks * bs, num_kv, head_dim, generator=g) * 10).to(dtype)
        slots = []
        for (ctx, n), table in zip(seqs, tables):
            pos_slots = [table[p // bs] * bs + p % bs for p in range(ctx + n)]
            self.cache[:, pos_slots[:ctx]] = torch.randn(2, ctx, num_kv, head_dim, generator=g).to(dtype)
            slots.extend(pos_slots[ctx:])
        total = sum(n for _, n in seqs)
        qkv = torch.randn(total, self.num_heads + 2 * num_kv, head_dim, generator=g).to(dtype)
        self.q, self.k, self.v = qkv.split([self.num_heads, num_kv, num_kv], dim=1)
        self.batch = AttentionBatch(
            query_lens=[n for _, n in seqs],
            context_lens=[c for c, _ in seqs],
            block_tables=tables,
            # decodes: the leading one-token rows, unless told (a 1-token verify chunk is a prefill)
            num_decodes=nd
            if nd is not None
            else next((i for i, (_, n) in enumerate(seqs) if n != 1), len(seqs)),
            slot_mapping=torch.tensor(slots, dtype=torch.long),
            block_size=bs,
        )
        self.device = torch.device(device) if device is not None else DEVICE
        self.to(self.device)

    def to(self, device):
        for name in ("cache", "q", "k", "v"):
            setattr(self, name, getattr(self, name).to(device))
        self.batch.slot_mapping = self.batch.slot_mapping.to(device)
        return self

    def run(self, backend, cache, meta=None, **kw):
        meta = backend.plan(self.batch, self.device) if meta is None else meta
        return backend.forward(self.q, self.k, self.v, cache, meta, SCALE, **kw)


def tolerance(dtype, paths: int = 1):
    """The tolerance of one path against the oracle; paths=2: of two paths each within it of the
    oracle (twice as wide: they may round to opposite sides, as the interpreter's numpy does on some
    CPUs)."""
    tol = dict(atol=2e-5, rtol=1e-5) if dtype == torch.float32 else dict(atol=3e-2, rtol=2e-2)
    return {k: v * paths for k, v in tol.items()}


def compare(case: Case, backend, tol: dict | None = None, **kw):
    """backend == torch on the outputs (within `tol`, else the dtype's tolerance) and on the cache after
    the store."""
    c_ref, c_new = case.cache.clone(), case.cache.clone()
    ref = case.run(TorchAttentionBackend(), c_ref, **kw)
    out = case.run(backend, c_new, **kw)
    assert out.dtype == case.q.dtype and out.shape == case.q.shape
    torch.testing.assert_close(out, ref, **(tol or tolerance(case.q.dtype)))
    assert torch.equal(c_new, c_ref), "cache after the store differs"


# (context, new tokens): 17 is no multiple of either block size; 150 crosses several splits
DECODES = [(0, 1), (5, 1), (17, 1), (150, 1)]
FRESH = [(0, 11), (0, 23)]
CHUNKS = [(9, 7), (32, 16)]  # prefix hits / later chunks
VERIFY = [(20, 1), (33, 2), (50, 4)]  # 1..k+1 tokens after a context, in the prefill section
MIXED = [(3, 1), (40, 1), (0, 13), (21, 6), (6, 2)]

SHAPES = [  # num_kv, group, head_dim, block_size
    pytest.param(2, 2, 32, 16, id="kv2g2-d32-bs16"),
    pytest.param(1, 4, 48, 4, id="kv1g4-d48-bs4"),
    pytest.param(2, 1, 32, 4, id="kv2g1-d32-bs4"),
    pytest.param(4, 7, 32, 16, id="kv4g7-d32-bs16"),  # Qwen2.5-VL-7B: 28 heads over 4 KV heads
]
