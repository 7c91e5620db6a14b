"""A denoising pass's choice per position, on the device: the token the model picks (x0) and its
probability (the confidence that decides which masked positions take their token; diffusion/state.py).

    never the mask   the mask token's logit is -inf first (a random-weight model may rank it first; a
                     trained one gives it ~0: the published samplers leave it, and stall on it)
    greedy           x0 = argmax(logits)
    temperature T    x0 = argmax(logits - T * log(-log U)), U ~ Uniform(0, 1) in float64 (Gumbel-max: a
                     draw from softmax(logits / T); LLaDA's generate() writes it exp(l) / (-log U)^T)
    confidence       softmax(logits)[x0] in float32 (of the untempered logits, as LLaDA)

U of a seeded request is the counter-based noise of sample/noise.py keyed per row by (draw_seed(seed,
pass index), row): a [window rows, vocab] tensor (masked models: the whole canvas's rows, of which the
pass uses those from its active block on), so a request's draws do not depend on its batch.
"""

from __future__ import annotations

from dataclasses import replace

import torch

from foveal.sample import noise


def uniforms(seed: int | None, index: int, rows: int, vocab: int, device) -> torch.Tensor:
    """The pass's U [rows, vocab] float64: row r's from the noise keyed by (draw_seed(seed, index), r)
    (sample/noise.py; seed None: a random key per row)."""
    base = None if seed is None else noise.draw_seed(seed, index)
    keys = noise.row_keys([base] * rows, list(range(rows)))
    return noise.uniform_matrix(noise.key_halves(keys, device), vocab).double()


def choose(
    logits: torch.Tensor, mask_id: int, params, index: int, total_rows: int, sampler
) -> tuple[torch.Tensor, torch.Tensor]:
    """(x0 [n] int64, confidence [n] float32) of the pass's last n = logits.shape[0] rows of a window
    of `total_rows` (the uniforms' rows line up with the window's), for a request's SamplingParams.
    top_k / top_p drop tokens first (the plain sampler's filter, `sampler.filter`, on the tempered
    logits; temperature 1 when greedy): x0 is chosen among the rest and the confidence is renormalised
    over them (as Dream's sampler)."""
    x = logits.float()  # a copy (or a new tensor): the caller's logits stay as they are
    x = x.clone() if x is logits else x
    x[:, mask_id] = float("-inf")
    t = params.temperature
    if params.top_k > 0 or params.top_p < 1:
        p = params if t > 0 else replace(params, temperature=1.0)
        kept = torch.isfinite(sampler.filter(x.clone(), [p] * x.shape[0]))
        x = x.masked_fill(~kept, float("-inf"))
    if t == 0:
        x0 = x.argmax(-1)
    else:
        n, vocab = x.shape
        u = uniforms(params.seed, index, total_rows, vocab, x.device)[total_rows - n :]
        x0 = (x.double() - t * torch.log(-torch.log(u))).argmax(-1)
    conf = x.softmax(-1).gather(1, x0[:, None]).squeeze(1)
    return x0, conf
