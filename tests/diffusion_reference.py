"""Reference samplers for diffusion LMs, written from the published algorithms: plain, slow, full-sequence
code on a transformers model (tests/diffusion_models.py `hf_model`), to compare Foveal's engine with.
Nothing here imports Foveal.

    llada_generate   LLaDA's generate() (ML-GSAI/LLaDA generate.py): masked diffusion, low-confidence
                     remasking, semi-autoregressive blocks, no classifier-free guidance
    block_generate   SDAR-style block diffusion (JetAstra/SDAR generate.py block_diffusion_generate, with
                     greedy / Gumbel choice instead of its always-multinomial one) and Fast-dLLM's
                     threshold rule (NVlabs/Fast-dLLM, parallel decoding: every masked position above
                     the threshold, at least the most confident one)

Every denoising forward re-runs the whole sequence with the model's attention mask as a 4-D additive
float mask (transformers uses a 4-D mask as given):

    LLaDA  [prompt | canvas], every token sees every token
    block  [prompt | committed blocks | current block], q sees k iff q // bs >= k // bs (absolute
           positions); no KV cache: the prefix is recomputed each forward, committed blocks never change

Shared rules, the same in both samplers (a sampler under test must follow them):

  * choice per position, from that position's own logits row (no shift):
      the mask token is never chosen: its logit is set to -inf first (a deviation from the published
          code, where a random-weight model could "unmask" a position to MASK and leave the block
          unfinished; a trained model gives the mask token ~0 probability, so nothing else changes)
      temperature 0:  x0 = argmax(logits)
      temperature T:  x0 = argmax(float64(logits) - T * log(-log U)) (Gumbel-max, a draw from
                      softmax(logits / T); LLaDA writes it argmax(exp(l) / (-log U)^T))
      confidence = softmax(float32 logits)[x0] (the untempered probability, as LLaDA)
  * U comes from the caller: `uniforms(step_index, shape)` returns a float64 tensor of `shape` with
    values in [0, 1). step_index counts the request's denoising forwards from 0 (every forward that
    chooses tokens; the references run no other). Rows line up with positions:
      llada_generate  shape (gen_length, vocab): row i is canvas position i (sequence position P + i)
      block_generate  shape (block_size, vocab): row j is position j of the current block (its first
                      rows are the prompt's tail in the first block; those rows are unused)
    Temperature 0 never calls it.
  * "the k most confident" masked positions: by confidence, descending, ties to the earlier position
    (a stable sort; torch.topk's tie order is unspecified).
  * transfer schedule of m masks over s steps: m // s per step, the remainder one more to the FIRST
    steps (LLaDA's get_num_transfer_tokens): num_transfer_tokens(10, 4) == [3, 3, 2, 2].
  * a prompt must not contain the mask token (ValueError).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

Uniforms = Callable[[int, tuple[int, int]], torch.Tensor]

STRATEGIES = ("low_confidence_static", "low_confidence_dynamic", "threshold")


def num_transfer_tokens(num_masks: int, steps: int) -> list[int]:
    """How many masked positions each of `steps` steps unmasks: the remainder goes to the first steps."""
    base, rem = divmod(num_masks, steps)
    return [base + 1 if i < rem else base for i in range(steps)]


def full_mask(n: int) -> torch.Tensor:
    """[n, n] bool (query, key): every token sees every token (LLaDA)."""
    return torch.ones(n, n, dtype=torch.bool)


def block_causal_mask(n: int, block_size: int) -> torch.Tensor:
    """[n, n] bool (query, key): q sees k iff q // block_size >= k // block_size (SDAR)."""
    blocks = torch.arange(n) // block_size
    return blocks[:, None] >= blocks[None, :]


def forward_logits(hf, ids: Sequence[int], allowed: torch.Tensor) -> torch.Tensor:
    """float32 logits [n, vocab] of one sequence under the attention rule `allowed` [n, n] (True =
    attend), given to transformers as a 4-D additive mask: 0 where allowed, finfo.min elsewhere."""
    bias = torch.zeros(allowed.shape, dtype=torch.float32).masked_fill(
        ~allowed, torch.finfo(torch.float32).min
    )
    with torch.no_grad():
        out = hf(
            input_ids=torch.tensor([list(ids)]),
            attention_mask=bias[None, None],
            position_ids=torch.arange(len(ids))[None],
        )
    return out.logits[0].float()


def keep_filtered(logits: torch.Tensor, temperature: float, top_k: int, top_p: float) -> torch.Tensor:
    """Bool [n, vocab]: the tokens top_k (the k largest logits) and then top_p (the most probable ones
    of softmax(logits / T), T = 1 when greedy, until their sum reaches top_p; the first always) keep."""
    keep = torch.isfinite(logits)
    for i in range(logits.shape[0]):
        row = logits[i].clone()
        if 0 < top_k < row.numel():
            kth = row.sort(descending=True).values[top_k - 1]
            keep[i] &= row >= kth
        if top_p < 1:
            row = row.masked_fill(~keep[i], float("-inf")) / (temperature if temperature > 0 else 1.0)
            probs = row.softmax(-1)
            order = probs.argsort(descending=True, stable=True)
            before = 0.0
            for j in order.tolist():
                if not keep[i, j]:
                    continue
                if before >= top_p:
                    keep[i, j] = False
                before += float(probs[j])
    return keep


def choose(
    logits: torch.Tensor,
    mask_id: int,
    temperature: float,
    u: torch.Tensor | None,
    top_k: int = 0,
    top_p: float = 1.0,
) -> tuple[list[int], list[float]]:
    """(x0, confidence) per row of `logits` [n, vocab] (the module docstring's rule); `u` [n, vocab]
    float64 when temperature > 0. top_k / top_p drop tokens first (keep_filtered): x0 is chosen among
    the rest and the confidence is renormalised over them."""
    logits = logits.float().clone()
    logits[:, mask_id] = float("-inf")
    if top_k > 0 or top_p < 1:
        logits = logits.masked_fill(~keep_filtered(logits, temperature, top_k, top_p), float("-inf"))
    if temperature == 0:
        x0 = logits.argmax(-1)
    else:
        assert u is not None and u.shape == logits.shape and u.dtype == torch.float64, "bad uniforms"
        x0 = (logits.double() - temperature * torch.log(-torch.log(u))).argmax(-1)
    conf = torch.softmax(logits, dim=-1).gather(1, x0[:, None])[:, 0]
    return x0.tolist(), conf.tolist()


def most_confident(candidates: Sequence[int], conf: Sequence[float], k: int) -> list[int]:
    """The k most confident of `candidates` (indices into conf); ties to the earlier index."""
    ranked = sorted(candidates, key=lambda i: -conf[i])  # sorted() is stable: equal ones keep order
    return ranked[:k]


def _check_prompt(prompt: Sequence[int], mask_id: int) -> None:
    if mask_id in prompt:
        raise ValueError("the prompt contains the mask token")
    if not prompt:
        raise ValueError("the prompt is empty")


def llada_generate(
    hf,
    prompt: Sequence[int],
    *,
    steps: int,
    gen_length: int,
    block_length: int,
    temperature: float = 0.0,
    mask_id: int,
    uniforms: Uniforms | None = None,
    top_k: int = 0,
    top_p: float = 1.0,
) -> list[int]:
    """LLaDA's generate() with remasking 'low_confidence' and cfg_scale 0. Returns the gen_length
    generated ids (canvas positions P .. P + gen_length - 1), not cut at EOS.

    x = [prompt | MASK * gen_length]; the canvas is split into gen_length / block_length blocks, and
    `steps` (the total) into steps / num_blocks steps per block. For block b (positions [lo, hi)):
    ntt = num_transfer_tokens(#masks in the block, steps per block); then for each step i of the block
    (always all of them, even when ntt[i] == 0, as LLaDA does; step_index = b * steps_per_block + i):
    one bidirectional forward of the whole x; x0 and confidence for every canvas position; of the
    masked positions before hi (later blocks are excluded; earlier ones have none left) the ntt[i] most
    confident take their x0. Every block ends with no mask (the ntt sum to its masks)."""
    _check_prompt(prompt, mask_id)
    if gen_length <= 0 or block_length <= 0 or gen_length % block_length:
        raise ValueError("gen_length must be a positive multiple of block_length")
    num_blocks = gen_length // block_length
    if steps <= 0 or steps % num_blocks:
        raise ValueError("steps must be a positive multiple of the number of blocks")
    steps_per_block = steps // num_blocks
    if temperature > 0 and uniforms is None:
        raise ValueError("temperature > 0 needs uniforms")
    p = len(prompt)
    x = list(prompt) + [mask_id] * gen_length
    step_index = 0
    for b in range(num_blocks):
        lo, hi = p + b * block_length, p + (b + 1) * block_length
        ntt = num_transfer_tokens(sum(t == mask_id for t in x[lo:hi]), steps_per_block)
        for i in range(steps_per_block):
            logits = forward_logits(hf, x, full_mask(len(x)))[p:]  # canvas rows
            u = None
            if temperature > 0:
                u = uniforms(step_index, (gen_length, logits.shape[1]))
            step_index += 1
            x0, conf = choose(logits, mask_id, temperature, u, top_k, top_p)
            masked = [j for j in range(hi - p) if x[p + j] == mask_id]  # canvas indices before hi
            for j in most_confident(masked, conf, ntt[i]):
                x[p + j] = x0[j]
        assert mask_id not in x[lo:hi], "a block kept a mask after its last step"
    return x[p:]


def block_generate(
    hf,
    prompt: Sequence[int],
    *,
    block_size: int,
    gen_length: int,
    mask_id: int,
    steps_per_block: int | None,
    strategy: str,
    threshold: float = 0.9,
    temperature: float = 0.0,
    uniforms: Uniforms | None = None,
    stop_ids: Sequence[int] = (),
    top_k: int = 0,
    top_p: float = 1.0,
    editing_threshold: float | None = None,
    stability_steps: int = 2,
    max_post_steps: int = 16,
) -> list[int]:
    """Block diffusion (SDAR; Fast-dLLM's threshold rule), the model's block-causal mask over the whole
    sequence, no KV cache.

    Blocks are the absolute ranges [k * bs, (k + 1) * bs). The first one generated starts at
    floor(P / bs) * bs: the prompt's last P % bs tokens are fixed members of it (never candidates), the
    rest of it is masks; every later block is bs masks. A block is denoised until it has no mask, each
    forward covering the prefix and the block (positions [0, block end)) and choosing tokens for the
    block's rows. Which masked positions take their x0 in a forward (ntt = num_transfer_tokens(the
    block's masks when it starts, steps_per_block), s = the block's forward count so far):

      low_confidence_static   the min(ntt[s], #masks) most confident
      low_confidence_dynamic  every masked one with confidence > threshold if there are >= ntt[s] of
                              them, else the min(ntt[s], #masks) most confident
      threshold               every masked one with confidence > threshold, and always the most
                              confident one (steps_per_block is ignored; as many forwards as it takes;
                              threshold 1.0 gives exactly one token per forward)

    With `editing_threshold` e (mlx-vlm's editing), each forward also rewrites the block's positions
    unmasked in earlier forwards (not the prompt's tail) whose x0 differs with confidence > e, and a
    block with no mask left gets more forwards until `stability_steps` in a row change nothing or
    `max_post_steps` forwards have run since its last mask went.

    Blocks are generated while fewer than gen_length tokens have been generated (generated = positions
    P onward; the first block generates bs - P % bs of them), and no more after the first block whose
    generated positions hold a stop id.

    Returns: x[P:] of the final sequence (every generated position of those blocks, in order), cut to
    its first gen_length tokens, then cut after the first stop id (kept) if one is left in it."""
    _check_prompt(prompt, mask_id)
    if strategy not in STRATEGIES:
        raise ValueError(f"unknown strategy {strategy!r}")
    if strategy != "threshold" and (steps_per_block is None or steps_per_block <= 0):
        raise ValueError(f"{strategy} needs steps_per_block >= 1")
    if block_size <= 0 or gen_length <= 0:
        raise ValueError("block_size and gen_length must be positive")
    if temperature > 0 and uniforms is None:
        raise ValueError("temperature > 0 needs uniforms")
    p, bs = len(prompt), block_size
    x = list(prompt)
    start = p // bs * bs
    generated, step_index = 0, 0
    while generated < gen_length:
        end = start + bs
        x += [mask_id] * (end - len(x))
        masks0 = sum(t == mask_id for t in x[start:end])
        ntt = num_transfer_tokens(masks0, steps_per_block) if strategy != "threshold" else None
        s = post = stable = 0
        fixed = max(0, p - start)  # the prompt's tail: never a candidate, never edited
        while mask_id in x[start:end] or (
            editing_threshold is not None and stable < stability_steps and post < max_post_steps
        ):
            had_mask = mask_id in x[start:end]
            logits = forward_logits(hf, x[:end], block_causal_mask(end, bs))[start:end]
            u = None
            if temperature > 0:
                u = uniforms(step_index, (bs, logits.shape[1]))
            step_index += 1
            x0, conf = choose(logits, mask_id, temperature, u, top_k, top_p)
            masked = [j for j in range(bs) if x[start + j] == mask_id]
            edits = []
            if editing_threshold is not None:  # earlier unmasked positions whose token would change
                edits = [
                    j for j in range(fixed, bs)
                    if x[start + j] != mask_id and x0[j] != x[start + j] and conf[j] > editing_threshold
                ]  # fmt: skip
            if not masked:
                chosen = set()
            elif strategy == "threshold":
                chosen = set(most_confident(masked, conf, 1))
                chosen |= {j for j in masked if conf[j] > threshold}
            else:
                assert s < len(ntt), "a block kept masks after its last scheduled step"
                k = min(ntt[s], len(masked))
                over = [j for j in masked if conf[j] > threshold]
                if strategy == "low_confidence_dynamic" and len(over) >= ntt[s]:
                    chosen = set(over)
                else:
                    chosen = set(most_confident(masked, conf, k))
            for j in list(chosen) + edits:
                x[start + j] = x0[j]
            s += 1
            if editing_threshold is not None and mask_id not in x[start:end]:
                post += not had_mask
                stable = 0 if chosen or edits else stable + 1
        new = x[max(start, p) : end]
        generated += len(new)
        start = end
        if any(t in stop_ids for t in new):
            break
    out = x[p:][:gen_length]
    for i, t in enumerate(out):
        if t in stop_ids:
            return out[: i + 1]
    return out
