"""The detokenizer's cost a token on the embedded model's tokenizer (SmolLM2's byte-level BPE, a Rust
tokenizer under transformers): one request's 4,000 tokens of text (this repository's README, three
times over), fed one token a call through foveal.engine.detokenizer.IncrementalDetokenizer with its
windows in Rust (tokenizers' DecodeStream) and in Python (the stream switched off), alternating, and
the bare DecodeStream for scale. Each: median of 5 rounds; the texts must equal.

    python benchmarks/detokenize.py

Ends with one JSON line.
"""

from __future__ import annotations

import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def main() -> None:
    from tokenizers.decoders import DecodeStream
    from transformers import AutoTokenizer

    from foveal.engine import detokenizer as dm
    from foveal.loader.default_model import default_model_path

    d, f = os.path.split(default_model_path())
    tok = AutoTokenizer.from_pretrained(d, gguf_file=f)
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    with open(os.path.join(root, "README.md")) as fh:
        ids = tok(fh.read() * 3)["input_ids"][:4000]
    prompt = ids[:4]
    stream_on = dm._decode_stream

    def ours(rust: bool) -> str:
        dm._decode_stream = stream_on if rust else (lambda *a: (None, None, frozenset()))
        try:
            det = dm.IncrementalDetokenizer(tok, prompt)
            assert (det._stream is not None) is rust
            return "".join(det.add([t]) for t in ids) + det.flush()
        finally:
            dm._decode_stream = stream_on

    def bare() -> str:
        s, rt = DecodeStream(ids=prompt, skip_special_tokens=True), tok.backend_tokenizer
        return "".join(x for t in ids if (x := s.step(rt, t)) is not None)

    cases = {"rust_windows": lambda: ours(True), "python_windows": lambda: ours(False), "bare_stream": bare}
    times: dict[str, list[float]] = {k: [] for k in cases}
    texts = {}
    for _ in range(5):
        for name, fn in cases.items():
            t0 = time.perf_counter()
            texts[name] = fn()
            times[name].append((time.perf_counter() - t0) / len(ids) * 1e6)
    assert texts["rust_windows"] == texts["python_windows"] == texts["bare_stream"]
    res = {f"{k}_us_per_token": round(sorted(v)[2], 3) for k, v in times.items()}
    print(f"{len(ids)} tokens: {res}")
    print(json.dumps({"benchmark": "detokenize", "tokens": len(ids), **res}))


if __name__ == "__main__":
    main()
