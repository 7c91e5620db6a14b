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
        videos: list = (),
        add_special_tokens: bool = True,
        pixel_hashes: list[str] | None = None,
    ) -> MultiModalPrompt:
        """`text` with one image placeholder per image and one video placeholder per `VideoClip`, in
        order -> token ids with every placeholder expanded, and one item per image and video."""
        if not videos:
            ids, parts = self._processed(text, images, add_special_tokens)
            clips = []
        else:
            ids, parts, clips = self._around_videos(text, images, list(videos), add_special_tokens)
        if not images and not videos:
            return MultiModalPrompt(ids, [])
        items = []
        if images:
            if len(parts) != len(images):
                raise ValueError(f"{len(images)} images gave {len(parts)} encoder inputs")
            items += _items("image", ids, self.image_token_id, parts, pixel_hashes or [""] * len(images))
        if clips:
            items += _items(
                "video", ids, self.adapter.video_token_id, clips, [v.content_hash for v in videos]
            )
        items.sort(key=lambda it: it.offset)
        prompt = MultiModalPrompt(ids, items)
        prompt.rope = self.adapter.rope(ids, items)
        return prompt

    def _processed(self, text: str, images: list, add_special_tokens: bool) -> tuple[list[int], list]:
        """The processor on `text` and its images: token ids (image placeholders expanded) and one
        (tensors, number of embeddings) per image."""
        kwargs: dict[str, Any] = {"return_tensors": "pt", "add_special_tokens": add_special_tokens}
        if images:
            kwargs["images"] = self.adapter.processor_images(images)
        try:
            out = self.processor(text=[text], **kwargs)
        except (ValueError, TypeError, IndexError) as e:
            raise ValueError(f"the model's processor rejected the input: {e}") from e
        return out["input_ids"][0].tolist(), (self.adapter.split(out) if images else [])

    def _around_videos(self, text: str, images: list, videos: list, add_special_tokens: bool):
        """Videos are ours to process (transformers' video processors need torchvision): the text is cut
        at each video placeholder (a special token: the tokenizer never merges across it, so the pieces
        tokenize as the whole does), the processor takes each piece with its images, and each
        placeholder becomes its video's run of tokens."""
        tok = self.processor.tokenizer
        token = tok.convert_ids_to_tokens(self.adapter.video_token_id)
        pieces = text.split(token)
        if len(pieces) - 1 != len(videos):
            raise ValueError(f"the prompt has {len(pieces) - 1} video placeholders for {len(videos)} videos")
        clips = [self.adapter.video_inputs(v) for v in videos]
        image_text = getattr(self.processor, "image_token", None)
        ids: list[int] = []
        parts: list = []
        left = list(images)
        for i, piece in enumerate(pieces):
            n = piece.count(image_text) if image_text else 0
            if n > len(left):
                raise ValueError(f"the prompt has more image placeholders than the {len(images)} images")
            piece_ids, piece_parts = self._processed(piece, left[:n], add_special_tokens and i == 0)
            left = left[n:]
            ids += piece_ids
            parts += piece_parts
            if i < len(clips):
                ids += [self.adapter.video_token_id] * clips[i][1]
        if left:
            raise ValueError(f"{len(images)} images for {len(images) - len(left)} image placeholders")
        return ids, parts, clips


def _items(modality: str, ids: list[int], token_id: int, parts, hashes: list[str]) -> list[MultiModalItem]:
    """One item per (tensors, number of embeddings) in `parts`, over the runs of `token_id` in `ids`,
    in order. The content hash covers the decoded media's own hash (pixels or frames) and the tensors."""
    slots = [i for i, t in enumerate(ids) if t == token_id]
    need = sum(n for _, n in parts)
    if len(slots) != need:
        have = f"the prompt has {len(slots)} {modality} placeholder tokens"
        raise ValueError(f"{have} but {len(parts)} {modality}s need {need}")
    items, k = [], 0
    for (data, n), media_hash in zip(parts, hashes):
        pos = slots[k : k + n]
        k += n
        first, last = pos[0], pos[-1]
        index = None
        if last - first + 1 != n:  # text tokens interleaved in the span (Idefics3 row/col markers)
            index = torch.full((last - first + 1,), -1, dtype=torch.long)
            index[torch.tensor(pos) - first] = torch.arange(n)
        h = hashlib.sha256(media_hash.encode())
        for key in sorted(data):
            if isinstance(data[key], torch.Tensor):
                h.update(key.encode())
                tensor_digest(h, data[key])
        items.append(MultiModalItem(modality, first, last - first + 1, n, h.hexdigest(), data, index))
    return items
