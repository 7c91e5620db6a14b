"""What a diffusion LM's config says about how it is decoded: which attention its canvas needs and
which token id marks a position still to be decoded. The model classes are ordinary decoders
(foveal/models/llama.py); everything diffusion-specific about a checkpoint is read here.

    masked (LLaDA):  every token sees every token of the sequence (prompt and canvas alike)
    block  (SDAR):   query q sees key k iff q // block_size >= k // block_size (absolute positions):
                     causal across blocks, bidirectional inside one, so committed blocks' K/V are final
"""

from __future__ import annotations

from dataclasses import dataclass

# architecture -> kind; the published families (see the models registry)
DIFFUSION_ARCHITECTURES = {"LLaDAModelLM": "masked", "SDARForCausalLM": "block"}
DEFAULT_BLOCK_SIZE = 4  # SDAR's published block (its 8..64 variants set block_size)


@dataclass(frozen=True, slots=True)
class DiffusionInfo:
    kind: str  # "masked": every token sees every token (LLaDA); "block": block-causal (SDAR)
    mask_token_id: int
    block_size: int = 0  # "block": the attention block (positions p // block_size)


def diffusion_info(hf_config) -> DiffusionInfo | None:
    """The diffusion facts of a (possibly remapped: see safetensors_loader.llada_config) transformers
    config; None for an autoregressive model. A diffusion config without a usable mask token, or a block
    model with a bad block_size, is a ValueError that names the problem."""
    archs = list(getattr(hf_config, "architectures", None) or [])
    kind = DIFFUSION_ARCHITECTURES.get(archs[0]) if archs else None
    if kind is None:
        return None
    arch = archs[0]
    mask = getattr(hf_config, "mask_token_id", None)
    if mask is None:
        raise ValueError(f"{arch} is a diffusion model but its config has no mask_token_id")
    vocab = getattr(hf_config, "vocab_size", None)
    if isinstance(mask, bool) or not isinstance(mask, int) or mask < 0 or (vocab and mask >= vocab):
        raise ValueError(f"{arch}: mask_token_id {mask!r} is not a token id of its vocabulary ({vocab})")
    if kind == "masked":
        return DiffusionInfo(kind, mask)
    block = getattr(hf_config, "block_size", None)
    block = DEFAULT_BLOCK_SIZE if block is None else block
    if isinstance(block, bool) or not isinstance(block, int) or block < 1:
        raise ValueError(f"{arch}: block_size {block!r} is not a positive integer")
    return DiffusionInfo(kind, mask, block)
