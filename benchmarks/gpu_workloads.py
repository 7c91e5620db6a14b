"""Issue 5's GPU workloads W1-W4 through Foveal's engine, on random-weight models of real shapes
(`--load-format dummy` with benchmarks/configs/*.json), with the hardware ceilings measured in the
same run and MBU/MFU against them.

    python3 benchmarks/gpu_workloads.py --workloads ceilings,w1,w2,w3,w4 [--profile] [--enforce-eager]
        [--async-scheduling auto|on|off]

W1 Llama-3.1-8B batch 1, 512 prompt / 256 output: TTFT and decode tok/s (MBU: weight + KV bytes
   read per step over the measured copy bandwidth).
W2 Llama-3.1-8B, 256 requests of 512 / 256, all at once: output tok/s (MFU: 2 x params FLOPs per
   token, the LM head's only for the rows whose logits are computed (forward_flops), over the measured
   bf16 matmul rate), TTFT p50/p99.
W3 nano-vllm's bench.py workload: Qwen3-0.6B, 256 sequences, prompt and output lengths uniform in
   [100, 1024] (Python's random, seed 0, in bench.py's order), temperature 0.6, ignore_eos; against
   the floor of its reads (the weights each decode step, each row's K/V over its context each step:
   15.1 TB in bf16, 13.9 of them K/V: ~25,700 tok/s at an H100's 2.9 TB/s copy, ~37,300 at an H200's
   4.2).
W4 Qwen2.5-VL-7B: one 448x448 image + 64 text tokens: TTFT (image preprocessing reported apart) and
   batch-1 decode tok/s; then 64 concurrent image requests: output tok/s, TTFT p50/p99 (once paying
   its sizes' first uses, then again: the figure).

Times come from the engine's own step loop (all requests submitted at t0); the engine's host time
per step phase (schedule / execute / update) is printed with each workload. Ends with one JSON line.

`--smoke` runs the same code on CPU with tiny configs of the three families and request counts and
lengths divided down: it checks the script, not the speed (GPU time is scarce; run it before a call).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import tempfile
import time

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))

from foveal import SamplingParams  # noqa: E402
from foveal.engine.llm import LLM  # noqa: E402

CONFIGS = os.path.join(HERE, "configs")
RESULTS: dict = {}
SMOKE = False  # --smoke: CPU, tiny configs, N() and L() shrink counts and lengths


def N(n: int) -> int:
    return max(2, n // 32) if SMOKE else n


def L(n: int) -> int:
    return max(4, n // 32) if SMOKE else n


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def log(msg: str) -> None:
    print(msg, flush=True)


# -- ceilings ------------------------------------------------------------------------------------
def ceilings() -> dict:
    """Device-to-device copy bandwidth (read + write bytes) and bf16 matmul rate, on random data."""
    n = 1 << 30  # 1 GiB per buffer: far past the 60 MB L2
    a = torch.randn(n // 2, device="cuda", dtype=torch.bfloat16)
    b = torch.empty_like(a)
    copy_s = _time_cuda(lambda: b.copy_(a), 20)
    x = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    y = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    mm_s = _time_cuda(lambda: x @ y, 20)
    out = {"copy_GBps": 2 * n / copy_s / 1e9, "bf16_TFLOPs": 2 * 8192**3 / mm_s / 1e12}
    log(
        f"ceilings: copy {out['copy_GBps']:.0f} GB/s (read+write), "
        f"bf16 matmul {out['bf16_TFLOPs']:.0f} TFLOP/s"
    )
    return out


def captured(fn):
    """fn captured in a CUDA graph (after two warm-up calls on a side stream): its replay."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn()
        fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return graph.replay


def _time_cuda(fn, reps: int) -> float:
    for _ in range(3):
        fn()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(reps):
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return sorted(times)[len(times) // 2]


# -- the engine's step loop with per-request timestamps -------------------------------------------
def run(llm: LLM, prompts: list, params: list[SamplingParams]) -> dict:
    eng = llm.engine
    for k in ("schedule", "execute", "update"):
        eng.step_seconds[k] = 0.0
    eng.step_seconds["steps"] = 0
    hits0 = eng.kv.hit_tokens
    _sync()
    t0 = time.perf_counter()
    ids = [eng.add_request(llm.processor.request(p, sp)) for p, sp in zip(prompts, params)]
    first: dict[str, float] = {}
    last: dict[str, float] = {}
    count: dict[str, int] = dict.fromkeys(ids, 0)
    all_in = None  # (time, step) once every request has its first token: decode steps only after it
    n_steps = 0
    ends: list[float] = []  # each step's end, once every request is decoding
    while eng.has_unfinished():
        for d in eng.step():
            if d.token_ids:
                now = time.perf_counter()
                first.setdefault(d.request_id, now)
                last[d.request_id] = now
                count[d.request_id] += len(d.token_ids)
        n_steps += 1
        if all_in is None and len(first) == len(ids):
            all_in = (time.perf_counter(), n_steps)
        elif all_in is not None:
            ends.append(time.perf_counter())
    wall = time.perf_counter() - t0
    end = max(last.values(), default=t0)
    decode_steps = n_steps - all_in[1] if all_in else 0
    ttft = sorted(first[r] - t0 for r in ids)
    steps = dict(eng.step_seconds)
    n = max(1, steps["steps"])
    phases = {k: round(steps[k] / n * 1e3, 3) for k in ("schedule", "execute", "update")}
    return {
        "wall_s": wall,
        "output_tokens": sum(count.values()),
        "prompt_tokens": sum(len(getattr(p, "prompt_token_ids", p)) for p in prompts),
        # of those, found in the prefix cache at admission (not computed; 0 with the cache off)
        "prompt_tokens_cached": eng.kv.hit_tokens - hits0,
        "output_tok_s": sum(count.values()) / wall,
        "ttft_p50_s": ttft[len(ttft) // 2],
        "ttft_p99_s": ttft[min(len(ttft) - 1, round(0.99 * (len(ttft) - 1)))],
        # batch-1 decode: tokens after the first over the time after the first
        "decode_tok_s": (count[ids[0]] - 1) / (last[ids[0]] - first[ids[0]]) if len(ids) == 1 else None,
        "steps": steps["steps"],
        "ms_per_step": phases,
        # wall time per engine step once every request was decoding (no prefill, no first-use costs)
        "decode_step_ms": (end - all_in[0]) / decode_steps * 1e3 if decode_steps > 0 else None,
        # the median decode step of each quarter of them (does a step's cost grow with the outputs?)
        "decode_step_ms_quarters": _quarter_medians(all_in[0] if all_in else t0, ends),
    }


def _quarter_medians(start: float, ends: list[float]) -> list[float]:
    steps = [(b - a) * 1e3 for a, b in zip([start] + ends, ends)]
    q = len(steps) // 4
    if not q:
        return []
    return [round(sorted(part)[len(part) // 2], 2) for part in (steps[i * q : (i + 1) * q] for i in range(4))]


def random_prompts(n: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(100, vocab, (length,), generator=g).tolist() for _ in range(n)]


def greedy(n: int) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)


def decode_bytes(llm: LLM) -> int:
    """Bytes one decode step must read at batch 1: every weight used per token (the embedding table
    only when it doubles as the LM head) - the text model's, not a vision tower's."""
    model = llm.engine.model
    text = getattr(model, "language_model", model)
    total = sum(p.numel() * p.element_size() for p in text.parameters())
    if getattr(text, "lm_head", None) is not None:
        total -= text.embed_tokens.weight.numel() * text.embed_tokens.weight.element_size()
    return total


def forward_flops(llm: LLM, weights: float, tokens: int, logit_rows: int) -> float:
    """FLOPs of `tokens` tokens through the model at 2 a weight: `weights` a token (the LM head's among
    them: decode_bytes' weights, or a mixture's active ones), the LM head's only for the `logit_rows`
    rows whose logits are computed (a prefill's: each prompt's last token; a decode step's: every row);
    attention's own products left out."""
    model = llm.engine.model
    text = getattr(model, "language_model", model)
    head = text.lm_head if getattr(text, "lm_head", None) is not None else text.embed_tokens
    n = head.weight.numel()
    return 2 * ((weights - n) * tokens + n * logit_rows)


def kv_bytes_per_token(llm: LLM) -> int:
    layers, kvh, hd = llm.engine.model.kv_shape
    return layers * 2 * kvh * hd * llm.engine.dtype.itemsize


def engine(config: str, a, **kw) -> LLM:
    t0 = time.perf_counter()
    if SMOKE:
        kw.update(device="cpu", num_blocks=1024, max_num_seqs=min(kw["max_num_seqs"], 16))
    llm = LLM(
        os.path.join(CONFIGS, config),
        load_format="dummy",
        dtype="float32" if SMOKE else "bfloat16",
        enforce_eager=a.enforce_eager,
        async_scheduling={"auto": None, "on": True, "off": False}[a.async_scheduling],
        gpu_memory_utilization=a.gpu_memory_utilization,
        **kw,
    )
    log(
        f"{config}: engine ready in {time.perf_counter() - t0:.1f} s; "
        f"KV pool {llm.engine.kv.capacity_tokens} tokens"
    )
    return llm


def report(name: str, r: dict, extra: str = "") -> None:
    log(
        f"{name}: {r['output_tok_s']:.1f} out tok/s, {r['output_tokens']} tokens in {r['wall_s']:.2f} s, "
        f"TTFT p50 {r['ttft_p50_s'] * 1e3:.1f} ms p99 {r['ttft_p99_s'] * 1e3:.1f} ms, {r['steps']} steps, "
        f"host ms/step {r['ms_per_step']}, decode step {r.get('decode_step_ms') or 0:.2f} ms "
        f"(quarters' medians {r.get('decode_step_ms_quarters')}) {extra}"
    )


# -- workloads -----------------------------------------------------------------------------------
def w1_w2(a) -> None:
    llm = engine("llama-3.1-8b.json", a, max_model_len=2048, max_num_seqs=256, max_num_batched_tokens=8192)
    V = llm.processor.info.vocab_size
    # warm-up: the workloads' shapes at small scale, so Triton's compiles stay out of the timings
    run(llm, random_prompts(4, L(512), V, 99), [greedy(8)] * 4)
    if "w1" in a.workloads:
        if a.profile:
            profile(llm, V, batch=1, context=L(512))
        r = run(llm, random_prompts(1, L(512), V, 0), [greedy(L(256))])
        step_bytes = decode_bytes(llm) + kv_bytes_per_token(llm) * (512 + 128)  # mean context
        floor = RESULTS["ceilings"]["copy_GBps"] * 1e9 / decode_bytes(llm) if "ceilings" in RESULTS else None
        r["MBU"] = (
            r["decode_tok_s"] * step_bytes / (RESULTS["ceilings"]["copy_GBps"] * 1e9) if floor else None
        )
        r["floor_tok_s"] = floor
        report(
            "W1", r, f"decode {r['decode_tok_s']:.1f} tok/s (floor {floor or 0:.0f}, MBU {r['MBU'] or 0:.2f})"
        )
        RESULTS["W1"] = r
    if "w2" in a.workloads:
        if a.profile:
            profile(llm, V, batch=N(256), context=L(512))
            prefill_rate(llm, V)
        r = run(llm, random_prompts(N(256), L(512), V, 1), [greedy(L(256))] * N(256))
        tokens = r["output_tokens"] + r["prompt_tokens"]  # (each output token's logits: one row)
        flops = forward_flops(llm, decode_bytes(llm) / llm.engine.dtype.itemsize, tokens, r["output_tokens"])
        if "ceilings" in RESULTS:
            r["MFU"] = flops / r["wall_s"] / (RESULTS["ceilings"]["bf16_TFLOPs"] * 1e12)
        report("W2", r, f"MFU {r.get('MFU', 0):.3f}")
        RESULTS["W2"] = r
    del llm
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def profile(llm: LLM, V: int, batch: int, context: int, prompts: list | None = None) -> None:
    """torch.profiler over 8 decode steps of `batch` requests with `context`-token prompts (or these
    `prompts`): where the device and host time go (device time per step = CUDA total / 8)."""
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as tprof

    eng = llm.engine
    prompts = random_prompts(batch, context, V, 7) if prompts is None else prompts
    ids = [eng.add_request(llm.processor.request(p, greedy(40))) for p in prompts]
    while eng.num_waiting:  # prefill everything first: the profile is of decode steps
        eng.step()
    for _ in range(4):
        eng.step()
    _sync()
    with tprof(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(8):
            eng.step()
        _sync()
    log(f"profile: 8 decode steps at batch {len(prompts)}, context ~{len(prompts[0])}")
    log(prof.key_averages().table(sort_by="cuda_time_total", row_limit=18, max_name_column_width=60))
    log(prof.key_averages().table(sort_by="cpu_time_total", row_limit=12, max_name_column_width=60))
    for r in ids:
        eng.abort(r)
    while eng.has_unfinished():
        eng.step()


def profile_first_token(llm: LLM, prompt) -> None:
    """torch.profiler over the steps up to one request's first token (vision tower + prefill)."""
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as tprof

    eng = llm.engine
    _sync()
    with tprof(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        rid = eng.add_request(llm.processor.request(prompt, greedy(2)))
        steps = 0
        while not any(d.token_ids for d in eng.step()):
            steps += 1
        _sync()
    log(f"profile: the first token of one image request ({steps + 1} steps)")
    log(prof.key_averages().table(sort_by="cuda_time_total", row_limit=15, max_name_column_width=60))
    log(prof.key_averages().table(sort_by="cpu_time_total", row_limit=15, max_name_column_width=60))
    eng.abort(rid)
    while eng.has_unfinished():
        eng.step()


def prefill_rate(llm: LLM, V: int) -> None:
    """W2's prompts alone (max_tokens=1): the prefill share of W2's time, and its MFU."""
    r = run(llm, random_prompts(N(256), L(512), V, 3), [greedy(1)] * N(256))
    flops = forward_flops(llm, decode_bytes(llm) / llm.engine.dtype.itemsize, r["prompt_tokens"], N(256))
    mfu = flops / r["wall_s"] / (RESULTS["ceilings"]["bf16_TFLOPs"] * 1e12) if "ceilings" in RESULTS else 0
    log(
        f"W2 prefill only: {r['prompt_tokens']} prompt tokens in {r['wall_s']:.2f} s "
        f"({r['prompt_tokens'] / r['wall_s']:.0f} tok/s, MFU {mfu:.3f}), {r['steps']} steps, "
        f"host ms/step {r['ms_per_step']}"
    )
    RESULTS["W2_prefill"] = {**r, "MFU": mfu}


def w3(a) -> None:
    """nano-vllm bench.py: random.seed(0); prompts of randint(100, 1024) ids in randint(0, 10000);
    max_tokens randint(100, 1024), temperature 0.6, ignore_eos."""
    llm = engine("qwen3-0.6b.json", a, max_model_len=4096, max_num_seqs=256, max_num_batched_tokens=16384)
    vocab = min(10000, llm.processor.info.vocab_size - 1)
    # warm-up (bench.py warms up too): sequences of the workload's kind and number, so Triton's
    # compiles stay out of the timing (three short ones left the first run on a fresh H100 compiling
    # inside it: TTFT p50 6.5 s against 0.3 s warm). Other ids than the timed prompts': no prefix hits
    rw = random.Random(1)
    warm = [[rw.randint(0, vocab) for _ in range(L(rw.randint(100, 1024)))] for _ in range(N(256))]
    run(llm, warm, [SamplingParams(temperature=0.6, ignore_eos=True, max_tokens=16)] * len(warm))
    random.seed(0)  # bench.py's stream starts here
    prompts = [[random.randint(0, vocab) for _ in range(L(random.randint(100, 1024)))] for _ in range(N(256))]
    params = [
        SamplingParams(temperature=0.6, ignore_eos=True, max_tokens=L(random.randint(100, 1024)))
        for _ in range(N(256))
    ]
    r = run(llm, prompts, params)
    # the memory floor: every decode step reads the weights, and each row its whole context's K/V (a
    # row of prompt p and o outputs reads o * p + o (o - 1) / 2 tokens' K/V over its steps); the
    # prefill's compute is left out, so the floor is a bound no run reaches
    outs = [q.max_tokens for q in params]
    reads = sum(o * len(p) + o * (o - 1) // 2 for p, o in zip(prompts, outs))
    floor_bytes = max(outs) * decode_bytes(llm) + reads * kv_bytes_per_token(llm)
    extra = ""
    if "ceilings" in RESULTS:
        floor_s = floor_bytes / (RESULTS["ceilings"]["copy_GBps"] * 1e9)
        r.update(floor_tok_s=round(r["output_tokens"] / floor_s, 1))
        r["share_of_floor"] = round(r["output_tok_s"] / r["floor_tok_s"], 3)
        tb = floor_bytes / 1e12
        extra = f"floor {r['floor_tok_s']:.0f} tok/s ({tb:.2f} TB read), share {r['share_of_floor']}"
    report("W3", r, extra)
    RESULTS["W3"] = r
    if a.profile:  # where a W3 decode step goes: the same requests again, profiled once all decode
        from benchmarks.step_profile import decode_window

        trace = os.path.join(a.trace_dir or tempfile.mkdtemp(prefix="foveal-w3-"), "w3.json")
        out = decode_window(llm, prompts, params, trace, finish=False, cprofiled=10)
        table = out.pop("cprofile")
        log(f"W3 profile: {json.dumps(out)}\n{table}")


def w4_engine(a):
    """W4's engine and its prompt maker: image_prompt(i) is one 448x448 image (seeded by i) and L(64) text
    tokens (benchmarks/first_use.py uses both too)."""
    from PIL import Image

    llm = engine("qwen2.5-vl-7b.json", a, max_model_len=4096, max_num_seqs=64, max_num_batched_tokens=8192)
    V = min(150000, llm.processor.info.vocab_size - 10)  # text ids below the special ones

    def image_prompt(i: int):
        g = torch.Generator().manual_seed(1000 + i)
        img = Image.fromarray(torch.randint(0, 256, (448, 448, 3), generator=g, dtype=torch.uint8).numpy())
        text = " ".join(f"t{t}" for t in torch.randint(100, V, (L(64),), generator=g).tolist())
        content = [{"type": "image"}, {"type": "text", "text": text}]
        return llm.processor.render_chat([{"role": "user", "content": content}], images=[img])

    return llm, image_prompt


def w4_warm_up(llm, image_prompt, first=None) -> None:
    """W4's warm-up (vision tower included): two requests one after the other, then a few at once. On a
    fresh machine one warm-up request left the measured TTFT at 87-96 ms against 45-46 ms after more
    warm-up (first-use costs of the second request's path; not pinned down yet)."""
    run(llm, [first if first is not None else image_prompt(999)], [greedy(8)])
    run(llm, [image_prompt(997)], [greedy(8)])
    run(llm, [image_prompt(990 + i) for i in range(4)], [greedy(8)] * 4)


def w4(a) -> None:
    llm, image_prompt = w4_engine(a)
    t0 = time.perf_counter()
    warm = image_prompt(999)
    prep = time.perf_counter() - t0
    w4_warm_up(llm, image_prompt, warm)
    if a.profile:
        profile_first_token(llm, image_prompt(998))
    r = run(llm, [image_prompt(0)], [greedy(L(128))])
    floor = RESULTS["ceilings"]["copy_GBps"] * 1e9 / decode_bytes(llm) if "ceilings" in RESULTS else None
    r["floor_tok_s"], r["preprocess_s"] = floor, prep
    report(
        "W4 batch 1",
        r,
        f"decode {r['decode_tok_s']:.1f} tok/s (floor {floor or 0:.0f}); preprocess {prep * 1e3:.0f} ms",
    )
    RESULTS["W4_single"] = r
    # 64 at once, twice (other images the second time): the first run pays the first uses of its
    # step sizes (on a fresh H100 ~1.6-1.9 s, ~0.9 s of it Triton compiles of the split decode: session
    # 44, benchmarks/first_use.py), the second is the steady state
    prompts = [image_prompt(i) for i in range(1, N(64) + 1)]
    r = run(llm, prompts, [greedy(L(128))] * N(64))
    report("W4 64 concurrent, first use", r)
    RESULTS["W4_64_first"] = r
    prompts = [image_prompt(i) for i in range(101, N(64) + 101)]
    r = run(llm, prompts, [greedy(L(128))] * N(64))
    report("W4 64 concurrent", r)
    RESULTS["W4_64"] = r


def smoke_configs() -> str:
    """Tiny configs of the three families, named like the real ones, in a temp folder."""

    from tiny_configs import write_tiny_configs

    d = tempfile.mkdtemp(prefix="foveal-smoke-")
    write_tiny_configs(d)
    return d


def engine_options(ap: argparse.ArgumentParser) -> None:
    """The flags `engine()` reads, and --smoke (for `setup`): shared by the scripts built on this one."""
    ap.add_argument("--smoke", action="store_true", help="CPU, tiny configs: check the script only")
    ap.add_argument("--enforce-eager", action="store_true")
    ap.add_argument("--async-scheduling", choices=["auto", "on", "off"], default="auto")
    ap.add_argument("--gpu-memory-utilization", type=float, default=0.9)


def setup(a, script: str) -> None:
    """--smoke: the CPU and the tiny configs (smoke_configs); otherwise CUDA, or exit saying so."""
    global SMOKE, CONFIGS
    if a.smoke:
        SMOKE, CONFIGS = True, smoke_configs()
    elif not torch.cuda.is_available():
        raise SystemExit(f"{script} needs CUDA (or --smoke)")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--workloads", default="ceilings,w1,w2,w3,w4")
    ap.add_argument(
        "--profile",
        action="store_true",
        help="torch.profiler tables of W1 and W2 decode steps; W2 prefill alone; W3's decode steps",
    )
    ap.add_argument("--trace-dir", default=None, help="--profile: where W3's trace is written")
    engine_options(ap)
    a = ap.parse_args()
    a.workloads = set(a.workloads.split(","))
    setup(a, "gpu_workloads.py")
    if a.smoke:
        a.workloads.discard("ceilings")
    else:
        log(f"{torch.cuda.get_device_name(0)}, torch {torch.__version__}, eager={a.enforce_eager}")
    steps = [("ceilings", lambda a: RESULTS.__setitem__("ceilings", ceilings()))]
    steps += [("w1", w1_w2) if "w1" in a.workloads else ("w2", w1_w2), ("w3", w3), ("w4", w4)]
    for name, fn in steps:
        if name in a.workloads:
            try:
                fn(a)
            except Exception as e:  # one workload's failure must not hide the others' figures
                import traceback

                traceback.print_exc()
                RESULTS[name] = {"error": f"{type(e).__name__}: {e}"}
                if torch.cuda.is_available():
                    torch.cuda.empty_cache()
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout
    RESULTS["commit"] = os.environ.get("FOVEAL_COMMIT") or commit.strip()  # the device copy has no .git
    RESULTS["eager"] = a.enforce_eager
    RESULTS["async_scheduling"] = a.async_scheduling
    print(json.dumps(RESULTS, default=lambda x: round(x, 4) if isinstance(x, float) else str(x)))


if __name__ == "__main__":
    main()
