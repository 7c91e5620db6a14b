"""Lossless verification of draft tokens: which drafts a step keeps, and the one token the target adds.

Owns the acceptance rule and its randomness, for a batch of items (requests) whose verify rows are
stacked in one [R, V] logits matrix. Item i with k_i drafts d1..dk owns k_i + 1 consecutive rows; row j
holds the target's distribution for the token after row j's input, and the draft it must judge:

    item i (k_i = 3), x = its last committed token, m = draw_index[i]:

        row j        0       1       2       3
        input        x       d1      d2      d3   | the bonus row
        logits       p_0     p_1     p_2     p_3  | p_j: target's next-token distribution
        draft_ids    d1      d2      d3      -1   | (ignored on the bonus row)
        output idx   m       m+1     m+2     m+3

Greedy items (temperature 0) accept the longest prefix of drafts with d_{j+1} == argmax p_j, then add
the argmax of the first row that disagrees (or of the bonus row): exactly what plain greedy decoding emits.

Sampled items follow speculative sampling (Leviathan et al. 2023, Chen et al. 2023): row j accepts its
draft d with probability min(1, p_j(d) / q_j(d)), q_j being the proposer's distribution (one-hot on d for a
deterministic proposer such as n-gram lookup); at the first rejection the token is drawn from the residual
normalize(max(p_j - q_j, 0)) (one-hot q: p_j without d), and if all k_i drafts pass, the bonus token is
drawn from p_k. Each output token is then distributed exactly as a draw from the target. Where the residual
has (numerically) no mass, i.e. p_j == q_j, row j draws from p_j instead: the rejection itself then has
probability below that mass, so the substitution moves the output distribution by less than _MIN_RESIDUAL.

Randomness (sample/noise.py, the plain sampler's contract): a seeded item's draws depend only on (seed,
output index, purpose): the token draw of the row with output index m uses the noise keyed by
draw_seed(seed, m), exactly like the plain sampler (so an item with no drafts draws what Sampler would),
and its acceptance uniform the noise keyed by draw_seed(seed ^ _ACCEPT_SALT, m), an independent stream.
Unseeded rows get keys from the global generator. Token draws are exponential races, argmax(p / E) with
E ~ Exp(1).

It must not know about requests, proposers or models: callers hand it logits, drafts and per-item lists.
Everything stays on the logits' device; the only host->device copies are the small per-item lists.
"""

from __future__ import annotations

import torch

from foveal.device import to_device
from foveal.sample import noise

_ACCEPT_SALT = 0x5EC0_ACCE_97ED_0001  # mixed into a request's seed for its acceptance uniforms
_MIN_RESIDUAL = 1e-6  # residual mass below this counts as none (p == q up to rounding)


def probs_of(logits: torch.Tensor) -> torch.Tensor:
    """float32 softmax over the last dim: the target's distribution p for logits as verify() takes them."""
    return logits.to(torch.float32).softmax(-1)


def verify(
    logits: torch.Tensor,
    draft_ids: torch.Tensor,
    num_drafts: list[int],
    greedy: list[bool],
    seeds: list[int | None],
    draw_index: list[int],
    draft_probs: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Judge every item's drafts against the target; see the module docstring for the rows and the rule.

    logits: [R, V] float32, per row the target's logits after the row's processing (for sampled items
    temperature-scaled and filtered, dropped tokens -inf, so softmax gives p).
    draft_ids: [R] int64, the draft judged at each row; -1 on bonus rows (ignored). On a draft row an id
    outside [0, V) is rejected, so a proposer with fewer drafts than k_i may pad with -1.
    num_drafts: k_i >= 0 per item; item i owns the k_i + 1 rows after the earlier items' rows.
    greedy, seeds, draw_index: per item, temperature 0; the request seed (None: the global RNG); the
    output index of the token its first row produces.
    draft_probs: [R, V] float32, the proposer's q per row (bonus rows ignored); None for a deterministic
    proposer, whose q is one-hot on its draft. Greedy items ignore it.

    Returns (tokens [R] int64, num_accepted [items] int64), on the logits' device. Item i's output is
    tokens[row0 : row0 + a_i + 1]: its a_i accepted drafts, then the correction (at the first rejection)
    or the bonus token. Rows past that are valid ids of no meaning.
    """
    _check(logits, draft_ids, num_drafts, greedy, seeds, draw_index, draft_probs)
    dev = logits.device
    R = logits.shape[0]
    if R == 0:
        return torch.empty(0, dtype=torch.long, device=dev), torch.empty(0, dtype=torch.long, device=dev)
    meta = to_device(torch.tensor([num_drafts, [int(g) for g in greedy]], dtype=torch.long), dev)
    k, greedy_t = meta[0], meta[1].bool()
    item, offset = _row_layout(k, R)
    if draft_ids.device != dev:
        draft_ids = to_device(draft_ids, dev)
    draft_ids = draft_ids.long()
    # rows with a draft to judge; one outside [0, V) (e.g. a placeholder id) is rejected outright
    judged = (offset < k[item]) & (draft_ids >= 0) & (draft_ids < logits.shape[1])
    draft = torch.where(judged, draft_ids, 0)  # a valid id everywhere, for the gathers
    target_max = logits.argmax(-1)
    accept = judged & (draft == target_max)
    recovered = target_max
    if not all(greedy):
        p = probs_of(logits)
        u, e = _randoms(logits.shape[1], dev, num_drafts, greedy, seeds, draw_index)
        p_d = p.gather(1, draft[:, None]).squeeze(1)
        q_d = 1.0 if draft_probs is None else draft_probs.gather(1, draft[:, None]).squeeze(1).float()
        # u in [0, 1): always accepts where p(d) >= q(d) > 0, never where p(d) == 0
        sampled_accept = judged & (u * q_d < p_d)
        sampled = _race(_residual(p, draft, draft_probs, judged), e)
        g_row = greedy_t[item]
        accept = torch.where(g_row, accept, sampled_accept)
        recovered = torch.where(g_row, target_max, sampled)
    # a_i = the offset of the first rejected row, or k_i when every draft passes
    num_accepted = k.scatter_reduce(0, item, torch.where(accept, k[item], offset), "amin")
    tokens = torch.where(offset < num_accepted[item], draft, recovered)
    return tokens, num_accepted


def _row_layout(k: torch.Tensor, R: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Per row: the item that owns it and its offset j within that item (0 .. k_i)."""
    rows = k + 1
    item = torch.repeat_interleave(torch.arange(k.numel(), device=k.device), rows, output_size=R)
    start = rows.cumsum(0) - rows
    return item, torch.arange(R, device=k.device) - start[item]


def _residual(
    p: torch.Tensor, draft: torch.Tensor, q: torch.Tensor | None, judged: torch.Tensor
) -> torch.Tensor:
    """Unnormalized distribution of each row's token if it is the one emitted: max(p - q, 0) on judged
    rows (p where that has no mass), p on the others. The exponential race needs no normalization."""
    if q is None:
        r = p.scatter(1, draft[:, None], 0.0)
    else:
        r = (p - q.float()).clamp_min_(0.0)
    use = judged[:, None] & (r.sum(-1, keepdim=True) > _MIN_RESIDUAL)
    return torch.where(use, r, p)


def _race(weights: torch.Tensor, e: torch.Tensor) -> torch.Tensor:
    """argmax(w / E), E ~ Exp(1): token t with probability w_t / sum(w)."""
    return (weights / e.clamp_min(1e-20)).argmax(-1)


def _randoms(
    V: int,
    dev: torch.device,
    num_drafts: list[int],
    greedy: list[bool],
    seeds: list[int | None],
    draw_index: list[int],
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per row an acceptance uniform [R] and the exponentials of its token draw [R, V], from the rows'
    noise keys (sample/noise.py): row j of a seeded item from (seed, m + j), its acceptance from
    (seed ^ _ACCEPT_SALT, m + j). Greedy items' rows are filled but unused."""
    row_seeds: list[int | None] = []
    row_index: list[int] = []
    for k, g, seed, m in zip(num_drafts, greedy, seeds, draw_index):
        row_seeds += [None if g else seed] * (k + 1)
        row_index += range(m, m + k + 1)
    draws = noise.key_halves(noise.row_keys(row_seeds, row_index), dev)
    accepts = noise.key_halves(noise.row_keys(row_seeds, row_index, salt=_ACCEPT_SALT), dev)
    u = noise.uniforms(accepts, torch.zeros(1, dtype=torch.long, device=dev))[:, 0]
    return u, noise.exponentials(draws, V)


def _check(
    logits: torch.Tensor,
    draft_ids: torch.Tensor,
    num_drafts: list[int],
    greedy: list[bool],
    seeds: list[int | None],
    draw_index: list[int],
    draft_probs: torch.Tensor | None,
) -> None:
    n = len(num_drafts)
    if len(greedy) != n or len(seeds) != n or len(draw_index) != n:
        raise ValueError(
            f"num_drafts, greedy, seeds, draw_index have lengths "
            f"{n}, {len(greedy)}, {len(seeds)}, {len(draw_index)}: one entry per item each"
        )
    if any(k < 0 for k in num_drafts):
        raise ValueError(f"num_drafts must be >= 0, got {num_drafts}")
    R = sum(num_drafts) + n
    if logits.dim() != 2 or logits.shape[0] != R:
        raise ValueError(f"logits {tuple(logits.shape)} do not match {R} rows (sum of num_drafts + 1)")
    if tuple(draft_ids.shape) != (R,):
        raise ValueError(f"draft_ids {tuple(draft_ids.shape)} do not match {R} rows")
    if draft_probs is not None and draft_probs.shape != logits.shape:
        raise ValueError(f"draft_probs {tuple(draft_probs.shape)} do not match logits {tuple(logits.shape)}")
