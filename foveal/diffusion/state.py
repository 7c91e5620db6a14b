"""One diffusion request's canvas on the host, and what a denoising step does with it.

A diffusion model fills a canvas of MASK tokens over several forward passes instead of appending one
token per pass. Each pass (one engine step) gives, for every position of the window it computed, the
token the model picks there (x0) and its probability (the confidence); this module decides which
masked positions take their token now, and when tokens are final.

    masked (LLaDA)  every token sees every token: the window is prompt + the whole canvas, recomputed
                    each step (no K/V kept). The canvas is filled in semi-autoregressive blocks of
                    `block_length` generated tokens, left to right; a block's tokens are final when it
                    has no mask left (positions of later blocks are never picked before that).
    block (SDAR)    causal across blocks of `block_size` positions, both ways inside one: committed
                    blocks keep their K/V (and the prefix cache), the window is the current block. The
                    first block starts at the prompt's last block boundary, so it holds the prompt's
                    tail tokens (fixed) before its masks. A finished block is committed by one more pass
                    that writes its K/V.

Which masked positions of the active block take their token in a step (k = the step's count in the
block's schedule: the block's masks spread over `steps` steps, the remainder to the first ones):

    threshold None        the k most confident (LLaDA's low-confidence remasking; SDAR's static rule)
    threshold t, steps s  every one with confidence > t, or the k most confident if fewer pass (SDAR's
                          dynamic rule)
    threshold t, no steps every one with confidence > t, and at least the most confident one
                          (Fast-dLLM's parallel decoding: as many steps as it takes)

and then mlx-vlm's extras: `min_threshold` lowers the threshold linearly over the block's scheduled
steps (from t at the first to the minimum at the last), `max_tokens_per_step` keeps at most that many
of a pass's positions (the most confident; a block it holds back runs past its schedule, one position
per pass at least), and editing: with `editing_threshold` e, a generated position unmasked in an
earlier pass takes the pass's token where it differs with confidence > e (the prompt's tail never),
and a block with no mask left goes on until `stability_steps` passes in a row change nothing or
`max_post_steps` passes have run past its last mask.

The schedule splits the masks the block has when it starts (for the first block of a block model, the
positions after the prompt's tail); SDAR's own generate() splits the block length instead. Ties in
confidence go to the earlier position.
"""

from __future__ import annotations

from dataclasses import dataclass

from foveal.request import InvalidParameter

DEFAULT_BLOCK_LENGTH = 32  # a masked model's semi-autoregressive block when the request names none


@dataclass(frozen=True, slots=True)
class DiffusionParams:
    """A request's denoising knobs (None: the server's default, then the rule above)."""

    steps: int | None = None  # denoising steps per block (None: one token per step, or the threshold's)
    block_length: int | None = None  # masked models: generated tokens per semi-autoregressive block
    threshold: float | None = None  # confidence threshold for parallel unmasking (see the module doc)
    # the threshold falls linearly to this over the block's steps (mlx-vlm's minimum threshold)
    min_threshold: float | None = None
    max_tokens_per_step: int | None = None  # at most this many positions unmasked per pass
    # mlx-vlm's editing: a position unmasked earlier takes the pass's token when it differs and its
    # confidence passes this; a block with no mask left then ends after `stability_steps` passes in a
    # row that change nothing, or after `max_post_steps` passes past its last mask
    editing_threshold: float | None = None
    stability_steps: int | None = None  # (default 2)
    max_post_steps: int | None = None  # (default 16)

    def __post_init__(self) -> None:
        if self.steps is not None and (not _is_int(self.steps) or self.steps < 1):
            raise InvalidParameter(
                "steps", f"invalid diffusion parameter steps={self.steps!r}: an integer >= 1"
            )
        if self.block_length is not None and (not _is_int(self.block_length) or self.block_length < 1):
            raise InvalidParameter(
                "block_length",
                f"invalid diffusion parameter block_length={self.block_length!r}: an integer >= 1",
            )
        for name in ("stability_steps", "max_post_steps"):
            v = getattr(self, name)
            if v is not None and (not _is_int(v) or v < (1 if name == "stability_steps" else 0)):
                raise InvalidParameter(name, f"invalid diffusion parameter {name}={v!r}: a count of passes")
            if v is not None and self.editing_threshold is None:
                raise InvalidParameter(
                    name, f"invalid diffusion parameter {name}: it needs editing_threshold"
                )
        for name in ("threshold", "min_threshold", "editing_threshold"):
            t = getattr(self, name)
            if t is not None and (
                isinstance(t, bool) or not isinstance(t, (int, float)) or not 0.0 <= t <= 1.0
            ):
                raise InvalidParameter(name, f"invalid diffusion parameter {name}={t!r}: in [0, 1]")
        if self.min_threshold is not None and (self.threshold is None or self.min_threshold > self.threshold):
            raise InvalidParameter(
                "min_threshold", "invalid diffusion parameter min_threshold: needs a threshold >= it"
            )
        m = self.max_tokens_per_step
        if m is not None and (not _is_int(m) or m < 1):
            raise InvalidParameter(
                "max_tokens_per_step",
                f"invalid diffusion parameter max_tokens_per_step={m!r}: an integer >= 1",
            )


def transfer_schedule(num_masks: int, steps: int) -> list[int]:
    """How many positions each of `steps` steps unmasks: num_masks // steps each, the remainder one
    more to the first steps."""
    base, rem = divmod(num_masks, steps)
    return [base + (i < rem) for i in range(steps)]


def pick(
    conf: list[float],
    masked: list[bool],
    k: int,
    threshold: float | None,
    at_least: int,
    cap: int | None = None,
) -> list[int]:
    """The positions to unmask: with a threshold every masked one above it, topped up to `at_least` by
    confidence; without one the `k` most confident; then at most `cap` of them, the most confident.
    Only masked positions, never more than there are."""
    cands = sorted((i for i, m in enumerate(masked) if m), key=lambda i: -conf[i])  # stable: earlier first
    if threshold is None:
        chosen = cands[: min(k, len(cands))]
    else:
        chosen = [i for i in cands if conf[i] > threshold]
        if len(chosen) < at_least:
            chosen = cands[: min(at_least, len(cands))]
    return sorted(chosen[:cap] if cap else chosen)


class DiffusionState:
    """The host side of one diffusion request (owned by the scheduler, like the request itself)."""

    def __init__(
        self,
        kind: str,
        mask_id: int,
        prompt: list[int],
        max_tokens: int,
        params: DiffusionParams,
        block_size: int,
    ):
        self.kind, self.mask_id = kind, mask_id
        self.steps, self.threshold = params.steps, params.threshold
        self.min_threshold, self.cap = params.min_threshold, params.max_tokens_per_step
        self.editing = params.editing_threshold
        self.stability_steps = params.stability_steps or 2
        self.max_post_steps = 16 if params.max_post_steps is None else params.max_post_steps
        self.step_index = 0  # denoising passes so far (the noise stream of sampled requests)
        self.canvas_len = max_tokens  # generated tokens wanted
        self.done = 0  # generated tokens final (handed out)
        self.commit_pending = False  # block kind: the window is final, its K/V to be written next
        # block kind: keep no K/V and compute the whole prefix in every pass (LLaDA2's reference
        # sampler does; benchmarks/diffusion.py measures the block cache against it)
        self.recompute_prefix = False
        if kind == "block":
            self.block = block_size  # the attention block: each window is one (the last may run past
            self.window_start = len(prompt) // block_size * block_size  # max_tokens: cut by the caller)
            self.fixed = len(prompt) - self.window_start  # the prompt's tail in the first window
            self._new_window(list(prompt[self.window_start :]))
        elif kind == "masked":
            self.block = params.block_length or min(DEFAULT_BLOCK_LENGTH, max_tokens)
            self.window_start = self.fixed = 0
            self.canvas = [mask_id] * max_tokens
            self._start_block()
        else:
            raise ValueError(f"unknown diffusion kind {kind!r}")

    # -- the window the next step computes ---------------------------------------------------------
    def _new_window(self, prompt_tail: list[int]) -> None:
        """Block kind: the next window, the prompt's tail (first window only) then masks."""
        self.canvas = prompt_tail + [self.mask_id] * (self.block - len(prompt_tail))
        self._start_block()

    def _start_block(self) -> None:
        lo, hi = self.active
        masks = sum(1 for t in self.canvas[lo:hi] if t == self.mask_id)
        self.block_step = 0
        self.post = self.stable = 0  # editing: passes past the block's last mask; unchanged in a row
        self.schedule = transfer_schedule(masks, self.steps or max(masks, 1))

    @property
    def active(self) -> tuple[int, int]:
        """The canvas indices the current block spans."""
        if self.kind == "block":
            return 0, len(self.canvas)
        lo = self.done
        return lo, min(lo + self.block, self.canvas_len)

    # -- one step's results ------------------------------------------------------------------------
    def observe(self, x0: list[int], conf: list[float]) -> list[int]:
        """Apply one denoising pass over the active block's window rows (x0, conf aligned with the
        canvas from index `active[0]` on). Returns the generated tokens that became final."""
        self.step_index += 1
        lo, hi = self.active
        block = self.canvas[lo:hi]
        masked = [t == self.mask_id for t in block]
        s = self.block_step
        # past its schedule (a cap held it back) a block goes on one position per pass at least
        k = self.schedule[s] if s < len(self.schedule) else 1
        at_least = k if self.steps else 1
        edits = []
        if self.editing is not None:  # earlier unmasked generated positions the pass would change
            first = self.fixed if self.kind == "block" else 0
            edits = [
                i
                for i in range(first, hi - lo)
                if not masked[i] and x0[i] != block[i] and conf[i] > self.editing
            ]
        picked = (
            pick(conf[: hi - lo], masked, k, self._threshold_now(), at_least, self.cap) if any(masked) else []
        )
        for i in edits + picked:
            self.canvas[lo + i] = x0[i]
        self.block_step += 1
        if any(t == self.mask_id for t in self.canvas[lo:hi]):
            return []
        if self.editing is not None:  # a filled block may still change: it ends once it holds still
            self.post += not any(masked)
            self.stable = 0 if edits or picked else self.stable + 1
            if self.stable < self.stability_steps and self.post < self.max_post_steps:
                return []
        return self._finish_block()

    def _threshold_now(self) -> float | None:
        """The threshold of this pass: with a minimum, falling linearly from the threshold at the block's
        first pass to the minimum at its last scheduled one (mlx-vlm's rule), then staying there."""
        t, m = self.threshold, self.min_threshold
        if t is None or m is None:
            return t
        span = max(len(self.schedule) - 1, 1)
        return t - (t - m) * min(self.block_step, span) / span

    def _finish_block(self) -> list[int]:
        lo, hi = self.active
        if self.kind == "masked":
            # LLaDA runs every scheduled step of a block; the ones left would unmask nothing: skipped,
            # they still count in the noise stream (so a sampled request draws what LLaDA's would)
            self.step_index += max(len(self.schedule) - self.block_step, 0) if self.steps else 0
            out = self.canvas[lo:hi]
            self.done = hi
            if self.done < self.canvas_len:
                self._start_block()
            return out
        out = self.canvas[self.fixed :]
        self.done += len(out)
        self.commit_pending = True
        return out

    def committed(self) -> None:
        """Block kind: the window's K/V was written; the next window starts after it."""
        self.window_start += len(self.canvas)
        self.fixed = 0
        self.commit_pending = False
        if self.done < self.canvas_len:
            self._new_window([])

    @property
    def runner_view(self) -> tuple[str, int, int]:
        """What the runner needs (NewRequest.diffusion): (kind, attention block or 0, mask token)."""
        return (self.kind, self.block if self.kind == "block" else 0, self.mask_id)

    @property
    def finished(self) -> bool:
        return self.done >= self.canvas_len


def _is_int(x: object) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def new_diffusion_state(info, req) -> DiffusionState:
    """The canvas of an admitted request of the model `info` (a DiffusionInfo) describes."""
    params = req.params.diffusion or DiffusionParams()
    return DiffusionState(
        info.kind,
        info.mask_token_id,
        list(req.prompt_token_ids),
        req.params.max_tokens,
        params,
        info.block_size,
    )
