"""Token sampling for one engine step: a [B, V_model] logits matrix in, one token per row out.

Owns the per-row sampling pipeline, in this order: min_tokens masking of EOS/stop ids, logit_bias,
repetition penalty (prompt + output), frequency/presence penalties (output), the grammar mask of
constrained rows (a packed bitmask, foveal/structured/bitmask.py; where min_tokens would leave such a
row nothing, the grammar wins), temperature (0 = greedy), then min_p -> top_k -> top_p, then the draw;
plus logprobs taken from the raw logits (before the mask too). Every row uses its
own SamplingParams, packed into per-row tensors once per call: nothing is inherited from another row.
The draw's randomness is counter-based noise keyed per row (sample/noise.py): a seeded row's key comes
only from (seed, draw index), so its tokens do not depend on the batch it happens to share. On CUDA
temperature, the filters and the draw are one Triton kernel with no sort (sample/triton_sample.py),
which also applies the penalties of rows kept in the device history as it reads the raw logits (a step
with a logit bias, min_tokens or grammar masks processes a float32 copy first); on the CPU they are
torch ops: top_p looks at each row's TOP_P_WINDOW largest logits (topk, not a sort of
the vocabulary) and sorts a whole row only where its kept set may reach past them. Columns past
vocab_size (padding of the LM head) are never sampled.

It must not know about requests, schedulers or models: callers hand it SamplingRow values and logits.
"""

from __future__ import annotations

import array
import logging
from dataclasses import dataclass, field

import torch

from foveal.device import to_device
from foveal.request import Logprob, SamplingParams, TokenLogprobs
from foveal.sample import noise, triton_sample
from foveal.sample.history import TokenHistory, occurrence_counts
from foveal.structured.bitmask import apply_bitmask

log = logging.getLogger(__name__)
# per Triton kernel (each compiles at its first launch): whether it built here; absent: not tried yet
_kernel_ok: dict[str, bool] = {}
# the torch path's top_p: candidates per row taken by topk; a row whose kept set may not lie inside them
# (a flat distribution, or a top_k larger than this) is sorted whole. A constant, so a row's result
# never depends on the other rows of its batch. (On the 2-vCPU host, 32 rows x 49,152: a full sort
# ~45 ms a step, topk of 256 a few ms.)
TOP_P_WINDOW = 256

# the grammar masks of a step's constrained rows: (bitmask int32 [n, words], logits row of each) on the
# logits' device; None when no row is constrained
Masks = tuple[torch.Tensor, torch.Tensor] | None


@dataclass(slots=True)
class SamplingRow:
    """One row of the logits matrix and what the sampler needs to know about its request."""

    params: SamplingParams
    prompt_token_ids: list[int]
    output_token_ids: list[int]  # generated so far (the penalties count them)
    eos_token_ids: frozenset[int]
    index: int | None = None  # the output index of the token being drawn; None: len(output_token_ids)
    # the row's slot in the sampler's TokenHistory (its penalties read the device counts there, and its
    # token is added to them), or None: the penalties count the lists above
    slot: int | None = None

    @property
    def draw_index(self) -> int:
        return len(self.output_token_ids) if self.index is None else self.index


@dataclass(slots=True)
class SamplerOutput:
    token_ids: list[int]  # one per row
    logprobs: list[TokenLogprobs | None]  # one per row; None where params.logprobs is None


def _min_tokens_active(row: SamplingRow) -> bool:
    return row.draw_index < row.params.min_tokens


def _loads_raw(r: SamplingRow, history: bool) -> bool:
    """Whether CUDA's kernel can draw this row from the raw logits: nothing to apply in place but
    penalties over the row's device history (`history`: the sampler keeps one), which the kernel
    applies as it loads."""
    p = r.params
    in_history = not p.needs_penalties or (history and r.slot is not None)
    return in_history and not _min_tokens_active(r) and not p.bias_token_ids


def _plain_greedy(row: SamplingRow) -> bool:
    p = row.params
    return (
        p.greedy
        and p.logprobs is None
        and not p.logit_bias
        and not p.needs_penalties
        and not _min_tokens_active(row)
    )


class Sampler:
    """Every draw's randomness is a function of its row's key (sample/noise.py); the only state is
    the penalties' device counts (`history`), kept per request slot for the runner."""

    def __init__(self, vocab_size: int, device=None):
        self.vocab_size = vocab_size
        # the penalties' device counts per request slot (the runner starts a slot's): with a device only
        self.history = TokenHistory(vocab_size, device) if device is not None else None

    def __call__(self, logits: torch.Tensor, rows: list[SamplingRow]) -> SamplerOutput:
        tokens, logprobs = self.sample(logits, rows)
        return SamplerOutput(tokens.tolist(), logprobs.values())

    def sample(
        self, logits: torch.Tensor, rows: list[SamplingRow], masks: Masks = None
    ) -> tuple[torch.Tensor, PendingLogprobs]:
        """The drawn tokens as a device tensor [B] and the rows' logprobs on their way to the host: no
        host sync (seeded or not, logprobs or not)."""
        V = self.vocab_size
        if logits.dim() != 2 or logits.shape[0] != len(rows) or logits.shape[1] < V:
            raise ValueError(f"logits {tuple(logits.shape)} do not match {len(rows)} rows x vocab {V}")
        raw = logits[:, :V]  # dropping the padding columns is the same as masking them to -inf
        if all(_plain_greedy(r) for r in rows):
            if masks is not None:  # the greedy fast path, masked (a copy: logprobs read the raw logits)
                pick = raw.to(torch.float32, copy=True)
                apply_bitmask(pick, *masks)
                return pick.argmax(-1), PendingLogprobs(len(rows))
            if raw.device.type == "cpu" and raw.dtype != torch.float32:
                raw = raw.float()  # same maximum, same first index; bf16 argmax ran 2x slower here
            return raw.argmax(-1), PendingLogprobs(len(rows))

        if raw.is_cuda and masks is None and all(_loads_raw(r, self.history is not None) for r in rows):
            # nothing to apply in place: the kernel reads the raw rows (bf16 widens exactly, as the
            # float32 copy would) and the penalties' device counts, a copy of the logits and a pass less
            tokens = self._draw_kernel(raw, rows, penalties=True)
            if tokens is not None:
                return tokens, self.logprobs(raw, rows, tokens)
        x = self.process_logits(logits, rows, masks)
        tokens = self._draw_kernel(x, rows) if x.is_cuda else None
        if tokens is None:
            ng = [i for i, r in enumerate(rows) if not r.params.greedy]
            if len(ng) == len(rows):
                tokens = self._draw(self.filter(x, [r.params for r in rows]).softmax(-1), rows)
            else:
                tokens = x.argmax(-1)
                if ng:
                    idx = _long(ng, x.device)
                    sub = [rows[i] for i in ng]
                    tokens[idx] = self._draw(self.filter(x[idx], [r.params for r in sub]).softmax(-1), sub)
        return tokens, self.logprobs(raw, rows, tokens)

    def count(self, rows: list[SamplingRow], tokens: torch.Tensor) -> None:
        """The drawn tokens of rows with a history slot join their requests' device counts (rows of one
        token each; the caller's, after sample() or a verify run)."""
        counted = [i for i, r in enumerate(rows) if r.slot is not None]
        if counted:
            slots = [rows[i].slot for i in counted]
            self.history.add(_long(slots, tokens.device), tokens[_long(counted, tokens.device)])

    # ---- steps 1-4: masking, bias, penalties -------------------------------------------------------

    def process_logits(
        self, logits: torch.Tensor, rows: list[SamplingRow], masks: Masks = None
    ) -> torch.Tensor:
        """float32 [B, vocab_size] logits after min_tokens masking, logit_bias, penalties and the
        grammar masks."""
        V = self.vocab_size
        x = logits[:, :V].to(torch.float32, copy=True)
        mask_r: list[int] = []
        mask_t: list[int] = []
        bias_r: list[int] = []
        bias_t: list[int] = []
        bias_v: list[float] = []
        for i, r in enumerate(rows):
            p = r.params
            if _min_tokens_active(r):
                # ignore_eos: the engine will not stop on EOS, so only stop ids need holding back
                ids = set(p.stop_token_ids) if p.ignore_eos else set(p.stop_token_ids) | r.eos_token_ids
                ids = [t for t in ids if 0 <= t < V]
                mask_r += [i] * len(ids)
                mask_t += ids
            if p.bias_token_ids:  # made when the params were (request side); ids checked against the vocab
                bias_r += [i] * len(p.bias_token_ids)
                bias_t += p.bias_token_ids
                bias_v += p.bias_values
        dev = x.device
        if mask_t:
            x[_long(mask_r, dev), _long(mask_t, dev)] = float("-inf")
        if bias_t:
            vals = to_device(torch.tensor(bias_v, dtype=torch.float32), dev)
            x.index_put_((_long(bias_r, dev), _long(bias_t, dev)), vals, accumulate=True)
        pen = [i for i, r in enumerate(rows) if r.params.needs_penalties]
        if pen:
            self._apply_penalties(x, rows, pen)
        if masks is not None:
            apply_bitmask(x, *masks)
            if mask_t:  # a grammar that allows only EOS where min_tokens holds it back: the grammar wins
                held = _long(sorted(set(mask_r)), dev)
                dead = held[x[held].amax(-1) == float("-inf")]
                if dead.numel():
                    x[dead] = logits[dead, :V].to(torch.float32)
                    apply_bitmask(x, *masks)
        return x

    def _apply_penalties(self, x: torch.Tensor, rows: list[SamplingRow], pen: list[int]) -> None:
        dev, V = x.device, self.vocab_size
        sub = [rows[i] for i in pen]
        ps = [r.params for r in sub]
        vals = to_device(  # pinned, not pageable: a pageable copy would wait for the forward pass
            torch.tensor(
                [[p.repetition_penalty, p.frequency_penalty, p.presence_penalty] for p in ps],
                dtype=torch.float32,
            ),
            dev,
        )
        idx = _long(pen, dev)
        slots = [r.slot for r in sub]
        prompt_seen = None
        if all(s is not None for s in slots):  # the device history: no host lists
            h, at = self.history, _long(slots, dev)
            if x.is_cuda:  # one pass in place (the torch ops below take ~15)
                penalize = lambda ts: ts.penalize(x, idx, at, vals, h.counts, h.prompt)  # noqa: E731
                if _triton("penalize", penalize) is not None:
                    return
            out_counts, prompt_seen = h.read(at)
        else:
            out_counts = occurrence_counts([r.output_token_ids for r in sub], V, dev)
        sel = x[idx]
        if any(p.repetition_penalty != 1.0 for p in ps):
            if prompt_seen is None:  # only rows with a repetition penalty pay for scanning their prompt
                prompts = [r.prompt_token_ids if p.repetition_penalty != 1.0 else [] for r, p in zip(sub, ps)]
                prompt_seen = occurrence_counts(prompts, V, dev) > 0
            seen = prompt_seen | (out_counts > 0)
            rep = vals[:, 0:1]
            sel = torch.where(seen, torch.where(sel > 0, sel / rep, sel * rep), sel)
        cnt = out_counts.to(torch.float32)
        sel = sel - (vals[:, 1:2] * cnt + vals[:, 2:3] * (cnt > 0))
        x[idx] = sel

    # ---- steps 5-6: temperature and min_p / top_k / top_p -----------------------------------------

    def filtered_logits(
        self, logits: torch.Tensor, rows: list[SamplingRow], masks: Masks = None
    ) -> torch.Tensor:
        """Steps 1-6: non-greedy rows are temperature-scaled and filtered (dropped tokens are -inf);
        greedy rows are left as process_logits returns them. softmax() gives the sampling distribution."""
        x = self.process_logits(logits, rows, masks)
        ng = [i for i, r in enumerate(rows) if not r.params.greedy]
        if ng:
            idx = _long(ng, x.device)
            x[idx] = self.filter(x[idx], [rows[i].params for i in ng])
        return x

    def filter(self, x: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
        """Rows of logits temperature-scaled, then min_p, top_k and top_p (dropped tokens -inf). On
        CUDA the kernel's thresholds (no sort): a token stays when its tempered logit reaches its row's."""
        if x.is_cuda and x.shape[0]:
            xf = x.float().contiguous()
            tau = self._kernel(xf, params, None)
            if tau is not None:
                # tempered as the kernel tempers (times the float32 reciprocal): the same values it
                # compared with its thresholds, so the boundary tokens stay
                inv = 1.0 / torch.tensor([p.temperature for p in params], dtype=torch.float32)
                y = xf * to_device(inv, x.device)[:, None]
                return y.masked_fill(y < tau[:, None], float("-inf"))
        return self.sort_filter(x, params)

    def sort_filter(self, x: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
        """filter() by torch ops (the CPU's, and CUDA's where the kernel did not build): top_k and top_p
        sort the rows."""
        V = self.vocab_size
        neg_inf = float("-inf")
        # one host->device copy for every per-row scalar; off switches get values that keep everything
        cols = to_device(
            torch.tensor(
                [
                    [
                        p.temperature,
                        p.min_p,
                        p.top_k if 0 < p.top_k < V else 0,
                        p.top_p if p.top_p < 1 else 2.0,
                    ]
                    for p in params
                ],
                dtype=torch.float32,
            ),
            x.device,
        )
        x = x / cols[:, 0:1]
        if any(p.min_p > 0 for p in params):
            probs = x.softmax(-1)
            x = x.masked_fill(probs < probs.amax(-1, keepdim=True) * cols[:, 1:2], neg_inf)
        ks = [p.top_k for p in params if 0 < p.top_k < V]
        use_p = any(p.top_p < 1 for p in params)
        k = cols[:, 2].long()
        k_on = (k > 0).unsqueeze(1)
        if use_p:
            return _top_k_top_p(x, k, cols[:, 3:4])
        if ks:
            top = x.topk(max(ks), dim=-1).values
            kth = top.gather(1, (k - 1).clamp(0, max(ks) - 1).unsqueeze(1))
            x = x.masked_fill(k_on & (x < kth), neg_inf)
        return x

    # ---- step 7: the draw ----------------------------------------------------------------------------

    def _draw(self, probs: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
        """argmax(p / E) with E ~ Exp(1) picks token i with probability p_i (the exponential race); E
        is the rows' counter-based noise (sample/noise.py)."""
        keys = noise.row_keys([r.params.seed for r in rows], [r.draw_index for r in rows])
        e = noise.exponentials(noise.key_halves(keys, probs.device), probs.shape[1])
        return probs.div_(e).argmax(-1)

    def _draw_kernel(self, x: torch.Tensor, rows: list[SamplingRow], penalties: bool = False):
        """CUDA: sample/triton_sample.py's kernel over logits x (processed, or raw with `penalties`: the
        rows' penalties applied by the kernel from their device history); the same kept sets as
        filter() (ties at a boundary aside) and the same noise as _draw. None where the kernel failed
        to build on this machine (logged once; the torch ops sample instead)."""
        keys = noise.row_keys([r.params.seed for r in rows], [r.draw_index for r in rows])
        pen = penalties and any(r.params.needs_penalties for r in rows)
        return self._kernel(x, [r.params for r in rows], keys, rows if pen else None)

    def _kernel(self, x, params: list[SamplingParams], keys, penalized=None):
        """The kernel's tokens for rows of x (keys: row_keys' array; None: their thresholds), or None
        where it failed to build. penalized: the rows, when the kernel applies their penalties (slots
        in self.history)."""
        V = self.vocab_size
        table = array.array("f")  # the columns row after row, one buffer (torch.tensor of lists is slower)
        temps, min_p, top_k, top_p, rep, freq, pres = zip(*[p.kernel_columns for p in params])
        if max(top_k) >= V:  # a top_k past the vocabulary keeps every token: off
            top_k = tuple(k if k < V else 0.0 for k in top_k)
        for column in (temps, min_p, top_k, top_p):
            table.fromlist(list(column))  # (array.extend of a tuple takes twice as long)
        if penalized is not None:  # the same copy carries each row's slot (-1: none) and penalties
            table.fromlist([r.slot if r.params.needs_penalties else -1 for r in penalized])
            for column in (rep, freq, pres):
                table.fromlist(list(column))
        order = None if keys is None else triton_sample.row_order(temps, min_p, top_k, top_p)
        if order is not None:
            table.fromlist(order)
        cols = to_device(torch.frombuffer(table, dtype=torch.float32).view(-1, len(params)), x.device)
        if keys is None:
            return _triton("thresholds", lambda ts: ts.thresholds(x, cols[0], cols[1], cols[2], cols[3], V))
        halves = noise.key_halves(keys, x.device)
        pen = None if penalized is None else (cols[4], cols[5:8], self.history.counts, self.history.prompt)
        at = None if order is None else cols[-1]
        return _triton(
            "sample", lambda ts: ts.sample_rows(x, cols[0], cols[1], cols[2], cols[3], halves, V, pen, at)
        )

    # ---- step 8: logprobs from the raw logits -------------------------------------------------------

    def logprobs(self, raw: torch.Tensor, rows: list[SamplingRow], tokens: torch.Tensor) -> PendingLogprobs:
        """The rows' logprobs, computed on the device and on their way to the host (no wait here:
        `PendingLogprobs.values()` reads them once the step's tokens are in)."""
        want = [i for i, r in enumerate(rows) if r.params.logprobs is not None]
        if not want:
            return PendingLogprobs(len(rows))
        idx = _long(want, raw.device)
        kmax = max(rows[i].params.logprobs for i in want)
        # one float64 matrix (ids are exact in float64), one copy: [token, logprob, top values, top ids].
        # logprob = logit - logsumexp: only the chosen and the top logits are subtracted. CUDA: one pass
        # over each raw row gives them (the top ones up to TOP_SLOTS; more: torch.topk); else the torch
        # ops on a float copy of the rows
        both = pack = None
        if raw.is_cuda:
            got = _triton("logprobs", lambda ts: ts.row_logprobs(raw, idx, tokens, kmax))
            both, pack = got if got is not None else (None, None)
        if pack is None:
            picked = tokens[idx]
            sub = raw[idx] if kmax or both is None else None
            if both is not None:
                lse, chosen = both[:, :1], both[:, 1:]
            else:
                lse = row_logsumexp(sub.float())
                chosen = sub.gather(1, picked.unsqueeze(1)).float() - lse
            empty = lse[:, :0]
            top_v, top_i = sub.topk(kmax, dim=-1) if kmax else (empty, empty.long())
            top_v = top_v.float() - lse
            parts = [picked.unsqueeze(1).double(), chosen.double(), top_v.double(), top_i.double()]
            pack = torch.cat(parts, 1)
        if pack.is_cuda:
            host = torch.empty(pack.shape, dtype=pack.dtype, pin_memory=True)
            host.copy_(pack, non_blocking=True)  # ordered before the step's event (ModelRunner)
            pack = host
        return PendingLogprobs(len(rows), want, [rows[i].params.logprobs for i in want], pack)


@dataclass(slots=True)
class PendingLogprobs:
    """A step's logprobs on their way to the host: `values()` once the step's copy is done."""

    num_rows: int
    want: list[int] = field(default_factory=list)  # the rows that asked
    ks: list[int] = field(default_factory=list)  # their top-k
    pack: torch.Tensor | None = None  # [len(want), 2 + 2 * kmax] float64 on the host

    def values(self) -> list[TokenLogprobs | None]:
        out: list[TokenLogprobs | None] = [None] * self.num_rows
        if not self.want:
            return out
        rows = self.pack.tolist()
        kmax = (self.pack.shape[1] - 2) // 2
        for i, k, r in zip(self.want, self.ks, rows):
            top = [Logprob(int(t), v) for v, t in zip(r[2 : 2 + k], r[2 + kmax : 2 + kmax + k])]
            out[i] = TokenLogprobs(int(r[0]), r[1], top)
        return out


def _triton(name: str, call):
    """call(sample/triton_sample.py), the kernel `name` (CUDA's, or the interpreter's); None where it
    failed to build on this machine (logged once; the torch ops run instead from then on)."""
    if _kernel_ok.get(name) is False:
        return None
    try:  # its first launch compiles it
        out = call(triton_sample)
    except Exception:
        if _kernel_ok.get(name):  # it built and ran before: this is no build failure
            raise
        log.exception("the Triton %s kernel failed; torch ops run instead from now on", name)
        _kernel_ok[name] = False
        return None
    _kernel_ok[name] = True
    return out


def row_logsumexp(x: torch.Tensor, width: int = 64) -> torch.Tensor:
    """log(sum(exp(x))) of each row of x [n, V] (float) as [n, 1], the same bits whatever rows x holds
    beside it: torch's logsumexp splits a lone row's sum between a CPU's threads (a batch's rows are each
    summed whole), an ulp apart. Here each row's exps are summed in runs of `width` (a reduction of each
    run's own, never split) and the runs' sums in order, in float64."""
    n, V = x.shape
    top = x.amax(-1, keepdim=True)
    top = top.masked_fill(top.isinf(), 0)  # a row all -inf gives -inf (all +inf: inf), as torch's does
    e = (x - top).exp_()
    whole = V - V % width
    sums = e.as_strided((n, whole // width, width), (V, width, 1)).sum(-1)
    if whole < V:
        sums = torch.cat([sums, e[:, whole:].sum(-1, keepdim=True)], 1)
    return (sums.double().cumsum(-1)[:, -1:].log() + top).to(x.dtype)


def _long(values: list[int], dev: torch.device) -> torch.Tensor:
    return to_device(torch.tensor(values, dtype=torch.long), dev)


def _kept(vals: torch.Tensor, k: torch.Tensor, top_p: torch.Tensor, lse: torch.Tensor | None, room: int = 0):
    """Rows of logits sorted descending -> (them with top_k's and top_p's dropped tokens at -inf, whether
    each row's kept set is decided inside them, whether it could be decided among `room` more of its
    largest). `lse`: the rows' log-normalizer over the whole vocabulary (for rows without top_k);
    None: `vals` is the whole row."""
    neg_inf = float("-inf")
    n, w = vals.shape
    k_on = (k > 0).unsqueeze(1)
    kth = vals.gather(1, (k - 1).clamp(0, w - 1).unsqueeze(1))
    inside = (vals[:, -1:] < kth) & (k <= w).unsqueeze(1)  # every token tied with the k-th value is here
    vals = vals.masked_fill(k_on & (vals < kth), neg_inf)
    norm = vals.logsumexp(-1, keepdim=True)  # top_k rows: over their kept set
    if lse is not None:
        norm = torch.where(k_on, norm, lse)
    probs = (vals - norm).exp()
    # drop a token once the more probable ones already reach top_p; the first always stays
    cum = probs.cumsum(-1)
    drop = (cum - probs) >= top_p
    drop[:, 0] = False
    kept = vals.masked_fill(drop, neg_inf)
    if lse is None:
        return kept, torch.ones(n, dtype=torch.bool, device=vals.device), None
    # a row without top_k is decided once the window's last token is dropped (or -inf): the tokens
    # past it are no more probable. Each of those has at most the last one's probability, so it needs
    # >= (top_p - mass here) / that many more: more than `room`, and a wider window cannot decide it;
    # nor is it tried where this window holds under half of top_p (a flat row: a wide set, sorted)
    decided = torch.where(k_on, inside, drop[:, -1:] | (vals[:, -1:] == neg_inf))[:, 0]
    need = (top_p - cum[:, -1:]) / probs[:, -1:].clamp_min(torch.finfo(probs.dtype).tiny)
    could = torch.where(k_on, (k <= w + room).unsqueeze(1), (need <= room) & (2 * cum[:, -1:] >= top_p))[:, 0]
    return kept, decided, could


def _top_k_top_p(x: torch.Tensor, k: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """top_k (k > 0) then top_p over rows of tempered logits x (min_p's drops at -inf): dropped tokens
    -inf. From each row's TOP_P_WINDOW largest logits where its kept set lies among them, else from its
    16 x TOP_P_WINDOW largest where it can, else from the whole sorted row (the same set each way)."""
    neg_inf = float("-inf")
    V = x.shape[1]
    whole = (k == 0) & (top_p[:, 0] > 1)  # neither filter (the batch's other rows have one): x itself
    out = torch.where(whole[:, None], x, neg_inf)
    lse = row_logsumexp(x)
    windows = [w for w in (TOP_P_WINDOW, 16 * TOP_P_WINDOW) if w < V]
    to_sort = []
    if windows:  # a row without top_k whose first window cannot hold half of top_p (its largest
        # probability times the window is under that: a flat row) goes straight to the sort
        flat = (k == 0) & (windows[0] * (x.amax(-1) - lse[:, 0]).exp() < top_p[:, 0] / 2) & ~whole
        to_sort.append(flat.nonzero().squeeze(1))
    rows = (~whole & ~flat).nonzero().squeeze(1) if windows else (~whole).nonzero().squeeze(1)
    for j, w in enumerate(windows):
        if not len(rows):
            break
        room = windows[j + 1] - w if j + 1 < len(windows) else 0
        vals, order = (x if len(rows) == len(x) else x[rows]).topk(w, dim=-1)
        kept, decided, could = _kept(vals, k[rows], top_p[rows], lse[rows], room)
        if bool(decided.any()):
            done = rows[decided]
            blank = torch.full((len(done), V), neg_inf, dtype=x.dtype, device=x.device)
            out[done] = blank.scatter_(1, order[decided], kept[decided])
        to_sort.append(rows[~decided & ~could])  # no wider window can decide these
        rows = rows[~decided & could]
    rows = torch.cat([rows, *to_sort])
    if not len(rows):
        return out
    every = len(rows) == len(x) and bool((rows == torch.arange(len(x), device=x.device)).all())
    srt, order = (x if every else x[rows]).sort(-1, descending=True)
    kept, _, _ = _kept(srt, k[rows], top_p[rows], None)
    full = torch.empty_like(srt).scatter_(1, order, kept)
    if every:  # every row sorted (all flat): no copy into out
        return full
    out[rows] = full
    return out
