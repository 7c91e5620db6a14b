"""Per-request data: what a caller asks for (SamplingParams), the processed request the engine admits
(EngineRequest), and what the engine tracks (Request).

One request_id follows a request from the API to the logs. This module owns validation of sampling
values and their limits (one set, the same for the HTTP API and the library): a bad value raises
InvalidParameter naming the field when the SamplingParams is made, before anything is admitted; the
checks that need the model's vocabulary run once more in the input processor (`check_vocab`).
It must not import torch or anything model-specific.
"""

from __future__ import annotations

import enum
import uuid
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # the feature packages' types, for the fields that carry them (no import at run time)
    from foveal.diffusion.state import DiffusionParams, DiffusionState
    from foveal.lora.adapter import HostAdapter
    from foveal.structured.constraint import OutputConstraint
    from foveal.structured.guide import GuideSetup

# The limits of sampling values (the server's OpenAPI schema publishes these same numbers)
MAX_N = 16  # choices per prompt
MAX_TEMPERATURE = 2.0
MAX_TOP_LOGPROBS = 20
MAX_PENALTY = 2.0  # presence and frequency penalties lie in [-MAX_PENALTY, MAX_PENALTY]
MAX_REPETITION_PENALTY = 10.0
MAX_STOPS, MAX_STOP_CHARS = 16, 1024  # the detokenizer matches every stop string after every token
MAX_STOP_TOKEN_IDS = 64
MAX_LOGIT_BIAS, MAX_BIAS = 300, 100.0  # entries (applied to the row at every step); |bias|


class InvalidParameter(ValueError):
    """A bad request value; `param` names the field (the HTTP layer's 400 carries it)."""

    def __init__(self, param: str, message: str):
        super().__init__(message)
        self.param = param


@dataclass(frozen=True, slots=True)
class SamplingParams:
    """How to pick tokens for one request: immutable, validated when made (`dataclasses.replace`
    validates the copy too).

    temperature 0 means greedy. top_k <= 0 and top_p == 1 and min_p == 0 switch those filters off.
    logprobs=None returns no logprobs; logprobs=k (0..20) returns the sampled token's logprob plus the
    k most likely tokens (from the raw model distribution, before penalties and temperature).
    max_tokens=None: as many as the context leaves (the input processor fills it in), or
    `default_max_tokens` where that is fewer (a server's --max-tokens).
    """

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: dict[int, float] | None = None
    seed: int | None = None
    max_tokens: int | None = 16
    default_max_tokens: int | None = None
    min_tokens: int = 0
    ignore_eos: bool = False
    stop: tuple[str, ...] = ()  # any sequence is taken (a str: one stop string), kept as a tuple
    stop_token_ids: tuple[int, ...] = ()
    include_stop_str_in_output: bool = False
    logprobs: int | None = None
    skip_special_tokens: bool = True
    # special tokens whose text stays in the output anyway: the markers a reasoning or tool-call parser
    # reads (the input processor sets them)
    keep_special_token_ids: tuple[int, ...] = ()
    speculative: bool = True  # may this request speculate when the engine does (False: plain decoding)
    # structured output: a OutputConstraint (foveal/structured/constraint.py) the answer must match, or None
    structured: OutputConstraint | None = None
    # a structured answer that would run past max_tokens is closed by a short completion of its
    # grammar, forced at the end (finish_reason stays "length"); False: cut wherever it is
    close_on_length: bool = True
    thinking_budget: int | None = (
        None  # thinking tokens before the end of thinking is forced (None: the default)
    )
    # a diffusion model's denoising knobs: a DiffusionParams (foveal/diffusion/state.py), or None
    diffusion: DiffusionParams | None = None
    # logit_bias as two parallel tuples (token ids, biases): made once here, read by the sampler each step
    bias_token_ids: tuple[int, ...] = field(default=(), init=False, repr=False, compare=False)
    bias_values: tuple[float, ...] = field(default=(), init=False, repr=False, compare=False)
    # any of the three penalties is on (made once here: the sampler asks per row each step)
    needs_penalties: bool = field(default=False, init=False, repr=False, compare=False)
    # the sampling kernel's per-row values, made once here: (temperature, 0 when greedy; min_p; top_k,
    # 0 when off; top_p; repetition, frequency and presence penalties) as floats
    kernel_columns: tuple[float, ...] = field(default=(), init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        set_ = object.__setattr__
        stop = [self.stop] if isinstance(self.stop, str) else self.stop
        set_(self, "stop", tuple(stop or ()))
        set_(self, "stop_token_ids", tuple(self.stop_token_ids or ()))
        set_(self, "keep_special_token_ids", tuple(self.keep_special_token_ids or ()))
        if isinstance(self.logit_bias, dict):
            set_(self, "logit_bias", dict(self.logit_bias))  # a copy: the caller's later edits never reach it
        self._validate()
        if self.logit_bias:
            set_(self, "bias_token_ids", tuple(self.logit_bias))
            set_(self, "bias_values", tuple(float(b) for b in self.logit_bias.values()))
        rep, freq, pres = self.repetition_penalty, self.frequency_penalty, self.presence_penalty
        set_(self, "needs_penalties", rep != 1.0 or pres != 0.0 or freq != 0.0)
        columns = (self.temperature, self.min_p, max(self.top_k, 0), self.top_p, rep, freq, pres)
        set_(self, "kernel_columns", tuple(float(v) for v in columns))

    def choices(self) -> list[SamplingParams]:
        """n choices -> n single-sequence params; seeded choices get distinct, reproducible seeds seed+i."""
        return [replace(self, n=1, seed=None if self.seed is None else self.seed + i) for i in range(self.n)]

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    def _bad(self, name: str, why: str):
        return InvalidParameter(name, f"invalid sampling parameter {name}={getattr(self, name)!r}: {why}")

    def _validate(self) -> None:
        """Raise InvalidParameter naming the first bad field."""
        bad = self._bad
        if not _is_int(self.n) or not 1 <= self.n <= MAX_N:
            raise bad("n", f"must be an integer in [1, {MAX_N}]")
        if not _is_num(self.temperature) or not 0 <= self.temperature <= MAX_TEMPERATURE:
            raise bad("temperature", f"must be in [0, {MAX_TEMPERATURE:g}] (0 means greedy)")
        if not _is_num(self.top_p) or not 0.0 < self.top_p <= 1.0:
            raise bad("top_p", "must be in (0, 1]")
        if not _is_int(self.top_k) or self.top_k < -1:
            raise bad("top_k", "must be an integer; 0 or -1 disables it")
        if not _is_num(self.min_p) or not 0.0 <= self.min_p <= 1.0:
            raise bad("min_p", "must be in [0, 1]")
        rp = self.repetition_penalty
        if not _is_num(rp) or not 0 < rp <= MAX_REPETITION_PENALTY:
            raise bad("repetition_penalty", f"must be in (0, {MAX_REPETITION_PENALTY:g}] (1 disables it)")
        for name in ("presence_penalty", "frequency_penalty"):
            v = getattr(self, name)
            if not _is_num(v) or not -MAX_PENALTY <= v <= MAX_PENALTY:
                raise bad(name, f"must be in [-{MAX_PENALTY:g}, {MAX_PENALTY:g}]")
        if self.max_tokens is not None and (not _is_int(self.max_tokens) or self.max_tokens < 1):
            raise bad("max_tokens", "must be an integer >= 1")
        if self.default_max_tokens is not None and not (
            _is_int(self.default_max_tokens) and self.default_max_tokens >= 1
        ):
            raise bad("default_max_tokens", "must be an integer >= 1")
        if not _is_int(self.min_tokens) or self.min_tokens < 0:
            raise bad("min_tokens", "must be an integer >= 0")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise bad("min_tokens", f"must be <= max_tokens ({self.max_tokens})")
        if self.seed is not None and not _is_int(self.seed):
            raise bad("seed", "must be an integer")
        if self.logprobs is not None and (
            not _is_int(self.logprobs) or not 0 <= self.logprobs <= MAX_TOP_LOGPROBS
        ):
            raise bad("logprobs", f"must be an integer in [0, {MAX_TOP_LOGPROBS}]")
        if self.thinking_budget is not None and (
            not _is_int(self.thinking_budget) or self.thinking_budget < 0
        ):
            raise bad("thinking_budget", "must be an integer >= 0")
        if self.structured is not None and not hasattr(self.structured, "kind"):
            raise bad("structured", "must be a OutputConstraint")
        if self.diffusion is not None and not hasattr(self.diffusion, "threshold"):
            raise bad("diffusion", "must be a DiffusionParams")
        if len(self.stop) > MAX_STOPS:
            raise bad("stop", f"at most {MAX_STOPS} stop strings")
        if any(not isinstance(s, str) or not s or len(s) > MAX_STOP_CHARS for s in self.stop):
            raise bad("stop", f"must be non-empty strings of at most {MAX_STOP_CHARS} characters")
        if len(self.stop_token_ids) > MAX_STOP_TOKEN_IDS:
            raise bad("stop_token_ids", f"at most {MAX_STOP_TOKEN_IDS} stop token ids")
        if any(not _is_int(t) or t < 0 for t in self.stop_token_ids):
            raise bad("stop_token_ids", "must be non-negative integers")
        if self.logit_bias is not None:
            if not isinstance(self.logit_bias, dict) or len(self.logit_bias) > MAX_LOGIT_BIAS:
                raise bad("logit_bias", f"must be a mapping of at most {MAX_LOGIT_BIAS} token ids to biases")
            for tok, bias in self.logit_bias.items():
                if not _is_int(tok) or tok < 0:
                    raise bad("logit_bias", f"token id {tok!r} is not in the vocabulary")
                if not _is_num(bias) or not -MAX_BIAS <= bias <= MAX_BIAS:
                    raise bad("logit_bias", f"bias {bias!r} for token {tok} must be in [-100, 100]")

    def check_vocab(self, vocab_size: int) -> None:
        """The checks that need the model: every token id named must be in its vocabulary."""
        for t in self.bias_token_ids:
            if t >= vocab_size:
                raise self._bad("logit_bias", f"token id {t} is not in the vocabulary ({vocab_size})")
        for t in self.stop_token_ids:
            if t >= vocab_size:
                raise self._bad("stop_token_ids", f"token id {t} is not in the vocabulary ({vocab_size})")


def _is_int(x: object) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _is_num(x: object) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and x == x  # rejects NaN


class FinishReason(enum.StrEnum):
    STOP = "stop"  # EOS, a stop token or a stop string
    LENGTH = "length"  # max_tokens or the context limit
    ABORT = "abort"  # cancelled by the caller
    ERROR = "error"  # a failure that belongs to this request


class RequestStatus(enum.Enum):
    WAITING = enum.auto()
    RUNNING = enum.auto()
    PREEMPTED = enum.auto()
    FINISHED = enum.auto()


def new_request_id(prefix: str = "req") -> str:
    """The one request-id scheme: `prefix-` and 24 random hex digits (OpenAI's shape: chatcmpl-...,
    cmpl-...; req- for an HTTP request's X-Request-Id and the engine's default, gen- for LLM.generate).
    A request of n choices runs as ids `<id>-0` .. `<id>-<n-1>` (InputProcessor.requests)."""
    return f"{prefix}-{uuid.uuid4().hex[:24]}"


@dataclass(frozen=True, slots=True, eq=False)
class VideoClip:
    """A clip's sampled frames, as a VLM's request side takes them (the server decodes them from a URL;
    a library caller may build one from its own frames)."""

    frames: Any  # numpy uint8 [T, H, W, 3], RGB
    fps: float  # frames per second of these frames (the sampled rate, not the source's)
    content_hash: str = ""  # over the frames and their sampling: same clip, same sampling -> same hash
    # each frame's time in the source, seconds (its index / the source's rate); None: j / fps
    timestamps: tuple[float, ...] | None = None
    duration: float | None = None  # the source's length, seconds (None: unknown)


@dataclass(frozen=True, slots=True, eq=False)
class AudioClip:
    """A clip's samples, as an audio model's request side takes them."""

    samples: Any  # numpy float32 [n], mono, in [-1, 1]
    sampling_rate: int
    content_hash: str = ""  # over the samples: the same sound hashes the same whatever its container


@dataclass(slots=True, eq=False)
class MultiModalItem:
    """One image, video or audio clip of a request: where its placeholder tokens sit in the prompt and
    what the encoder needs.

    The span [offset, offset + length) covers the image's placeholder run. Most families fill every
    position of it with an embedding; some (Idefics3) interleave text tokens (row/column markers), so
    `embed_index[i]` gives, for span position i, the row of the image's embeddings it takes, or -1.

        prompt:      t t <img> <img> <img> <img> t t          offset=2, length=4, num_embeds=4
        idefics3:    t <fake> <row_1_col_1> <img> <img> <fake> ...   embed_index = [-1, -1, 0, 1, -1, ...]
    """

    modality: str  # "image" | "video" | "audio"
    offset: int
    length: int
    num_embeds: int
    content_hash: str  # over decoded pixels and processor output: the vision-cache and prefix-cache key
    data: dict[str, Any]  # this item's processor outputs (tensors), in the form the model's encoder takes
    embed_index: Any = None  # torch.LongTensor [length] or None when every span position is an embedding

    @property
    def end(self) -> int:
        return self.offset + self.length


@dataclass(slots=True, eq=False)
class MultiModalPrompt:
    """A processed prompt with images: token ids with placeholders expanded, and one item per image."""

    prompt_token_ids: list[int]
    items: list[MultiModalItem]
    # the model family's rotary positions for this prompt where they are not 0, 1, 2, ... (M-RoPE: see
    # models/qwen2_vl.py); the runner hands it back to the model, never reads it
    rope: Any = None
    # leading tokens (the system prompt) whose cached blocks may be shared across tenants (opt-in)
    shared_prefix_len: int = 0


@dataclass(frozen=True, slots=True, eq=False)
class EngineRequest:
    """One sequence, processed and validated on the request side (engine/input_processor.py), ready to
    admit: what crosses from the server's input pool to the model thread. Nothing here is input work
    left to do (tokens, image tensors, limits, max_tokens resolved)."""

    request_id: str
    prompt_token_ids: tuple[int, ...]
    params: SamplingParams  # max_tokens filled in (never None)
    eos_token_ids: frozenset[int] = frozenset()
    mm_items: tuple[MultiModalItem, ...] = ()  # content hashes already salted with the tenant's salt
    rope: Any = None  # see MultiModalPrompt.rope
    cache_salt: str | None = None
    shared_prefix_len: int = 0
    guide: GuideSetup | None = None  # the answer's grammar, think markers, budget (structured/guide.py)
    lora: HostAdapter | None = None  # the LoRA adapter to run with (None: the base model)
    # an embedding request: its prompt's hidden states pooled ("last" token or "mean"), no token sampled
    pooling: str | None = None


@dataclass(slots=True, eq=False)
class Request:
    """Engine-side state of one sequence. Owned by the engine thread; nobody else mutates it.

    all_token_ids = prompt + output, the tokens the host knows. With async scheduling up to two more
    are in flight (`num_pending`: sampled on the device, not yet seen here); they count in num_tokens
    and num_output_tokens, so the scheduler plans positions past them. num_computed_tokens counts
    positions whose K/V sit in the cache; after preemption it drops to 0 and the whole sequence is
    recomputed (prompt and output alike).
    """

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    eos_token_ids: frozenset[int] = frozenset()
    arrival: int = 0  # monotonically increasing admission order (FCFS)
    output_token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    block_ids: list[int] = field(default_factory=list)
    # block_ids as a tuple, made again only when the KV manager changes them: a decode step hands the
    # same object on each step (no copy a row a step), and the attention backend converts it once
    block_table: tuple[int, ...] = ()
    status: RequestStatus = RequestStatus.WAITING
    finish_reason: FinishReason | None = None
    num_preemptions: int = 0
    announced: bool = False  # the runner has its NewRequest (sent with the first step that ran it)
    # A cache of prompt+output, appended in place, so the scheduler never re-concatenates lists.
    all_token_ids: list[int] = field(default_factory=list)
    mm_items: list[MultiModalItem] = field(default_factory=list)  # in prompt order, spans disjoint
    rope: Any = None  # the model family's rotary positions (MultiModalPrompt.rope)
    guide: GuideSetup | None = None  # its tokens are steered (structured/driver.py masks its rows)
    encoder_time_s: float = 0.0  # this request's share of vision-encoder time (the runner reports it)
    # prefix cache: the tenant salt (never shared across salts), block keys computed so far, how many
    # of the request's blocks are published, and the prompt tokens a hit saved at first admission
    cache_salt: str | None = None
    # blocks wholly inside the first shared_prefix_len tokens are keyed without the salt (see
    # KVCacheManager.block_keys): the operator's --shared-prefix-cache, for system prompts
    shared_prefix_len: int = 0
    block_hashes: list[bytes] = field(default_factory=list)
    num_published_blocks: int = 0
    num_cached_tokens: int = 0
    # overlapped steps (async scheduling): tokens being sampled on the device (at most two: the step in
    # flight and the one being launched); `ends_after_pending`: the newest of them reaches a length
    # limit, so nothing more is scheduled
    num_pending: int = 0
    ends_after_pending: bool = False
    # speculative decoding: proposals for the positions after the last token, verified by the next step
    draft_ids: list[int] = field(default_factory=list)
    # a diffusion model's canvas (foveal/diffusion/state.py), set by the diffusion driver at admission
    diffusion: DiffusionState | None = None
    lora: HostAdapter | None = None  # or None (see EngineRequest)
    pooling: str | None = None  # an embedding request's pooling (see EngineRequest)

    def __post_init__(self) -> None:
        if not self.all_token_ids:
            self.all_token_ids = list(self.prompt_token_ids) + list(self.output_token_ids)

    @classmethod
    def admit(cls, r: EngineRequest, arrival: int) -> Request:
        """The engine-side state of a processed request."""
        return cls(
            r.request_id,
            list(r.prompt_token_ids),
            r.params,
            eos_token_ids=r.eos_token_ids,
            arrival=arrival,
            mm_items=list(r.mm_items),
            rope=r.rope,
            cache_salt=r.cache_salt,
            shared_prefix_len=r.shared_prefix_len,
            guide=r.guide,
            lora=r.lora,
            pooling=r.pooling,
        )

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids) + self.num_pending

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids) + self.num_pending

    @property
    def is_finished(self) -> bool:
        return self.status is RequestStatus.FINISHED

    @property
    def reads_history(self) -> bool:
        """Whether sampling may read this request's earlier tokens' values on the host: a grammar or
        think-block guide (its mask follows them) or repetition/frequency/presence penalties on a verify
        run (its rows count the drafts; one-row steps count on the device, sample/history.py). Such rows
        wait for tokens in flight; drafts left on the device are read back."""
        return self.guide is not None or self.params.needs_penalties

    def append_token(self, token_id: int) -> None:
        self.output_token_ids.append(token_id)
        self.all_token_ids.append(token_id)

    def append_pending(self) -> None:
        self.num_pending += 1

    def fill_pending(self, token_id: int) -> int:
        """The oldest pending token arrived; returns how many output tokens precede and include it."""
        self.num_pending -= 1
        self.append_token(token_id)
        return len(self.output_token_ids)

    def drop_output(self, n: int) -> None:
        """Forget the last n known output tokens (a run cut short after the engine saw a stop)."""
        if n:
            del self.output_token_ids[-n:]
            del self.all_token_ids[-n:]

    def drop_pending(self) -> None:
        """Forget tokens still in flight (the request ended before them)."""
        self.num_pending = 0


@dataclass(slots=True)
class Logprob:
    token_id: int
    logprob: float


@dataclass(slots=True)
class TokenLogprobs:
    """Logprob of the sampled token and the top-k alternatives at one position."""

    token_id: int
    logprob: float
    top: list[Logprob]


@dataclass(slots=True)
class TokenDelta:
    """What one engine step produced for one request: new tokens, new text, maybe the end."""

    request_id: str
    token_ids: list[int]
    text: str
    logprobs: list[TokenLogprobs] | None = None
    finish_reason: FinishReason | None = None
    stop_reason: str | int | None = None  # the stop string or stop token that ended it
    error: str | None = None
    error_type: str = "server_error"  # invalid_request_error: the request's fault (its grammar's limit)
    num_prompt_tokens: int = 0
    num_output_tokens: int = 0
    num_images: int = 0
    encoder_time_s: float = 0.0  # this request's share of vision-encoder time
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache
    embedding: list[float] | None = None  # an embedding request's pooled hidden state (its final delta)

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    def then(self, later: TokenDelta) -> TokenDelta:
        """This (unfinished) delta followed by `later`, as one: the tokens, text and logprobs of both,
        the rest (finish, counts) from `later`. A consumer that fell behind reads one merged delta."""
        lps = None
        if self.logprobs is not None or later.logprobs is not None:
            lps = (self.logprobs or []) + (later.logprobs or [])
        return replace(
            later, token_ids=self.token_ids + later.token_ids, text=self.text + later.text, logprobs=lps
        )
