"""/v1/embeddings through the official client (it asks for base64 and decodes it), against pooling
done by hand on transformers' own model: a tiny random Qwen3-Embedding-style checkpoint (transformers'
bare Qwen3Model, no LM head), last-token and mean pooling, batched == alone, chunked prompts,
`dimensions`, token-id inputs, base64; a generative model refuses with a 400 that says how to serve
embeddings."""

from __future__ import annotations

import base64
import struct

import openai
import pytest
import torch

from tests.test_server import serving

TEXTS = ["hello embeddings", "a", "the quick brown fox jumps over the lazy dog, twice over and again"]


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    import transformers as tf

    from tests.tiny import tiny_config
    from tests.tiny_vlm import byte_tokenizer

    path = tmp_path_factory.mktemp("embed")
    tok = byte_tokenizer([], "")
    cfg = tiny_config("qwen3")
    cfg.vocab_size = len(tok)
    cfg.architectures = ["Qwen3Model"]
    torch.manual_seed(0)
    model = tf.Qwen3Model(cfg).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.add_(torch.randn_like(p) * 0.1)
    model.save_pretrained(path)
    tok.save_pretrained(path)
    return {"path": str(path), "hf": model, "tok": tok}


def reference(folder, text: str, pooling: str = "last") -> torch.Tensor:
    ids = folder["tok"](text)["input_ids"]
    with torch.no_grad():
        h = folder["hf"](torch.tensor([ids])).last_hidden_state[0].double()
    v = h[-1] if pooling == "last" else h.mean(0)
    return v / v.norm()


def cosine(a, b) -> float:
    a, b = torch.tensor(a, dtype=torch.float64), torch.as_tensor(b, dtype=torch.float64)
    return float(a @ b / (a.norm() * b.norm()))


@pytest.mark.parametrize("pooling", ["last", "mean"])
def test_embeddings_equal_pooling_by_hand(folder, pooling):
    engine = {
        "model": folder["path"],
        "block_size": 4,
        "pooling": "auto" if pooling == "last" else "mean",
        "max_num_batched_tokens": 16,
    }  # fmt: skip (the long input runs in chunks)
    with serving(engine, {}) as s:
        c = s.client()
        batch = c.embeddings.create(model=s.model, input=TEXTS)
        assert [d.index for d in batch.data] == [0, 1, 2] and batch.model == s.model
        for text, d in zip(TEXTS, batch.data):
            want = reference(folder, text, pooling)
            assert cosine(d.embedding, want) > 0.9999
            assert abs(sum(x * x for x in d.embedding) - 1) < 1e-5  # unit length
            alone = c.embeddings.create(model=s.model, input=text).data[0].embedding
            assert alone == pytest.approx(d.embedding, abs=1e-5)
        tokens = sum(len(folder["tok"](t)["input_ids"]) for t in TEXTS)
        assert batch.usage.prompt_tokens == tokens == batch.usage.total_tokens
        short = c.embeddings.create(model=s.model, input=TEXTS[0], dimensions=16).data[0].embedding
        head = reference(folder, TEXTS[0], pooling)[:16]
        assert len(short) == 16 and cosine(short, head) > 0.9999
        ids = folder["tok"](TEXTS[1])["input_ids"]
        by_ids = c.embeddings.create(model=s.model, input=ids).data[0].embedding
        assert by_ids == pytest.approx(batch.data[1].embedding, abs=1e-6)
        with pytest.raises(openai.BadRequestError, match="dimensions"):
            c.embeddings.create(model=s.model, input="x", dimensions=10_000)
    assert s.engine.kv.num_used_blocks == 0


def test_base64_is_little_endian_float32(folder):
    import httpx

    with serving({"model": folder["path"], "block_size": 4}, {}) as s:
        body = {"input": "hi", "encoding_format": "base64"}
        got = httpx.post(s.url + "/v1/embeddings", json=body).json()["data"][0]["embedding"]
        floats = httpx.post(s.url + "/v1/embeddings", json={"input": "hi"}).json()["data"][0]["embedding"]
        raw = base64.b64decode(got)
        assert list(struct.unpack(f"<{len(raw) // 4}f", raw)) == pytest.approx(floats, abs=1e-6)


def test_a_generative_model_refuses_embeddings_clearly(tmp_path):
    from tests.tiny_vlm import save_tiny_text_model

    with serving({"model": save_tiny_text_model(str(tmp_path))}, {}) as s:
        with pytest.raises(openai.BadRequestError, match="--pooling"):
            s.client().embeddings.create(model=s.model, input="hello")
        with pytest.raises(openai.BadRequestError, match="input"):
            s.client().embeddings.create(model=s.model, input=[])
