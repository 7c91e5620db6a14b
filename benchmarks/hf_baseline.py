"""`transformers` reference figures for the GPU benchmarks, on random-weight models built from config JSON
files alone (no weights, no tokenizer, nothing downloaded).

Workloads (run one or several; a failure in one is printed and the next one still runs):

  w1  batch-1 decode, Llama-3.1-8B: a random 512-token prompt, exactly 256 new tokens, greedy
      (`generate`, min_new_tokens = max_new_tokens). Reports TTFT (prefill + first token) and decode
      tok/s = 255 / (time from the first to the last new token), plus the KV cache class `generate` used.
  w2  continuous batching, Llama-3.1-8B, through `model.generate_batch(...)`: N requests (default 256)
      of 512 random prompt tokens and exactly 256 output tokens (EOS disabled), all submitted at once.
  w3  the nano-vllm bench.py workload on Qwen3-0.6B through transformers' continuous batching: 256
      sequences, prompt and output lengths uniform in [100, 1024], prompt ids uniform in [0, 10000],
      ignore_eos, temperature 0.6 (as nano-vllm's bench.py; `--w3-temperature 0` for greedy).
  w4  Qwen2.5-VL-7B: one random 448x448 image + 64 random text tokens: TTFT (image preprocessing
      excluded, reported separately) and batch-1 decode tok/s over 128 new tokens.

    python benchmarks/hf_baseline.py --workloads w1,w2,w3,w4
    python benchmarks/hf_baseline.py --workloads w2 --num-requests 64

Prints one human-readable line per figure, then one JSON object (all figures) as the last line.
The configs default to benchmarks/configs/{llama-3.1-8b,qwen3-0.6b,qwen2.5-vl-7b}.json; `--config`
overrides the config of every workload run.

Continuous batching (w2, w3) runs with sdpa switched by transformers to "paged|sdpa" (it would pick
flash attention if flash-attn or `kernels` were installed) and a ContinuousBatchingConfig left to
transformers' own sizing unless --cb-* flags are given: 256-token blocks, KV cache from 90% (greedy)
or 80% (sampling) of the GPU memory free after the model is loaded (about 3,000 blocks = 780k tokens
for Llama-3.1-8B on an H200), max_batch_tokens 8192, max_requests_per_batch = the request count. The
sizes it chose are printed and put in the JSON. On an H200 (transformers 5.17) w2 at 256 requests
took about 110 s; w3 at 64 requests about 100 s, so its default of 256 takes several minutes:
`--num-requests 64` keeps it near 2 minutes.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import os
import platform
import random
import statistics
import sys
import tempfile
import time
import traceback

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))  # the repo root: foveal's config loader
CONFIG_DIR = os.path.join(HERE, "configs")
DEFAULT_CONFIGS = {
    "w1": os.path.join(CONFIG_DIR, "llama-3.1-8b.json"),
    "w2": os.path.join(CONFIG_DIR, "llama-3.1-8b.json"),
    "w3": os.path.join(CONFIG_DIR, "qwen3-0.6b.json"),
    "w4": os.path.join(CONFIG_DIR, "qwen2.5-vl-7b.json"),
}
ALL_WORKLOADS = ("w1", "w2", "w3", "w4")


def log(msg: str) -> None:
    print(msg, flush=True)


# --------------------------------------------------------------------------------------------------
# configs and models


def load_config(path: str):
    """A transformers config from a config.json file (a folder holding one works too): the loader
    Foveal's `--load-format dummy` uses, so both engines build the same shapes."""
    from foveal.loader.dummy import load_config as load

    return load(path)


def write_tiny_configs(folder: str) -> dict[str, str]:
    """The workloads' tiny configs (benchmarks/tiny_configs.py), for the CPU smoke test."""
    from tiny_configs import write_tiny_configs as write

    paths = write(folder)
    llama, qwen3, vl = paths["llama-3.1-8b"], paths["qwen3-0.6b"], paths["qwen2.5-vl-7b"]
    return {"w1": llama, "w2": llama, "w3": qwen3, "w4": vl}


def resolve_device(name: str) -> torch.device:
    dev = torch.device(name)
    if dev.type == "cuda" and dev.index is None:
        dev = torch.device("cuda", torch.cuda.current_device())
    if dev.type == "cuda":
        torch.cuda.set_device(dev)  # continuous batching sizes its cache from the current device
    return dev


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def build_model(config, device: torch.device, dtype: torch.dtype, vlm: bool = False):
    """Random-weight model from a config, initialized directly on `device` (fast on a GPU)."""
    from transformers import AutoModelForCausalLM, AutoModelForImageTextToText

    auto = AutoModelForImageTextToText if vlm else AutoModelForCausalLM
    torch.manual_seed(0)
    t0 = time.perf_counter()
    with torch.device(device):
        model = auto.from_config(config, dtype=dtype, attn_implementation="sdpa")
    model.to(device)
    model.eval()
    sync(device)
    init_s = time.perf_counter() - t0
    # Matmul speed on zeros is not representative: make sure the big matrices are random. Any that
    # came out constant (an init that zeroes, or none at all) are filled with small random normals.
    refilled = 0
    with torch.no_grad():
        for _name, p in model.named_parameters():
            if p.dim() >= 2 and p.is_floating_point() and p.numel() > 1:
                flat = p.view(-1)
                if bool((flat[: min(flat.numel(), 4096)] == flat[0]).all()):
                    p.normal_(0.0, 0.02)
                    refilled += 1
    sync(device)
    n_params = sum(p.numel() for p in model.parameters())
    log(
        f"  model {type(model).__name__}: {n_params / 1e9:.3f} B params, {dtype}, attn "
        f"{model.config._attn_implementation}, built on {device} in {init_s:.1f} s"
        + (f" ({refilled} constant matrices refilled with N(0, 0.02))" if refilled else "")
    )
    return model, {"params_b": round(n_params / 1e9, 4), "build_s": round(init_s, 2), "refilled": refilled}


def free_memory() -> None:
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def text_config(config):
    return config.get_text_config() if hasattr(config, "get_text_config") else config


def random_ids(g: torch.Generator, n: int, vocab: int, lo: int = 100, hi: int = 100_000) -> list[int]:
    """Random prompt ids, clear of the first ids and of the special tokens at the top of the vocabularies."""
    hi = min(hi, vocab)
    lo = min(lo, hi // 4)
    return torch.randint(lo, hi, (n,), generator=g).tolist()


class TimingStreamer:
    """A `generate` streamer that timestamps every new token (the first `put` is the prompt)."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.times: list[float] = []
        self._prompt_seen = False

    def put(self, value) -> None:
        if not self._prompt_seen:
            self._prompt_seen = True
            return
        sync(self.device)
        self.times.append(time.perf_counter())

    def end(self) -> None:
        pass


def timed_generate(model, device, inputs: dict, new_tokens: int, streamer: bool = False, **kw):
    """One greedy `generate` of exactly `new_tokens` tokens. Returns (seconds, output, token times)."""
    st = TimingStreamer(device) if streamer else None
    sync(device)
    t0 = time.perf_counter()
    out = model.generate(
        **inputs,
        max_new_tokens=new_tokens,
        min_new_tokens=new_tokens,
        do_sample=False,
        streamer=st,
        return_dict_in_generate=True,
        **kw,
    )
    sync(device)
    dt = time.perf_counter() - t0
    n_new = out.sequences.shape[1] - inputs["input_ids"].shape[1]
    if n_new != new_tokens:
        raise RuntimeError(f"generate returned {n_new} new tokens, expected {new_tokens}")
    times = [t - t0 for t in st.times] if st is not None else None
    return dt, out, times


def decode_figures(model, device, inputs: dict, new_tokens: int, repeats: int, gen_kw: dict) -> dict:
    """TTFT (median of 3 one-token generates) and decode tok/s (streamer timestamps; the two-call
    difference is reported as a cross-check)."""
    ttfts = [timed_generate(model, device, inputs, 1, **gen_kw)[0] for _ in range(3)]
    ttft = statistics.median(ttfts)
    decode_rates, streamer_ttfts, totals, cache_cls = [], [], [], None
    for _ in range(repeats):
        total, out, times = timed_generate(model, device, inputs, new_tokens, streamer=True, **gen_kw)
        cache = out.get("cache")  # `past_key_values` was renamed `cache` after 5.17
        cache_cls = type(cache if cache is not None else out.get("past_key_values")).__name__
        totals.append(total)
        streamer_ttfts.append(times[0])
        decode_rates.append((new_tokens - 1) / (times[-1] - times[0]))
    decode = statistics.median(decode_rates)
    total = statistics.median(totals)
    two_call = (new_tokens - 1) / (total - ttft)
    return {
        "ttft_ms": round(ttft * 1e3, 2),
        "ttft_ms_runs": [round(t * 1e3, 2) for t in ttfts],
        "ttft_ms_streamer": round(statistics.median(streamer_ttfts) * 1e3, 2),
        "decode_tok_s": round(decode, 2),
        "decode_tok_s_runs": [round(r, 2) for r in decode_rates],
        "decode_tok_s_two_call": round(two_call, 2),
        "ms_per_token": round(1e3 / decode, 3),
        "total_s": round(total, 3),
        "new_tokens": new_tokens,
        "kv_cache": cache_cls,
    }


# --------------------------------------------------------------------------------------------------
# w1: batch-1 decode


def run_w1(args, config_path: str) -> dict:
    device, dtype = args.device_t, args.dtype_t
    config = load_config(config_path)
    model, info = build_model(config, device, dtype)
    try:
        vocab = text_config(config).vocab_size
        g = torch.Generator().manual_seed(args.seed)
        ids = torch.tensor([random_ids(g, args.prompt_len, vocab)], device=device)
        inputs = {"input_ids": ids, "attention_mask": torch.ones_like(ids)}
        gen_kw = {"pad_token_id": 0}
        if args.cache_implementation:
            gen_kw["cache_implementation"] = args.cache_implementation
        t0 = time.perf_counter()
        timed_generate(model, device, inputs, args.output_len, **gen_kw)  # warm-up
        warm_s = time.perf_counter() - t0
        res = decode_figures(model, device, inputs, args.output_len, args.repeats, gen_kw)
        res.update(
            config=config_path,
            prompt_len=args.prompt_len,
            warmup_s=round(warm_s, 2),
            cache_implementation=args.cache_implementation
            or getattr(model.generation_config, "cache_implementation", None)
            or "default",
            **info,
        )
        log(
            f"w1 batch-1 decode: prompt {args.prompt_len}, {args.output_len} new tokens, greedy, "
            f"cache {res['kv_cache']} (cache_implementation={res['cache_implementation']})"
        )
        log(f"w1 TTFT (prefill {args.prompt_len} + 1st token): {res['ttft_ms']:.1f} ms")
        log(
            f"w1 decode: {res['decode_tok_s']:.1f} tok/s ({res['ms_per_token']:.2f} ms/token; "
            f"two-call difference {res['decode_tok_s_two_call']:.1f} tok/s)"
        )
        return res
    finally:
        model = None  # noqa: F841 (drop the weights before the next workload)
        free_memory()


# --------------------------------------------------------------------------------------------------
# w2 / w3: transformers' continuous batching


def make_cb_config(args):
    """A ContinuousBatchingConfig from the --cb-* flags; unset values are left to transformers' own
    sizing (KV cache from the free GPU memory after the model is loaded)."""
    from transformers import ContinuousBatchingConfig

    fields = set(getattr(ContinuousBatchingConfig, "__dataclass_fields__", {}))
    want = {
        "num_blocks": args.cb_num_blocks,
        "max_batch_tokens": args.cb_max_batch_tokens,
        "max_memory_percent": args.cb_max_memory_percent,
        "max_requests_per_batch": args.cb_max_requests_per_batch,
    }
    if args.cb_block_size is not None:
        # renamed page_size after 5.17 (block_size kept as a deprecated alias)
        want["page_size" if "page_size" in fields else "block_size"] = args.cb_block_size
    if args.cb_use_cuda_graph is not None:
        want["use_cuda_graph"] = args.cb_use_cuda_graph == "on"
    kw = {k: v for k, v in want.items() if v is not None and k in fields}
    return ContinuousBatchingConfig(**kw)


CB_REPORTED = (
    "block_size",
    "page_size",
    "num_blocks",
    "max_batch_tokens",
    "max_memory_percent",
    "max_requests_per_batch",
    "max_blocks_per_request",
    "use_cuda_graph",
    "use_async_batching",
    "allow_block_sharing",
    "scheduler_type",
)


def describe_cb_manager(manager, model) -> dict:
    out = {}
    cfg = getattr(manager, "continuous_batching_config", None)
    for k in CB_REPORTED:
        if cfg is not None and hasattr(cfg, k):
            v = getattr(cfg, k)
            out[k] = list(v) if isinstance(v, tuple) else v
    bp = getattr(manager, "batch_processor", None)
    cache = getattr(bp, "cache", None)
    for k in ("num_blocks", "max_batch_tokens", "block_size", "use_prefix_sharing"):
        if cache is not None and hasattr(cache, k):
            out[f"cache_{k}"] = getattr(cache, k)
    return out


@contextlib.contextmanager
def record_attn_implementation(model, seen: set):
    """Records the attention implementation the model runs with (continuous batching switches it to a
    paged one for the run and back afterwards)."""
    handle = model.register_forward_pre_hook(lambda m, a: seen.add(m.config._attn_implementation))
    try:
        yield seen
    finally:
        handle.remove()


def cb_generation_config(max_new_tokens: int, temperature: float):
    from transformers import GenerationConfig

    kw = {"max_new_tokens": max_new_tokens, "eos_token_id": -1, "pad_token_id": 0}
    if temperature > 0:
        kw.update(do_sample=True, temperature=temperature, top_k=0, top_p=1.0)
    else:
        kw.update(do_sample=False)
    return GenerationConfig(**kw)


def cb_warmup(model, vocab: int, args) -> None:
    """A small generate_batch first, so one-time CUDA/cuBLAS start-up is not in the timed run."""
    g = torch.Generator().manual_seed(args.seed + 1)
    prompts = [random_ids(g, 32, vocab) for _ in range(4)]
    model.generate_batch(
        inputs=prompts,
        generation_config=cb_generation_config(8, 0.0),
        continuous_batching_config=make_cb_config(args),
        progress_bar=False,
    )


def cb_stats(outputs, t_submit: float, t_done: float, expected: list[int] | None) -> dict:
    n_out = sum(len(o.generated_tokens) for o in outputs)
    n_in = sum(len(o.prompt_ids) for o in outputs)
    errors = [o.error for o in outputs if getattr(o, "error", None)]
    created = [o.created_time for o in outputs]
    ends = [o.lifespan[1] for o in outputs if o.lifespan and o.lifespan[1] > 0]
    # requests are created after the manager's own warm-up: first creation -> last finish is the run
    run_s = (max(ends) - min(created)) if ends else t_done - t_submit
    res = {
        "requests_done": len(outputs),
        "output_tokens": n_out,
        "prompt_tokens": n_in,
        "run_s": round(run_s, 3),
        "output_tok_s": round(n_out / run_s, 2),
        "total_tok_s": round((n_in + n_out) / run_s, 2),
        "call_s": round(t_done - t_submit, 3),
        "output_tok_s_incl_setup": round(n_out / (t_done - t_submit), 2),
    }
    if expected is not None:
        short = sum(1 for o, e in zip(outputs, expected) if len(o.generated_tokens) != e)
        res["requests_wrong_length"] = short
    if errors:
        res["errors"] = errors[:5]
    return res


def run_w2(args, config_path: str) -> dict:
    device, dtype = args.device_t, args.dtype_t
    config = load_config(config_path)
    model, info = build_model(config, device, dtype)
    try:
        vocab = text_config(config).vocab_size
        n = args.num_requests if args.num_requests is not None else 256
        g = torch.Generator().manual_seed(args.seed)
        prompts = [random_ids(g, args.prompt_len, vocab) for _ in range(n)]
        gen_cfg = cb_generation_config(args.output_len, 0.0)
        cb_warmup(model, vocab, args)
        sync(device)
        attn_seen: set = set()
        t0 = time.perf_counter()
        with record_attn_implementation(model, attn_seen):
            results = model.generate_batch(
                inputs=prompts,
                generation_config=gen_cfg,
                continuous_batching_config=make_cb_config(args),
                progress_bar=args.progress,
                persistent_manager=True,  # kept only to read back the sizes it chose, destroyed below
            )
        sync(device)
        t1 = time.perf_counter()
        manager = getattr(model, "_cached_continuous_batching_manager", None)
        cb = describe_cb_manager(manager, model) if manager is not None else {}
        cb["attn_implementation"] = sorted(attn_seen)
        if manager is not None:
            model.destroy_cached_continuous_batching_manager()
        outputs = list(results.values())
        res = cb_stats(outputs, t0, t1, [args.output_len] * len(outputs))
        if len(outputs) != n:
            res["requests_missing"] = n - len(outputs)
        res.update(
            config=config_path,
            num_requests=n,
            prompt_len=args.prompt_len,
            output_len=args.output_len,
            api="model.generate_batch(inputs, generation_config, continuous_batching_config)",
            cb=cb,
            **info,
        )
        log(
            f"w2 continuous batching (generate_batch): {n} x ({args.prompt_len} in, "
            f"{args.output_len} out), greedy"
        )
        log(f"w2 cb sizes: {json.dumps(cb, default=str)}")
        log(
            f"w2 output throughput: {res['output_tok_s']:.1f} tok/s ({res['output_tokens']} tokens in "
            f"{res['run_s']:.1f} s; whole call incl. manager setup {res['call_s']:.1f} s = "
            f"{res['output_tok_s_incl_setup']:.1f} tok/s)"
        )
        return res
    finally:
        model = None  # noqa: F841 (drop the weights before the next workload)
        free_memory()


def nano_vllm_workload(n: int, lo: int, hi: int, id_hi: int, seed: int, rng: str):
    """nano-vllm's bench.py: `seed(0)`, then per sequence randint(100, 1024) prompt ids each
    randint(0, 10000), then per sequence max_tokens = randint(100, 1024) (Python's random, bounds
    inclusive). rng='torch' draws the same shapes from a torch.Generator instead."""
    if rng == "python":
        r = random.Random(seed)
        prompts = [[r.randint(0, id_hi) for _ in range(r.randint(lo, hi))] for _ in range(n)]
        outs = [r.randint(lo, hi) for _ in range(n)]
    else:
        g = torch.Generator().manual_seed(seed)
        lens = torch.randint(lo, hi + 1, (n,), generator=g).tolist()
        prompts = [torch.randint(0, id_hi, (k,), generator=g).tolist() for k in lens]
        outs = torch.randint(lo, hi + 1, (n,), generator=g).tolist()
    return prompts, outs


def run_w3(args, config_path: str) -> dict:
    from transformers.generation.continuous_batching.utils import WorkloadHints

    device, dtype = args.device_t, args.dtype_t
    config = load_config(config_path)
    model, info = build_model(config, device, dtype)
    try:
        vocab = text_config(config).vocab_size
        n = args.num_requests if args.num_requests is not None else 256
        id_hi = min(10000, vocab - 1)
        prompts, out_lens = nano_vllm_workload(
            n, args.w3_min_len, args.w3_max_len, id_hi, args.seed, args.w3_rng
        )
        gen_cfg = cb_generation_config(max(out_lens), args.w3_temperature)
        cb_warmup(model, vocab, args)
        hints = WorkloadHints(
            max_prompt_length=max(len(p) for p in prompts), max_generated_length=max(out_lens), num_requests=n
        )
        # generate_batch takes one max_new_tokens for all requests: per-request lengths go through the
        # manager it wraps (same API underneath: continuous_batching_context_manager + add_request).
        cm = model.continuous_batching_context_manager(
            generation_config=gen_cfg,
            continuous_batching_config=make_cb_config(args),
            block=True,
            timeout=5,
            persistent_manager=True,  # kept only to read back the sizes it chose, destroyed below
            warmup=True,
            workload_hints=hints,
        )
        results: dict[str, object] = {}
        attn_seen: set = set()
        t0 = t1 = None
        with record_attn_implementation(model, attn_seen), cm as manager:
            sync(device)
            t0 = time.perf_counter()
            ids = []
            for i, (p, k) in enumerate(zip(prompts, out_lens)):
                rid = manager.add_request(
                    input_ids=p, request_id=f"w3_{i}", max_new_tokens=k, eos_token_id=-1
                )
                ids.append(rid)
            last_log = t0
            while len(results) < n:
                r = manager.get_result(timeout=1)
                if time.perf_counter() - last_log > 15:
                    last_log = time.perf_counter()
                    log(f"  w3: {len(results)}/{n} requests done after {last_log - t0:.0f} s")
                if r is not None:
                    if r.is_finished():
                        results[r.request_id] = r
                elif not manager.is_running():
                    log("w3: the generation thread stopped before all requests finished")
                    break
            sync(device)
            t1 = time.perf_counter()
        manager = getattr(model, "_cached_continuous_batching_manager", None)
        cb = describe_cb_manager(manager, model) if manager is not None else {}
        cb["attn_implementation"] = sorted(attn_seen)
        if manager is not None:
            model.destroy_cached_continuous_batching_manager()
        outputs = [results[i] for i in ids if i in results]
        expected = [k for i, k in zip(ids, out_lens) if i in results]
        res = cb_stats(outputs, t0, t1, expected)
        res["planned_output_tokens"] = sum(out_lens)
        # nano-vllm's own figure: sum of the planned max_tokens over the wall time of generate()
        res["nano_vllm_style_tok_s"] = round(sum(out_lens) / (t1 - t0), 2)
        if len(outputs) != n:
            res["requests_missing"] = n - len(outputs)
        res.update(
            config=config_path,
            num_requests=n,
            prompt_len_range=[args.w3_min_len, args.w3_max_len],
            rng=args.w3_rng,
            temperature=args.w3_temperature,
            api="model.continuous_batching_context_manager(...) + manager.add_request(max_new_tokens=k)",
            cb=cb,
            **info,
        )
        log(
            f"w3 nano-vllm workload: {n} seqs, prompt/output lengths in "
            f"[{args.w3_min_len}, {args.w3_max_len}] "
            f"({res['prompt_tokens']} prompt, {res['planned_output_tokens']} output tokens), "
            f"temperature {args.w3_temperature}, ignore_eos"
        )
        log(f"w3 cb sizes: {json.dumps(cb, default=str)}")
        log(
            f"w3 output throughput: {res['output_tok_s']:.1f} tok/s ({res['output_tokens']} tokens in "
            f"{res['run_s']:.1f} s; nano-vllm-style {res['nano_vllm_style_tok_s']:.1f} tok/s)"
        )
        return res
    finally:
        model = None  # noqa: F841 (drop the weights before the next workload)
        free_memory()


# --------------------------------------------------------------------------------------------------
# w4: Qwen2.5-VL, one image


def build_image_processor(vision_config):
    """Qwen2-VL's image processor from its defaults (nothing downloaded): patch 14, merge 2, temporal
    patch 2, CLIP mean/std. The torchvision-backed class when torchvision is there, else the PIL one."""
    import transformers

    kw = {
        "patch_size": getattr(vision_config, "patch_size", 14),
        "merge_size": getattr(vision_config, "spatial_merge_size", 2),
        "temporal_patch_size": getattr(vision_config, "temporal_patch_size", 2),
    }
    try:
        import torchvision  # noqa: F401

        names = ("Qwen2VLImageProcessor", "Qwen2VLImageProcessorFast", "Qwen2VLImageProcessorPil")
    except Exception:
        names = ("Qwen2VLImageProcessorPil", "Qwen2VLImageProcessor")
    errors = []
    for name in names:
        cls = getattr(transformers, name, None)
        if cls is None:
            continue
        try:
            proc = cls(**kw)
            return proc, type(proc).__name__
        except Exception as e:  # e.g. the torchvision class without torchvision
            errors.append(f"{name}: {e}")
    raise RuntimeError("no Qwen2-VL image processor could be built: " + "; ".join(errors))


def run_w4(args, config_path: str) -> dict:
    from PIL import Image

    device, dtype = args.device_t, args.dtype_t
    config = load_config(config_path)
    model, info = build_model(config, device, dtype, vlm=True)
    try:
        vcfg = config.vision_config
        tcfg = text_config(config)
        proc, proc_name = build_image_processor(vcfg)
        g = torch.Generator().manual_seed(args.seed)
        h = w = args.image_size
        img = Image.fromarray(torch.randint(0, 256, (h, w, 3), generator=g, dtype=torch.uint8).numpy())

        def preprocess():
            sync(device)
            t0 = time.perf_counter()
            feats = proc(images=[img], return_tensors="pt")
            pv = feats["pixel_values"].to(device, dtype)
            thw = feats["image_grid_thw"].to(device)
            sync(device)
            return time.perf_counter() - t0, pv, thw

        preprocess()  # warm-up
        proc_times = []
        for _ in range(3):
            dt, pixel_values, grid_thw = preprocess()
            proc_times.append(dt)
        merge = getattr(vcfg, "spatial_merge_size", 2)
        n_img = int(grid_thw.prod(-1).sum().item()) // (merge * merge)
        image_id = config.image_token_id
        start_id = config.vision_start_token_id
        end_id = config.vision_end_token_id
        text = random_ids(g, args.w4_text_len, tcfg.vocab_size, hi=min(tcfg.vocab_size, 150_000))
        ids = [start_id] + [image_id] * n_img + [end_id] + text
        input_ids = torch.tensor([ids], device=device)
        inputs = {
            "input_ids": input_ids,
            "attention_mask": torch.ones_like(input_ids),
            "pixel_values": pixel_values,
            "image_grid_thw": grid_thw,
        }
        gen_kw = {"pad_token_id": 0}
        t0 = time.perf_counter()
        timed_generate(model, device, inputs, args.w4_new_tokens, **gen_kw)  # warm-up
        warm_s = time.perf_counter() - t0
        res = decode_figures(model, device, inputs, args.w4_new_tokens, args.repeats, gen_kw)
        res.update(
            config=config_path,
            image_size=[h, w],
            image_grid_thw=grid_thw.tolist(),
            image_tokens=n_img,
            text_tokens=len(text),
            prompt_len=len(ids),
            image_processor=proc_name,
            image_preprocess_ms=round(statistics.median(proc_times) * 1e3, 2),
            warmup_s=round(warm_s, 2),
            **info,
        )
        log(
            f"w4 Qwen2.5-VL: {h}x{w} image -> grid {grid_thw.tolist()} -> {n_img} image tokens + "
            f"{len(text)} text tokens ({len(ids)} prompt ids), {args.w4_new_tokens} new tokens, greedy, "
            f"cache {res['kv_cache']}"
        )
        log(
            f"w4 image preprocessing ({proc_name}, CPU, + copy to {device}): "
            f"{res['image_preprocess_ms']:.1f} ms (not in TTFT)"
        )
        log(f"w4 TTFT (vision encoder + prefill + 1st token): {res['ttft_ms']:.1f} ms")
        log(
            f"w4 decode: {res['decode_tok_s']:.1f} tok/s ({res['ms_per_token']:.2f} ms/token; "
            f"two-call difference {res['decode_tok_s_two_call']:.1f} tok/s)"
        )
        return res
    finally:
        model = None  # noqa: F841 (drop the weights before the next workload)
        free_memory()


RUNNERS = {"w1": run_w1, "w2": run_w2, "w3": run_w3, "w4": run_w4}


# --------------------------------------------------------------------------------------------------


def environment(device: torch.device) -> dict:
    import transformers

    env = {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "device": str(device),
    }
    if device.type == "cuda":
        env["gpu"] = torch.cuda.get_device_name(device)
        env["cuda"] = torch.version.cuda
    try:
        import torchvision

        env["torchvision"] = torchvision.__version__
    except Exception:
        env["torchvision"] = None
    return env


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("workload", nargs="?", choices=ALL_WORKLOADS, help="one workload (or use --workloads)")
    p.add_argument("--workloads", default=None, help="comma-separated, e.g. w1,w2,w3,w4 (default: all)")
    p.add_argument("--config", default=None, help="config.json to use instead of each workload's default")
    p.add_argument("--num-requests", type=int, default=None, help="w2/w3 request count (default 256)")
    p.add_argument("--device", default="cuda")
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--prompt-len", type=int, default=512, help="w1/w2 prompt tokens")
    p.add_argument("--output-len", type=int, default=256, help="w1/w2 new tokens")
    p.add_argument("--repeats", type=int, default=2, help="w1/w4 timed decode runs (median reported)")
    p.add_argument("--cache-implementation", default=None, help="w1: e.g. 'static' (default: generate's own)")
    p.add_argument("--w3-min-len", type=int, default=100)
    p.add_argument("--w3-max-len", type=int, default=1024)
    p.add_argument(
        "--w3-rng",
        choices=["python", "torch"],
        default="python",
        help="python: exactly nano-vllm's bench.py draws (random.seed); torch: torch.Generator",
    )
    p.add_argument("--w3-temperature", type=float, default=0.6, help="nano-vllm uses 0.6; 0 = greedy")
    p.add_argument("--image-size", type=int, default=448)
    p.add_argument("--w4-text-len", type=int, default=64)
    p.add_argument("--w4-new-tokens", type=int, default=128)
    # continuous batching sizes (unset: transformers sizes them from free GPU memory)
    p.add_argument("--cb-block-size", type=int, default=None)
    p.add_argument("--cb-num-blocks", type=int, default=None)
    p.add_argument("--cb-max-batch-tokens", type=int, default=None)
    p.add_argument("--cb-max-memory-percent", type=float, default=None)
    p.add_argument("--cb-max-requests-per-batch", type=int, default=None)
    p.add_argument("--cb-use-cuda-graph", choices=["on", "off"], default=None)
    p.add_argument("--progress", action="store_true", help="show generate_batch's progress bar")
    p.add_argument(
        "--verbose", action="store_true", help="transformers INFO logs (continuous batching sizes)"
    )
    p.add_argument("--tiny", action="store_true", help=argparse.SUPPRESS)
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    import transformers

    if args.verbose:
        transformers.logging.set_verbosity_info()
    else:
        transformers.logging.set_verbosity_warning()

    if args.workloads:
        workloads = [w.strip() for w in args.workloads.split(",") if w.strip()]
    elif args.workload:
        workloads = [args.workload]
    else:
        workloads = list(ALL_WORKLOADS)
    bad = [w for w in workloads if w not in RUNNERS]
    if bad:
        raise SystemExit(f"unknown workload(s) {bad}; choose from {list(RUNNERS)}")

    configs = dict(DEFAULT_CONFIGS)
    tmp = None
    if args.tiny:
        # CPU smoke test: tiny configs from the config classes, fp32, small workloads
        tmp = tempfile.TemporaryDirectory(prefix="hf_baseline_tiny_")
        configs = write_tiny_configs(tmp.name)
        if args.device == "cuda" and not torch.cuda.is_available():
            args.device = "cpu"
        args.dtype = "float32" if args.device == "cpu" else args.dtype
        args.prompt_len, args.output_len = min(args.prompt_len, 64), min(args.output_len, 32)
        args.num_requests = args.num_requests or 8
        args.w3_min_len, args.w3_max_len = 16, 48
        args.w4_new_tokens = min(args.w4_new_tokens, 16)
        args.repeats = 1
        if args.device == "cpu":
            args.cb_num_blocks = args.cb_num_blocks or 64
            args.cb_block_size = args.cb_block_size or 32
            args.cb_max_batch_tokens = args.cb_max_batch_tokens or 256
    if args.config:
        configs = {w: args.config for w in configs}

    args.device_t = resolve_device(args.device)
    args.dtype_t = getattr(torch, args.dtype)
    env = environment(args.device_t)
    log(
        f"hf_baseline: transformers {env['transformers']}, torch {env['torch']}, "
        f"{env.get('gpu', env['device'])}, "
        f"{args.dtype}, workloads {','.join(workloads)}"
    )

    figures: dict[str, dict] = {}
    errors: dict[str, str] = {}
    for w in workloads:
        log(f"== {w} ({configs[w]})")
        t0 = time.perf_counter()
        try:
            figures[w] = RUNNERS[w](args, configs[w])
            figures[w]["workload_s"] = round(time.perf_counter() - t0, 1)
        except Exception as e:  # keep going with the next workload
            traceback.print_exc()
            sys.stderr.flush()
            errors[w] = f"{type(e).__name__}: {e}"
            log(f"{w} FAILED after {time.perf_counter() - t0:.1f} s: {errors[w]}")
        finally:
            gc.collect()
            if torch.cuda.is_available():
                torch.cuda.empty_cache()
    if tmp is not None:
        with contextlib.suppress(Exception):
            tmp.cleanup()
    summary = {
        "benchmark": "hf_baseline",
        "env": env,
        "dtype": args.dtype,
        "tiny": args.tiny,
        "figures": figures,
    }
    if errors:
        summary["errors"] = errors
    print(json.dumps(summary, default=str), flush=True)
    return 1 if errors and not figures else 0


if __name__ == "__main__":
    sys.exit(main())
