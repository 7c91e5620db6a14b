"""The real embedded model (SmolLM2-135M-Instruct, fp32, CPU) against transformers' greedy output on
the same GGUF: each prompt alone and all prompts in one continuous batch."""

from __future__ import annotations

import pytest
import torch

from foveal import SamplingParams

PROMPTS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "Explain in two sentences why the sky is blue.",
    "List three prime numbers greater than 20.",
    "Translate 'good morning' into Spanish and German.",
    "What is 17 multiplied by 3? Show your steps.",
    "Give me a short tip for writing clean Python code.",
    "Tell me a very short story about a robot who learns to paint, in under fifty words.",
]
N_TOKENS = 64
MARGIN = 1e-3


@pytest.fixture(scope="module")
def reference(hf_smollm, smollm_tokenizer):
    """Per prompt: chat-templated ids, transformers' greedy tokens and its top-2 logit margin per step.
    All prompts in one left-padded batch (generate's attention mask and positions skip the padding;
    each prompt alone gave the same tokens: RESULTS.md session 40), each row cut after its end token."""
    tok = smollm_tokenizer
    ids = [
        tok.apply_chat_template(
            [{"role": "user", "content": p}], add_generation_prompt=True, tokenize=True, return_dict=True
        )["input_ids"]
        for p in PROMPTS
    ]
    width = max(map(len, ids))
    pad = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
    with torch.no_grad():
        out = hf_smollm.generate(
            torch.tensor([[pad] * (width - len(i)) + i for i in ids]),
            attention_mask=torch.tensor([[0] * (width - len(i)) + [1] * len(i) for i in ids]),
            max_new_tokens=N_TOKENS,
            do_sample=False,
            output_logits=True,
            return_dict_in_generate=True,
            pad_token_id=pad,
        )
    eos = hf_smollm.generation_config.eos_token_id
    eos = set(eos if isinstance(eos, list) else [eos])
    refs = []
    for row, i in enumerate(ids):
        toks = out.sequences[row, width:].tolist()
        end = next((j + 1 for j, t in enumerate(toks) if t in eos), len(toks))
        top = [v[row].topk(2).values for v in out.logits[:end]]
        refs.append((i, toks[:end], [float(t[0] - t[1]) for t in top]))
    return refs


def assert_matches_reference(got: list[int], ref: list[int], margins: list[float], label: str) -> None:
    n = min(len(got), len(ref))
    for i in range(n):
        if got[i] != ref[i]:
            assert margins[i] < MARGIN, (
                f"{label}: token {i} differs ({got[i]} vs reference {ref[i]}) with reference top-2 margin "
                f"{margins[i]:.2e} >= {MARGIN}"
            )
            return  # after a legitimate tie-break the continuations may differ
    if len(got) != len(ref):
        i = n  # one stopped (EOS) where the other did not: that is a token difference at position n
        assert i < len(margins) and margins[i] < MARGIN, f"{label}: lengths differ ({len(got)} vs {len(ref)})"


def test_chat_template_matches_transformers(llm_fp32, reference):
    for p, (ids, _, _) in zip(PROMPTS, reference):
        assert llm_fp32.processor.apply_chat_template([{"role": "user", "content": p}]) == ids


def test_each_prompt_alone_matches_transformers(llm_fp32, reference):
    params = SamplingParams(temperature=0.0, max_tokens=N_TOKENS)
    for k, (ids, ref, margins) in enumerate(reference):
        out = llm_fp32.generate([ids], params)[0].outputs[0]
        assert_matches_reference(out.token_ids, ref, margins, f"prompt {k} alone")


def test_continuous_batch_matches_transformers(llm_fp32, reference):
    """All prompts at once (different lengths), plus a staggered start: the later half joins while the
    first half is decoding, so prefill chunks and decodes share steps."""
    eng = llm_fp32.engine
    params = SamplingParams(temperature=0.0, max_tokens=N_TOKENS)
    outs = llm_fp32.generate([r[0] for r in reference], params)
    for k, (o, (_, ref, margins)) in enumerate(zip(outs, reference)):
        assert_matches_reference(o.outputs[0].token_ids, ref, margins, f"prompt {k} batched")

    got: dict[str, list[int]] = {}
    order = {}
    proc = llm_fp32.processor
    for k in range(4):
        order[eng.add_request(proc.request(reference[k][0], params))] = k
    for _ in range(5):
        for d in eng.step():
            got.setdefault(d.request_id, []).extend(d.token_ids)
    for k in range(4, 8):
        order[eng.add_request(proc.request(reference[k][0], params))] = k
    while eng.has_unfinished():
        for d in eng.step():
            got.setdefault(d.request_id, []).extend(d.token_ids)
    for rid, k in order.items():
        _, ref, margins = reference[k]
        assert_matches_reference(got[rid], ref, margins, f"prompt {k} staggered")


def test_capital_of_france(llm_fp32):
    out = llm_fp32.chat(
        [{"role": "user", "content": "What is the capital of France?"}],
        SamplingParams(temperature=0.0, max_tokens=20),
    )[0].outputs[0]
    assert out.text == "The capital of France is Paris."
    assert out.finish_reason.value == "stop"
