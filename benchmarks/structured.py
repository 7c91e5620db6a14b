"""Structured outputs' cost: JSON-schema decoding vs unconstrained decoding on the same prompts, in one
process, alternating; the host time of grammar masks per row per step; compile time over the schema
corpus (issue 18).

    H200:  python3 benchmarks/structured.py --model benchmarks/configs/llama-3.1-8b.json \\
               --load-format dummy --tokenizer .vocab/llama3 --batches 1,64
    CPU:   python benchmarks/structured.py --batches 1,16 --max-tokens 64        (the embedded SmolLM2)

The JSON requests take the held-out maskbench schemas the backend accepts, one per request, each
wrapped as an array of at least 1,000 of its instances: no request can end before max_tokens, so both
modes decode the same number of steps at the same batch size and TPOT compares like with like (a
schema left alone ends a request early, and a batch that empties runs faster steps). Unconstrained
requests use ignore_eos. TPOT per request is (last token - first token) / (tokens - 1); the table
gives the median over requests and the best of --repeats runs of each mode.

--tokenizer: a random-weight model (--load-format dummy) needs a real tokenizer for JSON (the synthetic
one spells only words): a tokenizer folder, or a vocabulary-only GGUF such as llama.cpp's
models/ggml-vocab-llama-bpe.gguf (the Llama 3 tokenizer, in the llama-cpp-python sdist on PyPI). Ends
with one JSON line.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))

from foveal import SamplingParams  # noqa: E402
from foveal.engine.llm import LLM  # noqa: E402
from foveal.structured import OutputConstraint  # noqa: E402

HELDOUT = (
    HERE.parents[1] / "shared" / "heldout" / "jsonschemabench"
)  # beside the checkout (--schemas: elsewhere)


def log(msg: str) -> None:
    print(msg, flush=True)


def model_folder(config: str, tokenizer: str) -> str:
    """A folder with the dummy model's config and a real tokenizer: a tokenizer folder, or a vocabulary
    GGUF (converted by this machine's transformers: convert it once and carry the folder where versions
    differ, since two transformers versions converted llama.cpp's Llama 3 vocabulary differently)."""
    from transformers import AutoTokenizer

    if os.path.isdir(tokenizer):
        tok = AutoTokenizer.from_pretrained(tokenizer)
    else:
        d, f = os.path.split(os.path.abspath(tokenizer))
        tok = AutoTokenizer.from_pretrained(d, gguf_file=f)
    folder = tempfile.mkdtemp(prefix="foveal-structured-")
    cfg = json.loads(Path(config).read_text())
    cfg["bos_token_id"], cfg["eos_token_id"] = tok.bos_token_id, tok.eos_token_id
    (Path(folder) / "config.json").write_text(json.dumps(cfg))
    tok.save_pretrained(folder)
    return folder


def schemas(folder: Path) -> list[dict]:
    rows = [json.loads(line) for line in (folder / "maskbench_sample.jsonl").read_text().splitlines()]
    raw = folder / "raw_sample.jsonl"
    if raw.exists():
        rows += [json.loads(line) for line in raw.read_text().splitlines()]
    return rows


def compile_times(llm: LLM, rows: list[dict]) -> dict:
    """Each schema compiled afresh (no cache): p50, p99, max; how many the backend refuses."""
    backend = llm.processor.grammars.backend
    times, refused = [], 0
    for r in rows:
        t0 = time.perf_counter()
        try:
            backend.compile(OutputConstraint.json_schema(r["schema"]))
        except ValueError:
            refused += 1
        times.append(time.perf_counter() - t0)
    times.sort()
    q = lambda p: times[min(len(times) - 1, round(p * (len(times) - 1)))] * 1e3  # noqa: E731
    return {
        "schemas": len(rows),
        "refused": refused,
        "p50_ms": q(0.5),
        "p99_ms": q(0.99),
        "max_ms": times[-1] * 1e3,
    }


def accepted_specs(llm: LLM, rows: list[dict]) -> list[OutputConstraint]:
    out = []
    for r in rows:
        spec = OutputConstraint.json_schema({"type": "array", "minItems": 1000, "items": r["schema"]})
        try:
            llm.processor.grammars.get(spec)
        except ValueError:
            continue
        out.append(spec)
    return out


def run(llm: LLM, prompts: list, params: list[SamplingParams]) -> dict:
    """All requests at once through the engine's step loop: per-request TPOT, and the mask time per
    row of each step that filled masks."""
    eng, guides = llm.engine, llm.engine.guides
    per_row: list[float] = []
    real_masks = guides.masks

    def masks(items):
        t0, rows0 = guides.mask_seconds, guides.mask_rows
        out = real_masks(items)
        if guides.mask_rows > rows0:
            per_row.append((guides.mask_seconds - t0) / (guides.mask_rows - rows0))
        return out

    guides.masks = masks
    try:
        ids = [eng.add_request(llm.processor.request(p, sp)) for p, sp in zip(prompts, params)]
        first, last, count, ends = {}, {}, dict.fromkeys(ids, 0), {}
        t0 = time.perf_counter()
        while eng.has_unfinished():
            for d in eng.step():
                if d.token_ids:
                    now = time.perf_counter()
                    first.setdefault(d.request_id, now)
                    last[d.request_id] = now
                    count[d.request_id] += len(d.token_ids)
                if d.finished:
                    why = d.finish_reason.value + (f": {d.error}" if d.error else "")
                    ends[why] = ends.get(why, 0) + 1
        wall = time.perf_counter() - t0
    finally:
        guides.masks = real_masks
    tpot = [(last[r] - first[r]) / (count[r] - 1) for r in ids if count[r] > 1]
    return {
        "tpot_ms": statistics.median(tpot) * 1e3,
        "tokens": sum(count.values()),
        "output_tok_s": sum(count.values()) / wall,
        "mask_us_per_row_median": statistics.median(per_row) * 1e6 if per_row else None,
        "finish": ends,  # finish reason (and error) -> requests
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None)
    ap.add_argument("--load-format", default="auto")
    ap.add_argument("--tokenizer", default=None, help="a tokenizer folder or vocabulary GGUF (for dummy)")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--batches", default="1,16")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--kv-cache-memory", type=int, default=None)
    ap.add_argument(
        "--schemas", type=Path, default=HELDOUT, help="folder of maskbench_sample.jsonl (+ raw_sample)"
    )
    a = ap.parse_args()
    batches = [int(b) for b in a.batches.split(",")]
    model = a.model
    if a.load_format == "dummy":
        if not a.tokenizer:
            sys.exit("--load-format dummy needs --tokenizer (a real tokenizer for JSON)")
        model = model_folder(a.model, a.tokenizer)
    llm = LLM(model, load_format=a.load_format, dtype=a.dtype, max_num_seqs=max(batches),
              kv_cache_memory=a.kv_cache_memory)  # fmt: skip
    info = llm.processor.info
    log(f"model {info.model_name}, vocab {info.vocab_size} (tokenizer {len(llm.tokenizer)}), "
        f"device {llm.engine.device}, dtype {llm.engine.dtype}")  # fmt: skip
    rows = schemas(a.schemas)
    comp = compile_times(llm, rows)
    log(f"compile over {comp['schemas']} schemas: p50 {comp['p50_ms']:.2f} ms, p99 {comp['p99_ms']:.2f} ms, "
        f"max {comp['max_ms']:.1f} ms, {comp['refused']} refused")  # fmt: skip
    specs = accepted_specs(llm, rows)
    log(f"{len(specs)} schemas accepted for the decode runs")
    g = torch.Generator().manual_seed(0)
    results = {"compile": comp, "batches": {}}
    for b in batches:
        prompts = [torch.randint(1000, 20000, (a.prompt_len,), generator=g).tolist() for _ in range(b)]
        free = [
            SamplingParams(temperature=1.0, seed=i, max_tokens=a.max_tokens, ignore_eos=True)
            for i in range(b)
        ]
        guided = [
            SamplingParams(temperature=1.0, seed=i, max_tokens=a.max_tokens, structured=specs[i % len(specs)])
            for i in range(b)
        ]
        run(llm, prompts, free)  # warm: first-use kernels, graphs
        run(llm, prompts, guided)
        runs = {"free": [], "json": []}
        for _ in range(a.repeats):
            runs["free"].append(run(llm, prompts, free))
            runs["json"].append(run(llm, prompts, guided))
        best = {m: min(rs, key=lambda r: r["tpot_ms"]) for m, rs in runs.items()}
        over = best["json"]["tpot_ms"] / best["free"]["tpot_ms"] - 1
        results["batches"][b] = {"free": runs["free"], "json": runs["json"], "tpot_overhead": over}
        tf, tj = best["free"]["tpot_ms"], best["json"]["tpot_ms"]
        log(f"batch {b:3d}: TPOT free {tf:.3f} ms, json {tj:.3f} ms "
            f"({over * 100:+.1f}%); all runs free {[round(r['tpot_ms'], 3) for r in runs['free']]} "
            f"json {[round(r['tpot_ms'], 3) for r in runs['json']]}; mask per row per step (median) "
            f"{best['json']['mask_us_per_row_median']:.1f} us")  # fmt: skip
    print(json.dumps({"benchmark": "structured", "commit": os.environ.get("FOVEAL_COMMIT"), **results}))


if __name__ == "__main__":
    main()
