"""CUDA checks (skipped without a GPU): the engine on a tiny saved model matches transformers' greedy
output on the same device, in fp32; bf16 runs end to end; no blocks leak."""

from __future__ import annotations

import pytest
import torch

from foveal import SamplingParams
from tests.test_loader import tiny_hf_tokenizer, tiny_model

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


@pytest.fixture(scope="module", params=["llama", "qwen3"])
def tiny_folder(request, tmp_path_factory):
    model = tiny_model(request.param, tie=request.param == "qwen3")
    folder = tmp_path_factory.mktemp(request.param)
    model.save_pretrained(folder)
    tiny_hf_tokenizer().save_pretrained(folder)
    return folder, model


def test_greedy_matches_transformers_on_cuda(tiny_folder):
    from foveal.engine.llm import LLM

    folder, hf = tiny_folder
    hf = hf.to("cuda", torch.float32)
    llm = LLM(str(folder), device="cuda", dtype="float32", kv_cache_memory=64 * 2**20)
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, 1000, (n,), generator=g).tolist() for n in (4, 11, 29)]
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=16, ignore_eos=True))
    for p, o in zip(prompts, outs):
        with torch.no_grad():
            ref = hf.generate(
                torch.tensor([p], device="cuda"),
                max_new_tokens=16,
                min_new_tokens=16,
                do_sample=False,
                output_logits=True,
                return_dict_in_generate=True,
            )
        want = ref.sequences[0, len(p) :].tolist()
        got = o.outputs[0].token_ids
        for i, (a, b) in enumerate(zip(got, want)):
            if a != b:
                top2 = ref.logits[i][0].topk(2).values
                assert float(top2[0] - top2[1]) < 1e-3, f"token {i}: {a} vs {b}"
                break
    llm.engine.kv.check_integrity()
    assert llm.engine.kv.num_used_blocks == 0


def test_bf16_runs_on_cuda(tiny_folder):
    from foveal.engine.llm import LLM

    folder, _ = tiny_folder
    llm = LLM(str(folder), device="cuda", kv_cache_memory=64 * 2**20)
    assert llm.engine.dtype == torch.bfloat16
    outs = llm.generate(
        [[5, 6, 7]] * 4, SamplingParams(temperature=0.8, seed=1, max_tokens=20, ignore_eos=True)
    )
    assert all(len(o.outputs[0].token_ids) == 20 for o in outs)
    assert len({tuple(o.outputs[0].token_ids) for o in outs}) == 1  # same seed, same tokens
    assert llm.engine.kv.num_used_blocks == 0


@pytest.mark.parametrize(
    "family", ["llava", "qwen2_vl", "qwen2_5_vl", "qwen3_vl", "idefics3", "smolvlm", "gemma3"]
)
def test_vlm_matches_transformers_on_cuda(family, tmp_path):
    """Every VLM family on CUDA (fp32): prompt logits with two images vs transformers on the CPU."""
    from foveal.config import EngineConfig
    from foveal.engine.engine import Engine
    from tests.tiny_vlm import all_builders, foveal_greedy, hf_greedy, image

    if family not in all_builders():
        pytest.fail(f"no tiny builder for {family}")
    from tests.tiny_vlm import build

    tiny = build(family, str(tmp_path))
    eng = Engine(
        EngineConfig.from_kwargs(
            model=tiny.path, dtype="float32", device="cuda", num_blocks=256, block_size=4
        )
    ).start()
    im = tiny.image_text
    text, imgs = (
        f"<|user|>Compare {im} with {im} please.\n<|assistant|>",
        [image(56, 56, 2), image(28, 70, 3)],
    )
    ((logits, toks, _),) = foveal_greedy(eng, [eng.process_images(prompt=text, images=imgs)], 8)
    ref_logits, ref_toks, _ = hf_greedy(tiny, text, imgs, 8)
    assert (logits.float().cpu() - ref_logits).abs().max().item() < 1e-3
    assert toks == ref_toks
