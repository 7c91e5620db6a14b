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
import re
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
        audios: list = (),
        add_special_tokens: bool = True,
        pixel_hashes: list[str] | None = None,
    ) -> MultiModalPrompt:
        """`text` with one placeholder per image, per `VideoClip` and per `AudioClip`, in order -> token
        ids with every placeholder expanded, and one item per image, video and audio clip."""
        if images and self.image_token_id is None:
            raise ValueError("this model does not accept images")
        media = {
            "video": (
                self.adapter.video_token_id,
                [self.adapter.video_inputs(v, self.processor) for v in videos],
                videos,
            ),
            "audio": (
                self.adapter.audio_token_id,
                [self.adapter.audio_inputs(a, self.processor) for a in audios],
                audios,
            ),
        }
        media = {k: m for k, m in media.items() if m[2]}
        spans: list[tuple[str, int, int]] = []  # each clip's run of ids: (kind, start, end)
        if media:
            ids, parts, spans = self._around_media(text, images, media, add_special_tokens)
        else:
            ids, parts = self._processed(text, images, add_special_tokens)
        if not images and not media:
            return MultiModalPrompt(ids, [])
        owner: list[str | None] = [None] * len(ids)  # the clip kind whose run holds each position
        for kind, a, b in spans:
            owner[a:b] = [kind] * (b - a)
        items = []
        if images:  # image tokens outside the clips' runs (SmolVLM's frames are image tokens too)
            if len(parts) != len(images):
                raise ValueError(f"{len(images)} images gave {len(parts)} encoder inputs")
            slots = [i for i, t in enumerate(ids) if t == self.image_token_id and owner[i] is None]
            items += _items("image", slots, parts, pixel_hashes or [""] * len(images))
        for kind, (token_id, inputs, clips) in media.items():
            parts, hashes = [], []  # a clip may be encoded as several items (adapter.video_parts)
            for m, clip in zip(inputs, clips):
                split = self.adapter.video_parts(m) if kind == "video" else [m]
                parts += split
                hashes += [clip.content_hash] * len(split)
            slots = [i for i, t in enumerate(ids) if t == token_id and owner[i] == kind]
            items += _items(kind, slots, parts, hashes)
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

    def _around_media(self, text: str, images: list, media: dict, add_special_tokens: bool):
        """Videos and audio are ours to expand (transformers' video processors need torchvision; its
        audio processors expand on their own schedule): the text is cut at each of their placeholders (a
        special token: the tokenizer never merges across it, so the pieces tokenize as the whole does),
        the processor takes each piece with its images, and each placeholder becomes its clip's run."""
        tok = self.processor.tokenizer
        # each kind's placeholder as the rendered prompt writes it: its token, or a family's own text
        text_of = {"video": self.adapter.video_placeholder}
        marks = {
            text_of.get(kind) or tok.convert_ids_to_tokens(token_id): kind
            for kind, (token_id, _, _) in media.items()
        }
        wrapper = self.adapter.video_wrapper
        if (
            wrapper is not None and "video" in media
        ):  # the frames bring their own markers: drop the template's
            start, end = (tok.convert_ids_to_tokens(i) for i in wrapper)
            bare = tok.convert_ids_to_tokens(self.adapter.video_token_id)
            text = text.replace(start + bare + end, bare)
        pieces = re.split("(" + "|".join(re.escape(m) for m in marks) + ")", text)
        runs: list[tuple[str, list[int]]] = []  # each placeholder's kind and token ids, in order
        left_of = {kind: list(inputs) for kind, (_, inputs, _) in media.items()}
        for mark in pieces[1::2]:
            kind = marks[mark]
            if not left_of[kind]:
                raise ValueError(f"the prompt has more {kind} placeholders than {kind} inputs")
            data, n, replaced = left_of[kind].pop(0)
            if replaced is None:
                runs.append((kind, [media[kind][0]] * n))
            else:  # text interleaved with the clip's placeholders (Qwen3-VL's timestamps, SmolVLM's frames)
                runs.append((kind, tok(replaced, add_special_tokens=False)["input_ids"]))
        for kind, rest in left_of.items():
            if rest:
                raise ValueError(
                    f"{len(media[kind][2])} {kind} inputs for {len(media[kind][2]) - len(rest)} placeholders"
                )
        image_text = getattr(self.processor, "image_token", None)
        ids: list[int] = []
        parts: list = []
        spans: list[tuple[str, int, int]] = []
        left = list(images)
        for i, piece in enumerate(pieces[::2]):
            n = piece.count(image_text) if image_text else 0
            if n > len(left):
                raise ValueError(f"the prompt has more image placeholders than the {len(images)} images")
            piece_ids, piece_parts = self._processed(piece, left[:n], add_special_tokens and i == 0)
            left = left[n:]
            ids += piece_ids
            parts += piece_parts
            if i < len(runs):
                kind, run = runs[i]
                spans.append((kind, len(ids), len(ids) + len(run)))
                ids += run
        if left:
            raise ValueError(f"{len(images)} images for {len(images) - len(left)} image placeholders")
        return ids, parts, spans


def _items(modality: str, slots: list[int], parts, hashes: list[str]) -> list[MultiModalItem]:
    """One item per (tensors, number of embeddings, ...) in `parts`, over the embedding positions `slots`
    (this modality's placeholder tokens in the prompt), in order. The content hash covers the decoded
    media's own hash (pixels or frames) and the tensors."""
    need = sum(p[1] for p in parts)
    if len(slots) != need:
        have = f"the prompt has {len(slots)} {modality} placeholder tokens"
        raise ValueError(f"{have} but {len(parts)} {modality}s need {need}")
    items, k = [], 0
    for (data, n, *_), media_hash in zip(parts, hashes):
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
