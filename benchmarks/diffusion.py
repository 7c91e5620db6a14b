"""Diffusion LMs in the engine loop, against the same-size autoregressive model in the same run.

GPU, random weights (--load-format dummy) in the published shapes (benchmarks/configs):

    sdar   SDAR-8B-Chat shape (Qwen3-8B + block_size 4): block diffusion, committed blocks' K/V kept
    llada  LLaDA-8B-Instruct shape: masked diffusion (prompt + canvas recomputed every pass)
    ar     Qwen3-8B: plain decoding, the yardstick

    python benchmarks/diffusion.py [--models sdar,llada,ar] [--batches 1,8,32] [--input-len 256]
        [--max-tokens 256] [--llada-max-tokens 128]
    python benchmarks/diffusion.py --smoke      # CPU, tiny configs: checks the script

Per model, knob set and batch (all requests at once): output tok/s over the wall time, denoising passes
(forwards that choose tokens) per request and tokens per pass. SDAR also runs with `recompute_prefix`
(no K/V kept, the whole prefix computed in every pass, as LLaDA2's reference sampler does): the block
cache's speedup over recomputing. On random weights every distribution is nearly flat, so a
confidence threshold of 0.9 is never passed and the threshold rule unmasks its one forced position per
pass; the fixed schedules (`steps` per block) set tokens per pass by construction. Ends with one JSON
line.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))

from foveal import SamplingParams  # noqa: E402
from foveal.diffusion.state import DiffusionParams  # noqa: E402
from foveal.engine.llm import LLM  # noqa: E402

CONFIGS = {"sdar": "sdar-8b.json", "llada": "llada-8b.json", "ar": "qwen3-8b.json"}
KNOBS = {  # name -> (DiffusionParams, also timed with the prefix recomputed)
    "sdar": {
        "steps4": (DiffusionParams(steps=4), False),  # one token per pass (block 4)
        "steps2": (DiffusionParams(steps=2), True),  # two tokens per pass
        "threshold0.9": (DiffusionParams(threshold=0.9), False),
    },
    "llada": {"block32_steps8": (DiffusionParams(steps=8, block_length=32), False)},  # 4 per pass
}


def commit() -> str:
    import subprocess

    try:
        return subprocess.check_output(["git", "rev-parse", "--short", "HEAD"], cwd=HERE, text=True).strip()
    except Exception:
        return os.environ.get("FOVEAL_COMMIT", "unknown")


def smoke_configs() -> dict[str, str]:
    """Tiny configs of the three kinds (CPU)."""
    from tests.diffusion_models import llada_config, sdar_config
    from tests.tiny import tiny_config

    folder = tempfile.mkdtemp()
    qwen3 = tiny_config("qwen3").to_dict()
    qwen3["architectures"] = ["Qwen3ForCausalLM"]
    out = {}
    for name, cfg in (("sdar", sdar_config()), ("llada", llada_config()), ("ar", qwen3)):
        out[name] = os.path.join(folder, f"{name}.json")
        with open(out[name], "w") as f:
            json.dump(cfg, f)
    return out


def run(llm: LLM, prompts: list[list[int]], params: SamplingParams) -> dict:
    """All prompts at once: output tok/s over the wall time, and denoising passes."""
    eng = llm.engine
    passes = 0
    schedule = eng.scheduler.schedule

    def counting():
        nonlocal passes
        batch = schedule()
        passes += sum(1 for s in batch.items if s.denoise >= 0)
        return batch

    eng.scheduler.schedule = counting
    rids = [eng.add_request(llm.processor.request(p, params)) for p in prompts]
    out = {r: 0 for r in rids}
    t0 = time.perf_counter()
    while eng.has_unfinished():
        for d in eng.step():
            out[d.request_id] += len(d.token_ids)
    wall = time.perf_counter() - t0
    del eng.scheduler.schedule
    tokens = sum(out.values())
    return {
        "out_tok_s": round(tokens / wall, 1),
        "wall_s": round(wall, 3),
        "passes_per_request": round(passes / len(prompts), 1) if passes else None,
        "tokens_per_pass": round(tokens / passes, 2) if passes else None,
    }


def bench(a) -> list[dict]:
    configs = {m: os.path.join(HERE, "configs", c) for m, c in CONFIGS.items()}
    if a.smoke:
        configs = smoke_configs()
    opts = dict(load_format="dummy", dtype=a.dtype, max_num_seqs=max(a.batches))
    if torch.cuda.is_available():
        opts["kv_cache_memory"] = a.kv_memory_gib * 2**30
    else:
        opts.update(num_blocks=4096, block_size=16)
    g = torch.Generator().manual_seed(0)
    rows = []
    for model in a.models:
        max_tokens = a.llada_max_tokens if model == "llada" else a.max_tokens
        kw = dict(opts, max_model_len=a.input_len + max_tokens + 64)
        if model == "llada":  # a masked pass computes prompt + canvas of every request in one step
            kw["max_num_batched_tokens"] = max(a.batches) * (a.input_len + max_tokens)
        llm = LLM(configs[model], **kw)
        vocab = llm.processor.info.vocab_size
        mask = llm.processor.info.diffusion.mask_token_id if llm.processor.info.diffusion else -1
        for b in a.batches:
            prompts = []
            for _ in range(b):
                p = torch.randint(100, vocab - 1, (a.input_len,), generator=g).tolist()
                prompts.append([t if t != mask else t + 1 for t in p])
            knobs = KNOBS.get(model, {"plain": (None, False)})
            for name, (knob, recompute_too) in knobs.items():
                params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True, diffusion=knob)
                warm = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, diffusion=knob)
                run(llm, prompts[:1], warm)
                modes = ["cached", "recompute"] if recompute_too else ["cached"]
                for rep in range(a.reps):
                    for mode in modes:  # alternating
                        llm.engine.scheduler.diffusion.recompute_prefix = mode == "recompute"
                        try:
                            res = run(llm, prompts, params)
                        finally:
                            llm.engine.scheduler.diffusion.recompute_prefix = False
                        kv = mode if knob is not None and model == "sdar" else None
                        row = {"model": model, "knobs": name, "batch": b, "rep": rep, "kv": kv, **res}
                        rows.append(row)
                        print(json.dumps(row), flush=True)
        del llm
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", default="sdar,llada,ar")
    ap.add_argument("--batches", default="1,8,32")
    ap.add_argument("--input-len", type=int, default=256)
    ap.add_argument("--max-tokens", type=int, default=256)
    ap.add_argument("--llada-max-tokens", type=int, default=128)
    ap.add_argument("--reps", type=int, default=1)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--kv-memory-gib", type=int, default=16)
    ap.add_argument("--smoke", action="store_true")
    a = ap.parse_args()
    a.models = a.models.split(",")
    a.batches = [int(x) for x in a.batches.split(",")]
    if a.smoke:
        a.input_len, a.max_tokens, a.llada_max_tokens, a.dtype, a.batches = 16, 16, 16, "float32", [1, 4]
    torch.set_num_threads(os.cpu_count() or 1)
    rows = bench(a)
    device = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
    res = {"benchmark": "diffusion", "commit": commit(), "dtype": a.dtype, "rows": rows, "device": device}
    print(json.dumps(res))


if __name__ == "__main__":
    main()
