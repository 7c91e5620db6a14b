"""The request side of the engine: a prompt (text, token ids, chat messages, images) and SamplingParams in,
validated `EngineRequest`s out. Chat templates, tokenizing, the model's image processor, the prompt's
limits, `max_tokens` defaults, `n` expansion and the request id all happen here, in the caller's thread
(the server runs it in its input pool, server/inputs.py), never on the model thread: the engine only
admits what this made.

    processor.requests(prompt, params, "chatcmpl-1", cache_salt)   ->  [EngineRequest, ...] (one per choice)
    loop.submit("chatcmpl-1", those)  /  engine.add_request(one)

Bounds on the work one input may cause: text that could not fit the context whatever it tokenizes to
is refused before tokenizing (`check_text_length`). It holds no engine state, so any number of threads
may use it at once (the tokenizer and processor are read-only here).
"""

from __future__ import annotations

import hashlib
import logging
import threading
import time
from dataclasses import dataclass, replace
from typing import Any

from foveal.config import OutputConfig
from foveal.diffusion.state import DiffusionParams
from foveal.engine.tool_prompt import has_tool_turns, renders_tools, with_tool_prompt
from foveal.parsing import harmony, reasoning, tools
from foveal.request import EngineRequest, InvalidParameter, MultiModalPrompt, SamplingParams, new_request_id
from foveal.structured import closing
from foveal.structured.bitmask import bitmask_words
from foveal.structured.guide import GuideSetup

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class EngineInfo:
    """What the request side and the server know of a started engine: fixed at start-up."""

    model_name: str
    vocab_size: int
    max_model_len: int
    max_request_tokens: int  # prompt + output of one request: the context, or --max-request-kv-tokens
    eos_token_ids: frozenset[int]
    is_multimodal: bool = False
    block_size: int = 16
    prefix_caching: bool = True
    diffusion: Any = None  # a diffusion model's DiffusionInfo (foveal/diffusion/info.py), else None
    max_num_batched_tokens: int = 0  # one step's token budget (a masked diffusion pass must fit it)
    pooling: str | None = None  # embeddings: "last" or "mean" pooling of a prompt's hidden states; None: none


def _salted(item, cache_salt: str | None):
    """The item keyed for this tenant: its content hash is the vision cache's key, and one tenant must
    not reuse (or time) the encoder output of another's image."""
    if not cache_salt:
        return item
    h = hashlib.sha256(f"{cache_salt}\x00{item.content_hash}".encode()).hexdigest()
    return replace(item, content_hash=h)


def _longest_token_chars(tokenizer) -> int:
    """An upper bound on the characters one token covers: its vocabulary string's length (byte-level
    BPE spells each byte as one character, SentencePiece a space as one), special tokens included."""
    vocab = tokenizer.get_vocab()
    return max((len(t) for t in vocab), default=1) or 1


class InputProcessor:
    def __init__(self, info: EngineInfo, tokenizer, mm_processor=None, output: OutputConfig | None = None):
        self.info = info
        self.tokenizer = tokenizer
        self.mm_processor = mm_processor  # engine/multimodal.py's, for a vision-language model
        self.output = output or OutputConfig()
        # no text longer than this can tokenize to a prompt that fits: refused before tokenizing it
        self.max_prompt_chars = info.max_request_tokens * _longest_token_chars(tokenizer)
        # gpt-oss's Harmony: reasoning, content and calls in one message format (foveal/parsing/harmony.py)
        self.harmony = self._harmony()
        self.reasoning = None if self.harmony else self._reasoning_format()  # None: the model does not think
        self.think_ids = (
            (self._marker_ids(self.reasoning.start), self._marker_ids(self.reasoning.end))
            if self.reasoning
            else ((), ())
        )
        template = self.chat_template
        # tool calls: the template renders `tools` itself, or gets the generic (Hermes-style) prompt
        self.native_tools = renders_tools(template)
        # the format's name, or None: no tool parsing (Harmony's calls are its own parser's)
        self.tool_format = None if self.harmony else self._tool_format(template)
        # the markers' special tokens keep their text in the output (the parsers read them)
        keep = set(self.think_ids[0] + self.think_ids[1])
        self.tool_special: dict[str, int] = {}  # the format's markers that are special tokens (grammars)
        if self.tool_format is not None:
            vocab = tokenizer.get_vocab()
            markup = tools.get_format(self.tool_format).markers.markup
            keep.update(vocab[m] for m in markup if m in vocab)
            added = getattr(tokenizer, "added_tokens_decoder", {}) or {}
            special = {t.content: i for i, t in added.items() if getattr(t, "special", False)}
            self.tool_special = {m: special[m] for m in markup if m in special}
        if self.harmony:
            vocab = tokenizer.get_vocab()
            keep.update(vocab[m] for m in harmony.MARKERS if m in vocab)
        self.keep_special_ids = tuple(sorted(keep))
        self._grammars = None  # the GrammarCache, made at the first constrained request
        self.lora = None  # foveal.lora.registry.LoRARegistry when adapters are enabled (set at start)
        self._grammars_lock = threading.Lock()

    @property
    def chat_template(self) -> str | None:
        for owner in (self.mm_processor and self.mm_processor.processor, self.tokenizer):
            t = getattr(owner, "chat_template", None) if owner is not None else None
            if isinstance(t, str) and t:
                return t
        return None

    def _tool_format(self, template: str | None) -> str | None:
        name = self.output.tool_call_parser
        if name == "none":
            return None
        if name != "auto":
            return tools.get_format(name).name  # ValueError for an unknown name
        if not self.native_tools:
            return "hermes"  # the generic tool prompt asks for Hermes-style calls
        found = tools.detect(template, self.tokenizer)
        if found is None:
            log.warning("the chat template renders tools in a format not recognised; parsing as hermes")
            return "hermes"
        return found.name

    # -- output formats -----------------------------------------------------------------------------
    def _harmony(self) -> bool:
        """Harmony output (auto: where the tokenizer has its markers, unless a parser is named)."""
        named = "harmony" in (self.output.reasoning_parser, self.output.tool_call_parser)
        if not harmony.detect(self.tokenizer):
            if named:
                raise ValueError("the harmony parser needs a tokenizer with Harmony's <|channel|> markers")
            return False
        parsers = {self.output.reasoning_parser, self.output.tool_call_parser}
        return parsers <= {"auto", "harmony"}  # a parser named otherwise takes the output instead

    def _reasoning_format(self):
        name = self.output.reasoning_parser
        if name == "none":
            return None
        if name == "auto":
            name = reasoning.detect(self.tokenizer)
            return reasoning.get_format(name) if name else None
        return reasoning.get_format(name)  # ValueError for an unknown name

    def _marker_ids(self, marker: str) -> tuple[int, ...]:
        """A marker's token ids: its own token when the vocabulary has one, else its text encoded."""
        tid = self.tokenizer.get_vocab().get(marker)
        if tid is not None:
            return (tid,)
        return tuple(self.tokenizer.encode(marker, add_special_tokens=False))

    @property
    def grammars(self):
        """The compiled-grammar cache (llguidance over this tokenizer), made on first use."""
        with self._grammars_lock:
            if self._grammars is None:
                from foveal.structured import GrammarCache
                from foveal.structured.llguidance_backend import LLGuidanceBackend

                backend = LLGuidanceBackend.from_tokenizer(
                    self.tokenizer, vocab_size=self.mask_vocab, eos_token_ids=self.info.eos_token_ids
                )
                o = self.output
                self._grammars = GrammarCache(backend, o.grammar_cache_entries, o.grammar_cache_bytes)
            return self._grammars

    def prepare_grammars(self) -> None:
        """Build the grammar backend now (a server, before it serves): made at the first constrained
        request, it stopped every stream for ~0.85 s on the Zen 3 host (llguidance holds the GIL while
        it reads the vocabulary). A tokenizer it cannot use is logged; such requests then get its 400."""
        t = time.perf_counter()
        try:
            backend = self.grammars.backend
        except ValueError as e:
            log.warning("structured outputs are unavailable: %s", e)
            return
        backend.byte_tokens, backend.lead_bytes  # noqa: B018 - the closing plans' tables (Python loops)
        log.info("grammar backend ready in %.2f s", time.perf_counter() - t)

    @property
    def mask_vocab(self) -> int:
        """Tokens a grammar mask covers: the model's vocabulary, or the tokenizer's where it has more
        (the logits' missing columns are simply never allowed)."""
        return max(self.info.vocab_size, len(self.tokenizer))

    def grammar_stats(self):
        """The compiled-grammar cache's GrammarCacheStats, or None before it was built (a server builds it
        before it serves; the offline LLM at its first constrained request)."""
        with self._grammars_lock:
            return self._grammars.stats() if self._grammars is not None else None

    def _guide(self, ids, params: SamplingParams, thinking: bool | None) -> GuideSetup | None:
        """How this request's tokens are steered: its grammar (compiled here, in the caller's thread;
        a bad spec is a ValueError) and its thinking budget; None when nothing steers them."""
        budget = params.thinking_budget if params.thinking_budget is not None else self.output.thinking_budget
        if self.reasoning is None:
            budget = None  # a model that does not think has nothing to budget
        if params.structured is None and budget is None:
            return None
        grammar = None
        if params.structured is not None:
            try:
                grammar = self.grammars.get(params.structured)
            except ValueError as e:  # the API layer knows which field the spec came from
                raise InvalidParameter("structured", str(e)) from None
        close = grammar is not None and params.close_on_length
        if close:  # what a closing plan reads, and the plan from the start: not on the model thread
            closing.prepare(grammar, params.max_tokens)
        start, end = self.think_ids
        opened = self.reasoning is not None and reasoning.prompt_opens_thinking(
            ids, self.reasoning, self.tokenizer
        )
        if thinking is None:
            thinking = self.output.enable_thinking is not False
        return GuideSetup(
            grammar,
            start,
            end,
            in_thinking=opened,
            may_think=not opened and thinking and self.reasoning is not None,
            thinking_budget=budget,
            mask_words=bitmask_words(self.mask_vocab),
            close_budget=params.max_tokens if close else None,
        )

    # -- prompts ------------------------------------------------------------------------------------
    def tokenize(self, text: str, add_special_tokens: bool = True) -> list[int]:
        self.check_text_length(text)
        return self.tokenizer.encode(text, add_special_tokens=add_special_tokens)

    def check_text_length(self, text: str) -> None:
        """Text that cannot fit the context whatever it tokenizes to is refused without tokenizing it
        (a 4 MB prompt took the tokenizer 5 s of a core to find out)."""
        if len(text) > self.max_prompt_chars:
            raise ValueError(
                f"the prompt has {len(text)} characters; no text over {self.max_prompt_chars} characters "
                f"fits in {self.info.max_request_tokens} tokens"
            )

    def render_chat(
        self,
        messages: list[dict],
        *,
        images=(),
        videos=(),
        audios=(),
        pixel_hashes: list[str] | None = None,
        add_generation_prompt: bool = True,
        tools: list[dict] | None = None,
        **template_kwargs,
    ) -> MultiModalPrompt:
        """Chat messages (a VLM's may have {"type": "image"} parts, one per image in `images`,
        {"type": "video"} parts, one per `VideoClip` in `videos`, and {"type": "audio"} parts, one per
        `AudioClip` in `audios`, in order) -> token ids with expanded placeholders and one item each.
        `tools` (OpenAI function definitions) go to a template that renders them, else into the generic
        tool prompt."""
        if not messages:
            raise ValueError("messages must not be empty")
        if self.native_tools:
            if tools:
                template_kwargs["tools"] = tools
        elif tools or has_tool_turns(messages):
            messages = with_tool_prompt(messages, tools or ())
        if self.mm_processor is None:
            self._text_only(images, videos, audios)
            if not getattr(self.tokenizer, "chat_template", None) and "chat_template" not in template_kwargs:
                raise ValueError("this model has no chat template; use a plain prompt")
            text = self.tokenizer.apply_chat_template(
                messages, tokenize=False, add_generation_prompt=add_generation_prompt, **template_kwargs
            )
            return MultiModalPrompt(self.tokenize(text, add_special_tokens=False), [])
        text = self.mm_processor.render_chat(
            messages, add_generation_prompt=add_generation_prompt, **template_kwargs
        )
        self.check_text_length(text)
        return self.mm_processor.process(
            text,
            list(images),
            videos=list(videos),
            audios=list(audios),
            add_special_tokens=False,
            pixel_hashes=pixel_hashes,
        )

    def render_prompt(
        self, text: str, *, images=(), videos=(), audios=(), pixel_hashes: list[str] | None = None
    ) -> MultiModalPrompt:
        """A plain prompt (a multimodal model's with its placeholder text, one per image, video and
        audio clip) -> token ids and items."""
        if self.mm_processor is None:
            self._text_only(images, videos, audios)
            return MultiModalPrompt(self.tokenize(text), [])
        self.check_text_length(text)
        return self.mm_processor.process(
            text, list(images), videos=list(videos), audios=list(audios), pixel_hashes=pixel_hashes
        )

    @property
    def audio_sampling_rate(self) -> int | None:
        """The rate this model's audio input takes (its feature extractor's), None without audio."""
        mm = self.mm_processor
        if mm is None or mm.adapter.audio_token_id is None:
            return None
        return int(mm.processor.feature_extractor.sampling_rate)

    def frame_indices(self, total_frames: int, video_fps: float, **sampling) -> list[int]:
        """Which frames of a clip of `total_frames` at `video_fps` this model's video input takes: the
        family's rule (models/vlm.py ImageAdapter.frame_indices) with the request's `sampling` (fps,
        num_frames, max_frames). ValueError for a model that takes no video."""
        if self.mm_processor is None or self.mm_processor.adapter.video_token_id is None:
            raise ValueError(f"{self.info.model_name} does not accept video inputs")
        return self.mm_processor.adapter.frame_indices(total_frames, video_fps, **sampling)

    def apply_chat_template(
        self, messages: list[dict], add_generation_prompt: bool = True, **template_kwargs
    ) -> list[int]:
        return self.render_chat(
            messages, add_generation_prompt=add_generation_prompt, **template_kwargs
        ).prompt_token_ids

    def _text_only(self, images, videos=(), audios=()) -> None:
        for what, given in (("images", images), ("videos", videos), ("audio", audios)):
            if given:
                raise ValueError(f"{self.info.model_name} is a text-only model; it does not accept {what}")

    def system_prefix_len(self, messages: list[dict], ids: list[int], **template_kwargs) -> int:
        """How many leading tokens of `ids` (these messages' rendered chat) are the leading system
        message(s) alone, as the template renders them without a generation prompt; 0 when there are
        none, or when that rendering is not a token prefix of `ids` (a template that changes earlier
        text depending on later messages)."""
        n = 0
        while n < len(messages) and messages[n].get("role") in ("system", "developer"):
            n += 1
        if n == 0:
            return 0
        drop = ("add_generation_prompt", "continue_final_message")
        kw = {k: v for k, v in template_kwargs.items() if k not in drop}
        try:
            pre = self.apply_chat_template(messages[:n], add_generation_prompt=False, **kw)
        except Exception:  # a template that cannot render a system-only chat: share nothing
            return 0
        return len(pre) if 0 < len(pre) <= len(ids) and ids[: len(pre)] == pre else 0

    # -- requests -----------------------------------------------------------------------------------
    def requests(
        self,
        prompt: str | list[int] | MultiModalPrompt,
        params: SamplingParams | None = None,
        request_id: str | None = None,
        cache_salt: str | None = None,
        thinking: bool | None = None,
    ) -> list[EngineRequest]:
        """One request of `params.n` choices -> one EngineRequest per choice: the request id itself for
        n == 1, `{id}-{i}` otherwise; seeded choices get seeds seed + i. ValueError (InvalidParameter
        for a sampling field) says what is wrong; nothing is admitted by this."""
        params = params or SamplingParams()
        rid = request_id or new_request_id()
        first = self.request(prompt, replace(params, n=1), rid, cache_salt, thinking)
        if params.n == 1:
            return [first]
        return [
            replace(first, request_id=f"{rid}-{i}", params=replace(first.params, seed=p.seed))
            for i, p in enumerate(params.choices())
        ]

    def request(
        self,
        prompt: str | list[int] | MultiModalPrompt,
        params: SamplingParams | None = None,
        request_id: str | None = None,
        cache_salt: str | None = None,
        thinking: bool | None = None,
    ) -> EngineRequest:
        """One sequence (params.n must be 1). `cache_salt` isolates the prefix cache (and the vision
        cache): requests with different salts never share a block or an image's embeddings.
        `thinking`: chat_template_kwargs.enable_thinking (None: the server default), i.e. whether the
        output may open a think block."""
        params = params or SamplingParams()
        info = self.info
        if params.n != 1:
            raise ValueError("request() makes one sequence; use requests() for n > 1")
        params.check_vocab(info.vocab_size)
        if isinstance(prompt, str):
            prompt = self.render_prompt(prompt)
        mm = prompt if isinstance(prompt, MultiModalPrompt) else None
        if mm is not None:
            ids = mm.prompt_token_ids
            if mm.items and not info.is_multimodal:
                raise ValueError(f"{info.model_name} is a text-only model; it does not accept images")
            if any(it.offset < 0 or it.end > len(ids) for it in mm.items):
                raise ValueError("an image or video placeholder span lies outside the prompt")
        else:
            ids = prompt
        if not ids:
            raise ValueError("the prompt is empty")
        limit = info.max_request_tokens
        what = (
            f"the context of {limit} tokens"
            if limit == info.max_model_len
            else f"the per-request KV limit of {limit} tokens (--max-request-kv-tokens)"
        )
        if len(ids) >= limit:
            raise ValueError(
                f"the prompt has {len(ids)} tokens but {what} leaves no room "
                "(prompt plus at least one generated token must fit)"
            )
        vocab = info.vocab_size  # checked after the length: a too-long prompt costs no scan
        if any(not isinstance(t, int) or not 0 <= t < vocab for t in ids):
            raise ValueError(f"prompt token ids must be integers in [0, {vocab})")
        room = limit - len(ids)
        if params.max_tokens is None:
            params = replace(params, max_tokens=min(room, params.default_max_tokens or room))
        if self.keep_special_ids and params.skip_special_tokens and not params.keep_special_token_ids:
            params = replace(params, keep_special_token_ids=self.keep_special_ids)
        if params.max_tokens > room:
            raise ValueError(f"prompt ({len(ids)} tokens) + max_tokens ({params.max_tokens}) exceeds {what}")
        diffusion = info.diffusion is not None or params.diffusion is not None
        if diffusion:
            params = self._check_diffusion(len(ids), params, limit, what)
        return EngineRequest(
            request_id or new_request_id(),
            tuple(ids),
            params,
            eos_token_ids=info.eos_token_ids,
            mm_items=tuple(_salted(it, cache_salt) for it in mm.items) if mm is not None else (),
            rope=mm.rope if mm is not None and mm.items else None,
            cache_salt=cache_salt,
            shared_prefix_len=min(mm.shared_prefix_len, len(ids)) if mm is not None else 0,
            guide=None if diffusion else self._guide(ids, params, thinking),
        )

    def embedding_request(
        self, text_or_ids: str | list[int], request_id: str | None = None, cache_salt: str | None = None
    ) -> EngineRequest:
        """One input of /v1/embeddings: its tokens (a string tokenized as the model's tokenizer adds
        special tokens), to be pooled by the engine (`info.pooling`), no token generated."""
        info = self.info
        if info.pooling is None:
            raise ValueError(
                f"{info.model_name} is not served for embeddings (a generative model: start it with "
                "--pooling last or mean)"
            )
        ids = self.tokenizer(text_or_ids)["input_ids"] if isinstance(text_or_ids, str) else list(text_or_ids)
        if not ids:
            raise ValueError("an input is empty")
        if len(ids) > info.max_request_tokens - 1:
            raise ValueError(f"an input has {len(ids)} tokens; at most {info.max_request_tokens - 1} fit")
        if any(not isinstance(t, int) or not 0 <= t < info.vocab_size for t in ids):
            raise ValueError(f"input token ids must be integers in [0, {info.vocab_size})")
        params = SamplingParams(temperature=0.0, max_tokens=1)  # never reached: the prompt ends it
        rid = request_id or new_request_id("emb")
        return EngineRequest(rid, tuple(ids), params, cache_salt=cache_salt, pooling=info.pooling)

    # sampling fields a diffusion pass does not apply (yet): field -> whether the request sets it
    _NOT_FOR_DIFFUSION = {
        "logprobs": lambda p: p.logprobs is not None,
        "repetition_penalty": lambda p: p.repetition_penalty != 1.0,
        "presence_penalty": lambda p: p.presence_penalty != 0.0,
        "frequency_penalty": lambda p: p.frequency_penalty != 0.0,
        "logit_bias": lambda p: bool(p.logit_bias),
        "min_tokens": lambda p: p.min_tokens > 0,
        "min_p": lambda p: p.min_p != 0.0,
        "structured": lambda p: p.structured is not None,
        "thinking_budget": lambda p: p.thinking_budget is not None,
    }

    def _check_diffusion(self, prompt_len: int, params: SamplingParams, limit: int, what: str):
        """A diffusion model's request: the fields its passes do not apply are refused by name; the
        knobs (the server's defaults where the request names none) must fit the model; a pass must fit
        one step (masked) and the last block the context. Returns the params with the knobs filled."""
        d = self.info.diffusion
        if d is None:
            raise InvalidParameter(
                "diffusion", f"{self.info.model_name} is not a diffusion model: steps, block_length and "
                "threshold apply to diffusion models only",
            )  # fmt: skip
        for name, used in self._NOT_FOR_DIFFUSION.items():
            if used(params):
                raise InvalidParameter(name, f"{name} is not supported with diffusion decoding")
        knobs, defaults = params.diffusion or DiffusionParams(), dict(self.output.diffusion_config or {})
        if d.kind == "block":
            defaults.pop("block_length", None)  # a block model's block is its own
        knobs = replace(knobs, **{k: v for k, v in defaults.items() if getattr(knobs, k) is None})
        params = replace(params, diffusion=knobs)
        if d.kind == "block":
            if knobs.block_length not in (None, d.block_size):
                raise InvalidParameter(
                    "block_length",
                    f"block_length={knobs.block_length}: this model denoises blocks of {d.block_size}",
                )
            end = -(-(prompt_len + params.max_tokens) // d.block_size) * d.block_size
            if end > limit:
                raise ValueError(
                    f"prompt ({prompt_len} tokens) + max_tokens ({params.max_tokens}), rounded up to whole "
                    f"blocks of {d.block_size}, exceeds {what}"
                )
        elif prompt_len + params.max_tokens > self.info.max_num_batched_tokens:
            raise ValueError(
                f"a masked diffusion pass computes prompt + max_tokens ({prompt_len} + {params.max_tokens}) "
                f"tokens in one step; the step's token budget is {self.info.max_num_batched_tokens} "
                "(--max-num-batched-tokens)"
            )
        return params
