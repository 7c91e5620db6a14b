"""Request-side image processing: the model's own transformers processor expands image placeholders
and turns images into encoder inputs; the family adapter splits that into one item per image with its
placeholder span and content hash. Runs in the caller's thread (the server uses a thread pool), never
on the model thread.

The content hash covers the decoded pixels (the server's media loader hashes them) and the processor
output, never the URL: the same picture
sent twice (any encoding) hits the vision cache, and the prefix cache can tell two images apart even
though their placeholder tokens are identical.
"""

from __future__ import annotations

import hashlib
import logging
from typing import Any

import torch

from foveal.request import MultiModalItem, MultiModalPrompt

log = logging.getLogger(__name__)


def tensor_digest(h, t: torch.Tensor) -> None:
    t = t.detach().contiguous().cpu()
    h.update(f"{t.dtype}{tuple(t.shape)}".encode())
    h.update(t.view(torch.uint8).numpy().tobytes() if t.numel() else b"")


class MultiModalProcessor:
    def __init__(self, processor, adapter):
        self.processor = processor
        self.adapter = adapter
        self.image_token_id = adapter.image_token_id

    def render_chat(self, messages: list[dict], add_generation_prompt: bool = True, **template_kwargs) -> str:
        """Chat messages whose content parts may include {"type": "image"} -> the prompt text.

        The processor's template is rendered by the tokenizer: some processors' own apply_chat_template
        reaches for their video half (SmolVLM), which an image-only processor does not have."""
        tok = self.processor.tokenizer
        template = (
            template_kwargs.pop("chat_template", None)  # a request's own (when the server trusts those)
            or getattr(self.processor, "chat_template", None)
            or getattr(tok, "chat_template", None)
        )
        if not template:
            raise ValueError("this model has no chat template; use a plain prompt")
        return tok.apply_chat_template(
            messages,
            chat_template=template,
            tokenize=False,
            add_generation_prompt=add_generation_prompt,
            **template_kwargs,
        )

    def process(
        self,
        text: str,
        images: list,
        *,
        add_special_tokens: bool = True,
        pixel_hashes: list[str] | None = None,
    ) -> MultiModalPrompt:
        kwargs: dict[str, Any] = {"return_tensors": "pt", "add_special_tokens": add_special_tokens}
        if images:
            kwargs["images"] = self.adapter.processor_images(images)
        try:
            out = self.processor(text=[text], **kwargs)
        except (ValueError, TypeError, IndexError) as e:
            raise ValueError(f"the model's processor rejected the input: {e}") from e
        ids = out["input_ids"][0].tolist()
        if not images:
            return MultiModalPrompt(ids, [])
        parts = self.adapter.split(out)
        if len(parts) != len(images):
            raise ValueError(f"{len(images)} images gave {len(parts)} encoder inputs")
        slots = [i for i, t in enumerate(ids) if t == self.image_token_id]
        need = sum(n for _, n in parts)
        if len(slots) != need:
            raise ValueError(
                f"the prompt has {len(slots)} image placeholder tokens but {len(images)} images need {need}"
            )
        items = []
        k = 0
        hashes = pixel_hashes or [""] * len(images)  # the processor output alone identifies the pixels too
        for (data, n), ph in zip(parts, hashes):
            pos = slots[k : k + n]
            k += n
            first, last = pos[0], pos[-1]
            index = None
            if last - first + 1 != n:  # text tokens interleaved in the span (Idefics3 row/col markers)
                index = torch.full((last - first + 1,), -1, dtype=torch.long)
                index[torch.tensor(pos) - first] = torch.arange(n)
            h = hashlib.sha256(ph.encode())
            for key in sorted(data):
                if isinstance(data[key], torch.Tensor):
                    h.update(key.encode())
                    tensor_digest(h, data[key])
            items.append(MultiModalItem("image", first, last - first + 1, n, h.hexdigest(), data, index))
        prompt = MultiModalPrompt(ids, items)
        prompt.rope = self.adapter.rope(ids, items)
        return prompt
