"""Pydantic models of the OpenAI request bodies (strict: unknown fields and wrong types are 400s),
and their translation to SamplingParams. Response bodies are built as plain dicts in app.py/sse.py.
This module owns what the API accepts; it must not touch the engine."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from foveal.request import MAX_TOP_LOGPROBS, SamplingParams

_STRICT = ConfigDict(extra="forbid", strict=True)

Prob = Annotated[float, Field(ge=0.0, le=1.0)]
Penalty = Annotated[float, Field(ge=-2.0, le=2.0)]
MAX_N = 16


class TextPart(BaseModel):
    model_config = _STRICT
    type: Literal["text"]
    text: str


class ImageURL(BaseModel):
    model_config = _STRICT
    url: Annotated[str, Field(min_length=1)]
    detail: Literal["auto", "low", "high"] | None = None


class ImagePart(BaseModel):
    model_config = _STRICT
    type: Literal["image_url"]
    image_url: ImageURL


class ChatMessage(BaseModel):
    model_config = _STRICT
    role: Literal["system", "user", "assistant"]
    content: str | list[Annotated[TextPart | ImagePart, Field(discriminator="type")]]
    name: str | None = None

    @property
    def image_urls(self) -> list[str]:
        if isinstance(self.content, str):
            return []
        return [p.image_url.url for p in self.content if isinstance(p, ImagePart)]

    def as_template_dict(self, multimodal: bool = False) -> dict:
        """A text model gets one string; a VLM's template gets parts, an image as {"type": "image"}."""
        if not multimodal:
            text = self.content if isinstance(self.content, str) else "".join(p.text for p in self.content)
            return {"role": self.role, "content": text}
        parts = [{"type": "text", "text": self.content}] if isinstance(self.content, str) else self.content
        return {
            "role": self.role,
            "content": [
                p
                if isinstance(p, dict)
                else {"type": "image"}
                if p.type == "image_url"
                else {"type": "text", "text": p.text}
                for p in parts
            ],
        }


class StreamOptions(BaseModel):
    model_config = _STRICT
    include_usage: bool = False


class _Common(BaseModel):
    model_config = _STRICT
    model: str | None = None
    temperature: Annotated[float, Field(ge=0.0, le=2.0)] | None = None
    top_p: Annotated[float, Field(gt=0.0, le=1.0)] | None = None
    n: Annotated[int, Field(ge=1, le=MAX_N)] = 1
    stop: str | list[Annotated[str, Field(min_length=1)]] | None = None
    seed: int | None = None
    presence_penalty: Penalty | None = None
    frequency_penalty: Penalty | None = None
    logit_bias: dict[str, Annotated[float, Field(ge=-100.0, le=100.0)]] | None = None
    user: str | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    # extras users of vLLM expect
    top_k: Annotated[int, Field(ge=-1)] | None = None
    min_p: Prob | None = None
    repetition_penalty: Annotated[float, Field(gt=0.0, le=10.0)] | None = None
    min_tokens: Annotated[int, Field(ge=0)] = 0
    ignore_eos: bool = False
    cache_salt: Annotated[str, Field(min_length=1, max_length=256)] | None = None  # vLLM's field

    def _params(self, max_tokens: int | None, logprobs: int | None) -> SamplingParams:
        bias = None
        if self.logit_bias:
            bias = {}
            for k, v in self.logit_bias.items():
                try:
                    bias[int(k)] = v
                except ValueError:
                    raise ValueError(
                        f"invalid sampling parameter logit_bias: key {k!r} is not a token id"
                    ) from None
        stop = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        return SamplingParams(
            n=self.n,
            temperature=1.0 if self.temperature is None else self.temperature,
            top_p=1.0 if self.top_p is None else self.top_p,
            top_k=self.top_k or 0,
            min_p=self.min_p or 0.0,
            repetition_penalty=self.repetition_penalty or 1.0,
            presence_penalty=self.presence_penalty or 0.0,
            frequency_penalty=self.frequency_penalty or 0.0,
            logit_bias=bias,
            seed=self.seed,
            max_tokens=max_tokens,
            min_tokens=self.min_tokens,
            ignore_eos=self.ignore_eos,
            stop=stop,
            logprobs=logprobs,
        )

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


class ChatCompletionRequest(_Common):
    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    max_tokens: Annotated[int, Field(ge=1)] | None = None
    max_completion_tokens: Annotated[int, Field(ge=1)] | None = None
    logprobs: bool = False
    top_logprobs: Annotated[int, Field(ge=0, le=MAX_TOP_LOGPROBS)] | None = None
    chat_template_kwargs: dict[str, Any] | None = None

    def sampling_params(self) -> SamplingParams:
        if self.top_logprobs is not None and not self.logprobs:
            raise ValueError("invalid sampling parameter top_logprobs: requires logprobs=true")
        mt = self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens
        return self._params(mt, (self.top_logprobs or 0) if self.logprobs else None)


MAX_PROMPTS = 64  # prompts in one /v1/completions request (each with n choices)


class CompletionRequest(_Common):
    prompt: (
        str
        | Annotated[list[int], Field(min_length=1)]
        | Annotated[list[str], Field(min_length=1, max_length=MAX_PROMPTS)]
        | Annotated[
            list[Annotated[list[int], Field(min_length=1)]], Field(min_length=1, max_length=MAX_PROMPTS)
        ]
    )
    max_tokens: Annotated[int, Field(ge=1)] | None = 16
    logprobs: Annotated[int, Field(ge=0, le=MAX_TOP_LOGPROBS)] | None = None
    echo: Literal[False] = False
    suffix: None = None
    best_of: Annotated[int, Field(ge=1)] | None = None

    def sampling_params(self) -> SamplingParams:
        if self.best_of is not None and self.best_of != self.n:
            raise ValueError("invalid sampling parameter best_of: only best_of == n is supported")
        return self._params(self.max_tokens, self.logprobs)
