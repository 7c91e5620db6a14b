"""LoRA serving cost: throughput of one batch of requests on the base model and with adapters, in one
process, alternating, so host noise hits every mode alike.

    modes   plain     an engine without LoRA (the base model as served today)
            base      the LoRA engine, no request names an adapter (the LoRA kernels run, nothing to add)
            lora1     the LoRA engine, every request with the same adapter
            loraN     the LoRA engine, request i with adapter i % N (N distinct adapters in every step)

Adapters are random, rank --rank on every linear of every decoder layer (q/k/v/o/gate/up/down), written
in PEFT's layout (adapter_config.json + adapter_model.safetensors) into a temp folder and loaded through
the normal path. Greedy, fixed output length (ignore_eos).

    H200:  python benchmarks/lora.py --model benchmarks/configs/llama-3.1-8b.json --load-format dummy \
               --dtype bfloat16 --batch 64 --adapters 8
    CPU:   python benchmarks/lora.py --batch 16 --adapters 8 --quantization gguf   (the embedded SmolLM2)

Prints one JSON line per mode and rep, then a summary line (tokens/s per mode, ratio to plain).

    python benchmarks/lora.py --kernels     (CUDA) each Llama-3.1-8B projection with LoRA (the GEMM
                                            over [W; A...] and the expand) vs its plain GEMM, in a graph
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import platform
import subprocess
import sys
import tempfile
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from foveal import LLM, LoRARequest, SamplingParams  # noqa: E402

MODULES = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
           "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")  # fmt: skip


def write_adapters(llm: LLM, n: int, rank: int, folder: str, dtype: torch.dtype) -> list[str]:
    """n random PEFT adapters fitting the engine's model (module names checked against its layout)."""
    from safetensors.torch import save_file

    layout = llm.engine.runner.lora.layout
    layers = max(int(name.split(".")[-3]) for name in layout.targets) + 1
    shapes = {}
    for i in range(layers):
        for m in MODULES:
            name = f"model.layers.{i}.{m}"
            target, j = layout.route(name)
            shapes[name] = (target.slices[j][1], target.in_features)
    paths = []
    for a in range(n):
        g = torch.Generator().manual_seed(a)
        tensors = {}
        for name, (out, inp) in shapes.items():
            key = f"base_model.model.{name}"
            tensors[key + ".lora_A.weight"] = (torch.randn(rank, inp, generator=g) / inp**0.5).to(dtype)
            tensors[key + ".lora_B.weight"] = (torch.randn(out, rank, generator=g) * 0.01).to(dtype)
        path = os.path.join(folder, f"adapter{a}")
        os.makedirs(path, exist_ok=True)
        save_file(tensors, os.path.join(path, "adapter_model.safetensors"))
        with open(os.path.join(path, "adapter_config.json"), "w") as f:
            json.dump(
                {"peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank, "target_modules": list(MODULES)}, f
            )
        paths.append(path)
    return paths


def run(llm: LLM, prompts, params, loras) -> tuple[dict, list[list[int]]]:
    """The timing of one batch, and its outputs: every request ran to max_tokens (ignore_eos) or the
    run is refused (a request that failed would make the figure wrong)."""
    t0 = time.perf_counter()
    outs = llm.generate(prompts, params, lora_request=loras)
    dt = time.perf_counter() - t0
    tokens = [list(o.outputs[0].token_ids) for o in outs]
    short = [i for i, t in enumerate(tokens) if len(t) != params.max_tokens]
    if short:
        raise SystemExit(
            f"requests {short[:8]} ended early: {[outs[i].outputs[0].finish_reason for i in short[:8]]}"
        )
    n = sum(map(len, tokens))
    return {"seconds": round(dt, 3), "output_tokens": n, "tok_s": round(n / dt, 1)}, tokens


def kernels(rank: int, slots: int) -> None:
    """Microseconds per projection of Llama-3.1-8B under graph replay (bf16): the base GEMM alone, and
    the LoRA path (the GEMM over [W; every slot's A], then the expand) with 1 and `slots` adapters."""
    from foveal.lora.ops_triton import lora_expand_fused
    from foveal.lora.slots import group_rows

    shapes = {
        "qkv": (4096, 6144, 3),
        "o": (4096, 4096, 1),
        "gate_up": (4096, 28672, 2),
        "down": (14336, 4096, 1),
    }
    dev, dt = torch.device("cuda"), torch.bfloat16

    def timed(fn, n=50) -> float:
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            fn()
        torch.cuda.current_stream().wait_stream(s)
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            for _ in range(n):
                fn()
        g.replay()
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(5):
            g.replay()
        torch.cuda.synchronize()
        return (time.perf_counter() - t0) / (5 * n) * 1e6

    def lora_path(x, w_ext, B, perm, offs, out):
        return lora_expand_fused(torch.nn.functional.linear(x, w_ext), B, perm, offs, slots, out)

    for name, (inp, out, n) in shapes.items():
        K = n * rank
        w_ext = torch.randn(out + slots * K, inp, device=dev, dtype=dt) * 0.01
        B = torch.randn(slots + 1, out, K, device=dev, dtype=dt) * 0.01
        for T in (1, 16, 64, 256):
            x = torch.randn(T, inp, device=dev, dtype=dt)
            row = {"proj": name, "rows": T}
            row["gemm_us"] = round(timed(functools.partial(torch.nn.functional.linear, x, w_ext[:out])), 1)
            for active in (1, slots):
                packed = torch.tensor(group_rows([(i % active, 1) for i in range(T)], slots + 1), device=dev)
                f = functools.partial(lora_path, x, w_ext, B, packed[:T], packed[T:].to(torch.int32), out)
                row[f"lora{active}_us"] = round(timed(f), 1)
            print(json.dumps(row), flush=True)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--kernels", action="store_true", help="CUDA: time the LoRA add per projection")
    ap.add_argument("--model", default=None, help="a model folder, GGUF or config.json (default: SmolLM2)")
    ap.add_argument("--load-format", default="auto")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--quantization", default="none")
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--adapters", type=int, default=8, help="N of the loraN mode")
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--input-len", type=int, default=128)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--kv-memory-gib", type=float, default=None, help="a fixed KV pool per engine")
    ap.add_argument("--modes", default="plain,base,lora1,loraN")
    a = ap.parse_args()
    if a.kernels:
        return kernels(a.rank, a.adapters)
    opts = dict(dtype=a.dtype, load_format=a.load_format, quantization=a.quantization, max_num_seqs=a.batch,
                max_model_len=a.input_len + a.output_len + 16)  # fmt: skip
    if a.kv_memory_gib:
        opts["kv_cache_memory"] = int(a.kv_memory_gib * 2**30)
    elif torch.cuda.is_available():  # two engines in one process: a fixed pool each
        opts["kv_cache_memory"] = 16 << 30
    modes = a.modes.split(",")
    plain = LLM(a.model, **opts) if "plain" in modes else None
    lora = LLM(a.model, enable_lora=True, max_loras=max(1, a.adapters), max_lora_rank=a.rank, **opts)
    dtype = lora.engine.dtype
    tmp = tempfile.mkdtemp(prefix="foveal_lora_bench_")
    paths = write_adapters(lora, max(1, a.adapters), a.rank, tmp, dtype)
    vocab = lora.processor.info.vocab_size
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(100, vocab, (a.input_len,), generator=g).tolist() for _ in range(a.batch)]
    reqs = [LoRARequest(f"a{i}", p) for i, p in enumerate(paths)]
    loras = {
        "base": None,
        "lora1": [reqs[0]] * a.batch,
        "loraN": [reqs[i % len(reqs)] for i in range(a.batch)],
    }
    params = SamplingParams(temperature=0, max_tokens=a.output_len, ignore_eos=True)
    warm = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    for m in modes:  # first-use costs (kernel compiles, recorded CPU steps, adapter reads) outside the clock
        llm = plain if m == "plain" else lora
        llm.generate(prompts, warm, lora_request=None if m == "plain" else loras[m])
    results: dict[str, list[float]] = {m: [] for m in modes}
    first: dict[str, list[list[int]]] = {}  # each mode's outputs at its first rep
    for rep in range(a.reps):
        for m in modes:
            llm = plain if m == "plain" else lora
            r, tokens = run(llm, prompts, params, None if m == "plain" else loras[m])
            if first.setdefault(m, tokens) != tokens:  # greedy: every rep writes the same tokens
                raise SystemExit(f"mode {m}: rep {rep} wrote other tokens than rep 0")
            results[m].append(r["tok_s"])
            print(json.dumps({"mode": m, "rep": rep, **r}), flush=True)
    best = {m: max(v) for m, v in results.items()}
    ref = best.get("plain") or best.get("base")
    commit = subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True
    ).stdout.strip()
    summary = {
        "model": a.model or "SmolLM2-135M (embedded)",
        "device": torch.cuda.get_device_name()
        if torch.cuda.is_available()
        else platform.processor() or "cpu",
        "commit": commit,
        "batch": a.batch,
        "adapters": a.adapters,
        "rank": a.rank,
        "input_len": a.input_len,
        "output_len": a.output_len,
        "tok_s": results,
        "best_tok_s": best,
        "ratio_to_plain": {m: round(v / ref, 3) for m, v in best.items()},
        "lora_slot_mib": round(lora.engine.runner.lora.nbytes / 2**20, 1),
    }
    print(json.dumps(summary), flush=True)


if __name__ == "__main__":
    main()
