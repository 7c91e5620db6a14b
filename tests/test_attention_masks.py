"""The torch attention backend's sliding windows, bidirectional spans and logit softcap against a dense
reference that applies the rule of attention/base.py token by token, in float64:

    attend(q, k) = (k <= q  or  q and k in one span)  and  (k > q - window, when the layer has one)

Batches mix decode rows and prefill chunks (fresh, and with cached context), on a paged cache whose
unused slots hold large junk, so a mask that lets in one wrong slot shows."""

from __future__ import annotations

import math

import pytest
import torch

from foveal.attention.base import AttentionBatch
from foveal.attention.torch_backend import TorchAttentionBackend, _layout

BS, NUM_KV, GROUP, HD = 4, 2, 2, 8
H = NUM_KV * GROUP
SCALE = 0.3


class Case:
    """Sequences given as (cached context, new tokens, bidirectional spans), decodes first; a paged
    cache holding the context, and the step's q/k/v."""

    def __init__(self, seqs, seed=0):
        assert seqs == sorted(seqs, key=lambda s: s[1] != 1), "decode rows come first"
        g = torch.Generator().manual_seed(seed)
        self.seqs = seqs
        need = [math.ceil((c + n) / BS) for c, n, _ in seqs]
        num_blocks = sum(need) + 1  # block 0 is the null block that pads decode rows
        order = (torch.randperm(num_blocks - 1, generator=g) + 1).tolist()
        self.tables = []
        for n in need:
            self.tables.append(order[:n])
            order = order[n:]
        self.cache = torch.randn(2, num_blocks * BS, NUM_KV, HD, generator=g) * 10  # junk everywhere
        self.keys, self.values, qs, ks, vs, slots = [], [], [], [], [], []
        for (ctx, n, _), table in zip(seqs, self.tables):
            k = torch.randn(ctx + n, NUM_KV, HD, generator=g)
            v = torch.randn(ctx + n, NUM_KV, HD, generator=g)
            pos_slots = [table[p // BS] * BS + p % BS for p in range(ctx + n)]
            self.cache[0, pos_slots[:ctx]] = k[:ctx]
            self.cache[1, pos_slots[:ctx]] = v[:ctx]
            self.keys.append(k)
            self.values.append(v)
            qs.append(torch.randn(n, H, HD, generator=g))
            ks.append(k[ctx:])
            vs.append(v[ctx:])
            slots.extend(pos_slots[ctx:])
        self.q, self.k, self.v = torch.cat(qs), torch.cat(ks), torch.cat(vs)
        self.batch = AttentionBatch(
            query_lens=[n for _, n, _ in seqs],
            context_lens=[c for c, _, _ in seqs],
            block_tables=self.tables,
            num_decodes=sum(1 for _, n, _ in seqs if n == 1),
            slot_mapping=torch.tensor(slots, dtype=torch.long),
            block_size=BS,
            bidirectional=[list(sp) for _, _, sp in seqs] if any(sp for _, _, sp in seqs) else None,
        )

    def run(self, backend, meta, window=None, softcap=None, sinks=None):
        return backend.forward(
            self.q, self.k, self.v, self.cache, meta, SCALE, window=window, softcap=softcap, sinks=sinks
        )

    def reference(self, window=None, softcap=None, sinks=None) -> torch.Tensor:
        rows = []
        for (ctx, n, spans), q, k, v in zip(
            self.seqs, self.q.cpu().split([s[1] for s in self.seqs]), self.keys, self.values
        ):
            for t in range(n):
                p = ctx + t
                seen = [
                    j
                    for j in range(ctx + n)
                    if (j <= p or any(a <= p < b and a <= j < b for a, b in spans))
                    and (window is None or j > p - window)
                ]
                out = torch.empty(H, HD, dtype=torch.float64)
                for h in range(H):
                    kk, vv = k[seen, h // GROUP].double(), v[seen, h // GROUP].double()
                    s = kk @ q[t, h].double() * SCALE
                    if softcap is not None:
                        s = torch.tanh(s / softcap) * softcap
                    if sinks is not None:  # one more logit, of a zero value
                        p_all = torch.softmax(torch.cat([s, sinks[h : h + 1].double()]), 0)
                        out[h] = p_all[:-1] @ vv
                        continue
                    out[h] = torch.softmax(s, 0) @ vv
                rows.append(out)
        return torch.stack(rows)


MIXED = [(0, 1, ()), (6, 1, ()), (13, 1, ()), (21, 1, ()), (0, 11, ()), (9, 7, ()), (3, 2, ())]


def check(case, window=None, softcap=None, tol=1e-5, device="cpu", sinks=None):
    backend = TorchAttentionBackend()
    if device != "cpu":
        for name in ("q", "k", "v", "cache"):
            setattr(case, name, getattr(case, name).to(device))
        case.batch.slot_mapping = case.batch.slot_mapping.to(device)
    dev_sinks = None if sinks is None else sinks.to(device)
    out = case.run(backend, backend.plan(case.batch, torch.device(device)), window, softcap, dev_sinks)
    err = (out.double().cpu() - case.reference(window, softcap, sinks)).abs().max().item()
    assert err < tol, f"window={window} softcap={softcap} sinks={sinks is not None}: max error {err}"


def test_plain_causal_matches_reference():
    check(Case(MIXED))


@pytest.mark.parametrize("window", [1, 3, 4, 6, 9, 100])
def test_sliding_window_decode_and_prefill(window):
    check(Case(MIXED, seed=window), window=window)


SPANS = [
    (7, 1, ()),  # a decode row next to the spans
    (0, 14, [(2, 6), (8, 13)]),  # fresh prompt with two images
    (8, 10, [(3, 7), (10, 15), (16, 18)]),  # a later chunk: a span in the cache, two in the chunk
    (5, 6, [(3, 8)]),  # a chunk starting inside a span (prefix-cache hit mid-image)
    (0, 5, [(2, 9)]),  # spans running past the chunk: only the keys already written count
    (6, 3, [(7, 12)]),
]


@pytest.mark.parametrize("window", [None, 3, 8])
def test_bidirectional_spans_with_and_without_window(window):
    # window 3 is shorter than the spans: the window still hides a span's far past (AND, as transformers)
    check(Case(SPANS, seed=3), window=window)


@pytest.mark.parametrize("window", [None, 5])
def test_softcap(window):
    case = Case(SPANS + [(0, 9, ())], seed=4)
    case.q *= 4  # large scores, so the cap bites
    check(case, window=window, softcap=2.0)


@pytest.mark.parametrize("window", [None, 4])
def test_attention_sinks(window):
    """gpt-oss's sinks: per head one more logit in every softmax, of value zero (large and small ones,
    so some heads put most of their weight on the sink); decode and prefill rows, with a window."""
    sinks = torch.tensor([3.0, -2.0, 0.5, 8.0, -30.0, 1.0][:H], dtype=torch.float32)
    check(Case(MIXED, seed=11), window=window, sinks=sinks)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("window,softcap", [(None, None), (3, None), (8, None), (5, 2.0)])
def test_masks_on_cuda(window, softcap):
    torch.backends.cuda.matmul.allow_tf32 = False
    check(
        Case(sorted(MIXED + SPANS, key=lambda s: s[1] != 1), seed=6),
        window=window,
        softcap=softcap,
        tol=1e-4,
        device="cuda",
    )


def test_layers_with_different_windows_share_one_plan():
    """Alternating full and sliding layers reuse one meta; each window's layout is built once."""
    case = Case(MIXED + [(0, 6, [(1, 4)])], seed=5)
    backend = TorchAttentionBackend()
    meta = backend.plan(case.batch, torch.device("cpu"))
    for window in (None, 6, None, 6, 2):
        err = (case.run(backend, meta, window).double() - case.reference(window)).abs().max().item()
        assert err < 1e-5, window
    assert sorted(meta.windowed) == [2, 6]


def test_window_that_hides_nothing_keeps_the_plain_layout():
    backend = TorchAttentionBackend()
    meta = backend.plan(Case([(3, 1, ()), (0, 5, ()), (2, 4, ())]).batch, torch.device("cpu"))
    decode, prefills = _layout(meta, 8)
    assert decode is meta.decode and all(a is b for a, b in zip(prefills, meta.prefills))
    assert meta.prefills[0].mask is None  # the fresh prompt stays on is_causal SDPA
