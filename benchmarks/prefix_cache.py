"""Prefix caching, offline engine, cache on vs off in the same process:

1. Shared system prompt: a ~2,000-token system prompt, then short user turns, one request at a time.
   Time to first token of each turn (the first turn warms the cache and is not counted).
2. Multi-turn image chat (only with --vlm-model): turn 2 resends turn 1 (image included) plus a new
   question; TTFT of turn 2.
3. Throughput at a 0% hit rate: distinct random prompts (nothing to share) through generate(), cache on
   vs off, alternating rounds; the median of each is reported, so the cost of hashing and publishing
   blocks shows (the machine's run-to-run noise is printed too).
4. What caching costs at a 0% hit rate, measured directly (the host's +-15% round-to-round noise cannot
   resolve a 2% throughput difference): one more round with the cache on, timing every call into the
   cache's own code (lookup, publish with its block hashing, and all block-pool allocate/free/touch,
   which runs with the cache off too: an upper bound), as a share of the round's wall time.

    python benchmarks/prefix_cache.py --dtype float32
    python benchmarks/prefix_cache.py --vlm-model /tmp/smolvlm-256m-dummy   # adds the image chat
    python benchmarks/prefix_cache.py --overhead-only                         # 4 alone

Prints a table, then one JSON object as the last line.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from foveal import SamplingParams  # noqa: E402
from foveal.engine.llm import LLM  # noqa: E402

WORDS = (
    "river mountain quiet lantern orbit pepper signal harbor meadow copper violet thunder anchor "
    "silver garden planet whisper candle ember forest"
).split()


def ttft(llm: LLM, prompt) -> float:
    """Seconds from add_request to the first generated token (the engine alone, nothing else running)."""
    t0 = time.perf_counter()
    for d in llm.stream(prompt, SamplingParams(temperature=0, max_tokens=1)):
        if d.token_ids:
            return time.perf_counter() - t0
    raise RuntimeError("no token")


def system_prompt_case(llm: LLM, system_tokens: int, turns: int) -> list[float]:
    g = torch.Generator().manual_seed(0)
    words = [WORDS[i] for i in torch.randint(0, len(WORDS), (system_tokens,), generator=g).tolist()]
    system = "You are a helpful assistant. Reference notes: " + " ".join(words)
    out = []
    for i in range(turns + 1):
        msgs = [
            {"role": "system", "content": system},
            {"role": "user", "content": f"Question {i}: summarize."},
        ]
        ids = llm.processor.apply_chat_template(msgs)
        t = ttft(llm, ids)
        if i:  # turn 0 warms the cache
            out.append(t)
    return out


def image_chat_case(llm: LLM, size: int) -> float:
    from PIL import Image

    g = torch.Generator().manual_seed(1)
    img = Image.fromarray(torch.randint(0, 256, (size, size, 3), generator=g, dtype=torch.uint8).numpy())
    turn1 = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "What is this?"}]}]
    p1 = llm.processor.render_chat(turn1, images=[img])
    ttft(llm, p1)
    turn2 = turn1 + [
        {"role": "assistant", "content": [{"type": "text", "text": "A picture of noise."}]},
        {"role": "user", "content": [{"type": "text", "text": "What colors dominate?"}]},
    ]
    return ttft(llm, llm.processor.render_chat(turn2, images=[img]))


def throughput(llm: LLM, n: int, input_len: int, output_len: int, seed: int) -> float:
    g = torch.Generator().manual_seed(seed)  # a fresh seed per round: nothing is shared or reused
    prompts = [
        torch.randint(100, llm.processor.info.vocab_size, (input_len,), generator=g).tolist()
        for _ in range(n)
    ]
    t0 = time.perf_counter()
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=output_len, ignore_eos=True))
    return sum(len(o.outputs[0].token_ids) for o in outs) / (time.perf_counter() - t0)


def cache_work_share(llm: LLM, n: int, input_len: int, output_len: int, seed: int) -> tuple[float, float]:
    """(seconds inside the cache's code, wall seconds) over one throughput round."""
    kv = llm.engine.kv
    spent = [0.0]

    def timed(obj, name):
        fn = getattr(obj, name)

        def wrapper(*args, **kw):
            t = time.perf_counter()
            try:
                return fn(*args, **kw)
            finally:
                spent[0] += time.perf_counter() - t

        setattr(obj, name, wrapper)  # an instance attribute over the class method: undone below
        return obj, name

    # no nesting among these (find_cached and publish call the pool's lookup/cache_block, not these)
    patched = [timed(kv, m) for m in ("find_cached", "publish", "record_lookup")]
    patched += [timed(kv.pool, m) for m in ("allocate", "free", "touch")]
    try:
        t0 = time.perf_counter()
        throughput(llm, n, input_len, output_len, seed)
        wall = time.perf_counter() - t0
    finally:
        for obj, name in patched:
            delattr(obj, name)
    return spent[0], wall


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default=None)
    ap.add_argument("--vlm-model", default=None, help="a vision-language model folder for the image chat")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--system-tokens", type=int, default=2000)
    ap.add_argument("--turns", type=int, default=4)
    ap.add_argument("--image-size", type=int, default=448)
    ap.add_argument("--num-prompts", type=int, default=16)
    ap.add_argument("--input-len", type=int, default=128)
    ap.add_argument("--output-len", type=int, default=32)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--overhead-only", action="store_true", help="only case 4 (the cache's own time)")
    a = ap.parse_args()
    if a.overhead_only:
        llm = LLM(a.model, dtype=a.dtype, kv_cache_memory=512 * 2**20, max_num_seqs=32)
        throughput(llm, 2, 16, 4, seed=999)  # warm-up
        shares = [
            cache_work_share(llm, a.num_prompts, a.input_len, a.output_len, seed=100 + r)
            for r in range(a.rounds)
        ]
        for spent, wall in shares:
            print(f"cache work {spent * 1e3:.1f} ms of {wall:.2f} s = {spent / wall:.3%}")
        worst = max(spent / wall for spent, wall in shares)
        print(
            json.dumps(
                {"benchmark": "prefix_cache_overhead", "rounds": len(shares), "max_share": round(worst, 5)}
            )
        )
        return

    opts = dict(dtype=a.dtype, kv_cache_memory=512 * 2**20, max_num_seqs=32)
    engines = {"on": LLM(a.model, **opts), "off": LLM(a.model, enable_prefix_caching=False, **opts)}
    res: dict = {}
    for name, llm in engines.items():
        res[f"system_ttft_{name}"] = statistics.median(system_prompt_case(llm, a.system_tokens, a.turns))
    if a.vlm_model:
        for name, on in (("on", True), ("off", False)):
            vlm = LLM(a.vlm_model, dtype=a.dtype, enable_prefix_caching=on)
            res[f"image_turn2_ttft_{name}"] = image_chat_case(vlm, a.image_size)
            del vlm
    tput: dict[str, list[float]] = {"on": [], "off": []}
    for llm in engines.values():  # warm-up
        throughput(llm, 2, 16, 4, seed=999)
    for r in range(a.rounds):
        for name in ("on", "off") if r % 2 == 0 else ("off", "on"):
            tput[name].append(throughput(engines[name], a.num_prompts, a.input_len, a.output_len, seed=r))
    spent, wall = cache_work_share(engines["on"], a.num_prompts, a.input_len, a.output_len, seed=100)
    res["cache_work_ms"], res["cache_work_share"] = spent * 1e3, spent / wall
    hits = engines["on"].engine.kv.stats()
    for name in ("on", "off"):
        res[f"tput_{name}"] = statistics.median(tput[name])
        res[f"tput_{name}_all"] = [round(x, 1) for x in tput[name]]

    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True)
    print(f"\n{'case':<44}{'cache on':>12}{'cache off':>12}{'ratio':>8}")
    s_on, s_off = res["system_ttft_on"], res["system_ttft_off"]
    print(
        f"{'TTFT, ' + str(a.system_tokens) + '-token system prompt (s)':<44}{s_on:>12.3f}{s_off:>12.3f}"
        f"{s_off / s_on:>7.1f}x"
    )
    if a.vlm_model:
        i_on, i_off = res["image_turn2_ttft_on"], res["image_turn2_ttft_off"]
        print(f"{'TTFT, image chat turn 2 (s)':<44}{i_on:>12.3f}{i_off:>12.3f}{i_off / i_on:>7.1f}x")
    t_on, t_off = res["tput_on"], res["tput_off"]
    print(
        f"{'throughput at 0% hits (out tok/s, median)':<44}{t_on:>12.1f}{t_off:>12.1f}{t_on / t_off:>7.3f}x"
    )
    print(f"rounds: on {res['tput_on_all']}  off {res['tput_off_all']}")
    share = f"{spent * 1e3:.1f} ms of {wall:.2f} s = {spent / wall:.3%}"
    print(f"time inside the cache's code in one 0%-hit round: {share}")
    summary = {
        "benchmark": "prefix_cache",
        "model": engines["on"].processor.info.model_name,
        "dtype": a.dtype,
        "commit": commit.stdout.strip(),
        "threads": torch.get_num_threads(),
        "system_tokens": a.system_tokens,
        "ttft_speedup": round(s_off / s_on, 2),
        "tput_ratio_on_off": round(t_on / t_off, 4),
        **{k: (round(v, 4) if isinstance(v, float) else v) for k, v in res.items()},
        "hit_tokens_during_throughput_and_ttft": hits["hit_tokens"],
    }
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
