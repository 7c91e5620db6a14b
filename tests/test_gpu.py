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
        assert len(got) == len(want) == 16
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
    assert llm.engine.scheduler.config.max_num_batched_tokens == 2048  # the CUDA default
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
    from foveal.engine.llm import LLM
    from tests.tiny_vlm import all_builders, foveal_greedy, hf_greedy, image

    if family not in all_builders():
        pytest.fail(f"no tiny builder for {family}")
    from tests.tiny_vlm import build

    tiny = build(family, str(tmp_path))
    llm = LLM(tiny.path, dtype="float32", device="cuda", num_blocks=256, block_size=4)
    im = tiny.image_text
    text, imgs = (
        f"<|user|>Compare {im} with {im} please.\n<|assistant|>",
        [image(56, 56, 2), image(28, 70, 3)],
    )
    ((logits, toks, _),) = foveal_greedy(llm, [llm.processor.render_prompt(text, images=imgs)], 8)
    ref_logits, ref_toks, _ = hf_greedy(tiny, text, imgs, 8)
    assert (logits.float().cpu() - ref_logits).abs().max().item() < 1e-3
    assert toks == ref_toks


def test_qwen25_vl_shapes_survive_the_w4_request_sequence(tmp_path):
    """Qwen2.5-VL-7B's attention shapes (28 query heads over 4 KV heads: a group of 7, head_dim 128,
    M-RoPE) with 2 decoder and 2 vision layers, bf16, random weights, CUDA graphs on: the request
    sequence after which the full-size W4 run faulted (illegal address) in a graph decode replay on
    the H200 (2026-11-30: one image request, another, four at once, then one more). Every request
    must get its tokens without a device fault. (Graph vs eager tokens are not compared: with random
    bf16 weights the graphs' fixed split-KV count changes the reduction order and flips near-tied
    argmaxes; a run on the H200 diverged at the 5th token of one request that way. At this size the
    fault did not reproduce; its cause, a split-KV workspace freed after capture, has its own test in
    test_cuda_graphs.py.)"""
    import json
    import os

    from PIL import Image

    from foveal.engine.llm import LLM

    here = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    cfg = json.load(open(os.path.join(here, "benchmarks", "configs", "qwen2.5-vl-7b.json")))
    cfg["num_hidden_layers"], cfg["vision_config"]["depth"] = 2, 2
    cfg["vision_config"]["fullatt_block_indexes"] = [1]
    path = tmp_path / "qwen25vl-2layer.json"
    path.write_text(json.dumps(cfg))

    def run() -> list[list[int]]:
        llm = LLM(str(path), load_format="dummy", dtype="bfloat16", max_model_len=4096, max_num_seqs=16,
                  gpu_memory_utilization=0.5)  # fmt: skip
        assert llm.engine.runner.graphs is not None
        vocab = 150000

        def prompt(i: int, processor=llm.processor):
            g = torch.Generator().manual_seed(1000 + i)
            img = Image.fromarray(
                torch.randint(0, 256, (448, 448, 3), generator=g, dtype=torch.uint8).numpy()
            )
            text = " ".join(f"t{t}" for t in torch.randint(100, vocab, (64,), generator=g).tolist())
            content = [{"type": "image"}, {"type": "text", "text": text}]
            return processor.render_chat([{"role": "user", "content": content}], images=[img])

        p = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
        out = []
        for group in ([999], [997], [990, 991, 992, 993], [0]):
            res = llm.generate([prompt(i) for i in group], [p] * len(group))
            out += [r.outputs[0].token_ids for r in res]
        torch.cuda.synchronize()
        return out

    out = run()
    assert [len(t) for t in out] == [8] * 7


@pytest.mark.parametrize("family", ["qwen3_moe", "mixtral", "gpt_oss"])
def test_moe_families_match_transformers_on_cuda(family, tmp_path):
    """The mixtures on CUDA (fp32; the experts by the Triton grouped-GEMM kernel, decode steps through
    CUDA graphs, gpt-oss's sinks and windows in the Triton attention kernels): each greedy token of three
    batched prompts is transformers' argmax on the same prefix, up to near-ties; graphs == eager."""
    from foveal.engine.llm import LLM
    from tests.tiny import tiny_hf_model
    from tests.tiny_vlm import byte_tokenizer

    tok = byte_tokenizer([], "")
    hf = tiny_hf_model(family, vocab_size=len(tok), eos_token_id=tok.eos_token_id)
    with torch.no_grad():  # routers that score experts apart: no near-ties in the top k
        for name, p in hf.named_parameters():
            if name.endswith(("mlp.gate.weight", "router.weight")):
                p.normal_(0, 0.5)
    hf.save_pretrained(tmp_path)
    tok.save_pretrained(tmp_path)
    hf = hf.to("cuda")
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(0, 256, (n,), generator=g).tolist() for n in (3, 12, 25)]
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    runs = {}
    for eager in (False, True):
        llm = LLM(
            str(tmp_path), device="cuda", dtype="float32", block_size=16, num_blocks=64, enforce_eager=eager
        )
        assert (llm.engine.runner.graphs is None) == eager
        runs[eager] = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
        assert llm.engine.kv.num_used_blocks == 0
    assert runs[False] == runs[True]
    for p, got in zip(prompts, runs[False]):  # each token is transformers' argmax on the same prefix
        with torch.no_grad():
            logits = hf(torch.tensor([p + got], device="cuda")).logits[0, len(p) - 1 : -1].float()
        for i, token in enumerate(got):
            best = logits[i].topk(2)
            if token != int(best.indices[0]):
                gap = float(best.values[0] - logits[i, token])
                assert gap < 1e-3, f"{family} token {i}: {token} vs {int(best.indices[0])}"
