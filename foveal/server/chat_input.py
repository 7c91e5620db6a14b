"""A chat request in no protocol's shape: what the input side needs of OpenAI chat completions,
Anthropic Messages or any other chat protocol, which each build one (`Prompts.chat` takes it).

    messages       the chat template's own shape: {"role", "content": str | [{"type": "text", "text"},
                   {"type": "image"}, {"type": "video"}, {"type": "audio"}], "tool_calls": [{"id",
                   "type": "function", "function": {"name", "arguments": dict}}], "tool_call_id",
                   "reasoning_content"};
                   roles system, user, assistant, tool
    images         per image part, in order: (the index of its message, its URL or data: URL)
    videos         the same per video part (a URL, or VideoFrames: a list of images taken as the
                   clip's frames); video_fps / video_frames: how URL clips are sampled
    audios         the same per audio part (audio in the body comes as a data: URL)
    tools          OpenAI-shaped function tools ({"type": "function", "function": {name, description,
                   parameters}}), and tool_mode none | auto | required | {"type": "function",
                   "function": {"name": ...}}
    template       the template's switches the request may set (validated by Prompts)
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True, slots=True)
class VideoFrames:
    """A video given as its frames, each an image URL (the frames are used as they are, not sampled)."""

    urls: tuple[str, ...]
    fps: float  # the frames' rate: frame j is at j / fps seconds


@dataclass(slots=True)
class ChatInput:
    messages: list[dict]
    images: list[tuple[int, str]] = field(default_factory=list)
    videos: list[tuple[int, str | VideoFrames]] = field(default_factory=list)  # (message index, source)
    video_fps: float | None = None  # the videos' sampling, as the request asks (None: the model's)
    video_frames: int | None = None  # ... or this many frames in all
    # as images (input_audio as a data: URL), or the bytes themselves (a form's file)
    audios: list[tuple[int, str | bytes]] = field(default_factory=list)
    tools: list[dict] | None = None
    tool_mode: str | dict = "none"
    parallel_tool_calls: bool = True
    chat_template_kwargs: dict[str, Any] | None = None
    chat_template: str | None = None  # refused unless the server trusts request templates
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    reasoning_effort: str | None = None
    grammar_source: str | None = None  # the request field a structured-output constraint came from

    @property
    def image_urls(self) -> list[str]:
        return [url for _, url in self.images]
