"""The one configuration tree: frozen dataclasses built once (from CLI flags or keyword arguments).

Environment variables are declared here and only here; they are read when a config is built, never
deep inside the engine. Nothing in this module imports torch at module load.
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass, field

# Environment variables Foveal reads (all optional).
ENV_CACHE_DIR = "FOVEAL_CACHE_DIR"  # where converted tokenizers etc. are cached (default ~/.cache/foveal)
ENV_LOG_LEVEL = "FOVEAL_LOG_LEVEL"
ENV_API_KEY = "FOVEAL_API_KEY"  # bearer token for /v1/* (and /metrics unless --metrics-public)
# read from other tools' conventions
ENV_CC = "CC"  # the C compiler for the native kernels (default: cc, then gcc)
ENV_HF_OFFLINE = "HF_HUB_OFFLINE"  # huggingface_hub's offline switch (only to word an error)
ENV_TRITON_INTERPRET = "TRITON_INTERPRET"  # Triton's interpreter (CPU tests of the kernels)


def cache_dir() -> str:
    return os.environ.get(ENV_CACHE_DIR) or os.path.join(os.path.expanduser("~"), ".cache", "foveal")


def default_log_level() -> str:
    return os.environ.get(ENV_LOG_LEVEL, "INFO")


def c_compiler_override() -> str | None:
    return os.environ.get(ENV_CC) or None


def hub_offline() -> bool:
    return os.environ.get(ENV_HF_OFFLINE, "").strip().lower() in ("1", "true", "yes", "on")


def triton_interpreted() -> bool:
    """Triton kernels run in its interpreter (TRITON_INTERPRET=1: no bf16 dot there, so they upcast)."""
    return os.environ.get(ENV_TRITON_INTERPRET) == "1"


QUANTIZATIONS = ("auto", "none", "gguf")


@dataclass(frozen=True, slots=True)
class ModelConfig:
    model: str | None = None  # None: the embedded SmolLM2-135M-Instruct GGUF
    dtype: str = "auto"  # auto | float32 | bfloat16 | float16 (auto: bf16 on CUDA, fp32 on CPU)
    device: str = "auto"  # auto | cpu | cuda | cuda:N
    max_model_len: int | None = None  # default: the model's context length
    seed: int = 0  # for unseeded sampling
    revision: str | None = None
    load_format: str = "auto"  # auto | dummy (random weights from a config alone: benchmarks)
    enforce_eager: bool = False  # no CUDA graphs / recorded CPU decode steps (worker/cpu_graphs.py)
    # none: every weight dequantized to `dtype`; gguf: a GGUF's Q4_0/Q4_1/Q8_0 linear weights run as
    # stored, on CPUs with AVX2 (layers/quant.py: int8 activations per block of 32, as llama.cpp);
    # auto: gguf where it can run (a CPU with the kernel, float32 / bfloat16 activations), else none
    quantization: str = "auto"
    # embeddings (/v1/embeddings): how a prompt's hidden states are pooled. auto: an embedding model's
    # own (transformers' bare *Model architectures: the last token), none for a generative model;
    # last | mean serve a generative model's hidden states too; none: no embeddings
    pooling: str = "auto"


@dataclass(frozen=True, slots=True)
class CacheConfig:
    block_size: int = 16
    kv_cache_memory: int | None = None  # bytes; default: 1 GiB on CPU, a fraction of free memory on CUDA
    gpu_memory_utilization: float = 0.9
    num_blocks: int | None = None  # override (tests); wins over kv_cache_memory
    vision_cache_memory: int = 256 * 2**20  # bytes of projected image embeddings kept (LRU); 0 disables
    enable_prefix_caching: bool = True  # reuse KV blocks of earlier requests with the same prefix
    # auto: K/V in the model dtype; fp8 | int8: quantized, per-token scales, ~2x tokens (attention/kv_quant)
    kv_cache_dtype: str = "auto"
    # the most K/V one request may hold, in tokens (prompt + generated), checked at admission: one long
    # request cannot take the pool from the rest (default: the context length, max_model_len)
    max_request_kv_tokens: int | None = None


@dataclass(frozen=True, slots=True)
class SchedulerConfig:
    # the per-step token budget (prefill chunks + decodes); default 2048, but 128 for a server on CPU
    # (`serving`), where a step's time grows with every token (GEMMs run at full rate from ~128 rows) and
    # a big prefill step stalls every running stream (SmolLM2-135M on the 2-vCPU host, 16 streams: TTFT
    # p50 5.5 s at 2048, 2.7 s at 256; with the CPU decode kernel 2.3-2.4 s at 256, 1.8-1.9 s at 128, at
    # the same or higher throughput). Offline runs keep 2048: at 128 the offline benchmark lost 15%
    # (its last prompts start late and finish in small batches). benchmarks/RESULTS.md. The budget also
    # caps the sequences decoding in one step: requests past it wait in the queue.
    max_num_batched_tokens: int | None = None
    serving: bool = False  # set by `foveal serve`: defaults favour time to first token (see above)
    max_num_seqs: int = 256
    # images encoded per step, in embedding tokens (default: the token budget); one image always passes
    max_encoder_tokens_per_step: int | None = None
    # schedule step N+1 while the device runs step N (default: on for CUDA, off on CPU, where the
    # device is the host and nothing would overlap)
    async_scheduling: bool | None = None

    def for_device(self, device_type: str) -> SchedulerConfig:
        """This config with the default token budget for the device (and for serving) where none was given."""
        if self.max_num_batched_tokens is not None:
            return self
        budget = 128 if self.serving and device_type == "cpu" else 2048
        return dataclasses.replace(self, max_num_batched_tokens=budget)


@dataclass(frozen=True, slots=True)
class ServerConfig:
    """The HTTP layer's settings (`foveal serve`); the engine never reads them."""

    host: str = "127.0.0.1"
    port: int = 8000
    api_key: str | None = None  # default: $FOVEAL_API_KEY (read by from_env); its tenant is "default", admin
    # more keys: (key, tenant, admin); each tenant has its own prefix cache (from --api-key-file)
    api_keys: tuple[tuple[str, str, bool], ...] = ()
    allow_client_cache_salt: bool = False  # honour X-Tenant-Id / cache_salt (within the caller's tenant)
    # blocks wholly inside a chat's leading system message(s) are cached for every tenant: other
    # tenants can then tell (by cached_tokens or timing) that a system prompt was used before
    shared_prefix_cache: bool = False
    served_model_name: str | None = None  # default: the engine's model name
    # tokens a request may generate: its max_tokens when it sends none, and the most it may ask for
    # (more is cut to this, as llama.cpp's --n-predict); None: up to the context
    max_tokens: int | None = 4096
    # waiting sequences over this -> 429 (a request that could never fit: 400); None: unbounded
    max_queued_requests: int | None = 1024
    # seconds without output (queueing included) before a request is ended (504); None: never
    request_timeout: float | None = 600.0
    # input work (templates, tokenizing, image decoding) per request: a deadline, in a pool of its own
    input_timeout: float = 10.0
    input_workers: int = 8
    # chat templates sent by clients (chat_template, chat_template_kwargs.chat_template) are code: only
    # when the operator says so (vLLM's --trust-request-chat-template)
    trust_request_chat_template: bool = False
    metrics_public: bool = False
    ui: bool = True  # the built-in page at / (chat and dashboard, foveal/server/ui); --no-ui: off
    max_body_bytes: int = 4 * 2**20
    # slow clients (server/transport.py, server/body.py): a connection's request headers must arrive in
    # header_timeout s and its body in body_timeout s; idle keep-alive connections close after
    # keep_alive_timeout s; connections past max_connections are turned away
    header_timeout: float = 10.0
    body_timeout: float = 30.0
    keep_alive_timeout: float = 5.0
    max_connections: int = 1024
    drain_timeout: float = 30.0  # on shutdown, running requests get this long to finish
    # images (vision-language models)
    limit_images_per_request: int = 8
    allow_private_media_urls: bool = False  # image URLs on private/loopback/link-local addresses
    allowed_local_media_path: str | None = None  # local image files only under this folder
    media_fetch_timeout: float = 10.0
    max_image_bytes: int = 20 * 2**20
    max_image_pixels: int = 32 * 2**20  # one image, from its header before decoding
    max_request_image_pixels: int = 64 * 2**20  # all of one request's images: 413 over it
    # decoded pixels being processed at once across requests (~7.5 bytes each at the peak: ~1 GiB); a
    # request that would pass it waits up to image_queue_timeout s, then gets a 429
    max_image_pixels_in_flight: int = 128 * 2**20
    image_queue_timeout: float = 10.0
    # videos (the VLMs that take them): encoded bytes, the clip's length (from its header and its
    # packets, before any frame is decoded), frames sampled from one clip (the family's own cap too)
    limit_videos_per_request: int = 2
    max_video_bytes: int = 64 * 2**20
    max_video_duration: float = 600.0
    max_video_frames: int = 256
    # decoded video frames held at once across requests (at the source's size, before resizing): a
    # request past it waits up to image_queue_timeout s, then gets a 429; one video past it all, a 413
    max_video_bytes_in_flight: int = 2 * 2**30
    # audio (the models that hear): encoded bytes (OpenAI's upload limit), the clip's length before
    # decoding (the model's own window applies too: 30 s for Qwen2-Audio)
    limit_audios_per_request: int = 4
    max_audio_bytes: int = 25 * 2**20
    max_audio_duration: float = 600.0

    @classmethod
    def from_env(cls, api_key_file: str | None = None, **kwargs) -> ServerConfig:
        if kwargs.get("api_key") is None:
            kwargs["api_key"] = os.environ.get(ENV_API_KEY) or None
        if api_key_file:
            kwargs["api_keys"] = read_api_key_file(api_key_file)
        cfg = cls(**kwargs)
        if cfg.max_queued_requests is not None and cfg.max_queued_requests < 1:
            raise ValueError("max_queued_requests must be >= 1")
        if cfg.request_timeout is not None and cfg.request_timeout <= 0:
            raise ValueError("request_timeout must be > 0")
        if min(cfg.limit_images_per_request, cfg.limit_videos_per_request, cfg.limit_audios_per_request) < 0:
            raise ValueError("limit_images/videos/audios_per_request must be >= 0")
        if cfg.max_audio_duration <= 0 or cfg.max_audio_bytes < 1:
            raise ValueError("max_audio_duration and max_audio_bytes must be positive")
        if cfg.max_video_duration <= 0 or cfg.max_video_frames < 1 or cfg.max_video_bytes < 1:
            raise ValueError("max_video_duration, max_video_frames and max_video_bytes must be positive")
        if cfg.media_fetch_timeout <= 0:
            raise ValueError("media_fetch_timeout must be > 0")
        for name in ("input_timeout", "body_timeout", "header_timeout", "keep_alive_timeout"):
            if getattr(cfg, name) <= 0:
                raise ValueError(f"{name} must be > 0")
        if cfg.input_workers < 1 or cfg.max_connections < 1:
            raise ValueError("input_workers and max_connections must be >= 1")
        if cfg.max_request_image_pixels > cfg.max_image_pixels_in_flight:
            raise ValueError("max_request_image_pixels must be <= max_image_pixels_in_flight")
        return cfg


def read_api_key_file(path: str) -> tuple[tuple[str, str, bool], ...]:
    """JSON object: {"<key>": "<tenant>"} or {"<key>": {"tenant": "<tenant>", "admin": true}}. Keys that
    share a tenant share its prefix cache; a key without a tenant entry is its own tenant."""
    import json

    try:
        with open(path) as f:
            data = json.load(f)
    except (OSError, ValueError) as e:
        raise ValueError(f"cannot read the API key file {path}: {e}") from None
    if not isinstance(data, dict) or not data:
        raise ValueError(f"the API key file {path} must be a non-empty JSON object of key -> tenant")
    out = []
    for key, v in data.items():
        if isinstance(v, str):
            v = {"tenant": v}
        if not isinstance(key, str) or not key or not isinstance(v, dict):
            raise ValueError(f"the API key file {path}: bad entry for a key")
        out.append((key, str(v.get("tenant") or key), bool(v.get("admin", False))))
    return tuple(out)


SPEC_METHODS = ("ngram", "draft_model", "eagle3", "mtp", "dflash")


def spec_method_of(model: str) -> str:
    """The speculative method a local draft checkpoint is built for, from its config.json's
    architectures: EAGLE-3 and DFlash heads name themselves; anything else is a draft model."""
    import json
    import os

    path = os.path.join(model, "config.json")
    if not os.path.isfile(path):
        raise ValueError(f"speculative config needs a method: {model} has no config.json to read it from")
    with open(path) as f:
        cfg = json.load(f)
    archs = " ".join(cfg.get("architectures") or [])
    if "Eagle3" in archs or cfg.get("speculators_model_type") == "eagle3":
        return "eagle3"
    if "DFlash" in archs:
        return "dflash"
    return "draft_model"


@dataclass(frozen=True, slots=True)
class SpeculativeConfig:
    """Speculative decoding, in vLLM's `--speculative-config` shape (JSON object, same keys):

    {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4, "prompt_lookup_min": 2}
    {"method": "draft_model", "model": PATH, "num_speculative_tokens": 4, "quantization": "gguf"}
    {"method": "eagle3" | "dflash", "model": PATH, "num_speculative_tokens": 4}   (a head's checkpoint)
    {"method": "mtp", "num_speculative_tokens": 1}   (the target's own next-token layers)
    {"model": PATH, ...}   the method read from the checkpoint's config.json

    plus Foveal's "adaptive" (default true): k per row and step, 0 included, by load and acceptance.
    """

    method: str
    num_speculative_tokens: int = 4  # k: drafts proposed per row and step
    prompt_lookup_max: int = 4  # ngram: the longest suffix matched
    prompt_lookup_min: int = 2  # ngram: the shortest
    # draft_model, eagle3, dflash: the draft's checkpoint (shares the target's tokenizer); mtp: where the
    # MTP layers are (default: the target's own checkpoint)
    model: str | None = None
    quantization: str = "auto"  # draft_model: as ModelConfig.quantization, for the draft
    dtype: str = "auto"  # draft_model: its dtype (auto: the target's)
    # choose each row's k per step from measured acceptance and step costs (foveal.speculative.adaptive), so
    # speculation does not cost throughput at high load; false: every row takes k whenever it can
    adaptive: bool = True

    @classmethod
    def parse(cls, value) -> SpeculativeConfig | None:
        """A SpeculativeConfig from a JSON string or a dict (None stays None); ValueError names what is
        wrong."""
        if value is None or isinstance(value, SpeculativeConfig):
            return value
        if isinstance(value, str):
            import json

            try:
                value = json.loads(value)
            except json.JSONDecodeError as e:
                raise ValueError(f"speculative config is not valid JSON: {e}") from None
        if not isinstance(value, dict):
            raise ValueError("speculative config must be a JSON object")
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(value) - names)
        if unknown:
            raise ValueError(f"unknown speculative config key(s): {', '.join(unknown)}")
        if "method" not in value:
            if not value.get("model"):
                raise ValueError(f"speculative config needs a method: one of {', '.join(SPEC_METHODS)}")
            value = {**value, "method": spec_method_of(value["model"])}
        cfg = cls(**value)
        cfg.validate()
        return cfg

    def validate(self) -> None:
        if self.method not in SPEC_METHODS:
            raise ValueError(f"unknown speculative method {self.method!r}; use {' or '.join(SPEC_METHODS)}")

        def positive_int(name: str, lo: int) -> None:
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < lo:
                raise ValueError(f"speculative config {name} must be an integer >= {lo}, got {v!r}")

        positive_int("num_speculative_tokens", 1)
        if self.num_speculative_tokens > 16:
            raise ValueError("speculative config num_speculative_tokens must be <= 16")
        positive_int("prompt_lookup_min", 1)
        positive_int("prompt_lookup_max", 1)
        if self.prompt_lookup_min > self.prompt_lookup_max:
            raise ValueError("speculative config prompt_lookup_min must be <= prompt_lookup_max")
        if self.method in ("draft_model", "eagle3", "dflash") and not self.model:
            raise ValueError(f'speculative method {self.method} needs "model": the draft checkpoint')
        if not isinstance(self.adaptive, bool):
            raise ValueError(f"speculative config adaptive must be true or false, got {self.adaptive!r}")
        if self.quantization not in QUANTIZATIONS:
            raise ValueError(f"speculative config quantization {self.quantization!r}: use auto, none or gguf")


@dataclass(frozen=True, slots=True)
class OutputConfig:
    """How outputs are shaped: the reasoning and tool-call formats, thinking defaults, grammars."""

    # auto: from the tokenizer's think markers (foveal/parsing/reasoning.py; Harmony's markers: gpt-oss's
    # one parser for reasoning, content and calls, foveal/parsing/harmony.py); none; or a format name
    reasoning_parser: str = "auto"
    # auto: from the chat template's markers (foveal/parsing/tools.py; a template without tool support
    # gets a generic Hermes-style tool prompt and parser); none; or a format name
    tool_call_parser: str = "auto"
    enable_thinking: bool | None = None  # chat_template_kwargs.enable_thinking's default (None: template's)
    thinking_budget: int | None = None  # thinking tokens a request may spend (None: no limit)
    grammar_cache_entries: int = 256  # compiled grammars kept (LRU)
    grammar_cache_bytes: int = 512 * 2**20  # and their estimated memory (structured/backend.py)
    # diffusion models: the denoising knobs a request gets where it names none, by name (the fields of
    # foveal/diffusion/state.py's DiffusionParams: steps, block_length, threshold, ...); None: none
    diffusion_config: dict | None = None


@dataclass(frozen=True, slots=True)
class LoRAConfig:
    """LoRA adapters (foveal/lora): vLLM's options and defaults where it has them."""

    enable_lora: bool = False
    max_loras: int = 4  # adapters on the device at once: the most distinct adapters one step runs
    max_lora_rank: int = 16  # the largest rank an adapter may have (sizes the device slots)
    max_cpu_loras: int | None = None  # adapters kept in host memory (None: 2 x max_loras); reloaded on use
    lora_modules: tuple = ()  # adapters registered at start: (name, path) pairs


@dataclass(frozen=True, slots=True)
class EngineConfig:
    model: ModelConfig = field(default_factory=ModelConfig)
    cache: CacheConfig = field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    attention_backend: str = "auto"  # auto | torch | cpu | triton (auto: triton on CUDA, cpu on CPU)
    # the Triton backend's shared-prefix decode: >= this many decode rows holding the same first blocks
    # for >= shared_prefix_min_tokens keys read them once per tile of rows (0 rows: never)
    shared_prefix_min_rows: int = 64
    shared_prefix_min_tokens: int = 1024
    # and a request's own several decode rows (speculation's verify rows, DFlash's and block diffusion's
    # block rows) read its keys once for all of them when it holds >= this many (0: never)
    request_rows_min_tokens: int = 256
    speculative: SpeculativeConfig | None = None  # speculative decoding (None: off)
    output: OutputConfig = field(default_factory=OutputConfig)
    lora: LoRAConfig = field(default_factory=LoRAConfig)

    @classmethod
    def from_kwargs(cls, **kwargs) -> EngineConfig:
        """Build the tree from flat keyword arguments (the CLI and LLM(...) use this).

        Unknown keys raise TypeError naming them, so a typo never silently does nothing.
        """
        parts = {}
        if "speculative_config" in kwargs:  # vLLM's keyword: a JSON string or a dict
            kwargs["speculative"] = SpeculativeConfig.parse(kwargs.pop("speculative_config"))
        subs = (
            ("model", ModelConfig),
            ("cache", CacheConfig),
            ("scheduler", SchedulerConfig),
            ("output", OutputConfig),
            ("lora", LoRAConfig),
        )
        for name, sub in subs:
            names = {f.name for f in dataclasses.fields(sub)}
            parts[name] = sub(**{k: kwargs.pop(k) for k in list(kwargs) if k in names})
        top = {f.name for f in dataclasses.fields(cls)} - set(parts)
        extra = {k: kwargs.pop(k) for k in list(kwargs) if k in top}
        if kwargs:
            raise TypeError(f"unknown engine option(s): {', '.join(sorted(kwargs))}")
        cfg = cls(**parts, **extra)
        cfg.validate()
        return cfg

    def validate(self) -> None:
        s, c = self.scheduler, self.cache
        if s.max_num_batched_tokens is not None and s.max_num_batched_tokens < 1:
            raise ValueError("max_num_batched_tokens must be >= 1")
        if s.max_num_seqs < 1:
            raise ValueError("max_num_seqs must be >= 1")
        if s.max_encoder_tokens_per_step is not None and s.max_encoder_tokens_per_step < 1:
            raise ValueError("max_encoder_tokens_per_step must be >= 1")
        if self.shared_prefix_min_rows < 0 or self.shared_prefix_min_tokens < 1:
            raise ValueError("shared_prefix_min_rows must be >= 0 and shared_prefix_min_tokens >= 1")
        if self.request_rows_min_tokens < 0:
            raise ValueError("request_rows_min_tokens must be >= 0 (0: never)")
        if c.vision_cache_memory < 0:
            raise ValueError("vision_cache_memory must be >= 0 bytes")
        if c.block_size < 1:
            raise ValueError("block_size must be >= 1")
        if c.num_blocks is not None and c.num_blocks < 2:
            raise ValueError("num_blocks must be >= 2")
        if c.kv_cache_memory is not None and c.kv_cache_memory <= 0:
            raise ValueError("kv_cache_memory must be a positive number of bytes")
        if c.kv_cache_dtype not in ("auto", "fp8", "int8"):
            raise ValueError(f"unknown kv_cache_dtype {c.kv_cache_dtype!r}; use auto, fp8 or int8")
        if not 0.0 < c.gpu_memory_utilization <= 1.0:
            raise ValueError("gpu_memory_utilization must be in (0, 1]")
        if self.model.dtype not in ("auto", "float32", "bfloat16", "float16", "fp32", "bf16", "fp16"):
            raise ValueError(f"unknown dtype {self.model.dtype!r}; use auto, float32, bfloat16 or float16")
        if self.model.quantization not in QUANTIZATIONS:
            raise ValueError(f"unknown quantization {self.model.quantization!r}; use auto, none or gguf")
        if self.model.load_format not in ("auto", "dummy"):
            raise ValueError(f"unknown load_format {self.model.load_format!r}; use auto or dummy")
        if self.model.max_model_len is not None and self.model.max_model_len < 1:
            raise ValueError("max_model_len must be >= 1")
        o = self.output
        if o.thinking_budget is not None and o.thinking_budget < 0:
            raise ValueError("thinking_budget must be >= 0 tokens")
        if o.diffusion_config is not None:
            from foveal.diffusion.state import DiffusionParams

            if not isinstance(o.diffusion_config, dict):
                raise ValueError("diffusion_config must be a mapping of knob names to values")
            try:
                DiffusionParams(**o.diffusion_config)
            except TypeError as e:  # an unknown knob
                raise ValueError(f"diffusion_config: {e}") from None
        if o.grammar_cache_entries < 1:
            raise ValueError("grammar_cache_entries must be >= 1")
        if o.grammar_cache_bytes < 1:
            raise ValueError("grammar_cache_bytes must be >= 1")
        lo = self.lora
        if lo.enable_lora:
            if lo.max_loras < 1 or lo.max_lora_rank < 1:
                raise ValueError("max_loras and max_lora_rank must be >= 1")
            if lo.max_cpu_loras is not None and lo.max_cpu_loras < lo.max_loras:
                raise ValueError(f"max_cpu_loras ({lo.max_cpu_loras}) must be >= max_loras ({lo.max_loras})")
        elif lo.lora_modules:
            raise ValueError("lora_modules needs enable_lora")
        if c.max_request_kv_tokens is not None and c.max_request_kv_tokens < 2:
            raise ValueError("max_request_kv_tokens must be >= 2 (a prompt token and a generated one)")
