"""The offline API: `LLM(model=...).generate(prompts, SamplingParams(...))`, `LLM.chat(messages)` and
`LLM.stream(...)`. A thin driver: prompts go through the InputProcessor, then Engine.step() runs them;
no scheduling logic of its own.

Images (vision-language models): chat message parts `{"type": "image", "image": <PIL.Image>}`, or a
prompt made with `llm.processor.render_prompt(text, images=[...])`. Videos (Qwen2-VL, Qwen2.5-VL): parts
`{"type": "video", "video": VideoClip(frames, fps)}` (foveal.request.VideoClip: uint8 [T, H, W, 3] frames
already sampled, at `fps` frames a second). Audio (Qwen2-Audio): `{"type": "audio", "audio":
AudioClip(samples, sampling_rate)}` (mono float32 at the model's rate, `processor.audio_sampling_rate`).

LoRA adapters: `LLM(model, enable_lora=True)`, then `generate(prompts, params,
lora_request=LoRARequest("sql", "/path/to/adapter"))` (one for all prompts, or a list, one per prompt;
None for the base model). An adapter is registered at its first use.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field, replace

from foveal.config import EngineConfig
from foveal.engine.factory import build_engine, freeze_startup_heap
from foveal.request import (
    FinishReason,
    MultiModalPrompt,
    SamplingParams,
    TokenDelta,
    TokenLogprobs,
    new_request_id,
)


@dataclass(slots=True)
class CompletionOutput:
    index: int
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprobs] | None = None
    finish_reason: FinishReason | None = None
    stop_reason: str | int | None = None
    error: str | None = None


@dataclass(slots=True)
class RequestOutput:
    request_id: str
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]


PromptLike = str | list[int] | MultiModalPrompt


class LoRARequest:
    """An adapter for a prompt: `LoRARequest(name, path)`, or vLLM's `LoRARequest(name, int_id, path)`
    (the int id is not needed here: adapters are told apart by name)."""

    __slots__ = ("lora_name", "lora_path")

    def __init__(self, lora_name: str, *args, lora_path: str | None = None, lora_int_id: int | None = None):
        if lora_path is None:
            if len(args) == 1:
                lora_path = args[0]
            elif len(args) == 2:
                lora_path = args[1]
        if not isinstance(lora_path, str) or not lora_name:
            raise TypeError("LoRARequest(name, path) or LoRARequest(name, int_id, path)")
        self.lora_name, self.lora_path = lora_name, lora_path

    def __repr__(self) -> str:
        return f"LoRARequest({self.lora_name!r}, {self.lora_path!r})"


class LLM:
    """Offline generation. Keyword arguments are engine options (see foveal.config), e.g.
    `LLM(dtype="bfloat16", max_num_seqs=64, kv_cache_memory=2**30)`."""

    def __init__(self, model: str | None = None, *, progress: bool = False, **engine_options):
        config = EngineConfig.from_kwargs(model=model, **engine_options)
        self.engine, self.processor = build_engine(config, progress=progress)
        freeze_startup_heap()

    @property
    def tokenizer(self):
        return self.processor.tokenizer

    def generate(
        self,
        prompts: PromptLike | list[PromptLike],
        params: SamplingParams | list[SamplingParams] | None = None,
        lora_request: LoRARequest | list[LoRARequest | None] | None = None,
    ) -> list[RequestOutput]:
        return self._run(self._as_list(prompts), params, lora=lora_request)

    def chat(
        self,
        messages: list[dict] | list[list[dict]],
        params: SamplingParams | list[SamplingParams] | None = None,
        chat_template_kwargs: dict | None = None,
        lora_request: LoRARequest | list[LoRARequest | None] | None = None,
    ) -> list[RequestOutput]:
        if not messages:
            raise ValueError("messages must not be empty")
        convs = [messages] if isinstance(messages[0], dict) else messages
        kw = chat_template_kwargs or {}
        prompts = [self._chat_prompt(c, kw) for c in convs]
        return self._run(prompts, params, kw.get("enable_thinking"), lora_request)

    def _chat_prompt(self, messages: list[dict], kw: dict) -> MultiModalPrompt:
        """Pull PIL images out of {"type": "image", "image": ...} parts, VideoClips out of
        {"type": "video", "video": ...} and AudioClips out of {"type": "audio", "audio": ...}, in order."""
        media: dict[str, list] = {"image": [], "video": [], "audio": []}
        msgs = []
        for m in messages:
            content = m.get("content")
            if isinstance(content, list):
                parts = []
                for p in content:
                    kind = p.get("type") if isinstance(p, dict) else None
                    if kind in media:
                        if p.get(kind) is not None:
                            media[kind].append(p[kind])
                        parts.append({"type": kind})
                    else:
                        parts.append(p)
                m = {**m, "content": parts}
            msgs.append(m)
        return self.processor.render_chat(
            msgs, images=media["image"], videos=media["video"], audios=media["audio"], **kw
        )

    def stream(
        self,
        prompt: PromptLike,
        params: SamplingParams | None = None,
        lora_request: LoRARequest | None = None,
    ) -> Iterator[TokenDelta]:
        """Yield each step's delta for one prompt (n must be 1) until it finishes."""
        req = replace(self.processor.request(prompt, params), lora=self._adapter(lora_request))
        rid = self.engine.add_request(req)
        try:
            while True:
                for d in self.engine.step():
                    if d.request_id == rid:
                        yield d
                        if d.finished:
                            return
        finally:
            self.engine.abort(rid)

    # -- helpers ----------------------------------------------------------------------------------
    @staticmethod
    def _as_list(prompts) -> list[PromptLike]:
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            return [prompts]
        return list(prompts)

    def _adapter(self, lora: LoRARequest | None):
        if lora is None:
            return None
        if self.processor.lora is None:
            raise ValueError("a lora_request needs an engine started with enable_lora=True")
        return self.processor.lora.get_or_load(lora.lora_name, lora.lora_path)

    def _run(
        self, prompts: list[PromptLike], params, thinking: bool | None = None, lora=None
    ) -> list[RequestOutput]:
        plist = params if isinstance(params, list) else [params or SamplingParams()] * len(prompts)
        if len(plist) != len(prompts):
            raise ValueError(f"got {len(plist)} SamplingParams for {len(prompts)} prompts")
        loras = lora if isinstance(lora, list) else [lora] * len(prompts)
        if len(loras) != len(prompts):
            raise ValueError(f"got {len(loras)} LoRA requests for {len(prompts)} prompts")
        # every prompt processed (and validated) before any is admitted
        rids = [new_request_id("gen") for _ in prompts]
        adapters = [self._adapter(x) for x in loras]
        batches = [
            [replace(r, lora=a) for r in self.processor.requests(p, sp, rid, thinking=thinking)]
            for p, sp, rid, a in zip(prompts, plist, rids, adapters)
        ]
        results: list[RequestOutput] = []
        where: dict[str, CompletionOutput] = {}
        try:
            for rid, reqs, p in zip(rids, batches, plist):
                ro = RequestOutput(rid, list(reqs[0].prompt_token_ids), [])
                for i, r in enumerate(reqs):  # each choice is its own sequence
                    co = CompletionOutput(i, logprobs=[] if p.logprobs is not None else None)
                    where[self.engine.add_request(r)] = co
                    ro.outputs.append(co)
                results.append(ro)
            while self.engine.has_unfinished():
                for d in self.engine.step():
                    co = where.get(d.request_id)
                    if co is None:
                        continue
                    co.text += d.text
                    co.token_ids.extend(d.token_ids)
                    if d.logprobs and co.logprobs is not None:
                        co.logprobs.extend(d.logprobs)
                    if d.finished:
                        co.finish_reason, co.stop_reason, co.error = d.finish_reason, d.stop_reason, d.error
        finally:
            for rid, co in where.items():
                if co.finish_reason is None:
                    self.engine.abort(rid)
        return results
