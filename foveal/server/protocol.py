"""Pydantic models of the OpenAI request bodies (strict: unknown fields and wrong types are 400s),
and their translation to SamplingParams. Response bodies are built as plain dicts in app.py/sse.py.
This module owns what the API accepts; it must not touch the engine.

Sampling values are typed here and validated once, by SamplingParams (request.py owns their limits);
the bounds shown in the OpenAPI schema are those same numbers, published for clients, not re-checked."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field

from foveal.request import (
    MAX_BIAS,
    MAX_LOGIT_BIAS,
    MAX_N,
    MAX_PENALTY,
    MAX_REPETITION_PENALTY,
    MAX_STOP_CHARS,
    MAX_STOPS,
    MAX_TEMPERATURE,
    MAX_TOP_LOGPROBS,
    InvalidParameter,
    SamplingParams,
)

_STRICT = ConfigDict(extra="forbid", strict=True)


def _integral(v):
    """JSON does not tell 5 from 5.0 (JSON Schema counts both as integers): a float with no fraction
    passes as an int; anything else goes on to strict int validation (true stays a bool: refused)."""
    return int(v) if type(v) is float and v.is_integer() else v


def _integral_list(v):
    if isinstance(v, list) and any(type(x) is float for x in v):
        return [_integral(x) for x in v]
    return v


def _shown(**bounds) -> Field:
    """JSON Schema bounds for the OpenAPI document only (SamplingParams checks them, once)."""
    return Field(json_schema_extra=bounds)


_INTEGRAL = BeforeValidator(_integral)
TokenIds = Annotated[list[int], BeforeValidator(_integral_list), Field(min_length=1)]

Prob = Annotated[float, _shown(minimum=0.0, maximum=1.0)]
Penalty = Annotated[float, _shown(minimum=-MAX_PENALTY, maximum=MAX_PENALTY)]
StopString = Annotated[str, _shown(minLength=1, maxLength=MAX_STOP_CHARS)]


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
    temperature: Annotated[float, _shown(minimum=0.0, maximum=MAX_TEMPERATURE)] | None = None
    top_p: Annotated[float, _shown(exclusiveMinimum=0.0, maximum=1.0)] | None = None
    n: Annotated[int, _shown(minimum=1, maximum=MAX_N), _INTEGRAL] = 1
    # the detokenizer matches every stop string after every token: their count and size are bounded
    stop: StopString | Annotated[list[StopString], _shown(maxItems=MAX_STOPS)] | None = None
    seed: Annotated[int, _INTEGRAL] | None = None
    presence_penalty: Penalty | None = None
    frequency_penalty: Penalty | None = None
    # applied to its row at every step: bounded
    logit_bias: (
        Annotated[
            dict[str, Annotated[float, _shown(minimum=-MAX_BIAS, maximum=MAX_BIAS)]],
            _shown(maxProperties=MAX_LOGIT_BIAS),
        ]
        | None
    ) = None
    user: str | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    # extras users of vLLM expect
    top_k: Annotated[int, _shown(minimum=-1), _INTEGRAL] | None = None
    min_p: Prob | None = None
    repetition_penalty: (
        Annotated[float, _shown(exclusiveMinimum=0.0, maximum=MAX_REPETITION_PENALTY)] | None
    ) = None
    min_tokens: Annotated[int, _shown(minimum=0), _INTEGRAL] = 0
    ignore_eos: bool = False
    cache_salt: Annotated[str, Field(min_length=1, max_length=256)] | None = None  # vLLM's field
    # speculate when the server does (--speculative-config); false: plain decoding for this request
    speculative: bool = True

    def _params(
        self, max_tokens: int | None, logprobs: int | None, names: dict[str, str] | None = None
    ) -> SamplingParams:
        """`names`: the body's name of a SamplingParams field where it differs (an error names it)."""
        bias = None
        if self.logit_bias:
            bias = {}
            for k, v in self.logit_bias.items():
                try:
                    bias[int(k)] = v
                except ValueError:
                    raise InvalidParameter(
                        "logit_bias", f"invalid sampling parameter logit_bias: key {k!r} is not a token id"
                    ) from None
        def given(v, default):
            return default if v is None else v

        try:
            return SamplingParams(
                n=self.n,
                temperature=given(self.temperature, 1.0),
                top_p=given(self.top_p, 1.0),
                top_k=given(self.top_k, 0),
                min_p=given(self.min_p, 0.0),
                repetition_penalty=given(self.repetition_penalty, 1.0),
                presence_penalty=given(self.presence_penalty, 0.0),
                frequency_penalty=given(self.frequency_penalty, 0.0),
                logit_bias=bias,
                seed=self.seed,
                max_tokens=max_tokens,
                min_tokens=self.min_tokens,
                ignore_eos=self.ignore_eos,
                stop=self.stop,
                logprobs=logprobs,
                speculative=self.speculative,
            )
        except InvalidParameter as e:
            name = (names or {}).get(e.param)
            if name is None:
                raise
            msg = str(e).replace(f"parameter {e.param}=", f"parameter {name}=", 1)
            raise InvalidParameter(name, msg) from None

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


class ChatCompletionRequest(_Common):
    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    max_tokens: Annotated[int, _shown(minimum=1), _INTEGRAL] | None = None
    max_completion_tokens: Annotated[int, _shown(minimum=1), _INTEGRAL] | None = None
    logprobs: bool = False
    top_logprobs: Annotated[int, _shown(minimum=0, maximum=MAX_TOP_LOGPROBS), _INTEGRAL] | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    # vLLM's fields: the template's generation prompt, or continuing the last (assistant) message
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template: str | None = None  # refused unless the server trusts request templates

    def sampling_params(self) -> SamplingParams:
        if self.top_logprobs is not None and not self.logprobs:
            raise InvalidParameter(
                "top_logprobs", "invalid sampling parameter top_logprobs: requires logprobs=true"
            )
        names = {"logprobs": "top_logprobs"}
        mt = self.max_tokens
        if self.max_completion_tokens is not None:
            mt, names["max_tokens"] = self.max_completion_tokens, "max_completion_tokens"
        return self._params(mt, (self.top_logprobs or 0) if self.logprobs else None, names)


MAX_PROMPTS = 64  # prompts in one /v1/completions request (each with n choices)


class CompletionRequest(_Common):
    prompt: (
        str
        | TokenIds
        | Annotated[list[str], Field(min_length=1, max_length=MAX_PROMPTS)]
        | Annotated[list[TokenIds], Field(min_length=1, max_length=MAX_PROMPTS)]
    )
    max_tokens: Annotated[int, _shown(minimum=1), _INTEGRAL] | None = 16
    logprobs: Annotated[int, _shown(minimum=0, maximum=MAX_TOP_LOGPROBS), _INTEGRAL] | None = None
    echo: Literal[False] = False
    suffix: None = None
    best_of: Annotated[int, Field(ge=1), _INTEGRAL] | None = None

    def sampling_params(self) -> SamplingParams:
        if self.best_of is not None and self.best_of != self.n:
            raise InvalidParameter(
                "best_of", "invalid sampling parameter best_of: only best_of == n is supported"
            )
        return self._params(self.max_tokens, self.logprobs)
