"""Pydantic models of the OpenAI request bodies (strict: unknown fields and wrong types are 400s),
and their translation to SamplingParams. Response bodies are built as plain dicts in app.py/sse.py.
This module owns what the API accepts; it must not touch the engine.

Sampling values are typed here and validated once, by SamplingParams (request.py owns their limits);
the bounds shown in the OpenAPI schema are those same numbers, published for clients, not re-checked."""

from __future__ import annotations

import json
from typing import Annotated, Any, Literal

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, model_validator

from foveal.diffusion.state import DiffusionParams
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
from foveal.server.chat_input import ChatInput, VideoFrames
from foveal.structured.constraint import OutputConstraint

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
MAX_TOOLS = 128  # tools offered, and tool calls in one history message


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


class VideoURL(BaseModel):
    model_config = _STRICT
    url: Annotated[str, Field(min_length=1)]


class VideoPart(BaseModel):
    """A video (vLLM's part): data:video/...;base64, http(s), or a local file under the allowed path."""

    model_config = _STRICT
    type: Literal["video_url"]
    video_url: VideoURL


class VideoFramesPart(BaseModel):
    """A video as a list of frames, each an image URL (data:image/..., http(s), a local file), at `fps`
    frames a second (default 2): the frames are the clip, used as given (qwen-vl-utils' shape)."""

    model_config = _STRICT
    type: Literal["video"]
    video: Annotated[list[Annotated[str, Field(min_length=1)]], Field(min_length=1)]
    fps: Annotated[float, Field(gt=0, le=60)] = 2.0


class InputAudio(BaseModel):
    model_config = _STRICT
    data: Annotated[str, Field(min_length=1)]  # base64
    format: Literal["wav", "mp3", "flac", "ogg", "opus", "m4a", "mp4", "webm", "aac", "aiff"]


class InputAudioPart(BaseModel):
    """Audio in the body (OpenAI's part): base64 data and its format."""

    model_config = _STRICT
    type: Literal["input_audio"]
    input_audio: InputAudio

    @property
    def url(self) -> str:
        return f"data:audio/{self.input_audio.format};base64,{self.input_audio.data}"


class AudioURL(BaseModel):
    model_config = _STRICT
    url: Annotated[str, Field(min_length=1)]


class AudioURLPart(BaseModel):
    """Audio by URL (vLLM's part): data:audio/...;base64, http(s), or a local file under the allowed path."""

    model_config = _STRICT
    type: Literal["audio_url"]
    audio_url: AudioURL

    @property
    def url(self) -> str:
        return self.audio_url.url


ContentPart = Annotated[
    TextPart | ImagePart | VideoPart | VideoFramesPart | InputAudioPart | AudioURLPart,
    Field(discriminator="type"),
]


class VideoSampling(BaseModel):
    """How a request's videos are sampled (vLLM's `mm_processor_kwargs`): `fps` frames a second of
    the clip, or `num_frames` in all, within the server's frame cap."""

    model_config = _STRICT
    fps: Annotated[float, _shown(exclusiveMinimum=0.0, maximum=60.0)] | None = None
    num_frames: Annotated[int, _shown(minimum=1), _INTEGRAL] | None = None

    @model_validator(mode="after")
    def _one(self):
        if self.fps is not None and self.num_frames is not None:
            raise ValueError("give fps or num_frames, not both")
        return self


class FunctionCall(BaseModel):
    model_config = _STRICT
    name: Annotated[str, Field(min_length=1)]
    arguments: str  # a JSON object, as text (OpenAI's shape)


class ToolCallPart(BaseModel):
    """A tool call in an assistant message of the history."""

    model_config = _STRICT
    id: str | None = None
    type: Literal["function"] = "function"
    function: FunctionCall


# what _content_present says, for the published schema (a fuzzer reading it should not send a
# content-less user message and be surprised by the 400)
_CONTENT_RULE = {
    "anyOf": [
        {"required": ["content"], "properties": {"content": {"not": {"type": "null"}}}},
        {
            "required": ["role"],
            "properties": {"role": {"const": "assistant"}},
            "anyOf": [
                {"required": ["tool_calls"], "properties": {"tool_calls": {"type": "array", "minItems": 1}}},
                {"required": ["reasoning"], "properties": {"reasoning": {"type": "string", "minLength": 1}}},
            ],
        },
    ]
}


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True, json_schema_extra=_CONTENT_RULE)
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: Annotated[list[ToolCallPart], Field(max_length=MAX_TOOLS)] | None = None  # assistant
    tool_call_id: str | None = None  # tool: the call this answers
    reasoning_content: str | None = None  # an assistant turn's reasoning, as this server returned it
    reasoning: str | None = None  # the same, under the newer name

    @model_validator(mode="after")
    def _content_present(self):
        if self.content is None and not (self.role == "assistant" and (self.tool_calls or self.reasoning)):
            raise ValueError("content is required (an assistant message may have tool_calls instead)")
        if self.tool_calls and self.role != "assistant":
            raise ValueError("only assistant messages have tool_calls")
        return self

    @property
    def image_urls(self) -> list[str]:
        if not isinstance(self.content, list):
            return []
        return [p.image_url.url for p in self.content if isinstance(p, ImagePart)]

    @property
    def video_sources(self) -> list[str | VideoFrames]:
        if not isinstance(self.content, list):
            return []
        return [
            p.video_url.url if isinstance(p, VideoPart) else VideoFrames(tuple(p.video), p.fps)
            for p in self.content
            if isinstance(p, VideoPart | VideoFramesPart)
        ]

    @property
    def audio_urls(self) -> list[str]:
        if not isinstance(self.content, list):
            return []
        return [p.url for p in self.content if isinstance(p, InputAudioPart | AudioURLPart)]

    def as_template_dict(self, multimodal: bool = False) -> dict:
        """A text model gets one string; a VLM's template gets parts, an image as {"type": "image"}.
        Tool calls go to the template with their arguments decoded (templates write them as JSON);
        "developer" is the system role for templates, which do not know it."""
        role = "system" if self.role == "developer" else self.role
        out: dict = {"role": role}
        if self.content is None:
            out["content"] = "" if not multimodal else []
        elif not multimodal:
            c = self.content
            out["content"] = (
                c if isinstance(c, str) else "".join(p.text for p in c if isinstance(p, TextPart))
            )
        else:
            parts = (
                [TextPart(type="text", text=self.content)] if isinstance(self.content, str) else self.content
            )
            out["content"] = [
                {"type": _MEDIA_PARTS[type(p)]}
                if type(p) in _MEDIA_PARTS
                else {"type": "text", "text": p.text}
                for p in parts
            ]
        if self.name is not None:
            out["name"] = self.name
        if self.tool_calls:
            out["tool_calls"] = [
                {
                    "id": c.id,
                    "type": "function",
                    "function": {"name": c.function.name, "arguments": _decoded(c.function.arguments)},
                }
                for c in self.tool_calls
            ]
        if self.tool_call_id is not None:
            out["tool_call_id"] = self.tool_call_id
        thought = self.reasoning_content if self.reasoning_content is not None else self.reasoning
        if thought is not None:
            out["reasoning_content"] = thought
        return out


_MEDIA_PARTS = {
    ImagePart: "image",
    VideoPart: "video",
    VideoFramesPart: "video",
    InputAudioPart: "audio",
    AudioURLPart: "audio",
}


def _field(name: str, build, value):
    """A structured-output field's OutputConstraint; its ValueError as an InvalidParameter naming it."""
    try:
        return build(value)
    except InvalidParameter:
        raise
    except ValueError as e:
        raise InvalidParameter(name, str(e)) from None


def _decoded(arguments: str):
    try:
        value = json.loads(arguments)
    except ValueError:
        return arguments
    return value if isinstance(value, dict) else arguments


class FunctionDef(BaseModel):
    model_config = _STRICT
    name: Annotated[str, Field(min_length=1, max_length=128)]
    description: str | None = None
    parameters: dict[str, Any] | None = None  # a JSON schema
    strict: bool | None = None  # accepted; arguments always follow the schema (a grammar enforces it)


class ToolDef(BaseModel):
    model_config = _STRICT
    type: Literal["function"]
    function: FunctionDef


class NamedFunction(BaseModel):
    model_config = _STRICT
    name: Annotated[str, Field(min_length=1)]


class NamedToolChoice(BaseModel):
    model_config = _STRICT
    type: Literal["function"]
    function: NamedFunction


class StreamOptions(BaseModel):
    model_config = _STRICT
    include_usage: bool = False


class DiffusionKnobs(BaseModel):
    """A diffusion model's denoising knobs (foveal/diffusion/state.py); the server's defaults fill the
    ones left out."""

    model_config = _STRICT
    steps: Annotated[int, _shown(minimum=1), _INTEGRAL] | None = None
    block_length: Annotated[int, _shown(minimum=1), _INTEGRAL] | None = None
    threshold: Prob | None = None
    min_threshold: Prob | None = None
    max_tokens_per_step: Annotated[int, _shown(minimum=1), _INTEGRAL] | None = None
    editing_threshold: Prob | None = None
    stability_steps: Annotated[int, _shown(minimum=1), _INTEGRAL] | None = None
    max_post_steps: Annotated[int, _shown(minimum=0), _INTEGRAL] | None = None


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
    # structured outputs: OpenAI's response_format, vLLM's structured_outputs object and its older
    # guided_* fields (at most one of them; foveal/structured/constraint.py reads their shapes)
    response_format: dict[str, Any] | None = None
    structured_outputs: dict[str, Any] | None = None
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    guided_whitespace_pattern: str | None = None
    # a structured answer that would run past max_tokens ends with a short completion of its grammar
    # (finish_reason stays "length"); false: cut wherever max_tokens falls, as vLLM does
    close_on_length: bool = True
    # thinking tokens before the end of thinking is forced (vLLM's name: thinking_token_budget)
    thinking_budget: Annotated[int, _shown(minimum=0), _INTEGRAL] | None = None
    thinking_token_budget: Annotated[int, _shown(minimum=0), _INTEGRAL] | None = None
    # diffusion models: {"steps", "block_length", "threshold"} (refused by autoregressive models)
    diffusion: DiffusionKnobs | None = None

    @property
    def grammar_source(self) -> str | None:
        """The field the structured-output constraint came from (errors name it)."""
        fields = ("response_format", "structured_outputs", "guided_json", "guided_regex", "guided_choice")
        return next((f for f in (*fields, "guided_grammar") if getattr(self, f) is not None), None)

    def grammar(self) -> OutputConstraint | None:
        """The grammar the output must match, from whichever structured-output field was given."""
        found = []
        if self.response_format is not None:
            spec = _field("response_format", OutputConstraint.from_response_format, self.response_format)
            if spec is not None:
                found.append(("response_format", spec))
        if self.structured_outputs is not None:
            spec = _field(
                "structured_outputs", OutputConstraint.from_structured_outputs, self.structured_outputs
            )
            if spec is not None:
                found.append(("structured_outputs", spec))
        guided = {
            k: getattr(self, k)
            for k in ("guided_json", "guided_regex", "guided_choice", "guided_grammar")
            if getattr(self, k) is not None
        }
        if guided:
            spec = _field(
                next(iter(guided)),
                lambda _: OutputConstraint.from_guided(
                    **guided, guided_whitespace_pattern=self.guided_whitespace_pattern
                ),
                None,
            )
            found += [(k, spec) for k in guided]
        if len(found) > 1:
            names = ", ".join(k for k, _ in found)
            raise InvalidParameter(
                found[1][0], f"give one structured-output constraint, not several ({names})"
            )
        return found[0][1] if found else None

    @property
    def thinking_limit(self) -> int | None:
        if self.thinking_budget is not None and self.thinking_token_budget is not None:
            if self.thinking_budget != self.thinking_token_budget:
                raise InvalidParameter("thinking_budget", "thinking_budget and thinking_token_budget differ")
        return self.thinking_budget if self.thinking_budget is not None else self.thinking_token_budget

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
                structured=self.grammar(),
                close_on_length=self.close_on_length,
                thinking_budget=self.thinking_limit,
                diffusion=None if self.diffusion is None else DiffusionParams(**self.diffusion.model_dump()),
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
    tools: Annotated[list[ToolDef], Field(max_length=MAX_TOOLS)] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool = True
    # passed to the chat template; "none" also turns thinking off (enable_thinking=false)
    reasoning_effort: Literal["none", "minimal", "low", "medium", "high"] | None = None
    mm_processor_kwargs: VideoSampling | None = None  # the videos' sampling (vLLM's field)

    def chat_input(self, multimodal: bool) -> ChatInput:
        """The protocol-neutral request (server/chat_input.py). `multimodal`: the model takes images
        (a text model's template gets each message's text as one string)."""
        images = [(i, url) for i, m in enumerate(self.messages) for url in m.image_urls]
        videos = [(i, src) for i, m in enumerate(self.messages) for src in m.video_sources]
        audios = [(i, url) for i, m in enumerate(self.messages) for url in m.audio_urls]
        sampling = self.mm_processor_kwargs
        return ChatInput(
            messages=[m.as_template_dict(multimodal) for m in self.messages],
            images=images,
            videos=videos,
            audios=audios,
            video_fps=sampling.fps if sampling else None,
            video_frames=sampling.num_frames if sampling else None,
            tools=[t.model_dump(exclude_none=True) for t in self.tools] if self.tools else None,
            tool_mode=self.tool_mode,
            parallel_tool_calls=self.parallel_tool_calls,
            chat_template_kwargs=self.chat_template_kwargs,
            chat_template=self.chat_template,
            add_generation_prompt=self.add_generation_prompt,
            continue_final_message=self.continue_final_message,
            reasoning_effort=self.reasoning_effort,
            grammar_source=self.grammar_source,
        )

    @property
    def tool_mode(self) -> str | dict:
        """none | auto | required | {"type": "function", "function": {"name": ...}} ("none" without
        tools; "auto" by default with them, as OpenAI)."""
        if not self.tools:
            if self.tool_choice not in (None, "none"):
                raise InvalidParameter("tool_choice", "tool_choice needs tools")
            return "none"
        if isinstance(self.tool_choice, NamedToolChoice):
            return self.tool_choice.model_dump()
        return self.tool_choice or "auto"

    def check_turns(self) -> None:
        """What OpenAI refuses and a schema cannot say: a tool message answers a call issued by an
        earlier assistant message (by its id), and tool names are unique."""
        issued: set[str] = set()
        for i, m in enumerate(self.messages):
            if m.role == "assistant" and m.tool_calls:
                issued.update(c.id for c in m.tool_calls if c.id)
            elif m.role == "tool":
                where = f"messages.{i}.tool_call_id"
                if not m.tool_call_id:
                    raise InvalidParameter(
                        where,
                        f"missing required parameter '{where}': a tool message answers a tool call by its id",
                    )
                if m.tool_call_id not in issued:
                    raise InvalidParameter(
                        where,
                        f"invalid value for '{where}': {m.tool_call_id!r} is not the id of a tool call in an "
                        "earlier assistant message",
                    )
        seen: set[str] = set()
        for i, t in enumerate(self.tools or ()):
            if t.function.name in seen:
                where = f"tools.{i}.function.name"
                raise InvalidParameter(
                    where, f"invalid value for '{where}': a second tool named {t.function.name!r}"
                )
            seen.add(t.function.name)

    def sampling_params(self) -> SamplingParams:
        self.check_turns()
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


class LoadLoraRequest(BaseModel):
    """/v1/load_lora_adapter's body (vLLM's)."""

    lora_name: Annotated[str, Field(min_length=1)]
    lora_path: Annotated[str, Field(min_length=1)]


class UnloadLoraRequest(BaseModel):
    lora_name: Annotated[str, Field(min_length=1)]
