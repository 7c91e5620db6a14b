"""The engine: one object that owns the model, the KV pool, the scheduler and every request's state,
and advances them all by one `step()`. It is single-threaded by design; the server's EngineLoop (a
later layer) owns the thread that calls it.

A failure that belongs to one request (detokenizer, stop matching) finishes that request with an
error delta; a failed forward pass aborts only the requests in that batch.
"""

from __future__ import annotations

import hashlib
import logging
import time
from dataclasses import dataclass, field, replace

import torch

from foveal.attention import kv_quant
from foveal.cache.kv_cache_manager import KVCacheManager
from foveal.config import EngineConfig
from foveal.engine.detokenizer import IncrementalDetokenizer
from foveal.request import (
    FinishReason,
    MultiModalPrompt,
    Request,
    RequestStatus,
    SamplingParams,
    TokenDelta,
    TokenLogprobs,
    new_request_id,
)
from foveal.sched.scheduler import Scheduler

log = logging.getLogger(__name__)

_DTYPES = {
    "float32": torch.float32,
    "fp32": torch.float32,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "float16": torch.float16,
    "fp16": torch.float16,
}
DEFAULT_CPU_KV_BYTES = 1 << 30


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


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dev = torch.device(name)
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ValueError("device 'cuda' was requested but CUDA is not available")
    return dev


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    if name == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return _DTYPES[name]


@dataclass(slots=True)
class SpecStats:
    """Cumulative speculative-decoding counts (vLLM's spec_decode metrics)."""

    num_drafts: int = 0  # verify rows that carried drafts
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_pos: list[int] = field(default_factory=list)  # [j]: rows whose draft j+1 was accepted

    def record(self, k: int, a: int) -> None:
        self.num_drafts += 1
        self.num_draft_tokens += k
        self.num_accepted_tokens += a
        if len(self.accepted_per_pos) < k:
            self.accepted_per_pos += [0] * (k - len(self.accepted_per_pos))
        for j in range(a):
            self.accepted_per_pos[j] += 1

    def as_dict(self) -> dict:
        n = self.num_drafts
        return {
            "num_drafts": n,
            "num_draft_tokens": self.num_draft_tokens,
            "num_accepted_tokens": self.num_accepted_tokens,
            "accepted_per_pos": list(self.accepted_per_pos),
            "acceptance_rate": self.num_accepted_tokens / self.num_draft_tokens
            if self.num_draft_tokens
            else 0.0,
            # tokens per verify row: the accepted drafts plus the one the target adds
            "mean_acceptance_length": 1 + self.num_accepted_tokens / n if n else 0.0,
        }


@dataclass(slots=True)
class _Tracked:
    req: Request
    detok: IncrementalDetokenizer
    error: str | None = None


class Engine:
    def __init__(self, config: EngineConfig):
        self.config = config
        self.model = None
        self.tokenizer = None
        self.scheduler: Scheduler | None = None
        self.runner = None
        self._tracked: dict[str, _Tracked] = {}
        self._pending: list[TokenDelta] = []  # deltas produced outside step() (aborts)
        self._arrivals = 0
        self._inflight = None  # the launched step whose tokens have not been applied (async scheduling)
        self.proposer = None  # speculative decoding (foveal.spec), set by start() when configured
        self.spec_stats = SpecStats()
        self.async_scheduling = False  # set by start(): config, else on for CUDA
        # cumulative host time per phase of step() (execute includes the device work it waits for)
        self.step_seconds = {"schedule": 0.0, "execute": 0.0, "update": 0.0, "steps": 0}

    # -- start-up ---------------------------------------------------------------------------------
    def start(self, progress: bool = False) -> Engine:
        from foveal.attention import get_backend
        from foveal.layers import quant
        from foveal.loader import load_checkpoint
        from foveal.models import build_model, max_context
        from foveal.worker.model_runner import ModelRunner

        cfg = self.config
        device = resolve_device(cfg.model.device)
        dtype = resolve_dtype(cfg.model.dtype, device)
        cfg = self.config = replace(cfg, scheduler=cfg.scheduler.for_device(device.type))
        if cfg.model.seed is not None:
            torch.manual_seed(cfg.model.seed)
        t0 = time.perf_counter()
        ckpt = load_checkpoint(
            cfg.model.model,
            dtype=dtype,
            device=device,
            progress=progress,
            revision=cfg.model.revision,
            load_format=cfg.model.load_format,
            keep_blocks=quant.TYPES if self._quantize(device) else (),
        )
        hf = ckpt.hf_config
        max_len = cfg.model.max_model_len or max_context(hf)
        backend = get_backend(cfg.attention_backend, device)
        self.model = build_model(
            hf, backend, max_positions=max(max_len, 1), dtype=dtype, device=device, weights=ckpt.weights
        )
        self.tokenizer = ckpt.tokenizer
        self.model_name = ckpt.name
        self.hf_config = hf
        self.text_config = hf.get_text_config()
        self.vocab_size = self.text_config.vocab_size
        self.is_multimodal = self.model.is_multimodal
        self.encoder_cache = self.mm_processor = None
        if self.is_multimodal:
            from foveal.cache.encoder_cache import EncoderCache
            from foveal.engine.multimodal import MultiModalProcessor

            if ckpt.processor is None:
                raise ValueError(
                    f"{ckpt.name} is a vision-language model but its folder has no processor files"
                )
            self.mm_processor = MultiModalProcessor(ckpt.processor, type(self.model).mm_adapter(hf))
            self.encoder_cache = EncoderCache(cfg.cache.vision_cache_memory)
        load_s = time.perf_counter() - t0

        layers, kv_heads, head_dim = self.model.kv_shape
        bs = cfg.cache.block_size
        kv_dtype = cfg.cache.kv_cache_dtype
        # from the real layout (quantized values + their scales), so fp8/int8 get ~2x the blocks
        block_bytes = layers * bs * kv_quant.bytes_per_token(kv_dtype, dtype, kv_heads, head_dim)
        num_blocks = cfg.cache.num_blocks or self._num_blocks(block_bytes, device, backend, dtype, max_len)
        kv_caches = kv_quant.allocate_kv_caches(
            kv_dtype, layers, num_blocks * bs, kv_heads, head_dim, dtype, device
        )
        kv = KVCacheManager(num_blocks, bs, cfg.cache.enable_prefix_caching)
        if max_len > kv.capacity_tokens:
            log.warning(
                "max_model_len %d exceeds the KV pool (%d tokens); capping it", max_len, kv.capacity_tokens
            )
            max_len = kv.capacity_tokens
        self.max_model_len = max_len
        cap = cfg.cache.max_request_kv_tokens
        # what one request may hold: its context, or less where the operator says so
        self.max_request_tokens = min(max_len, cap) if cap else max_len
        # no text longer than this can tokenize to a prompt that fits: refused before tokenizing it
        self.max_prompt_chars = self.max_request_tokens * _longest_token_chars(self.tokenizer)
        self.scheduler = Scheduler(
            cfg.scheduler,
            kv,
            max_len,
            encoder_cache=self.encoder_cache,
            atomic_mm_spans=self.model.mm_bidirectional,
        )
        spec = cfg.speculative
        self.proposer = None
        if spec is not None:
            from foveal.spec.proposer import build_proposer

            self.proposer = build_proposer(
                spec,
                device=device,
                dtype=dtype,
                backend=backend,
                max_model_len=max_len,
                num_blocks=num_blocks,
                block_size=bs,
            )
        self.runner = ModelRunner(
            self.model,
            kv_caches,
            backend,
            bs,
            device,
            self.vocab_size,
            encoder_cache=self.encoder_cache,
            max_tokens_per_row=1 + (spec.num_speculative_tokens if spec else 0),
        )
        graphs = None
        if self._use_graphs(device, backend):
            from foveal.worker.cuda_graphs import DecodeGraphs as graphs
        elif self._use_cpu_graphs(device, backend, kv_caches, dtype):
            from foveal.worker.cpu_graphs import CpuDecodeGraphs as graphs
        if graphs is not None:
            self.runner.graphs = graphs(
                self.model,
                kv_caches,
                backend,
                block_size=bs,
                max_seqs=self._graph_rows(),
                max_model_len=max_len,
                device=device,
            )
            try:
                self.runner.graphs.capture()  # CUDA: every bucket now; CPU: each at its first step
            except Exception:  # a model that cannot be captured still serves, eagerly
                log.exception("decode-step graph capture failed; decode steps run eagerly")
                self.runner.graphs = None
                if device.type == "cuda":
                    torch.cuda.synchronize(device)
        self.eos_token_ids = self._eos_ids()
        self.device, self.dtype = device, dtype
        overlap = cfg.scheduler.async_scheduling
        self.async_scheduling = device.type == "cuda" if overlap is None else overlap
        log.info(
            "loaded %s (%s, %s) on %s in %.2f s; KV pool (%s): %d tokens in %d blocks of %d (%.1f MiB), "
            "max_model_len %d; attention backend %s; %d tokens per step; %s",
            ckpt.name,
            ckpt.format,
            str(dtype).removeprefix("torch."),
            device,
            load_s,
            str(dtype).removeprefix("torch.") if kv_dtype == "auto" else kv_dtype,
            kv.capacity_tokens,
            num_blocks,
            bs,
            num_blocks * block_bytes / 2**20,
            max_len,
            backend.name,
            cfg.scheduler.max_num_batched_tokens,
            quant.describe(self.model),
        )
        if ckpt.format == "gguf" and device.type == "cpu" and cfg.model.quantization == "none":
            log.info("--quantization gguf runs a GGUF's Q4_0/Q4_1/Q8_0 weights as stored (faster on CPU)")
        elif ckpt.format != "gguf" and cfg.model.quantization == "gguf":
            log.warning("--quantization gguf applies to GGUF files: the %s weights stay dense", ckpt.format)
        return self

    def _graph_rows(self) -> int:
        """Rows a decode-step graph covers: every sequence's 1 + k tokens when speculating (verify runs
        are decode rows)."""
        spec = self.config.speculative
        return self.config.scheduler.max_num_seqs * (1 + (spec.num_speculative_tokens if spec else 0))

    def _quantize(self, device: torch.device) -> bool:
        """Whether GGUF-quantized linears run as stored (`quantization gguf` on a CPU with the kernel)."""
        if self.config.model.quantization == "none":
            return False
        if device.type != "cpu":
            raise ValueError(f"quantization gguf runs on CPUs only (the device is {device}); use none")
        from foveal.layers import quant

        if quant.kernel() is None:
            log.warning("quantization gguf needs an AVX2 CPU and a C compiler: weights are dequantized")
            return False
        return True

    def _use_graphs(self, device: torch.device, backend) -> bool:
        from foveal.worker.cuda_graphs import supports_graphs

        if device.type != "cuda" or self.config.model.enforce_eager:
            return False
        if not supports_graphs(backend):
            log.info("the %s attention backend runs eagerly (no CUDA graphs)", backend.name)
            return False
        return True

    def _use_cpu_graphs(self, device: torch.device, backend, kv_caches, dtype: torch.dtype) -> bool:
        """Recorded decode steps (worker/cpu_graphs.py): on a CPU whose attention backend has the native
        decode kernel, over plain K/V pools of the model's dtype (what that kernel reads)."""
        if device.type != "cpu" or self.config.model.enforce_eager:
            return False
        if getattr(backend, "kernel", None) is None or not hasattr(backend, "fill_graph_metadata"):
            return False
        return all(isinstance(c, torch.Tensor) and c.dtype == dtype for c in kv_caches)

    def _num_blocks(
        self, block_bytes: int, device: torch.device, backend, dtype: torch.dtype, max_len: int
    ) -> int:
        cfg = self.config
        budget = cfg.cache.kv_cache_memory
        if budget is None:
            if device.type == "cuda":
                from foveal.worker import memory
                from foveal.worker.cuda_graphs import DecodeGraphs

                peak = memory.profile_activation_peak(
                    self.model,
                    backend,
                    num_tokens=cfg.scheduler.max_num_batched_tokens,
                    num_seqs=cfg.scheduler.max_num_seqs,
                    max_len=max_len,
                    block_size=cfg.cache.block_size,
                    kv_cache_dtype=cfg.cache.kv_cache_dtype,
                    vocab_size=self.vocab_size,
                )
                reserve = 0
                if self._use_graphs(device, backend):
                    reserve = DecodeGraphs.reserve_bytes(self._graph_rows(), self.vocab_size, dtype)
                budget = memory.kv_pool_bytes(device, cfg.cache.gpu_memory_utilization, peak, reserve)
            else:
                budget = DEFAULT_CPU_KV_BYTES
        n = budget // block_bytes
        if n < 2:
            raise ValueError(
                f"KV cache memory budget {budget} bytes holds fewer than 2 blocks of {block_bytes} bytes"
            )
        return int(n)

    def _eos_ids(self) -> frozenset[int]:
        ids: set[int] = set()
        eos = getattr(self.hf_config, "eos_token_id", None) or getattr(self.text_config, "eos_token_id", None)
        if isinstance(eos, int):
            ids.add(eos)
        elif eos:
            ids.update(eos)
        if self.tokenizer.eos_token_id is not None:
            ids.add(self.tokenizer.eos_token_id)
        return frozenset(ids)

    # -- requests ---------------------------------------------------------------------------------
    def tokenize(self, prompt: str, add_special_tokens: bool = True) -> list[int]:
        self.check_text_length(prompt)
        return self.tokenizer.encode(prompt, add_special_tokens=add_special_tokens)

    def check_text_length(self, text: str) -> None:
        """Text that cannot fit the context whatever it tokenizes to is refused without tokenizing it
        (a 4 MB prompt took the tokenizer 5 s of a core to find out)."""
        if len(text) > self.max_prompt_chars:
            raise ValueError(
                f"the prompt has {len(text)} characters; no text over {self.max_prompt_chars} characters "
                f"fits in {self.max_request_tokens} tokens"
            )

    def process_images(
        self,
        *,
        prompt: str | None = None,
        messages: list[dict] | None = None,
        images=(),
        pixel_hashes: list[str] | None = None,
        **template_kwargs,
    ) -> MultiModalPrompt:
        """Request side (any thread): a prompt or chat messages with {"type": "image"} parts, plus the
        decoded images in order -> token ids with expanded placeholders and one item per image."""
        if not self.is_multimodal:
            if images:
                raise ValueError(f"{self.model_name} is a text-only model; it does not accept images")
            if messages is not None:
                ids = self.apply_chat_template(messages, **template_kwargs)
            else:
                ids = self.tokenize(prompt or "")
            return MultiModalPrompt(ids, [])
        if messages is not None:
            if not messages:
                raise ValueError("messages must not be empty")
            text = self.mm_processor.render_chat(messages, **template_kwargs)
            self.check_text_length(text)
            return self.mm_processor.process(
                text, list(images), add_special_tokens=False, pixel_hashes=pixel_hashes
            )
        self.check_text_length(prompt or "")
        return self.mm_processor.process(prompt or "", list(images), pixel_hashes=pixel_hashes)

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

    def apply_chat_template(
        self, messages: list[dict], add_generation_prompt: bool = True, **template_kwargs
    ) -> list[int]:
        if not messages:
            raise ValueError("messages must not be empty")
        if self.is_multimodal:
            return self.process_images(
                messages=messages, add_generation_prompt=add_generation_prompt, **template_kwargs
            ).prompt_token_ids
        if not getattr(self.tokenizer, "chat_template", None):
            raise ValueError("this model has no chat template; use a plain prompt")
        text = self.tokenizer.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=add_generation_prompt, **template_kwargs
        )
        return self.tokenize(text, add_special_tokens=False)

    def add_request(
        self,
        prompt: str | list[int] | MultiModalPrompt,
        params: SamplingParams | None = None,
        request_id: str | None = None,
        cache_salt: str | None = None,
    ) -> str:
        """Validate and queue one sequence; raises ValueError with the reason on bad input.

        `cache_salt` isolates the prefix cache: requests with different salts never share a block."""
        params = params or SamplingParams()
        params.validate(self.vocab_size)
        if params.n != 1:
            raise ValueError("the engine takes one sequence per request; expand n > 1 before add_request")
        mm = prompt if isinstance(prompt, MultiModalPrompt) else None
        if mm is not None:
            ids = list(mm.prompt_token_ids)
            if mm.items and not self.is_multimodal:
                raise ValueError(f"{self.model_name} is a text-only model; it does not accept images")
            if any(it.offset < 0 or it.end > len(ids) for it in mm.items):
                raise ValueError("an image placeholder span lies outside the prompt")
        else:
            ids = self.tokenize(prompt) if isinstance(prompt, str) else list(prompt)
        if not ids:
            raise ValueError("the prompt is empty")
        limit = self.max_request_tokens
        what = (
            f"the context of {limit} tokens"
            if limit == self.max_model_len
            else f"the per-request KV limit of {limit} tokens (--max-request-kv-tokens)"
        )
        if len(ids) >= limit:
            raise ValueError(
                f"the prompt has {len(ids)} tokens but {what} leaves no room "
                "(prompt plus at least one generated token must fit)"
            )
        vocab = self.vocab_size  # checked after the length: a too-long prompt costs no scan
        if any(not isinstance(t, int) or not 0 <= t < vocab for t in ids):
            raise ValueError(f"prompt token ids must be integers in [0, {vocab})")
        room = limit - len(ids)
        if params.max_tokens is None:
            params.max_tokens = room
        elif params.max_tokens > room:
            raise ValueError(f"prompt ({len(ids)} tokens) + max_tokens ({params.max_tokens}) exceeds {what}")
        rid = request_id or new_request_id()
        if rid in self._tracked:
            raise ValueError(f"request id {rid!r} is already in use")
        self._arrivals += 1
        req = Request(
            rid, ids, params, eos_token_ids=self.eos_token_ids, arrival=self._arrivals, cache_salt=cache_salt
        )
        if mm is not None:
            req.shared_prefix_len = min(mm.shared_prefix_len, len(ids))
        if mm is not None and mm.items:
            req.mm_items = [_salted(it, cache_salt) for it in mm.items]
            req.mrope_positions, req.mrope_delta = mm.mrope_positions, mm.mrope_delta
        detok = IncrementalDetokenizer(
            self.tokenizer,
            ids,
            skip_special_tokens=params.skip_special_tokens,
            stop=params.stop,
            include_stop_str_in_output=params.include_stop_str_in_output,
        )
        self._tracked[rid] = _Tracked(req, detok)
        self.scheduler.add(req)
        log.debug("%s added: %d prompt tokens", rid, len(ids))
        return rid

    def abort(self, request_id: str) -> bool:
        """Cancel a request; idempotent. Its blocks are free at once; a final delta comes from step()."""
        t = self._tracked.get(request_id)
        if t is None or t.req.is_finished:
            return False
        self.scheduler.finish(t.req, FinishReason.ABORT)
        self._pending.append(self._final_delta(t, [], "", None))
        self._release_finished()
        return True

    def _release_finished(self) -> None:
        """Let the runner forget the requests that finished (their image embeddings, buffer rows)."""
        ids = self.scheduler.take_finished()
        if ids:
            self.runner.release(ids)

    def reset_prefix_cache(self) -> int:
        """Forget every cached prefix block and image embedding (model thread only). Returns the
        number of prefix blocks dropped."""
        if self.encoder_cache is not None:
            self.encoder_cache.reset()
        return self.kv.reset_prefix_cache()

    def cache_stats(self) -> dict:
        out = {"prefix_cache": self.kv.stats()}
        if self.encoder_cache is not None:
            out["vision_cache"] = self.encoder_cache.stats().as_dict()
        return out

    def has_unfinished(self) -> bool:
        return bool(self._pending) or self.scheduler.num_unfinished > 0 or self._inflight is not None

    @property
    def kv(self) -> KVCacheManager:
        return self.scheduler.kv

    @property
    def num_waiting(self) -> int:
        return len(self.scheduler.waiting)

    @property
    def num_running(self) -> int:
        return len(self.scheduler.running)

    # -- one step ---------------------------------------------------------------------------------
    def step(self) -> list[TokenDelta]:
        """Schedule and launch one step; return the deltas of the step whose tokens arrived.

        With async scheduling (on for CUDA) the tokens of step N arrive during step N+1's call: step N+1
        is scheduled and launched first (its decode rows read step N's tokens on the device), so the
        host's scheduling, input building and detokenization overlap the device's work. The price: a
        request that stops on a token (EOS, stop id or string) has one extra position computed.
        Requests whose sampling needs earlier tokens' values (penalties) run without overlap."""
        deltas, self._pending = self._pending, []
        t0 = time.perf_counter()
        prev = self._inflight
        if prev is not None and not self._can_overlap():
            deltas += self._resolve(prev)
            prev = None
        if self.proposer is not None:
            self._propose()
        batch = self.scheduler.schedule()
        t1 = time.perf_counter()
        launched = None
        if not batch.empty:
            try:
                launched = self.runner.launch(batch)
            except Exception as e:  # a failed forward pass aborts only this batch's requests
                log.exception("forward pass failed; aborting %d request(s)", len(batch.items))
                if prev is not None:
                    deltas += self._resolve(prev)
                self._inflight = None
                return deltas + self._abort_batch(batch, e)
            self.scheduler.advance(batch)
        t2 = time.perf_counter()
        if prev is not None:
            deltas += self._resolve(prev)
        self._inflight = launched
        if launched is not None and not (self.async_scheduling and self._can_overlap()):
            deltas += self._resolve(launched)
        self._release_finished()
        t = self.step_seconds
        t["schedule"] += t1 - t0
        t["execute"] += t2 - t1
        t["update"] += time.perf_counter() - t2
        t["steps"] += not batch.empty
        return deltas

    def _can_overlap(self) -> bool:
        """Whether the next step may be scheduled before the tokens in flight arrive: not when a running
        request's sampling reads its earlier tokens' values (repetition/frequency/presence penalties),
        nor when speculating (proposals start from every token, and a verify row's count of new
        tokens is known only on the host)."""
        if self.proposer is not None:
            return False
        return not any(r.params.needs_penalties for r in self.scheduler.running)

    def _propose(self) -> None:
        """Drafts for every running decode that may speculate; the scheduler gives each 1 + k tokens."""
        from foveal.spec.proposer import ProposeRow

        reqs, rows = [], []
        for req in self.scheduler.running:
            if not req.params.speculative or req.num_pending or req.ends_after_pending:
                continue
            if req.num_tokens - req.num_computed_tokens != 1:
                continue  # a prefill chunk still to go
            # a verify row adds up to k + 1 tokens: stay inside max_tokens and the context
            room = min(
                req.params.max_tokens - req.num_output_tokens - 1,
                self.max_model_len - req.num_tokens - 1,
            )
            if room > 0:
                reqs.append(req)
                rows.append(ProposeRow(req.request_id, req.all_token_ids, room))
        if rows:
            for req, drafts in zip(reqs, self.proposer.propose(rows)):
                req.draft_ids = drafts

    def _resolve(self, launched) -> list[TokenDelta]:
        """Wait for a launched step's tokens; apply them and emit the deltas."""
        if self._inflight is launched:
            self._inflight = None
        live = [
            self._tracked[s.request_id]
            for s in launched.batch.items
            if s.num_logits and s.request_id in self._tracked
        ]
        live = [t for t in live if not t.req.is_finished]
        try:
            out = self.runner.collect(launched)
        except Exception as e:  # the device failed this step
            log.exception("collecting a step failed; aborting %d request(s)", len(launched.batch.items))
            return self._abort_batch(launched.batch, e)
        for s in launched.batch.items:
            if s.num_drafts and s.request_id in out.tokens:
                a = len(out.tokens[s.request_id]) - 1
                self.spec_stats.record(s.num_drafts, a)
                self.proposer.accepted(s.request_id, s.num_drafts, a)
        for rid, spent in out.encoder_time_s.items():
            t = self._tracked.get(rid)
            if t is not None:
                t.req.encoder_time_s += spent
        self.scheduler.resolve(launched.batch, out.tokens)
        deltas = []
        for t in live:
            toks = out.tokens.get(t.req.request_id)
            if toks:
                deltas.append(self._emit(t, toks, out.logprobs.get(t.req.request_id)))
        return deltas

    def _abort_batch(self, batch, e: Exception) -> list[TokenDelta]:
        deltas = []
        for s in batch.items:
            t = self._tracked.get(s.request_id)
            if t is None or t.req.is_finished:
                continue
            t.error = f"forward pass failed: {type(e).__name__}: {e}"
            self.scheduler.finish(t.req, FinishReason.ERROR)
            deltas.append(self._final_delta(t, [], "", None))
        return deltas

    def _emit(self, t: _Tracked, toks: list[int], lps: list[TokenLogprobs] | None) -> TokenDelta:
        """The delta of a request's new tokens (several after a verify step): text through the
        detokenizer one token at a time, so a stop string inside the run ends it there."""
        req = t.req
        stop_reason: str | int | None = None
        text = ""
        try:
            for j, tok in enumerate(toks):
                text += t.detok.add([tok])
                if t.detok.stop_matched is not None:
                    req.drop_output(len(toks) - j - 1)  # a verify run's tokens after the stop string
                    del toks[j + 1 :]
                    self.scheduler.finish(req, FinishReason.STOP)
                    req.finish_reason = FinishReason.STOP  # a stop string wins over a length stop
                    break
            if req.is_finished:
                if t.detok.stop_matched is not None:
                    stop_reason = t.detok.stop_matched
                else:
                    text += t.detok.flush()
                    if toks[-1] in req.params.stop_token_ids:
                        stop_reason = toks[-1]
        except (KeyboardInterrupt, SystemExit):
            raise
        except BaseException as e:  # this request's failure only (a Rust tokenizer's panic included)
            log.exception("%s: detokenization failed", req.request_id)
            t.error = f"detokenization failed: {type(e).__name__}: {e}"
            self.scheduler.finish(req, FinishReason.ERROR)
            text = ""
        lps = lps[: len(toks)] if lps else None
        if not req.is_finished:
            return TokenDelta(req.request_id, toks, text, lps)
        if req.finish_reason is FinishReason.ERROR and t.error is None:
            t.error = "request failed"
        return self._final_delta(t, toks, text, lps, stop_reason)

    def _final_delta(self, t: _Tracked, toks, text, lps, stop_reason=None) -> TokenDelta:
        req = t.req
        self._tracked.pop(req.request_id, None)
        if self.proposer is not None:
            self.proposer.finish(req.request_id)
        if req.status is not RequestStatus.FINISHED:  # defensive: never leave a request half-done
            self.scheduler.finish(req, FinishReason.ERROR)
        return TokenDelta(
            req.request_id,
            toks,
            text,
            lps,
            finish_reason=req.finish_reason,
            stop_reason=stop_reason,
            error=t.error,
            num_prompt_tokens=req.num_prompt_tokens,
            num_output_tokens=req.num_output_tokens,
            num_images=len(req.mm_items),
            encoder_time_s=req.encoder_time_s,
            num_cached_tokens=req.num_cached_tokens,
        )
