"""Request bodies -> EngineRequests: chat templates, tokenizing, image and video fetch and decode,
through the engine's InputProcessor (which also checks the prompt's limits, fills in max_tokens and
expands n). All of it runs before admission, off the model thread and the event loop (server/inputs.py's
pool, with a deadline), so every problem is a 4xx before a stream starts and one slow input fails alone.

Bounds on the work one request may cause:
- text: refused unhashed when too long to fit the context whatever it tokenizes to
  (InputProcessor.check_text_length);
- chat templates: the model's own only, unless the operator trusts request templates
  (--trust-request-chat-template, vLLM's flag): a template is code, and a nested loop in one renders
  for as long as it likes;
- images: each one's pixels (from its header, before decoding), the pixels of one request, and the
  pixels being decoded and processed at once across requests (a request past that waits briefly, then
  gets a 429), so eight 30-megapixel PNGs in 0.8 MB of body cannot take gigabytes per request;
- audio: a count per request, encoded bytes, the clip's length before decoding (server/audio.py) and
  the model's own window;
- videos: a count per request, encoded bytes, duration and frame size from the header and the packets
  before any frame is decoded (server/video.py), the frames the model's sampling rule picks (at most
  max_video_frames), their decoded bytes; decoded in the pool under the input deadline.
This module must not touch the model thread: it calls only the InputProcessor.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import threading
from dataclasses import dataclass, field, replace

from foveal.config import ServerConfig
from foveal.engine.input_processor import InputProcessor
from foveal.parsing.output import OutputPlan
from foveal.parsing.reasoning import prompt_opens_thinking
from foveal.request import AudioClip, EngineRequest, SamplingParams, VideoClip
from foveal.server import audio, media, video
from foveal.server.chat_input import ChatInput, VideoFrames
from foveal.server.errors import APIError
from foveal.server.inputs import InputWork, InputWorkTooSlow
from foveal.server.protocol import CompletionRequest
from foveal.structured.constraint import OutputConstraint
from foveal.structured.tool_grammar import tool_call_grammar

log = logging.getLogger(__name__)

# a video's sampled frames at the source's size, held while the family's processor resizes them
_VIDEO_DECODED_BYTES = 1 << 30

# apply_chat_template arguments a request may not set through chat_template_kwargs: they change what
# the call returns, not what the template sees (the generation-prompt switches are top-level fields)
_RESERVED_KWARGS = frozenset(
    {
        "conversation",
        "messages",
        "tokenize",
        "return_dict",
        "return_tensors",
        "return_assistant_tokens_mask",
        "padding",
        "truncation",
        "max_length",
        "tokenizer_kwargs",
        "processor_kwargs",
        "add_generation_prompt",
        "continue_final_message",
        "tools",
        "documents",
    }
)


@dataclass(slots=True)
class _Encoded:
    """A request's videos and audio clips as fetched (decoded in the pool), and the videos' sampling."""

    videos: list[bytes | tuple[list[bytes], float]] = field(default_factory=list)  # or (frames, fps)
    fps: float | None = None
    frames: int | None = None
    audios: list[bytes] = field(default_factory=list)


class ByteBudget:
    """Decoded video bytes held at once across requests, taken on the input pool's threads (a lock and
    a condition): a taker waits up to its timeout for room, then is refused."""

    def __init__(self, capacity: int):
        self.capacity = capacity
        self.in_use = 0
        self._changed = threading.Condition()

    def acquire(self, n: int, timeout: float) -> bool:
        with self._changed:
            if not self._changed.wait_for(lambda: self.in_use + n <= self.capacity, timeout):
                return False
            self.in_use += n
            return True

    def release(self, n: int) -> None:
        with self._changed:
            self.in_use -= n
            self._changed.notify_all()


class PixelBudget:
    """Decoded pixels in flight across requests (event-loop side only: no lock needed)."""

    def __init__(self, capacity: int):
        self.capacity = capacity
        self.in_use = 0
        self._changed = asyncio.Condition()

    async def acquire(self, n: int, timeout: float) -> bool:
        async with self._changed:
            try:
                async with asyncio.timeout(timeout):
                    await self._changed.wait_for(lambda: self.in_use + n <= self.capacity)
            except TimeoutError:
                return False
            self.in_use += n
            return True

    async def release(self, n: int) -> None:
        async with self._changed:
            self.in_use -= n
            self._changed.notify_all()


def _bad_input(e: ValueError, param: str, source: str | None = None) -> APIError:
    """A 400 naming the field: the error's own, where a grammar failed to compile the field it came
    from (`source`), else `param`."""
    named = getattr(e, "param", None)
    if named == "structured":
        named = source
    return APIError(400, str(e), param=named or param)


class Prompts:
    def __init__(self, processor: InputProcessor, cfg: ServerConfig, inputs: InputWork):
        self.processor, self.cfg, self.inputs = processor, cfg, inputs
        self.limits = media.MediaLimits(
            allow_private_urls=cfg.allow_private_media_urls,
            allowed_local_path=cfg.allowed_local_media_path,
            fetch_timeout_s=cfg.media_fetch_timeout,
            max_bytes=cfg.max_image_bytes,
            max_pixels=cfg.max_image_pixels,
        )
        self.pixels = PixelBudget(cfg.max_image_pixels_in_flight)
        self.video_fetch = replace(self.limits, max_bytes=cfg.max_video_bytes)
        self.video_bytes = ByteBudget(cfg.max_video_bytes_in_flight)
        self.audio_fetch = replace(self.limits, max_bytes=cfg.max_audio_bytes)
        self.audio_limits = audio.AudioLimits(
            max_bytes=cfg.max_audio_bytes, max_duration_s=cfg.max_audio_duration, deadline_s=cfg.input_timeout
        )
        self.video_limits = video.VideoLimits(
            max_bytes=cfg.max_video_bytes,
            max_duration_s=cfg.max_video_duration,
            max_frames=cfg.max_video_frames,
            max_decoded_bytes=min(_VIDEO_DECODED_BYTES, cfg.max_video_bytes_in_flight),
            deadline_s=cfg.input_timeout,
        )

    async def _work(self, fn, *args, **kwargs):
        try:
            return await self.inputs.run(fn, *args, **kwargs)
        except InputWorkTooSlow as e:
            raise APIError(400, str(e), code="input_too_slow") from None

    async def completion(
        self, req: CompletionRequest, params: SamplingParams, rid: str, cache_salt: str | None
    ) -> list[EngineRequest]:
        """A /v1/completions request -> its sequences: prompt j's choice i is entry j * n + i (text
        tokenized in the pool). One prompt's sequences are named like the request, several `{id}-{j}`."""
        prompt = req.prompt
        if isinstance(prompt, str) or (prompt and isinstance(prompt[0], int)):
            prompt = [prompt]
        proc = self.processor

        def work():
            out = []
            for j, p in enumerate(prompt):
                sub = rid if len(prompt) == 1 else f"{rid}-{j}"
                out += proc.requests(p, params, sub, cache_salt)
            return out

        try:
            return await self._work(work)
        except ValueError as e:
            raise _bad_input(e, "prompt", req.grammar_source) from None

    def _template_kwargs(self, req: ChatInput) -> dict:
        kwargs = dict(req.chat_template_kwargs or {})
        bad = sorted(k for k in kwargs if k in _RESERVED_KWARGS)
        if bad:
            raise APIError(
                400,
                f"chat_template_kwargs may not set {', '.join(bad)} (use the request's own fields)",
                param="chat_template_kwargs",
            )
        template = req.chat_template if req.chat_template is not None else kwargs.pop("chat_template", None)
        if template is not None:
            if not self.cfg.trust_request_chat_template:
                raise APIError(
                    400,
                    "request-supplied chat templates are refused; the server runs the model's own "
                    "(an operator may allow them with --trust-request-chat-template)",
                    param="chat_template",
                )
            kwargs["chat_template"] = template
        if req.continue_final_message:
            if req.add_generation_prompt:
                raise APIError(
                    400,
                    "continue_final_message needs add_generation_prompt=false",
                    param="continue_final_message",
                )
            if req.messages[-1]["role"] != "assistant":
                raise APIError(
                    400,
                    "continue_final_message needs the last message to be the assistant's",
                    param="continue_final_message",
                )
            kwargs["continue_final_message"] = True
        kwargs["add_generation_prompt"] = req.add_generation_prompt
        if req.reasoning_effort is not None:
            kwargs["reasoning_effort"] = req.reasoning_effort
            if req.reasoning_effort == "none":
                kwargs["enable_thinking"] = False
        default = self.processor.output.enable_thinking
        if default is not None:
            kwargs.setdefault("enable_thinking", default)
        return kwargs

    def _tools(self, req: ChatInput, params: SamplingParams):
        """(the tools for the template, or None; params with the tool calls' grammar; the output plan's
        tool format; the calls' syntax where the grammar constrains them). tool_choice none renders no
        tools and parses none."""
        mode = req.tool_mode
        if mode == "none":
            return None, params, None, None
        fmt = self.processor.tool_format
        if self.processor.harmony:  # gpt-oss: the template renders the tools, the Harmony parser reads calls
            if mode != "auto":
                raise APIError(
                    400, f"tool_choice {mode!r} is not supported for Harmony output (gpt-oss); use auto",
                    param="tool_choice",
                )  # fmt: skip
            return req.tools, params, None, None
        if fmt is None:
            raise APIError(
                400, "this server does not parse tool calls (--tool-call-parser none)", param="tools"
            )
        tools = req.tools
        try:
            constraint = tool_call_grammar(
                fmt, tools, mode, req.parallel_tool_calls, self.processor.tool_special
            )
        except ValueError as e:
            raise APIError(400, str(e), param="tool_choice") from None
        if constraint is None:
            return tools, params, fmt, None
        if params.structured is not None:
            raise APIError(
                400,
                "tool calls and a structured-output constraint cannot apply together",
                param="tool_choice",
            )
        # a tool call is never closed early for max_tokens: cut arguments must not look complete
        params = replace(params, structured=constraint.grammar, close_on_length=False)
        return tools, params, fmt, constraint.syntax

    def _check_tool_schemas(self, tools: list[dict]) -> None:
        """Each tool's parameters compiled on their own (cached): a bad schema is a 400 naming its tool,
        not an error of the combined call grammar, which would quote that grammar's internals."""
        for i, t in enumerate(tools):
            schema = t["function"].get("parameters")
            if schema is None:
                continue
            where = f"tools.{i}.function.parameters"
            try:
                self.processor.grammars.get(OutputConstraint.json_schema(schema))
            except ValueError as e:
                raise APIError(400, f"{where}: {e}", param=where) from None

    async def chat(
        self, req: ChatInput, params: SamplingParams, rid: str, cache_salt: str | None
    ) -> tuple[list[EngineRequest], OutputPlan]:
        """The request's sequences, and how their output is parsed (reasoning, tool calls)."""
        for what, parts in (("image", req.images), ("video", req.videos), ("audio", req.audios)):
            for i, _ in parts:
                if req.messages[i]["role"] != "user":
                    raise APIError(
                        400, f"messages[{i}]: {what} parts are only allowed in user messages", "messages"
                    )
        urls = req.image_urls
        info = self.processor.info
        for what, n, limit in (
            ("images", len(urls), self.cfg.limit_images_per_request),
            ("videos", len(req.videos), self.cfg.limit_videos_per_request),
            ("audio clips", len(req.audios), self.cfg.limit_audios_per_request),
        ):
            if n and not info.is_multimodal:
                raise APIError(
                    400,
                    f"model '{info.model_name}' is text-only; it does not accept {what}",
                    param="messages",
                )
            if n > limit:
                raise APIError(
                    400, f"{n} {what} in one request; this server allows {limit}", param="messages"
                )
        kwargs = self._template_kwargs(req)
        grammar_source = req.grammar_source
        tools, params, tool_format, tool_syntax = self._tools(req, params)
        if tool_syntax is not None:  # the calls are constrained: each tool's schema must compile
            await self._work(self._check_tool_schemas, tools)
        if tools and grammar_source is None:
            grammar_source = "tool_choice"
        if tools:
            kwargs["tools"] = tools
        messages = req.messages
        clips = await self._fetch_videos([src for _, src in req.videos])
        sounds = await self._fetch("audio", [url for _, url in req.audios], self.audio_fetch)
        opened = [await self._open_images(urls)] if urls else []
        total = sum(im.width * im.height for im in opened[0]) if urls else 0
        if total > self.cfg.max_request_image_pixels:
            raise APIError(
                413,
                f"the request's images have {total} pixels in all; this server allows "
                f"{self.cfg.max_request_image_pixels} per request",
                param="messages",
                code="images_too_large",
            )
        if total and not await self.pixels.acquire(total, self.cfg.image_queue_timeout):
            log.info("%s: refused, %d image pixels would pass the in-flight budget", rid, total)
            raise APIError(
                429,
                "too many image pixels are being processed; retry later",
                "rate_limit",
                headers={"Retry-After": "1"},
            )
        try:
            media = _Encoded(clips, req.video_fps, req.video_frames, sounds)
            choices, opened_thinking = await self._render(
                messages, opened[0] if urls else [], kwargs, rid, params, cache_salt, grammar_source, media
            )
        finally:
            if total:
                await self.pixels.release(total)
        plan = OutputPlan(
            reasoning=self.processor.reasoning,
            prompt_opened=opened_thinking,
            thinking=kwargs.get("enable_thinking") is not False,
            tool_format=tool_format,
            tools=tools or (),
            tool_syntax=tool_syntax,
            harmony=self.processor.harmony,
        )
        return choices, plan

    async def _open_images(self, urls: list[str]) -> list:
        """Fetch every image and read its header (nothing decoded yet): 400 naming the bad one."""

        def one(i, url):
            try:
                return media.open_image(media.read_media_bytes(url, self.limits), self.limits)
            except media.MediaError as e:
                raise APIError(400, f"image {i + 1}: {e}", param="messages", code="invalid_image") from None
            except Exception as e:  # a loader bug this input found: the request fails, with a trace logged
                log.exception("image %d: loading failed", i + 1)
                raise APIError(
                    400,
                    f"image {i + 1}: cannot be loaded ({type(e).__name__})",
                    param="messages",
                    code="invalid_image",
                ) from None

        return await asyncio.gather(*(asyncio.to_thread(one, i, u) for i, u in enumerate(urls)))

    async def _fetch_videos(self, sources: list[str | VideoFrames]) -> list:
        """Each video's encoded bytes, or a frame list's (images' bytes, rate): 400 naming the bad one."""
        urls = [s for s in sources if isinstance(s, str)]
        fetched = iter(await self._fetch("video", urls, self.video_fetch))
        cap = self.cfg.max_video_frames

        def frame(i: int, j: int, url: str) -> bytes:
            try:
                return media.read_media_bytes(url, self.limits)
            except media.MediaError as e:
                raise APIError(
                    400, f"video {i + 1}, frame {j + 1}: {e}", param="messages", code="invalid_video"
                ) from None

        out: list[bytes | tuple[list[bytes], float]] = []
        for i, src in enumerate(sources):
            if isinstance(src, str):
                out.append(next(fetched))
                continue
            if len(src.urls) > cap:
                raise APIError(
                    400, f"video {i + 1}: {len(src.urls)} frames; this server allows {cap}",
                    param="messages", code="invalid_video",
                )  # fmt: skip
            jobs = (asyncio.to_thread(frame, i, j, u) for j, u in enumerate(src.urls))
            out.append((list(await asyncio.gather(*jobs)), src.fps))
        return out

    async def _fetch(self, kind: str, urls: list[str | bytes], limits: media.MediaLimits) -> list[bytes]:
        """Every video's or audio clip's encoded bytes (decoding comes later, in the input pool): 400
        naming the bad one."""

        def one(i, url):
            if isinstance(url, bytes):  # already in hand (a form's file): only the size to check
                if len(url) > limits.max_bytes:
                    raise APIError(
                        413, f"{kind} is over the {limits.max_bytes} byte limit", code=f"{kind}_too_large"
                    )
                return url
            try:
                return media.read_media_bytes(url, limits, kind=kind)
            except media.MediaError as e:
                raise APIError(
                    400, f"{kind} {i + 1}: {e}", param="messages", code=f"invalid_{kind}"
                ) from None

        return list(await asyncio.gather(*(asyncio.to_thread(one, i, u) for i, u in enumerate(urls))))

    def _decode_audio(self, encoded: list[bytes]) -> list[AudioClip]:
        """Each clip's samples at the model's rate, mono (runs in the pool)."""
        rate = self.processor.audio_sampling_rate
        if encoded and rate is None:
            raise ValueError(f"{self.processor.info.model_name} does not accept audio inputs")
        clips = []
        for i, data in enumerate(encoded):
            try:
                samples = audio.decode_audio(data, self.audio_limits, rate)
            except media.MediaError as e:
                raise APIError(400, f"audio {i + 1}: {e}", param="messages", code="invalid_audio") from None
            clips.append(AudioClip(samples, rate, audio.audio_hash(samples, rate)))
        return clips

    def _decode_videos(self, encoded: _Encoded, held: list[int]) -> list[VideoClip]:
        """Each video's frames, sampled by the model's rule as the request asks (runs in the pool), its
        decoded bytes taken from the budget shared across requests (recorded in `held`, which the caller
        gives back): a budget full for image_queue_timeout s is a 429 (one video past the whole budget
        is refused by the decoder's own limit, which is never larger)."""
        proc, cap, budget = self.processor, self.cfg.max_video_frames, self.video_bytes

        def choose(meta):
            n = encoded.frames
            return proc.frame_indices(
                meta.total_frames, meta.fps, fps=encoded.fps, num_frames=n, max_frames=cap
            )

        def reserve(nbytes: int) -> None:
            if not budget.acquire(nbytes, self.cfg.image_queue_timeout):
                log.info("refused: %d decoded video bytes would pass the in-flight budget", nbytes)
                raise APIError(
                    429, "too many video frames are being decoded; retry later", "rate_limit",
                    headers={"Retry-After": "1"},
                )  # fmt: skip
            held.append(nbytes)

        clips = []
        for i, data in enumerate(encoded.videos):
            if isinstance(data, tuple):
                clips.append(self._frame_list(i, *data, reserve))
                continue
            try:
                v = video.decode_video(data, self.video_limits, choose, reserve)
            except media.MediaError as e:
                raise APIError(400, f"video {i + 1}: {e}", param="messages", code="invalid_video") from None
            meta = v.metadata
            sampled_fps = len(v.indices) / meta.total_frames * meta.fps if meta.fps > 0 else 1.0
            times = (
                tuple(i / meta.fps for i in v.indices) if meta.fps > 0 else None
            )  # index / rate, as transformers
            duration = meta.total_frames / meta.fps if meta.fps > 0 else None
            clips.append(VideoClip(v.frames, sampled_fps, video.video_hash(v), times, duration))
        return clips

    def _frame_list(self, i: int, frames: list[bytes], fps: float, reserve) -> VideoClip:
        """A video given as images: each decoded under the image limits, resized to the first frame's
        size where it differs, their decoded bytes taken from the shared budget first (runs in the pool)."""
        import numpy as np
        from PIL import Image

        def bad(j: int, e: Exception) -> APIError:
            return APIError(400, f"video {i + 1}, frame {j + 1}: {e}", param="messages", code="invalid_video")

        opened = []
        for j, data in enumerate(frames):
            try:
                opened.append(media.open_image(data, self.limits))
            except media.MediaError as e:
                raise bad(j, e) from None
        w, h = opened[0].size
        reserve(len(opened) * w * h * 3)
        arrays = []
        for j, im in enumerate(opened):
            try:
                img = media.decode_opened(im)
            except media.MediaError as e:
                raise bad(j, e) from None
            if img.size != (w, h):
                img = img.resize((w, h), Image.Resampling.BICUBIC)
            arrays.append(np.asarray(img, dtype=np.uint8))
        stacked = np.stack(arrays)
        digest = hashlib.sha256(f"frames|{stacked.shape}|{fps}|".encode())
        digest.update(memoryview(np.ascontiguousarray(stacked)).cast("B"))
        times = tuple(j / fps for j in range(len(arrays)))
        return VideoClip(stacked, fps, digest.hexdigest(), times, len(arrays) / fps)

    async def _render(
        self,
        messages: list[dict],
        opened: list,
        kwargs: dict,
        rid: str,
        params,
        cache_salt,
        source=None,
        encoded: _Encoded | None = None,
    ) -> tuple[list[EngineRequest], bool]:
        """(the sequences, whether the rendered prompt opened the think block). `encoded`: the videos
        and audio clips as fetched, decoded here, in the pool."""
        proc = self.processor
        encoded = encoded or _Encoded()

        def work():
            held: list[int] = []  # the decoded video bytes this request holds in the shared budget
            try:
                return render(held)
            finally:
                for n in held:
                    self.video_bytes.release(n)

        def render(held: list[int]):
            clips = self._decode_videos(encoded, held) if encoded.videos else []
            sounds = self._decode_audio(encoded.audios)
            images, hashes = [], []
            for i, im in enumerate(opened):
                try:
                    img = media.decode_opened(im)
                except media.MediaError as e:
                    raise APIError(
                        400, f"image {i + 1}: {e}", param="messages", code="invalid_image"
                    ) from None
                images.append(img)
                hashes.append(media.image_hash(img))
            prompt = proc.render_chat(
                messages, images=images, videos=clips, audios=sounds, pixel_hashes=hashes, **kwargs
            )
            if self.cfg.shared_prefix_cache:
                prompt.shared_prefix_len = proc.system_prefix_len(messages, prompt.prompt_token_ids, **kwargs)
            thinking = kwargs.get("enable_thinking")
            in_thought = proc.reasoning is not None and prompt_opens_thinking(
                prompt.prompt_token_ids, proc.reasoning, proc.tokenizer
            )
            return proc.requests(prompt, params, rid, cache_salt, thinking), in_thought

        try:
            return await self._work(work)
        except APIError:
            raise
        except ValueError as e:
            log.info("%s rejected: %s", rid, e)
            raise _bad_input(e, "messages", source) from None
        except Exception as e:  # template and processor errors are the request's fault
            msg = f"{type(e).__name__}: {e}"
            log.info("%s rejected: %s", rid, msg)
            raise APIError(400, msg, param="messages") from None
