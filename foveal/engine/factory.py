"""The one place an engine is built: config in, a started `Engine` (model thread side) and its
`InputProcessor` (request side) out, sharing nothing mutable.

    engine, processor = build_engine(EngineConfig.from_kwargs(model=...))

Order: device and dtype; the checkpoint (weights, tokenizer, processor files); the model; the KV pool
(sized by the memory budget, profiled on CUDA); scheduler, proposer (speculative decoding) and runner;
the speculation driver; decode-step graphs (CUDA graphs, or recorded CPU steps); then the EngineInfo
both sides read.
"""

from __future__ import annotations

import gc
import logging
import time
from dataclasses import replace

import torch

from foveal.attention import kv_quant
from foveal.cache.kv_cache_manager import KVCacheManager
from foveal.config import EngineConfig
from foveal.diffusion.driver import DiffusionDriver
from foveal.diffusion.info import diffusion_info
from foveal.diffusion.passes import DiffusionPasses
from foveal.engine.engine import Engine
from foveal.engine.input_processor import EngineInfo, InputProcessor
from foveal.lora.driver import LoRADriver
from foveal.sched.scheduler import Scheduler
from foveal.structured.driver import GuideDriver

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


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dev = torch.device(name)
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ValueError("device 'cuda' was requested but CUDA is not available")
    return dev


def resolve_dtype(name: str, device: torch.device, *, packed: bool = False) -> torch.dtype:
    """`auto`: bfloat16 on CUDA, and on a CPU for weights that run packed (a GGUF's Q4/Q8 blocks with
    int8 activations: bf16 activations cost them no accuracy, benchmarks/quant_accuracy.py, and halve the
    KV pool's bytes: +13% offline at 16 streams on the 2-vCPU host); float32 for dense weights on a CPU."""
    if name == "auto":
        return torch.bfloat16 if device.type == "cuda" or packed else torch.float32
    return _DTYPES[name]


def build_engine(config: EngineConfig, progress: bool = False) -> tuple[Engine, InputProcessor]:
    from foveal.attention import get_backend
    from foveal.layers import quant
    from foveal.loader import load_checkpoint
    from foveal.loader.checkpoint import is_gguf
    from foveal.models import build_model, max_context
    from foveal.worker.model_runner import ModelRunner

    device = resolve_device(config.model.device)
    packed = (
        device.type == "cpu"
        and config.model.quantization != "none"
        and config.model.load_format != "dummy"
        and quant.kernel() is not None
        and is_gguf(config.model.model)
    )
    dtype = resolve_dtype(config.model.dtype, device, packed=packed)
    cfg = replace(config, scheduler=config.scheduler.for_device(device.type))
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
        keep_blocks=quant.TYPES if quant.runs_packed(cfg.model.quantization, device, dtype) else (),
    )
    hf = ckpt.hf_config
    max_len = cfg.model.max_model_len or max_context(hf)
    diffusion = diffusion_info(hf)
    backend = get_backend(cfg.attention_backend, device)
    if hasattr(backend, "shared_min_rows"):  # Triton's shared-prefix decode
        backend.shared_min_rows, backend.shared_min_prefix = (
            cfg.shared_prefix_min_rows,
            cfg.shared_prefix_min_tokens,
        )
        # a request has several decode rows only under speculation or block diffusion (its graphs with
        # the grouping kernel are captured only then)
        several = cfg.speculative is not None or (diffusion is not None and diffusion.kind == "block")
        backend.request_min_prefix = cfg.request_rows_min_tokens if several else 0
    model = build_model(
        hf, backend, max_positions=max(max_len, 1), dtype=dtype, device=device, weights=ckpt.weights
    )
    vocab_size = hf.get_text_config().vocab_size
    encoder_cache = mm_processor = None
    if model.is_multimodal:
        from foveal.cache.encoder_cache import EncoderCache
        from foveal.engine.multimodal import MultiModalProcessor

        if ckpt.processor is None:
            raise ValueError(f"{ckpt.name} is a vision-language model but its folder has no processor files")
        mm_processor = MultiModalProcessor(ckpt.processor, type(model).mm_adapter(hf, ckpt.video_config))
        encoder_cache = EncoderCache(cfg.cache.vision_cache_memory)
    load_s = time.perf_counter() - t0
    lora_slots, lora_registry = _lora(cfg, model, dtype, device)  # before the KV pool's sizing

    layers, kv_heads, head_dim = model.kv_shape
    bs = cfg.cache.block_size
    kv_dtype = cfg.cache.kv_cache_dtype
    # from the real layout (quantized values + their scales), so fp8/int8 get ~2x the blocks
    block_bytes = layers * bs * kv_quant.bytes_per_token(kv_dtype, dtype, kv_heads, head_dim)
    num_blocks = cfg.cache.num_blocks or _num_blocks(
        cfg, model, block_bytes, device, backend, dtype, max_len, vocab_size, diffusion
    )
    kv_caches = kv_quant.allocate_kv_caches(
        kv_dtype, layers, num_blocks * bs, kv_heads, head_dim, dtype, device
    )
    kv = KVCacheManager(num_blocks, bs, cfg.cache.enable_prefix_caching)
    if max_len > kv.capacity_tokens:
        log.warning(
            "max_model_len %d exceeds the KV pool (%d tokens); capping it", max_len, kv.capacity_tokens
        )
        max_len = kv.capacity_tokens
    cap = cfg.cache.max_request_kv_tokens
    info = EngineInfo(
        model_name=ckpt.name,
        vocab_size=vocab_size,
        max_model_len=max_len,
        # what one request may hold: its context, or less where the operator says so
        max_request_tokens=min(max_len, cap) if cap else max_len,
        eos_token_ids=_eos_ids(hf, ckpt.tokenizer),
        is_multimodal=model.is_multimodal,
        block_size=bs,
        prefix_caching=cfg.cache.enable_prefix_caching,
        diffusion=diffusion,
        max_num_batched_tokens=cfg.scheduler.max_num_batched_tokens or 0,
        pooling=_pooling(cfg.model.pooling, model),
    )
    scheduler = Scheduler(
        cfg.scheduler,
        kv,
        max_len,
        encoder_cache=encoder_cache,
        atomic_mm_spans=model.mm_bidirectional,
        lora=LoRADriver(lora_slots.num_slots) if lora_slots is not None else None,
        diffusion=DiffusionDriver(info.diffusion) if info.diffusion is not None else None,
    )
    spec = cfg.speculative
    proposer = None
    if spec is not None and info.diffusion is not None:
        raise ValueError(
            f"{info.model_name} is a diffusion model: speculative decoding does not apply (a pass already "
            "fills several positions); drop --speculative-config"
        )
    if spec is not None:
        from foveal.speculative.proposer import build_proposer

        proposer = build_proposer(
            spec,
            target=model,
            target_source=ckpt.source if ckpt.format == "safetensors" else None,
            device=device,
            dtype=dtype,
            backend=backend,
            max_model_len=max_len,
            num_blocks=num_blocks,
            block_size=bs,
        )
        if hasattr(proposer, "use_graphs") and _use_graphs(cfg, device, backend):
            try:  # a head's steps as graphs, like the target's decodes
                proposer.use_graphs(cfg.scheduler.max_num_seqs, max_len + 2 * spec.num_speculative_tokens + 2)
            except Exception:
                log.exception("the draft head's graph capture failed; its steps run eagerly")
                proposer.graphs = None
    tap = proposer.tap if proposer is not None else None  # what a hidden-state drafter reads
    runner = ModelRunner(
        model,
        kv_caches,
        backend,
        bs,
        device,
        vocab_size,
        encoder_cache=encoder_cache,
        max_tokens_per_row=1 + (spec.num_speculative_tokens if spec else 0),
        graphs=_decode_graphs(cfg, info, model, kv_caches, backend, device, dtype, max_len, tap, lora_slots),
        lora=lora_slots,
        tap=tap,
        diffusion=DiffusionPasses() if info.diffusion is not None else None,
    )
    speculation = None
    if proposer is not None:
        from foveal.speculative.driver import SpeculationDriver

        speculation = SpeculationDriver(
            proposer,
            method=spec.method,
            adaptive=spec.adaptive,
            scheduler=scheduler,
            runner=runner,
            max_model_len=info.max_model_len,
        )
    overlap = cfg.scheduler.async_scheduling
    engine = Engine(
        cfg,
        info,
        model=model,
        tokenizer=ckpt.tokenizer,
        scheduler=scheduler,
        runner=runner,
        guides=GuideDriver(device),
        speculation=speculation,
        encoder_cache=encoder_cache,
        device=device,
        dtype=dtype,
        async_scheduling=device.type == "cuda" if overlap is None else overlap,
    )
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
        quant.describe(model),
    )
    if ckpt.format != "gguf" and cfg.model.quantization == "gguf":
        log.warning("--quantization gguf applies to GGUF files: the %s weights stay dense", ckpt.format)
    processor = InputProcessor(info, ckpt.tokenizer, mm_processor, cfg.output)
    processor.lora = lora_registry
    return engine, processor


def freeze_startup_heap() -> None:
    """What exists once the engine is built (the model, the tokenizer, every import) lives as long as the
    process: out of the collector's sight, a full collection scans request-time objects only (one over
    the ~320k start-up objects took ~140 ms with every thread stopped: a pause in every stream)."""
    gc.collect()
    gc.freeze()


def _decode_graphs(cfg: EngineConfig, info, model, kv_caches, backend, device, dtype, max_len, tap, lora):
    """The decode-step graphs (CUDA: captured now; CPU: each recorded at its first step), or None:
    eager steps (configured so, or a model that cannot be captured still serves, eagerly)."""
    if _use_graphs(cfg, device, backend):
        from foveal.worker.cuda_graphs import DecodeGraphs as graphs
    elif _use_cpu_graphs(cfg, device, backend, kv_caches, dtype):
        from foveal.worker.cpu_graphs import CpuDecodeGraphs as graphs
    else:
        return None
    made = graphs(
        model,
        kv_caches,
        backend,
        block_size=cfg.cache.block_size,
        max_seqs=_graph_rows(cfg, info.diffusion),
        max_model_len=max_len,
        device=device,
        tap=tap,
        lora_groups=lora.num_slots + 1 if lora is not None else 0,
    )
    try:
        made.capture()
    except Exception:
        log.exception("decode-step graph capture failed; decode steps run eagerly")
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        return None
    return made


def _pooling(setting: str, model) -> str | None:
    """The embeddings' pooling: the setting, or (auto) an embedding model's own; None: no embeddings."""
    if setting not in ("auto", "none", "last", "mean"):
        raise ValueError(f"unknown pooling {setting!r}; use auto, none, last or mean")
    if setting == "auto":
        return model.default_pooling
    return None if setting == "none" else setting


def _lora(cfg: EngineConfig, model, dtype: torch.dtype, device: torch.device):
    """LoRA's device slots on the model's linears and the registry of served adapters (the start-up
    ones loaded now), or (None, None) when LoRA is off."""
    lo = cfg.lora
    if not lo.enable_lora:
        return None, None
    from foveal.lora.registry import LoRARegistry
    from foveal.lora.slots import LoRASlots

    slots = LoRASlots(model, lo.max_loras, lo.max_lora_rank, dtype, device)
    registry = LoRARegistry(
        slots.layout, dtype, lo.max_lora_rank, lo.max_cpu_loras or 2 * lo.max_loras, pin=device.type == "cuda"
    )
    for name, path in lo.lora_modules:
        registry.load(name, path)
    log.info(
        "LoRA: %d device slots of rank <= %d on %d linears (%.1f MiB); %d adapters registered",
        lo.max_loras,
        lo.max_lora_rank,
        len(slots.stacks),
        slots.nbytes / 2**20,
        len(lo.lora_modules),
    )
    return slots, registry


def _graph_rows(cfg: EngineConfig, diffusion=None) -> int:
    """Rows a decode-step graph covers: every sequence's 1 + k tokens when speculating (verify runs
    are decode rows); a block diffusion model's two windows (a commit and the next window's pass)."""
    spec = cfg.speculative
    if diffusion is not None and diffusion.kind == "block":
        return cfg.scheduler.max_num_seqs * 2 * diffusion.block_size
    return cfg.scheduler.max_num_seqs * (1 + (spec.num_speculative_tokens if spec else 0))


def _use_graphs(cfg: EngineConfig, device: torch.device, backend) -> bool:
    from foveal.worker.cuda_graphs import supports_graphs

    if device.type != "cuda" or cfg.model.enforce_eager:
        return False
    if not supports_graphs(backend):
        log.info("the %s attention backend runs eagerly (no CUDA graphs)", backend.name)
        return False
    return True


def _use_cpu_graphs(cfg: EngineConfig, device: torch.device, backend, kv_caches, dtype: torch.dtype) -> bool:
    """Recorded decode steps (worker/cpu_graphs.py): on a CPU whose attention backend has the native
    decode kernel, over plain K/V pools of the model's dtype (what that kernel reads)."""
    if device.type != "cpu" or cfg.model.enforce_eager:
        return False
    if getattr(backend, "kernel", None) is None or not hasattr(backend, "fill_graph_metadata"):
        return False
    return all(isinstance(c, torch.Tensor) and c.dtype == dtype for c in kv_caches)


def _num_blocks(
    cfg: EngineConfig,
    model,
    block_bytes: int,
    device,
    backend,
    dtype,
    max_len: int,
    vocab_size: int,
    diffusion=None,
) -> int:
    budget = cfg.cache.kv_cache_memory
    if budget is None:
        if device.type == "cuda":
            from foveal.worker import memory
            from foveal.worker.cuda_graphs import DecodeGraphs

            peak = memory.profile_activation_peak(
                model,
                backend,
                num_tokens=cfg.scheduler.max_num_batched_tokens,
                num_seqs=cfg.scheduler.max_num_seqs,
                max_len=max_len,
                block_size=cfg.cache.block_size,
                kv_cache_dtype=cfg.cache.kv_cache_dtype,
                vocab_size=vocab_size,
            )
            reserve = 0
            if _use_graphs(cfg, device, backend):
                reserve = DecodeGraphs.reserve_bytes(_graph_rows(cfg, diffusion), vocab_size, dtype)
            budget = memory.kv_pool_bytes(device, cfg.cache.gpu_memory_utilization, peak, reserve)
        else:
            budget = DEFAULT_CPU_KV_BYTES
    n = budget // block_bytes
    if n < 2:
        raise ValueError(
            f"KV cache memory budget {budget} bytes holds fewer than 2 blocks of {block_bytes} bytes"
        )
    return int(n)


def _eos_ids(hf_config, tokenizer) -> frozenset[int]:
    ids: set[int] = set()
    eos = getattr(hf_config, "eos_token_id", None) or getattr(
        hf_config.get_text_config(), "eos_token_id", None
    )
    if isinstance(eos, int):
        ids.add(eos)
    elif eos:
        ids.update(eos)
    if tokenizer.eos_token_id is not None:
        ids.add(tokenizer.eos_token_id)
    return frozenset(ids)
