"""DFlash: a block-diffusion drafter (z-lab/dflash) that proposes a whole block from the target's hidden
states in one forward pass.

Checkpoint (z-lab's layout): a Qwen3 config with architectures ["DFlashDraftModel"], `block_size` (top
level, or in `dflash_config`), `dflash_config.mask_token_id` and `dflash_config.target_layer_ids` (the
target layers whose outputs it reads: HF's hidden_states[id + 1]); safetensors

    fc.weight [H, K * H], hidden_norm.weight       the K target states of a token -> its context feature
    layers.{i}.* (Qwen3 decoder layers, q/k norm)  norm.weight
    (no embedding, no LM head: the target's serve)

A context token's feature c_t = hidden_norm(fc([h_t^{l_1}, ..., h_t^{l_K}])) gives, in every layer, the
key and value at its position (that layer's k_proj, k_norm, RoPE; v_proj), never a query and never a
residual stream. The block holds the last token (whose target state is not computed yet) and S - 1
mask tokens at the next positions, embedded by the target; in each layer the block's queries attend to
every context key and to the whole block both ways (no causal mask inside it):

    positions   lo .. last (context fed now) | last+1 .. last+S (block: x_{n-1}, MASK, ..., MASK)
    layer       src = [c rows | input_layernorm(block x)] -> attention (causal; the block one span)
                x += o_proj(attn)[block] ; x += mlp(post_attention_layernorm(x))
    drafts      argmax of the target's LM head over norm(x) at block positions 1 .. k (k <= S - 1)

Every row of the step is a one-token query (the attention backends' decode path, which writes all the
step's keys before any row reads): a context row sees the keys up to its own (its query is computed
and discarded: a few rows per step), a block row every key up to the block's end, so the block sees
itself both ways without a mask of its own. The block's keys land at positions the next proposal
overwrites with context. Greedy drafts, one forward per step for every row (spec/hidden.py holds the
states until they are fed, as for EAGLE-3).
"""

from __future__ import annotations

import logging

import torch
from torch import nn

from foveal.attention.base import AttentionBatch
from foveal.device import to_device
from foveal.layers.linear import Linear
from foveal.layers.norm import RMSNorm
from foveal.layers.rotary import RotaryEmbedding
from foveal.models.base import StepContext
from foveal.models.llama import DecoderLayer, DecoderSwitches
from foveal.models.weights import ParamFiller, decoder_param
from foveal.speculative.hidden import DraftHead, HiddenStateDrafter
from foveal.speculative.proposer import ProposeRow, VerifyRun
from foveal.worker.cuda_graphs import DecodeGraphs

log = logging.getLogger(__name__)


def is_dflash_config(config) -> bool:
    return any("DFlash" in a for a in getattr(config, "architectures", None) or [])


def default_target_layers(num_target_layers: int, num_draft_layers: int) -> list[int]:
    """DFlash's default: the middle layer for a one-layer drafter, else evenly from 1 to N - 3."""
    if num_draft_layers == 1:
        return [num_target_layers // 2]
    span = num_target_layers - 4
    return [round(1 + i * span / (num_draft_layers - 1)) for i in range(num_draft_layers)]


def block_size_of(config) -> int:
    extra = dict(getattr(config, "dflash_config", None) or {})
    return int(getattr(config, "block_size", None) or extra.get("block_size") or 0)


class DFlashHead(DraftHead):
    name = "dflash"

    def __init__(self, config, target, backend, max_positions: int):
        super().__init__()
        self.config = config
        extra = dict(getattr(config, "dflash_config", None) or {})
        spec = self.spec = DecoderSwitches(config, family_qkv_bias=False, qk_norm=True)
        n_target = target.spec.num_layers
        self.block_size = block_size_of(config)
        self.max_drafts = self.block_size - 1  # block positions 1 .. S - 1
        if self.block_size < 2:
            raise ValueError("a DFlash drafter's config needs block_size >= 2")
        if extra.get("mask_token_id") is None:
            raise ValueError("a DFlash drafter's config needs dflash_config.mask_token_id")
        self.mask_token_id = int(extra["mask_token_id"])
        ids = extra.get("target_layer_ids") or default_target_layers(
            int(getattr(config, "num_target_layers", None) or n_target), spec.num_layers
        )
        ids = [int(i) for i in ids]
        if ids != sorted(set(ids)) or not all(0 <= i < n_target for i in ids):
            raise ValueError(
                f"a DFlash drafter reads distinct target layers, in order, inside 0..{n_target - 1} "
                f"(the target has {n_target}); this one names {ids}"
            )
        self.target_layer_ids = ids
        self.tap_layers = tuple(i + 1 for i in ids)  # the output of layer i enters layer i + 1
        self.hidden_size = spec.hidden
        self.vocab_size = spec.vocab_size
        self.num_kv_layers = spec.num_layers
        self.fc = Linear(len(ids) * spec.hidden, spec.hidden, bias=False)
        self.hidden_norm = RMSNorm(spec.hidden, spec.eps)
        self.layers = nn.ModuleList(DecoderLayer(spec, backend) for _ in range(spec.num_layers))
        self.norm = RMSNorm(spec.hidden, spec.eps)
        self.rotary = RotaryEmbedding(config, spec.head_dim, max_positions)
        self._target = (target,)  # its embedding and LM head (not a submodule: no copy)

    def fuse(self, aux: list[torch.Tensor], final: torch.Tensor) -> torch.Tensor:
        return self.hidden_norm(self.fc(torch.cat(aux, dim=-1)))

    def forward(self, input_ids, feats, is_block, ctx: StepContext) -> torch.Tensor:
        """norm(x) of every row: a block row (`is_block` [T, 1]) carries its token's stream, a context
        row its feature in `feats` [T, H] (its stream is computed and never read)."""
        x = self._target[0].embed_input_ids(input_ids)
        cos, sin = self.rotary.cos_sin(ctx.positions, x.dtype)
        for layer, cache in zip(self.layers, ctx.kv_caches):
            src = torch.where(is_block, layer.input_layernorm(x), feats)
            a = layer.self_attn(src, cos, sin, cache, ctx.attn)
            y, x = layer.post_attention_layernorm.forward_residual(a, x)
            x = x + layer.mlp(y)
        return self.norm(x)

    def load_weights(self, weights) -> None:
        filler = ParamFiller(self)
        for name, tensor in weights:
            name = name.removeprefix("model.")
            if name in ("embed_tokens.weight", "lm_head.weight"):
                continue  # the target's serve (z-lab's checkpoints have none)
            target, offset, rows = decoder_param(name, self.spec, tied=False)
            filler.put(target, tensor, name, offset, rows)
        filler.check_complete()


class BlockProposer(HiddenStateDrafter):
    """One DFlash forward per step for every row: its unfed context and its block, as one chunk."""

    def _propose_fresh(self, rows: list[ProposeRow]) -> tuple[torch.Tensor, list[int]]:
        head, S = self.head, self.head.block_size
        counts = [0] * len(rows)
        chunks = []  # (row index, seq, first context position, last, drafts wanted)
        for i, row in enumerate(rows):
            k = min(row.max_drafts, self.num_speculative_tokens)
            c = self._catch_up(row, S, 0)
            if c is not None:
                chunks.append((i, *c, k))
                counts[i] = k
        if not chunks:
            return torch.empty(0, dtype=torch.long, device=self.device), counts
        ids, is_block, feats, ctx_rows, pos, ctxs, tables, slots, picks = [], [], [], [], [], [], [], [], []
        for i, seq, lo, last, k in chunks:
            if lo <= last:
                feats.append(self._take(seq, lo, last + 1))
                ctx_rows += range(len(pos), len(pos) + last + 1 - lo)
            ids += [0] * (last + 1 - lo) + [rows[i].token_ids[-1]] + [head.mask_token_id] * (S - 1)
            is_block += [False] * (last + 1 - lo) + [True] * S
            picks += range(len(pos) + last + 2 - lo, len(pos) + last + 2 - lo + k)
            # every row a one-token query (the decode path of every backend): a context row sees the
            # keys up to its own, a block row every key up to the block's end (the block both ways)
            end = last + S - seq.base  # the block's last key
            table = seq.kv.block_table
            for p in range(lo, last + 1 + S):
                pos.append(p)
                ctxs.append(p - seq.base if p <= last else end)
                tables.append(table)
                slots.append(self._slot(seq, p))
        dev, n = self.device, len(pos)
        # the step's integer inputs in one copy to the device: ids, positions, block flags, picks, rows
        flat = to_device(torch.tensor(ids + pos + is_block + picks + ctx_rows, dtype=torch.long), dev)
        ids_d, pos_d, block_d = flat[:n], flat[n : 2 * n], flat[2 * n : 3 * n].bool()[:, None]
        picks_d, rows_d = flat[3 * n : 3 * n + len(picks)], flat[3 * n + len(picks) :]
        x = torch.zeros(n, head.hidden_size, dtype=head.norm.weight.dtype, device=dev)
        if feats:
            x.index_copy_(0, rows_d, torch.cat(feats).to(x.dtype))
        graphs = self.graphs
        if graphs is not None and graphs.fits(n, max(ctxs) + 1):
            batch = AttentionBatch([1] * n, ctxs, tables, n, torch.tensor(slots), self.kv.block_size)
            normed = graphs.step(ids_d, x, block_d, pos_d, batch)
        else:
            ctx = self._context(pos, [1] * n, ctxs, tables, slots, n)
            normed = head(ids_d, x, block_d, ctx)
        picked = normed[picks_d]  # before the graphs' next replay; the chunks are in row order
        return head._target[0].compute_logits(picked).argmax(dim=-1), counts

    @torch.inference_mode()
    def follow(self, runs: list[VerifyRun], tokens, accepted, tapped) -> None:
        """The next proposal of each verify run, drafted behind its launched step on the device (as
        ChainProposer.follow): one forward of the run's 1 + k rows as context (those past the accepted
        count write nothing: the block's keys go there) and its block after the accepted row (the
        target's token there, then the masks), the block's positions, lengths and slots moved on by
        the accepted count on the device. Nothing is read back."""
        head, S = self.head, self.head.block_size
        k = min(max(r.num_drafts for r in runs), self.num_speculative_tokens)
        chunks = self._follow_chunks(runs, S)  # the block ends at start + accepted + S at the most
        if not chunks:
            return
        # per run: context rows start .. start + k_r, then the block's S rows, laid out as if nothing
        # were accepted; `flat` moves them on: the block by the accepted count a, and a context row j
        # writes its key only if j <= a
        ids, pos, ctxs, tables, index, is_block, js, runs_of = [], [], [], [], [], [], [], []
        tap_rows, ctx_rows, firsts, picks, tok_rows = [], [], [], [], []
        for c, (r, seq) in enumerate(chunks):
            nd, table, end = r.num_drafts, seq.kv.block_table, r.start + S - seq.base
            tap_rows += range(r.tapped_row, r.tapped_row + nd + 1)
            ctx_rows += range(len(pos), len(pos) + nd + 1)
            firsts.append(len(pos) + nd + 1)
            picks += range(firsts[-1] + 1, firsts[-1] + 1 + k)
            tok_rows.append(r.token_row)
            rows = [(r.start + j, j, False) for j in range(nd + 1)]  # context: position, row j
            rows += [(r.start + 1 + i, -1, True) for i in range(S)]  # the block (at a = 0)
            for p, j, block in rows:
                ids.append(head.mask_token_id if block else 0)
                pos.append(p)
                ctxs.append(end if block else p - seq.base)
                tables.append(table)
                index.append(p - seq.base)
                is_block.append(int(block))
                js.append(j)
                runs_of.append(c)
        dev, n, m = self.device, len(pos), len(chunks)
        flat = to_device(
            torch.tensor(ids + pos + index + is_block + js + runs_of + firsts + picks + tok_rows + tap_rows
                         + ctx_rows + [r.item for r, _ in chunks], dtype=torch.long),
            dev,
        )  # fmt: skip
        parts = flat.split([n] * 6 + [m, len(picks), m, len(tap_rows), len(ctx_rows), m])
        ids_d, pos_d, index_d, block_d, js_d, runs_d, firsts_d, picks_d, tok_d, tap_d, ctx_d, items_d = parts
        a = accepted[items_d].long()  # each run's accepted drafts
        a_row = a[runs_d]
        block_d = block_d.bool()
        shift = torch.where(block_d, a_row, 0)
        index_d = torch.where(block_d | (js_d <= a_row), index_d + shift, -1)
        ids_d = ids_d.clone()
        ids_d[firsts_d] = tokens[tok_d + a]  # the block's first token: the target's at the accepted row
        x = torch.zeros(n, head.hidden_size, dtype=head.norm.weight.dtype, device=dev)
        x.index_copy_(0, ctx_d, tapped[tap_d].to(x.dtype))
        graphs = self.graphs
        if graphs is not None and graphs.fits(n, max(ctxs) + 1 + k):
            batch = AttentionBatch([1] * n, ctxs, tables, n, None, self.kv.block_size)
            normed = graphs.step(ids_d, x, block_d[:, None], pos_d, batch, moved=(shift, index_d))
        else:  # eagerly the accepted counts are read (a wait for the verify step)
            sh, idx = shift.tolist(), index_d.tolist()
            keep = [i for i, s in enumerate(idx) if s >= 0]
            keep_d = to_device(torch.tensor(keep, dtype=torch.long), dev)
            ctx = self._context(
                [pos[i] + sh[i] for i in keep],
                [1] * len(keep),
                [ctxs[i] + sh[i] for i in keep],
                [tables[i] for i in keep],
                [self._slot(chunks[runs_of[i]][1], chunks[runs_of[i]][1].base + idx[i]) for i in keep],
                len(keep),
            )
            out = torch.zeros_like(x)
            out[keep_d] = head(ids_d[keep_d], x[keep_d], block_d[keep_d][:, None], ctx)
            normed = out
        drafts = head._target[0].compute_logits(normed[picks_d]).argmax(dim=-1)
        self._ready = (drafts.view(m, k), {r.request_id: i for i, (r, _) in enumerate(chunks)})

    def _feed(self, rows, chunks) -> None:
        """Context rows only (prefeed): each pair's keys and values, every row a one-token query over
        the keys up to its own; no block, nothing read back."""
        pos, ctxs, tables, slots, feats = [], [], [], [], []
        for _i, seq, lo, last, _k in chunks:
            feats.append(self._take(seq, lo, last + 1))
            table = seq.kv.block_table
            for p in range(lo, last + 1):
                pos.append(p)
                ctxs.append(p - seq.base)
                tables.append(table)
                slots.append(self._slot(seq, p))
        n, head = len(pos), self.head
        x = torch.cat(feats).to(head.norm.weight.dtype)
        ids = torch.zeros(n, dtype=torch.long, device=self.device)
        is_block = torch.zeros(n, 1, dtype=torch.bool, device=self.device)
        head(ids, x, is_block, self._context(pos, [1] * n, ctxs, tables, slots, n))

    graphs = None  # BlockStepGraphs, after use_graphs

    def use_graphs(self, max_seqs: int, max_model_len: int) -> None:
        """Run the block steps through graphs (captured now on CUDA) for up to max_seqs requests: up
        to k + 1 context rows and a block each."""
        max_rows = max_seqs * (1 + self.num_speculative_tokens + self.head.block_size)
        self.graphs = BlockStepGraphs(
            self.head, self.kv_caches, self.backend, block_size=self.kv.block_size, max_seqs=max_rows,
            max_model_len=max_model_len, device=self.device,
        )  # fmt: skip
        self.graphs.capture()


class BlockStepGraphs(DecodeGraphs):
    """DFlash steps as CUDA graphs (every row a one-token query, as the target's decode graphs): the
    token ids, context features and block flags in static buffers, norm(x) of every row out."""

    def __init__(self, head, kv_caches, backend, **kw):
        super().__init__(head, kv_caches, backend, **kw)
        self.feats = torch.zeros(
            self.max_seqs, head.hidden_size, dtype=head.norm.weight.dtype, device=self.device
        )
        self.is_block = torch.zeros(self.max_seqs, 1, dtype=torch.bool, device=self.device)
        self.normed = torch.zeros_like(self.feats)

    def _forward(self, b: int, meta) -> None:
        ctx = StepContext(self.positions[:b], self.kv_caches, meta)
        self.normed[:b].copy_(self.model(self.input_ids[:b], self.feats[:b], self.is_block[:b], ctx))

    def step(self, input_ids, feats, is_block, positions, batch, moved=None) -> torch.Tensor:
        """norm(x) [n, H] of n rows: a view of the static output, valid until the next step. `moved`:
        (shift, key index) [n] on the device: each row sits `shift` positions past its position and
        context in `positions` / `batch`, and writes its key at that index of its table (< 0: none)."""
        n = input_ids.shape[0]
        self.input_ids[:n].copy_(input_ids, non_blocking=True)
        self.positions[:n].copy_(positions if moved is None else positions + moved[0], non_blocking=True)
        self.feats[:n].copy_(feats)
        self.is_block[:n].copy_(is_block)
        # a request's rows (its catch-up rows and its block) read its keys once when the backend groups
        # them (shares_prefixes: a request_min_prefix of keys) and a graph with that kernel fits
        shares = getattr(self.backend, "shares_prefixes", None)
        shared = self.takes_shared(n) and shares is not None and shares(batch)
        self.replay(batch, n, shared=shared, moved=moved)
        return self.normed[:n]


DFlashHead.proposer = BlockProposer


def build_dflash_head(spec, target, target_source, backend, max_model_len: int, device, dtype) -> DFlashHead:
    """The DFlash drafter at spec.model, refused when its vocabulary, hidden size or mask token does
    not fit the target."""
    from foveal.speculative.hidden import check_fits, open_head_checkpoint

    folder = open_head_checkpoint(spec.model)
    cfg = folder.hf_config
    with torch.device("meta"):
        head = DFlashHead(cfg, target, backend, max_model_len + max(block_size_of(cfg), 2))
    check_fits(spec, head.vocab_size, target.spec.vocab_size, head.hidden_size, target.spec.hidden)
    if head.mask_token_id >= target.spec.vocab_size:
        raise ValueError(f"the DFlash mask token {head.mask_token_id} is outside the target's vocabulary")
    head = head.to_empty(device=device).to(dtype)
    head.reset_buffers(device)
    head.load_weights(folder.weights(dtype, device))
    return head
