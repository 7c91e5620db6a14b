"""IncrementalDetokenizer against the real byte-level BPE tokenizer of the embedded model.

Reference: streamed text (add + flush) == tokenizer.decode(output_ids) when no stop string matched.
"""

from __future__ import annotations

import random

import pytest

from foveal.engine import detokenizer as detok_mod
from foveal.engine.detokenizer import IncrementalDetokenizer

PROMPT = "<|im_start|>user\nTell me something.<|im_end|>\n<|im_start|>assistant\n"
ENGLISH = (
    "The quick brown fox jumps over the lazy dog. It's 42 degrees outside;\n"
    "def f(x):\n    return x ** 2  # square\n\nDone!  Two spaces, tabs\tand 'quotes'."
)
MULTIBYTE = [
    "café naïve résumé Ünïcödé façade",
    "世界你好，这是一个测试。我们正在测试中文字符的解码。",
    "日本語のテキストです。ひらがなとカタカナ。",
    "😀🎉👍🏽 family: 👨‍👩‍👧‍👦 flag: 🇺🇸 math: 𝔘𝔫𝔦𝔠𝔬𝔡𝔢",
    "Привет мир, 한국어 텍스트, ελληνικά, عربى",
]


def enc(tok, text: str) -> list[int]:
    return tok.encode(text, add_special_tokens=False)


def stream(tok, prompt_ids, out_ids, chunk=1, **kw) -> tuple[list[str], IncrementalDetokenizer]:
    """Feed out_ids in chunks of `chunk` (or a list of chunk sizes); return all pieces and the detok."""
    d = IncrementalDetokenizer(tok, prompt_ids, **kw)
    sizes = chunk if isinstance(chunk, list) else None
    pieces, i = [], 0
    while i < len(out_ids):
        n = sizes.pop(0) if sizes else chunk if not isinstance(chunk, list) else len(out_ids)
        pieces.append(d.add(out_ids[i : i + n]))
        i += n
    pieces.append(d.flush())
    assert "".join(pieces) == d.output_text
    return pieces, d


def full(tok, ids, skip=True) -> str:
    return tok.decode(ids, skip_special_tokens=skip)


@pytest.fixture(scope="module")
def tok(smollm_tokenizer):
    return smollm_tokenizer


@pytest.fixture(scope="module")
def prompt_ids(tok):
    return enc(tok, PROMPT)


@pytest.fixture(scope="module")
def normal_ids(tok):
    """Ids of ordinary vocabulary tokens (no special or added tokens)."""
    special = set(tok.all_special_ids) | set(tok.added_tokens_decoder)
    return [i for i in range(len(tok)) if i not in special]


# -- equality with full decode -----------------------------------------------------------------


@pytest.mark.parametrize("chunk", [1, 3, 1000])
def test_english_matches_full_decode(tok, prompt_ids, chunk):
    out = enc(tok, ENGLISH)
    pieces, d = stream(tok, prompt_ids, out, chunk=chunk)
    assert d.output_text == full(tok, out) == ENGLISH
    assert d.stop_matched is None
    if chunk == 1:
        assert sum(1 for p in pieces if p) >= len(out) // 2  # streamed, not all at the end


@pytest.mark.parametrize("text", MULTIBYTE)
def test_multibyte_text_never_emits_replacement_char(tok, prompt_ids, text):
    out = enc(tok, text)
    # The test only means something if characters really are split across tokens.
    assert any("\ufffd" in tok.decode([t]) for t in out)
    pieces, d = stream(tok, prompt_ids, out)
    assert d.output_text == full(tok, out) == text
    assert not any("\ufffd" in p for p in pieces)


def test_multibyte_random_splits_and_chunks(tok, prompt_ids):
    rng = random.Random(7)
    for _ in range(30):
        words = rng.choices(MULTIBYTE + [ENGLISH], k=3)
        text = " ".join(w[rng.randrange(len(w)) :] for w in words)
        out = enc(tok, text)
        sizes = [rng.randint(1, 4) for _ in out]
        pieces, d = stream(tok, prompt_ids, out, chunk=sizes)
        assert d.output_text == text
        assert not any("\ufffd" in p for p in pieces)


def test_no_prompt_and_prompt_ending_inside_a_character(tok):
    text = "😀 and 世界"
    ids = enc(tok, text)
    _, d = stream(tok, [], ids)
    assert d.output_text == text
    # The prompt holds the first byte token of 😀; the output the rest: the output alone decodes to
    # replacement chars for the orphan bytes, and that is what the stream must reproduce.
    _, d = stream(tok, ids[:1], ids[1:])
    assert d.output_text == full(tok, ids[1:])


@pytest.mark.parametrize("seed", range(6))
def test_random_token_sequences_match_full_decode(tok, normal_ids, seed):
    rng = random.Random(seed)
    prompt = rng.choices(normal_ids, k=rng.randint(0, 12))
    out = rng.choices(normal_ids, k=400)
    chunk = [rng.randint(1, 5) for _ in out] if seed % 2 else 1
    _, d = stream(tok, prompt, out, chunk=chunk)
    assert d.output_text == full(tok, out)


@pytest.mark.parametrize("seed", range(4))
def test_invalid_byte_runs_match_full_decode(tok, normal_ids, seed):
    """Streams of lone byte tokens never form characters; the held window must still be cut exactly."""
    rng = random.Random(100 + seed)
    byte_ids = [i for i in normal_ids if tok.decode([i]).endswith("\ufffd")]
    out = rng.choices(byte_ids, k=300)
    pos = rng.randrange(290)
    out[pos : pos + 5] = enc(tok, " ok 世界")[:5]  # some real text in the middle
    _, d = stream(tok, rng.choices(normal_ids, k=5), out)
    assert d.output_text == full(tok, out)


@pytest.mark.parametrize("skip", [True, False])
def test_special_tokens(tok, prompt_ids, normal_ids, skip):
    specials = list(tok.all_special_ids)
    rng = random.Random(3)
    out = enc(tok, "Hello 世界") + [specials[0]] + enc(tok, " there") + specials + enc(tok, "😀")
    out += [rng.choice(specials + normal_ids[:3000]) for _ in range(200)]
    pieces, d = stream(tok, prompt_ids, out, skip_special_tokens=skip)
    assert d.output_text == full(tok, out, skip)
    marker = tok.convert_ids_to_tokens(specials[0])
    assert (marker in d.output_text) is (not skip)


def test_special_token_split_inside_a_character(tok, prompt_ids):
    """A skipped special token between the byte tokens of one character: decode joins the bytes."""
    ids = enc(tok, "😀")
    out = ids[:1] + [tok.all_special_ids[0]] + ids[1:]
    _, d = stream(tok, prompt_ids, out)
    assert d.output_text == full(tok, out) == "😀"


# -- stop strings ------------------------------------------------------------------------------

STOP_TEXT = "Hello world. The answer is 42.\nUser: hi there\nUser: again"


@pytest.mark.parametrize("chunk", [1, 2, 1000])
def test_single_token_stop(tok, prompt_ids, chunk):
    out = enc(tok, STOP_TEXT)
    assert len(enc(tok, " answer")) == 1
    _, d = stream(tok, prompt_ids, out, chunk=chunk, stop=[" answer"])
    assert d.output_text == "Hello world. The"
    assert d.stop_matched == " answer"


@pytest.mark.parametrize("chunk", [1, 4, 1000])
def test_multi_token_stop_spanning_tokens(tok, prompt_ids, chunk):
    out = enc(tok, STOP_TEXT)
    stop = "42.\nUs"  # starts mid-token-sequence, ends inside the token "User"
    assert len(enc(tok, stop)) > 2
    pieces, d = stream(tok, prompt_ids, out, chunk=chunk, stop=[stop])
    assert d.output_text == "Hello world. The answer is "
    assert d.stop_matched == stop
    assert d.add(enc(tok, " more text")) == "" and d.flush() == ""
    assert d.output_text == "Hello world. The answer is "


def test_stop_at_first_token(tok, prompt_ids):
    out = enc(tok, STOP_TEXT)
    d = IncrementalDetokenizer(tok, prompt_ids, stop=["Hello"])
    assert d.add(out[:1]) == ""
    assert d.stop_matched == "Hello"
    assert d.add(out[1:]) == "" and d.flush() == "" and d.output_text == ""


@pytest.mark.parametrize("chunk", [1, 1000])
def test_include_stop_str_in_output(tok, prompt_ids, chunk):
    out = enc(tok, STOP_TEXT)
    _, d = stream(tok, prompt_ids, out, chunk=chunk, stop=["\nUser:"], include_stop_str_in_output=True)
    assert d.output_text == "Hello world. The answer is 42.\nUser:"
    assert d.stop_matched == "\nUser:"


@pytest.mark.parametrize("chunk", [1, 3, 1000])
def test_earlier_stop_string_wins(tok, prompt_ids, chunk):
    out = enc(tok, STOP_TEXT)
    stops = ["hi there", "answer"]  # the later one in the text is listed first
    _, d = stream(tok, prompt_ids, out, chunk=chunk, stop=stops)
    assert d.output_text == "Hello world. The "
    assert d.stop_matched == "answer"


def test_overlapping_stops_first_completed_wins_regardless_of_chunking(tok, prompt_ids):
    out = enc(tok, "xx abcdef yy")
    results = set()
    for chunk in (1, 2, 1000):
        _, d = stream(tok, prompt_ids, out, chunk=chunk, stop=["abcdef", "cd", "bcd"])
        results.add((d.output_text, d.stop_matched))
    # "bcd" and "cd" complete together; the one that starts earlier wins.
    assert results == {("xx a", "bcd")}


def test_text_after_stop_never_emitted_in_big_chunks(tok, prompt_ids):
    out = enc(tok, STOP_TEXT + " " + ENGLISH)
    for stop in ["\nUser:", " is 4", "STOP_NEVER", "there"]:
        d = IncrementalDetokenizer(tok, prompt_ids, stop=[stop])
        text = d.add(out) + d.flush()
        idx = STOP_TEXT.find(stop)
        expected = STOP_TEXT[:idx] if idx >= 0 else STOP_TEXT + " " + ENGLISH
        assert text == expected == d.output_text


def test_stop_inside_multibyte_text(tok, prompt_ids):
    text = "日本語のテキストです。😀ひらがな"
    out = enc(tok, text)
    pieces, d = stream(tok, prompt_ids, out, stop=["😀ひ"])
    assert d.output_text == "日本語のテキストです。"
    assert not any("\ufffd" in p for p in pieces)


def test_held_prefix_released_by_flush(tok, prompt_ids):
    out = enc(tok, "the end\nUs")
    d = IncrementalDetokenizer(tok, prompt_ids, stop=["\nUser:"])
    assert d.add(out) == "the end"
    assert d.flush() == "\nUs"
    assert d.output_text == "the end\nUs" and d.stop_matched is None
    assert d.flush() == ""


def test_held_prefix_released_as_soon_as_it_cannot_match(tok, prompt_ids):
    d = IncrementalDetokenizer(tok, prompt_ids, stop=["\nUser:"])
    assert d.add(enc(tok, "a")) == "a"
    assert d.add(enc(tok, "\n")) == ""
    assert d.add(enc(tok, "User")) == ""
    assert d.add(enc(tok, " says")) == "\nUser says"
    assert d.stop_matched is None


def test_streaming_with_stops_that_never_match_equals_full_decode(tok, prompt_ids):
    rng = random.Random(11)
    for text in MULTIBYTE + [ENGLISH]:
        out = enc(tok, text)
        stops = [text[: rng.randint(1, 3)] + "\x00", "zzq", text[-2:] + "!!"]
        pieces, d = stream(tok, prompt_ids, out, chunk=[rng.randint(1, 3) for _ in out], stop=stops)
        assert d.output_text == text and d.stop_matched is None
        assert not any("\ufffd" in p for p in pieces)


def reference_stop(text: str, stops: list[str], include: bool) -> tuple[str, str | None]:
    """Truncate the full text at the stop string that completes first (ties: the earlier start)."""
    hits = [(text.find(s) + len(s), text.find(s), s) for s in stops if s in text]
    if not hits:
        return text, None
    end, start, s = min(hits)
    return text[: end if include else start], s


@pytest.mark.parametrize("seed", range(8))
def test_random_stops_and_chunks_match_reference(tok, prompt_ids, seed):
    rng = random.Random(1000 + seed)
    text = " ".join(rng.sample(MULTIBYTE + [ENGLISH, STOP_TEXT], k=3))
    out = enc(tok, text)
    stops = []
    for _ in range(rng.randint(1, 3)):
        i = rng.randrange(len(text))
        stops.append(text[i : i + rng.randint(1, 8)] if rng.random() < 0.8 else "no such stop")
    include = rng.random() < 0.5
    chunks = [rng.randint(1, 6) for _ in out]
    pieces, d = stream(tok, prompt_ids, out, chunk=chunks, stop=stops, include_stop_str_in_output=include)
    assert (d.output_text, d.stop_matched) == reference_stop(text, stops, include)
    assert not any("\ufffd" in p for p in pieces)


def test_empty_stop_string_rejected(tok):
    with pytest.raises(ValueError):
        IncrementalDetokenizer(tok, [], stop=[""])


# -- cost and errors ---------------------------------------------------------------------------


class CountingTokenizer:
    """Wraps a tokenizer (which also hides it from the Rust fast path) and counts decode calls."""

    def __init__(self, tok):
        self._tok = tok
        self.lengths: list[int] = []

    def decode(self, ids, **kw):
        self.lengths.append(len(ids))
        return self._tok.decode(ids, **kw)

    def __getattr__(self, name):
        return getattr(self._tok, name)


def test_fast_path_matches_tokenizer_decode_path(tok, prompt_ids, normal_ids):
    """The Rust windows (DecodeStream, this tokenizer's path) give the Python windows' pieces token for
    token: with and without special tokens, with kept ones, and across a run of invalid byte tokens
    long enough to hand the request to the Python windows."""
    assert IncrementalDetokenizer(tok, []).__dict__["_window_decode"].__name__ == "<lambda>"
    assert IncrementalDetokenizer(tok, prompt_ids)._stream is not None
    assert IncrementalDetokenizer(CountingTokenizer(tok), prompt_ids)._stream is None
    rng = random.Random(9)
    byte_ids = [i for i in normal_ids if tok.decode([i]).endswith("\ufffd")]
    specials = list(tok.all_special_ids)
    out = enc(tok, " ".join(MULTIBYTE)) + rng.choices(normal_ids + specials, k=300)
    marked = enc(tok, "ok 世界") + specials + enc(tok, " then") + specials[::-1] + out
    held = enc(tok, "ok 世界") + rng.choices(byte_ids, k=40) + enc(tok, " then") + specials + enc(tok, " x")
    for ids, handed in ((out, False), (marked, False), (held + out, True)):
        for kw in ({"skip_special_tokens": True}, {"skip_special_tokens": False},
                   {"keep_special_token_ids": specials[:1]}):  # fmt: skip
            counting = CountingTokenizer(tok)
            slow, _ = stream(counting, prompt_ids, ids, stop=["zzq"], **kw)
            fast, d = stream(tok, prompt_ids, ids, stop=["zzq"], **kw)
            assert counting.lengths and slow == fast
            assert (d._stream is None) is handed  # the long hold handed the request over


@pytest.mark.parametrize("kind", ["text", "random", "bytes"])
def test_per_token_cost_is_bounded(tok, prompt_ids, normal_ids, kind, monkeypatch):
    rng = random.Random(5)
    if kind == "text":
        out = (enc(tok, " ".join(MULTIBYTE + [ENGLISH])) * 40)[:2000]
    elif kind == "random":
        out = rng.choices(normal_ids, k=2000)
    else:  # worst case: invalid byte tokens only, the UTF-8 hold never ends on its own
        out = rng.choices([i for i in normal_ids if tok.decode([i]).endswith("\ufffd")], k=2000)
    lengths: list[int] = []
    real_decode = IncrementalDetokenizer._decode

    def counting_decode(self, ids):
        lengths.append(len(ids))
        return real_decode(self, ids)

    monkeypatch.setattr(IncrementalDetokenizer, "_decode", counting_decode)
    _, d = stream(tok, prompt_ids, out, stop=["\nUser:", "never matches"])
    assert d.output_text == full(tok, out)
    window_cap = 2 * detok_mod._CONTEXT_TOKENS + 2 * detok_mod._MAX_HELD_TOKENS + 2
    assert max(lengths) <= window_cap
    calls_per_token = len(lengths) / len(out)
    assert calls_per_token <= (1.5 if kind != "bytes" else 6)
    # and the later half costs no more than the first half
    half = len(lengths) // 2
    assert sum(lengths[half:]) <= 1.2 * sum(lengths[:half]) + 50


def test_old_ids_are_dropped(tok, normal_ids, monkeypatch):
    monkeypatch.setattr(detok_mod, "_TRIM_IDS_AT", 100)
    out = random.Random(2).choices(normal_ids, k=3000)
    _, d = stream(tok, [], out, chunk=[7] * 500)
    assert d.output_text == full(tok, out)
    assert len(d._ids) <= 100 + 40


def test_output_ending_inside_a_character_is_flushed(tok, prompt_ids):
    import numpy as np

    ids = enc(tok, "ok 😀")
    out = np.array(ids[:-1])  # the engine may hand over numpy ints
    d = IncrementalDetokenizer(tok, prompt_ids)
    assert d.add(out) == "ok"  # " 😀" starts with the space: the whole token is held
    assert d.flush() == full(tok, ids[:-1])[2:] and d.output_text.endswith("\ufffd")
    assert d.output_text == full(tok, ids[:-1])


def test_tokenizer_errors_propagate(tok, prompt_ids):
    class Boom(CountingTokenizer):
        def decode(self, ids, **kw):
            if 999_999 in ids:
                raise OverflowError("bad id")
            return super().decode(ids, **kw)

    d = IncrementalDetokenizer(Boom(tok), prompt_ids)
    assert d.add(enc(tok, "ok")) == "ok"
    with pytest.raises(OverflowError):
        d.add([999_999])


# -- SentencePiece-style tokenizer (Metaspace + byte fallback), built offline ------------------


@pytest.fixture(scope="module")
def sp_tok():
    """A tiny Llama-style tokenizer: '▁' for spaces, <0xNN> byte-fallback tokens, strip-1 decoder."""
    import json

    from tokenizers import Tokenizer, decoders, models, normalizers, trainers
    from transformers import PreTrainedTokenizerFast

    norm = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    base = Tokenizer(models.BPE(unk_token="<unk>"))
    base.normalizer = norm
    corpus = [ENGLISH, "Hello world, this is a test.", "The answer is 42."] * 20
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=["<unk>", "<s>", "</s>"])
    base.train_from_iterator(corpus, trainer)
    model = json.loads(base.to_str())["model"]
    vocab = dict(model["vocab"])
    for i in range(256):
        vocab.setdefault(f"<0x{i:02X}>", len(vocab))
    merges = [tuple(m) if isinstance(m, list) else tuple(m.split(" ")) for m in model["merges"]]
    sp = Tokenizer(models.BPE(vocab, merges, byte_fallback=True, unk_token="<unk>"))
    sp.normalizer = norm
    sp.add_special_tokens(["<unk>", "<s>", "</s>"])
    sp.decoder = decoders.Sequence(
        [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(), decoders.Strip(" ", 1, 0)]
    )
    return PreTrainedTokenizerFast(tokenizer_object=sp, bos_token="<s>", eos_token="</s>", unk_token="<unk>")


@pytest.mark.parametrize("text", [ENGLISH] + MULTIBYTE)
def test_sentencepiece_keeps_leading_space_and_characters(sp_tok, text):
    prompt = sp_tok.encode("Say something:", add_special_tokens=False)
    out = sp_tok.encode(text, add_special_tokens=False)
    assert any(t.startswith("<0x") for t in sp_tok.convert_ids_to_tokens(out)) or text == ENGLISH
    pieces, d = stream(sp_tok, prompt, out)
    # A standalone decode strips the first '▁'; with the prompt as context the space is kept.
    assert sp_tok.decode(out) == text
    assert d.output_text == " " + text
    assert not any("\ufffd" in p for p in pieces)
    pieces, d = stream(sp_tok, prompt, out, chunk=3, stop=[text[5:9]])
    assert d.output_text == " " + text[:5]


def test_sentencepiece_rust_windows_keep_character_boundaries(sp_tok, monkeypatch):
    """SentencePiece byte fallback decodes a run of byte tokens all or nothing, so the context kept for
    flush and for a hand-over to the Python windows must start at a character: past the tail's trims,
    an output that ends inside a character (flushed) and one with a long invalid run (handed over) give
    the Python windows' pieces token for token."""
    monkeypatch.setattr(detok_mod, "_TAIL_MAX", 8)  # trim often
    prompt = sp_tok.encode("Say something:", add_special_tokens=False)
    text = sp_tok.encode(" ".join(MULTIBYTE[1:3]) * 3, add_special_tokens=False)
    bad = sp_tok.convert_tokens_to_ids([f"<0x{b:02X}>" for b in range(0x80, 0x8C)])  # continuation bytes
    cut = text[:-1] if sp_tok.decode(text[:-1]).endswith("\ufffd") else text[:-2]
    for out, handed in ((cut, False), (text + bad + text, True)):
        fast, d = stream(sp_tok, prompt, out)
        slow, _ = stream(CountingTokenizer(sp_tok), prompt, out)
        assert fast == slow and (d._stream is None) is handed
        assert d.output_text.startswith(" 世界") and d.output_text.count("\ufffd") >= (12 if handed else 1)
