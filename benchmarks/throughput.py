"""Offline throughput: N seeded random prompts through Foveal, and optionally through transformers'
batched `generate` on the same prompts and the same weights in the same process.

    python benchmarks/throughput.py --num-prompts 32 --input-len 128 --output-len 128 \
        --dtype bfloat16 --compare-hf

Image workload (a vision-language model folder): K seeded random images of a given size per request,
processed by the model's own processor before the clock starts (that time is reported separately);
`--repeat-images` sends the same images in every request (vision-cache hits after the first):

    python benchmarks/throughput.py --model /path/to/vlm --images-per-prompt 1 --image-size 448x448

Prints a table, then one JSON object as the last line.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from foveal import SamplingParams  # noqa: E402
from foveal.engine.llm import LLM  # noqa: E402


def make_prompts(n: int, input_len: int, range_ratio: float, vocab: int, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    lo = max(1, int(input_len * (1 - range_ratio)))
    hi = max(lo, int(input_len * (1 + range_ratio)))
    lens = torch.randint(lo, hi + 1, (n,), generator=g).tolist()
    # avoid the first 100 ids (special tokens in most vocabularies)
    return [torch.randint(100, vocab, (k,), generator=g).tolist() for k in lens]


def make_image_prompts(llm: LLM, prompts, k: int, size: str, repeat: bool, seed: int):
    """Each token prompt becomes a chat turn with k random images (noise: nothing for the encoder to
    shortcut) followed by the prompt's text."""
    from PIL import Image

    w, h = (int(x) for x in size.lower().split("x"))

    def pictures(i: int):
        if repeat:
            i = 0
        gi = torch.Generator().manual_seed(seed * 1000 + i)
        return [
            Image.fromarray(torch.randint(0, 256, (h, w, 3), generator=gi, dtype=torch.uint8).numpy())
            for _ in range(k)
        ]

    out = []
    for i, ids in enumerate(prompts):
        text = llm.tokenizer.decode(ids, skip_special_tokens=True)
        content = [{"type": "image"} for _ in range(k)] + [{"type": "text", "text": text}]
        out.append(llm.processor.render_chat([{"role": "user", "content": content}], images=pictures(i)))
    return out


def run_foveal(llm: LLM, prompts, output_len: int) -> dict:
    params = SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=True)
    # warm-up on text only, so the first timed image is not already in the vision cache
    warm = getattr(prompts[0], "prompt_token_ids", prompts[0])
    llm.generate([warm], SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True))
    t0 = time.perf_counter()
    outs = llm.generate(prompts, params)
    dt = time.perf_counter() - t0
    n_out = sum(len(o.outputs[0].token_ids) for o in outs)
    n_in = sum(len(o.prompt_token_ids) for o in outs)
    return {
        "seconds": dt,
        "output_tokens": n_out,
        "prompt_tokens": n_in,
        "output_tok_s": n_out / dt,
        "total_tok_s": (n_out + n_in) / dt,
    }


def run_hf(llm: LLM, prompts, output_len: int, batch_size: int, dtype) -> dict:
    """transformers batched generate (left padding) on the weights Foveal loaded."""
    import transformers as tf

    from foveal.loader import load_checkpoint

    ckpt = load_checkpoint(llm.engine.config.model.model, dtype=dtype, device="cpu")
    hf = tf.AutoModelForCausalLM.from_config(ckpt.hf_config, dtype=dtype)
    missing, unexpected = hf.load_state_dict(dict(ckpt.weights), strict=False)
    assert not unexpected and all("lm_head" in m for m in missing), (missing, unexpected)
    hf.tie_weights()
    hf.eval()
    pad = ckpt.tokenizer.pad_token_id or 0
    total, t0 = 0, time.perf_counter()
    with torch.inference_mode():
        for i in range(0, len(prompts), batch_size):
            chunk = prompts[i : i + batch_size]
            width = max(map(len, chunk))
            ids = torch.tensor([[pad] * (width - len(p)) + p for p in chunk])
            mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in chunk])
            out = hf.generate(
                input_ids=ids,
                attention_mask=mask,
                max_new_tokens=output_len,
                min_new_tokens=output_len,
                do_sample=False,
                pad_token_id=pad,
            )
            total += (out.shape[1] - width) * len(chunk)
    dt = time.perf_counter() - t0
    return {"seconds": dt, "output_tokens": total, "output_tok_s": total / dt}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default=None)
    ap.add_argument("--num-prompts", type=int, default=32)
    ap.add_argument("--input-len", type=int, default=128)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--range-ratio", type=float, default=0.0, help="prompt lengths uniform in len*(1±ratio)")
    ap.add_argument("--max-num-seqs", type=int, default=32)
    ap.add_argument("--max-num-batched-tokens", type=int, default=2048)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--quantization", default="none", choices=["none", "gguf"])
    ap.add_argument("--enforce-eager", action="store_true", help="no CUDA graphs / recorded CPU decode steps")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--compare-hf", action="store_true")
    ap.add_argument("--images-per-prompt", type=int, default=0, help="needs a vision-language --model")
    ap.add_argument("--image-size", default="448x448", help="WIDTHxHEIGHT of each random image")
    ap.add_argument("--repeat-images", action="store_true", help="the same images in every request")
    ap.add_argument("--vision-cache-memory", type=int, default=256 * 2**20)
    a = ap.parse_args()
    if a.images_per_prompt and a.compare_hf:
        ap.error("--compare-hf runs text prompts only")

    llm = LLM(
        a.model,
        dtype=a.dtype,
        quantization=a.quantization,
        enforce_eager=a.enforce_eager,
        max_num_seqs=a.max_num_seqs,
        max_num_batched_tokens=a.max_num_batched_tokens,
        vision_cache_memory=a.vision_cache_memory,
    )
    prompts = make_prompts(a.num_prompts, a.input_len, a.range_ratio, llm.processor.info.vocab_size, a.seed)
    prep_s = None
    if a.images_per_prompt:
        t0 = time.perf_counter()
        prompts = make_image_prompts(llm, prompts, a.images_per_prompt, a.image_size, a.repeat_images, a.seed)
        prep_s = time.perf_counter() - t0
    encoded0 = llm.engine.runner.num_encoded
    res = {"foveal": run_foveal(llm, prompts, a.output_len)}
    if a.compare_hf:
        res["transformers"] = run_hf(llm, prompts, a.output_len, a.max_num_seqs, llm.engine.dtype)
        res["ratio"] = res["foveal"]["output_tok_s"] / res["transformers"]["output_tok_s"]

    commit = subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True
    ).stdout.strip()
    print(f"\n{'engine':<14}{'seconds':>10}{'out tokens':>12}{'out tok/s':>12}")
    for k in ("foveal", "transformers"):
        if k in res:
            r = res[k]
            print(f"{k:<14}{r['seconds']:>10.2f}{r['output_tokens']:>12}{r['output_tok_s']:>12.1f}")
    if "ratio" in res:
        print(f"ratio foveal/transformers: {res['ratio']:.2f}x")
    summary = {
        "benchmark": "throughput",
        "model": llm.processor.info.model_name,
        "dtype": a.dtype,
        "quantization": a.quantization,
        "enforce_eager": a.enforce_eager,
        "num_prompts": a.num_prompts,
        "input_len": a.input_len,
        "output_len": a.output_len,
        "max_num_seqs": a.max_num_seqs,
        "threads": torch.get_num_threads(),
        "cpu": platform.processor(),
        "commit": commit,
        "foveal_tok_s": round(res["foveal"]["output_tok_s"], 1),
        "prompt_tokens": res["foveal"]["prompt_tokens"],
    }
    if a.images_per_prompt:
        summary.update(
            images_per_prompt=a.images_per_prompt,
            image_size=a.image_size,
            repeat_images=a.repeat_images,
            images_encoded=llm.engine.runner.num_encoded - encoded0,
            preprocess_s=round(prep_s, 2),
        )
        print(f"preprocessing (processor, before the clock): {prep_s:.2f} s")
    if "ratio" in res:
        summary["transformers_tok_s"] = round(res["transformers"]["output_tok_s"], 1)
        summary["ratio"] = round(res["ratio"], 2)
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
