"""Drafters that read the target's hidden states: a small head with its own paged KV. EAGLE-3 and MTP
(ChainProposer here) are fed pairs (h_i, x_{i+1}) at position i, where h_i is what the target computed
at position i (fused by the head: EAGLE-3's fc over three layers, MTP's last hidden state) and x_{i+1}
the token after it; the pair at position i predicts x_{i+2}. DFlash (spec/dflash.py) shares the state
keeping and KV of HiddenStateDrafter and drafts a block per forward.

    target step  runner taps each token's hidden state -> engine -> observe_hidden(rid: (start, [n, H]))
                 (a prompt chunk's states at its launch, and prefeed() feeds the pairs whose next token
                 is a prompt token behind that step; the others' when the step's tokens arrive)
    propose      1. catch up: every pair not fed yet, per row one chunk (or, when they fit the head's
                    graphs, one-token queries); its last row's logits give draft 1, its output the next h
                 2. k - 1 one-token steps: (h from the step before, draft j) at the next position
                    (through spec/head_graphs.py's CUDA graphs where captured)
                 3. the k drafts per row: a flat device tensor (propose_device, staged for the
                    verify step without a wait) or read back once (propose)
    follow       the same behind a launched verify step, before its tokens reach the host: its 1 + k
                 rows are fed (pair j: the state tapped at row j, the target's token at row j), draft 1
                 is taken at the accepted row and the chain runs at positions moved on by the accepted
                 count (DFlash: its block after the accepted row), all on the device (the graphs'
                 metadata moved there: the backends' shift_graph_metadata). The host
                 launches it while the verify step runs; observe_hidden then confirms the accepted rows
                 as fed, and the next propose only stages those drafts (a request's first proposal,
                 and one whose verify run lost its drafts, still catch up as above)

Only accepted tokens' hidden states reach the head (a verify row reports the rows up to its last
accepted draft), so what it fed never needs undoing; the chain's speculative positions (and follow's
rows past the accepted count) are overwritten by the next feeding. The head's KV is indexed from
`base`, the first position it was fed: a request whose early hidden states the head never saw (a
cached prefix, states dropped while it rested) is drafted from what it has, RoPE at the true
positions. Greedy drafts (verification treats q as one-hot).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

import torch
from torch import nn

from foveal.attention.base import AttentionBatch
from foveal.cache.kv_cache_manager import KVCacheManager
from foveal.device import to_device
from foveal.layers.rotary import RotaryEmbedding
from foveal.models.base import StepContext
from foveal.request import Request, SamplingParams
from foveal.speculative.proposer import ProposeRow, VerifyRun, split_drafts

log = logging.getLogger(__name__)

_GREEDY = SamplingParams(temperature=0.0, max_tokens=None)
MAX_PENDING = 4096  # hidden states kept per request between proposals (older ones are dropped)


@dataclass(slots=True)
class _Seq:
    kv: Request  # the head's KV blocks (num_computed_tokens: indices written, chain included)
    base: int = -1  # the position of KV index 0 (-1: nothing fed yet)
    fed: int = 0  # pairs fed: positions base .. base + fed - 1
    pending: list[tuple[int, torch.Tensor]] = field(default_factory=list)  # (start, [n, H]), contiguous
    # the first position of a verify run whose rows were fed behind its step (follow), until its
    # accepted rows' states arrive and confirm them (-1: none)
    following: int = -1

    @property
    def pending_span(self) -> tuple[int, int]:
        if not self.pending:
            return 0, 0
        start, last = self.pending[0][0], self.pending[-1]
        return start, last[0] + last[1].shape[0]


class DraftHead(nn.Module):
    """What the heads share: their KV geometry and rotary table (`spec`, `config`, `rotary` and
    `num_kv_layers` set by the head), the proposer that drives them and the most drafts they give."""

    num_kv_layers = 1
    max_drafts = 16
    proposer: type  # ChainProposer or dflash.BlockProposer (set below / in dflash.py)

    @property
    def kv_shape(self) -> tuple[int, int, int]:
        return self.num_kv_layers, self.spec.num_kv_heads, self.spec.head_dim

    def reset_buffers(self, device) -> None:
        self.rotary = RotaryEmbedding(self.config, self.spec.head_dim, self.rotary.cos.shape[0]).to(device)


class HiddenStateDrafter:
    """What every head that reads the target's hidden states shares: the states held per request until
    they are fed, the head's KV pool (indexed from `base`) and its planning. `tap` is what the target's
    runner keeps per token (`tap.tap_layers`, `tap.fuse`): the head."""

    def __init__(self, head, kv_caches, backend, kv: KVCacheManager, num_speculative_tokens: int, device):
        self.head = head
        self.tap = head
        self.kv_caches = kv_caches
        self.backend = backend
        self.kv = kv
        self.num_speculative_tokens = num_speculative_tokens
        self.device = torch.device(device)
        self._seqs: dict[str, _Seq] = {}
        # follow()'s drafts until the next propose: ([runs, k] on the device, request id -> its row)
        self._ready: tuple[torch.Tensor, dict[str, int]] | None = None

    # -- hidden states from the target ---------------------------------------------------------------
    def observe_hidden(self, states: dict[str, tuple[int, torch.Tensor]]) -> None:
        """Each request's newly computed, confirmed rows: (position of the first, [n, H])."""
        for rid, (start, h) in states.items():
            seq = self._seqs.get(rid)
            if seq is None:
                seq = self._seqs[rid] = _Seq(Request(rid, [], _GREEDY))
            if seq.following >= 0:  # a verify run fed behind its step: its accepted rows are fed
                followed, seq.following = seq.following, -1
                if start == followed:
                    seq.fed = start + h.shape[0] - seq.base
                    continue
            lo, hi = seq.pending_span
            if not seq.pending or start == hi:
                seq.pending.append((start, h))
            elif lo <= start < hi:  # recomputed rows (a preempted request): keep the new ones
                self._truncate(seq, start)
                seq.pending.append((start, h))
            else:  # a gap: what came before cannot be paired any more
                seq.pending = [(start, h)]
            lo, hi = seq.pending_span
            while hi - lo > MAX_PENDING and len(seq.pending) > 1:
                seq.pending.pop(0)
                lo = seq.pending[0][0]

    @staticmethod
    def _truncate(seq: _Seq, end: int) -> None:
        keep = []
        for start, h in seq.pending:
            if start < end:
                keep.append((start, h[: end - start]))
        seq.pending = keep

    def _take(self, seq: _Seq, lo: int, hi: int) -> torch.Tensor:
        """Pending rows for positions [lo, hi), then forget everything before hi."""
        parts = []
        for start, h in seq.pending:
            a, b = max(lo, start), min(hi, start + h.shape[0])
            if a < b:
                parts.append(h[a - start : b - start])
        rest = [(max(hi, s), h[max(hi, s) - s :]) for s, h in seq.pending if s + h.shape[0] > hi]
        seq.pending = rest
        return parts[0] if len(parts) == 1 else torch.cat(parts)

    def _catch_up(self, row: ProposeRow, extra: int, min_new: int):
        """(seq, first, last) for the row: the positions whose held states it feeds now (every one not
        fed yet, up to the one before its last token: that token's state is computed by the step this
        proposal is for), at least `min_new` of them, with KV allocated for them and `extra` positions
        past them; None when it cannot draft now (its states have not arrived, a full pool)."""
        last = len(row.token_ids) - 2
        seq = self._seqs.get(row.request_id)
        if seq is None or last < 0:
            return None
        lo, hi = seq.pending_span
        fed_end = seq.base + seq.fed
        if seq.base < 0 or fed_end > last + 1 or fed_end <= last and (not seq.pending or lo > fed_end):
            # nothing fed yet, or a gap between what was fed and what is held (a cached prefix, states
            # dropped): start over from the first held state
            if not seq.pending or hi <= last:
                return None
            self.kv.free(seq.kv)
            seq.kv.num_computed_tokens = 0
            seq.base, seq.fed, fed_end = lo, 0, lo
        if fed_end <= last and not lo <= fed_end < hi > last or last + 1 - fed_end < min_new:
            return None  # the target's states up to `last` have not arrived
        if seq.kv.num_computed_tokens > seq.fed:
            self.kv.rewind(seq.kv, seq.fed)  # the last proposal's speculative positions
        need = last - fed_end + 1 + extra
        if not self.kv.can_allocate(seq.kv, need):
            self.kv.free(seq.kv)
            seq.kv.num_computed_tokens = 0
            seq.base, seq.fed = -1, 0
            return None
        self.kv.allocate(seq.kv, need)
        seq.kv.num_computed_tokens = seq.fed + need
        seq.fed += last - fed_end + 1
        return seq, fed_end, last

    def _slot(self, seq: _Seq, p: int) -> int:
        bs = self.kv.block_size
        i = p - seq.base
        return seq.kv.block_ids[i // bs] * bs + i % bs

    def _context(self, pos, q_lens, ctxs, tables, slots, num_decodes, bidirectional=None) -> StepContext:
        """The head's StepContext for rows at positions `pos` (sequences as in AttentionBatch)."""
        attn = AttentionBatch(
            query_lens=q_lens,
            context_lens=ctxs,
            block_tables=tables,
            num_decodes=num_decodes,
            slot_mapping=to_device(torch.tensor(slots, dtype=torch.long), self.device),
            block_size=self.kv.block_size,
            bidirectional=bidirectional,
        )
        meta = self.backend.plan(attn, self.device)
        positions = to_device(torch.tensor(pos, dtype=torch.long), self.device)
        return StepContext(positions, self.kv_caches, meta)

    @torch.inference_mode()
    def prefeed(self, rows: list[ProposeRow]) -> None:
        """Feed every held pair whose next token the row already has (`token_ids` up to the token
        after the last state held), without drafting: called with a prompt chunk's states as its step
        is launched, so this host work overlaps that step on the device and the next proposal feeds
        only the prompt's last position."""
        chunks = []  # (row index, seq, first position, last position, 0 drafts)
        for i, row in enumerate(rows):
            c = self._catch_up(row, 0, 1)
            if c is not None:
                chunks.append((i, *c, 0))
        if chunks:
            chunks.sort(key=lambda c: c[3] != c[2])  # the attention layout: one-token chunks first
            self._feed(rows, chunks)

    def _feed(self, rows: list[ProposeRow], chunks: list) -> None:
        raise NotImplementedError

    def propose(self, rows: list[ProposeRow]) -> list[list[int]]:
        """The drafts per row, read back to the host (propose_device's, one wait)."""
        flat, counts = self.propose_device(rows)
        return split_drafts(flat.tolist(), counts)

    @torch.inference_mode()
    def propose_device(self, rows: list[ProposeRow]) -> tuple[torch.Tensor, list[int]]:
        """Every row's drafts, row after row, on the device: follow()'s where it drafted the row's
        proposal behind the last verify step, the others fed and drafted now (`_propose_fresh`)."""
        ready, self._ready = self._ready, None
        picks = {}  # row index -> (row of ready's drafts, drafts)
        for i, row in enumerate(rows):
            r = self._ready_row(ready, row)
            if r is not None:
                picks[i] = (r, min(row.max_drafts, self.num_speculative_tokens, ready[0].shape[1]))
        if not picks:
            return self._propose_fresh(rows)
        width = ready[0].shape[1]
        sel = to_device(torch.tensor([r for r, _ in picks.values()], dtype=torch.long), self.device)
        mine = ready[0][sel].view(-1)
        if len(picks) == len(rows) and all(c == width for _, c in picks.values()):
            return mine, [width] * len(rows)  # every row's proposal drafted behind the verify step
        rest = [i for i in range(len(rows)) if i not in picks]
        fresh, fresh_counts = self._propose_fresh([rows[i] for i in rest]) if rest else (mine[:0], [])
        counts, order, at = [0] * len(rows), [], len(mine)  # drafts in [mine | fresh], row after row
        for i, c in zip(rest, fresh_counts):
            counts[i] = c
        for i, (_, c) in picks.items():
            counts[i] = c
        starts = {i: n * width for n, i in enumerate(picks)}
        for i in range(len(rows)):
            if i in starts:
                order += range(starts[i], starts[i] + counts[i])
            else:
                order += range(at, at + counts[i])
                at += counts[i]
        flat = torch.cat([mine, fresh])[to_device(torch.tensor(order, dtype=torch.long), self.device)]
        return flat, counts

    def _propose_fresh(self, rows: list[ProposeRow]) -> tuple[torch.Tensor, list[int]]:
        """The rows' drafts from what the head holds: feed every pair not fed yet, then draft."""
        raise NotImplementedError

    def _ready_row(self, ready, row: ProposeRow) -> int | None:
        """The row of follow()'s drafts that is this row's proposal now: drafted behind the verify step
        whose accepted rows were the last the head was fed, up to the row's last token."""
        if ready is None or row.request_id not in ready[1]:
            return None
        seq = self._seqs.get(row.request_id)
        if seq is None or seq.following >= 0 or seq.base < 0 or seq.base + seq.fed != len(row.token_ids) - 1:
            return None
        return ready[1][row.request_id]

    def _follow_chunks(self, runs: list[VerifyRun], extra: int) -> list[tuple[VerifyRun, _Seq]]:
        """The verify runs follow() drafts behind (the head was fed every pair before each), with KV
        allocated for `extra` positions past the run's last row; each marked as followed."""
        self._ready = None
        chunks = []
        for r in runs:
            seq = self._seqs.get(r.request_id)
            if seq is None or seq.base < 0 or seq.base + seq.fed != r.start or seq.pending:
                continue
            if seq.kv.num_computed_tokens > seq.fed:
                self.kv.rewind(seq.kv, seq.fed)  # the last proposal's speculative positions
            need = r.num_drafts + 1 + extra
            if not self.kv.can_allocate(seq.kv, need):
                continue
            self.kv.allocate(seq.kv, need)
            seq.kv.num_computed_tokens = seq.fed + need
            seq.following = r.start
            chunks.append((r, seq))
        return chunks

    def accepted(self, request_id: str, num_drafts: int, num_accepted: int) -> None:
        pass  # the accepted tokens' hidden states arrive through observe_hidden

    def finish(self, request_id: str) -> None:
        seq = self._seqs.pop(request_id, None)
        if seq is not None:
            self.kv.free(seq.kv)


class ChainProposer(HiddenStateDrafter):
    """EAGLE-3 and MTP: one catch-up chunk per row, then k - 1 one-token steps (see the module doc)."""

    graphs = None  # spec/head_graphs.py's HeadStepGraphs, after use_graphs

    def use_graphs(self, max_seqs: int, max_model_len: int) -> None:
        """Run one-token head steps through graphs (captured now on CUDA) for up to max_seqs requests:
        a catch-up of up to k + 1 positions each."""
        from foveal.speculative.head_graphs import HeadStepGraphs

        max_rows = max_seqs * (1 + self.num_speculative_tokens)
        self.graphs = HeadStepGraphs(
            self.head, self.kv_caches, self.backend, block_size=self.kv.block_size, max_seqs=max_rows,
            max_model_len=max_model_len, device=self.device,
        )  # fmt: skip
        self.graphs.capture()

    # -- proposing --------------------------------------------------------------------------------------
    def _propose_fresh(self, rows: list[ProposeRow]) -> tuple[torch.Tensor, list[int]]:
        counts = [0] * len(rows)
        chunks = []  # (row index, seq, first position, last position, drafts wanted)
        for i, row in enumerate(rows):
            k = min(row.max_drafts, self.num_speculative_tokens)
            c = self._catch_up(row, k - 1, 1)
            if c is not None:
                chunks.append((i, *c, k))
                counts[i] = k
        if not chunks:
            return torch.empty(0, dtype=torch.long, device=self.device), counts
        chunks.sort(key=lambda c: c[3] != c[2])  # the attention layout: one-token chunks first
        draft, h = self._catch_up_step(rows, chunks)
        steps, at = self._chain(draft, h, [(c[1], c[3]) for c in chunks], [c[4] for c in chunks])
        # row after row (the rows' order), each row's drafts in step order
        if len(steps[-1]) == len(chunks) and all(a[0] < b[0] for a, b in zip(chunks, chunks[1:])):
            return torch.stack(steps, 1).view(-1), counts  # the common case: k each, rows in order
        order = [at[ci, j] for ci in sorted(range(len(chunks)), key=lambda c: chunks[c][0])
                 for j in range(chunks[ci][4])]  # fmt: skip
        flat = torch.cat(steps)[to_device(torch.tensor(order, dtype=torch.long), self.device)]
        return flat, counts

    def _chain(self, draft, h, lasts: list, ks: list[int], shift=None) -> tuple[list[torch.Tensor], dict]:
        """The one-token steps after each chunk's draft 1: chunk c at positions lasts[c] + j (its seq
        and last fed position; `shift` [chunks] on the device: that many positions further) for
        j = 1 .. ks[c] - 1. Returns (each step's drafts, (chunk, step) -> index in their concatenation)."""
        live = list(range(len(lasts)))  # chunks still drafting
        steps = [draft]
        at: dict[tuple[int, int], int] = {(ci, 0): ci for ci in live}
        done = len(live)
        for j in range(1, max(ks)):
            keep = [n for n, ci in enumerate(live) if ks[ci] > j]
            if len(keep) < len(live):
                sel = to_device(torch.tensor(keep), self.device)
                draft, h = draft[sel], h[sel]
                shift = None if shift is None else shift[sel]
                live = [live[n] for n in keep]
            seqs = [(lasts[ci][0], lasts[ci][1] + j) for ci in live]
            draft, h = self._one_token_step(draft, h, seqs, shift=shift)
            steps.append(draft)
            at.update(((ci, j), done + n) for n, ci in enumerate(live))
            done += len(live)
        return steps, at

    @torch.inference_mode()
    def follow(self, runs: list[VerifyRun], tokens, accepted, tapped) -> None:
        """Draft each verify run's next proposal behind its launched step, on the device: feed all of
        its 1 + k rows (pair j: the state tapped at row j, the target's token at row j; the rows past
        the accepted count are fed junk the next feeding overwrites), take draft 1 at the accepted row,
        then the chain's one-token steps at positions shifted by the accepted count on the device (the
        graphs' metadata moved there too). Nothing is read back: observe_hidden confirms the accepted
        rows when the step's states arrive, and the next propose() takes these drafts. A run whose
        earlier pairs the head has not all been fed (or no KV for it) is left to propose()."""
        k = min(max(r.num_drafts for r in runs), self.num_speculative_tokens)
        # positions start .. start + num_drafts + k - 1 at the most (the chain after the accepted row)
        chunks = self._follow_chunks(runs, k - 1)
        if not chunks:
            return
        tok_rows, tap_rows, pos, firsts, seqs = [], [], [], [], []
        for r, seq in chunks:
            firsts.append(len(pos))
            tok_rows += range(r.token_row, r.token_row + r.num_drafts + 1)
            tap_rows += range(r.tapped_row, r.tapped_row + r.num_drafts + 1)
            pos += range(r.start, r.start + r.num_drafts + 1)
            seqs += [(seq, p) for p in range(r.start, r.start + r.num_drafts + 1)]
        n, m = len(pos), len(chunks)
        flat = to_device(
            torch.tensor(tok_rows + tap_rows + pos + firsts + [r.item for r, _ in chunks], dtype=torch.long),
            self.device,
        )
        ids_d, x, pos_d = tokens[flat[:n]], tapped[flat[n : 2 * n]], flat[2 * n : 3 * n]
        shift = accepted[flat[3 * n + m :]].long()  # each run's accepted drafts
        sel = flat[3 * n : 3 * n + m] + shift  # its row at the last accepted position
        if self.graphs is not None and self.graphs.fits(n, max(p - q.base + 1 for q, p in seqs)):
            drafts, h = self._one_token_step(ids_d, x, seqs, pos_d)
            draft, h = drafts[sel], h[sel]
        else:  # one chunk a run
            q_lens = [r.num_drafts + 1 for r, _ in chunks]
            ctx = self._context(
                pos,
                q_lens,
                [r.start - seq.base for r, seq in chunks],
                [seq.kv.block_table for _, seq in chunks],
                [self._slot(seq, p) for seq, p in seqs],
                0,
            )
            normed, h = self.head(ids_d, x, ctx)
            draft, h = self.head.draft(normed[sel]), h[sel]
        steps, _ = self._chain(draft, h, [(seq, r.start) for r, seq in chunks], [k] * m, shift)
        self._ready = (torch.stack(steps, 1), {r.request_id: i for i, (r, _) in enumerate(chunks)})

    def _feed(self, rows, chunks) -> None:
        self._catch_up_step(rows, chunks)  # the pairs' keys and values; its drafts are not wanted

    def _catch_up_step(self, rows, chunks) -> tuple[torch.Tensor, torch.Tensor]:
        """Every row's unfed pairs in one forward: (draft 1, its hidden state) per chunk."""
        ids, hidden, pos, last_rows = [], [], [], []
        for i, seq, lo, hi, _k in chunks:
            ids.extend(rows[i].token_ids[lo + 1 : hi + 2])
            hidden.append(self._take(seq, lo, hi + 1))
            pos.extend(range(lo, hi + 1))
            last_rows.append(len(pos) - 1)
        n = len(pos)  # ids, positions and the chunks' last rows in one copy to the device
        flat = to_device(torch.tensor(ids + pos + last_rows, dtype=torch.long), self.device)
        ids_d, pos_d, last = flat[:n], flat[n : 2 * n], flat[2 * n :]
        x = torch.cat(hidden)
        seqs = [(seq, p) for _, seq, lo, hi, _ in chunks for p in range(lo, hi + 1)]
        if self.graphs is not None and self.graphs.fits(len(seqs), max(p - q.base + 1 for q, p in seqs)):
            draft, h = self._one_token_step(ids_d, x, seqs, pos_d)  # each position a one-token query
            return draft[last], h[last]
        q_lens = [hi + 1 - lo for _, _, lo, hi, _ in chunks]
        ctx = self._context(
            pos,
            q_lens,
            [lo - seq.base for _, seq, lo, _, _ in chunks],
            [seq.kv.block_table for _, seq, _, _, _ in chunks],
            [self._slot(seq, p) for seq, p in seqs],
            sum(1 for n in q_lens if n == 1),
        )
        normed, h = self.head(ids_d, x, ctx)
        return self.head.draft(normed[last]), h[last]

    def _one_token_step(
        self, ids, hidden, seqs: list, pos_d=None, shift=None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Rows (seq, position), each a one-token query over the keys up to its own: (drafts, hidden)
        (`pos_d`: the positions on the device already; `shift` [rows] on the device: each row sits
        that many positions further, at most k)."""
        pos = [p for _, p in seqs]
        ctxs = [p - seq.base for seq, p in seqs]
        tables = [seq.kv.block_table for seq, _ in seqs]  # one object a sequence: converted once
        reach = max(ctxs) + 1 + (0 if shift is None else self.num_speculative_tokens)
        if self.graphs is not None and self.graphs.fits(len(seqs), reach):
            batch = AttentionBatch([1] * len(seqs), ctxs, tables, len(seqs), None, self.kv.block_size)
            if pos_d is None:
                pos_d = to_device(torch.tensor(pos), self.device)
            return self.graphs.step(ids, hidden, pos_d, batch, shift=shift)
        if shift is not None:  # eagerly, the shift is read (a wait for the step it comes from)
            seqs = [(seq, p + a) for (seq, p), a in zip(seqs, shift.tolist())]
            pos = [p for _, p in seqs]
            ctxs = [p - seq.base for seq, p in seqs]
        slots = [self._slot(seq, p) for seq, p in seqs]
        ctx = self._context(pos, [1] * len(seqs), ctxs, tables, slots, len(seqs))
        normed, h = self.head(ids, hidden, ctx)
        return self.head.draft(normed), h


DraftHead.proposer = ChainProposer


def open_head_checkpoint(model: str):
    """An HF folder (config.json + safetensors) of a draft head: a local path or a Hub id."""
    import os

    from foveal.loader.safetensors_loader import open_hf_folder

    local = os.path.abspath(os.path.expanduser(model))
    if not os.path.exists(local):
        from foveal.loader.hub import download_repo

        local = download_repo(model)
    return open_hf_folder(local)


def build_hidden_proposer(
    spec,
    *,
    target,
    target_source=None,
    device,
    dtype,
    backend,
    max_model_len: int,
    num_blocks: int,
    block_size: int,
) -> HiddenStateDrafter:
    """The head the config names (eagle3, mtp: chain drafting; dflash: a block per forward), checked
    against the target by its builder, with a KV pool of num_blocks blocks for its layers."""
    from foveal.attention import kv_quant

    if not target.supports_aux_hidden:
        raise ValueError(f"speculative method {spec.method}: the target model cannot report hidden states")
    if spec.method == "eagle3":
        from foveal.speculative.eagle3 import build_eagle3_head as build
    elif spec.method == "mtp":
        from foveal.speculative.mtp import build_mtp_head as build
    elif spec.method == "dflash":
        from foveal.speculative.dflash import build_dflash_head as build
    else:
        raise ValueError(f"speculative method {spec.method!r} is not a hidden-state drafter")
    head = build(spec, target, target_source, backend, max_model_len, device, dtype).eval()
    k = min(spec.num_speculative_tokens, head.max_drafts)
    layers, kv_heads, head_dim = head.kv_shape
    caches = kv_quant.allocate_kv_caches(
        "auto", layers, num_blocks * block_size, kv_heads, head_dim, dtype, device
    )
    log.info(
        "%s head %s: %d layer(s), reads target layers %s; %d KV blocks; %d drafts per step",
        spec.method,
        spec.model or "(the target's)",
        layers,
        list(head.tap_layers) or "(last hidden state)",
        num_blocks,
        k,
    )
    kv = KVCacheManager(num_blocks, block_size)
    return head.proposer(head, caches, backend, kv, k, device)


def check_fits(spec, vocab: int, target_vocab: int, hidden: int, target_hidden: int) -> None:
    if vocab != target_vocab:
        raise ValueError(
            f"the {spec.method} head {spec.model} has a vocabulary of {vocab}; the target's is {target_vocab}"
        )
    if hidden != target_hidden:
        raise ValueError(
            f"the {spec.method} head {spec.model} reads hidden states of size {hidden}; "
            f"the target's are {target_hidden}"
        )
