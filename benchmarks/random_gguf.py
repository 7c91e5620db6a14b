"""A Llama-architecture GGUF of random F16 weights in a shape of your choosing, with the embedded model's
tokenizer and chat template: a file for timing servers on shapes the embedded model does not have (its
576-wide rows are no whole number of the K-quants' 256-weight superblocks, so llama.cpp's Q4_K_M of it
is mostly Q5_0). Quantize it with llama.cpp's own tool, then time both servers on it:

    python benchmarks/random_gguf.py --out /tmp/r.gguf              # ~0.2B parameters, 1024 wide
    llama-quantize /tmp/r.gguf /tmp/r-q4km.gguf Q4_K_M
    LLAMA_SERVER=... GGUF=/tmp/r-q4km.gguf bash benchmarks/run_serving_peer.sh

The weights are N(0, 0.02) (norms 1): the text is noise, the timing is not.
"""

from __future__ import annotations

import argparse
import os
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def main() -> None:
    import gguf

    from foveal.loader.default_model import default_model_path

    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--layers", type=int, default=16)
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--kv-heads", type=int, default=4)
    ap.add_argument("--ffn", type=int, default=2816)
    a = ap.parse_args()
    src = gguf.GGUFReader(default_model_path())
    vocab = len(src.fields["tokenizer.ggml.tokens"].data)
    w = gguf.GGUFWriter(a.out, "llama")
    for key, field in src.fields.items():  # the tokenizer and its template, as the embedded model has them
        if key.startswith("tokenizer."):
            kind = field.types[0]
            sub = field.types[-1] if kind == gguf.GGUFValueType.ARRAY else None
            w.add_key_value(key, field.contents(), kind, sub_type=sub)
    head_dim = a.hidden // a.heads
    w.add_block_count(a.layers)
    w.add_context_length(8192)
    w.add_embedding_length(a.hidden)
    w.add_feed_forward_length(a.ffn)
    w.add_head_count(a.heads)
    w.add_head_count_kv(a.kv_heads)
    w.add_rope_dimension_count(head_dim)
    w.add_rope_freq_base(100000.0)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_vocab_size(vocab)
    w.add_file_type(gguf.LlamaFileType.MOSTLY_F16)
    rng = np.random.default_rng(0)

    def weight(rows: int, cols: int) -> np.ndarray:
        return (rng.standard_normal((rows, cols), dtype=np.float32) * 0.02).astype(np.float16)

    kv = a.kv_heads * head_dim
    w.add_tensor("token_embd.weight", weight(vocab, a.hidden))
    w.add_tensor("output_norm.weight", np.ones(a.hidden, dtype=np.float32))
    w.add_tensor("output.weight", weight(vocab, a.hidden))
    for i in range(a.layers):
        b = f"blk.{i}."
        for name, (rows, cols) in {
            "attn_q": (a.hidden, a.hidden), "attn_k": (kv, a.hidden), "attn_v": (kv, a.hidden),
            "attn_output": (a.hidden, a.hidden), "ffn_gate": (a.ffn, a.hidden), "ffn_up": (a.ffn, a.hidden),
            "ffn_down": (a.hidden, a.ffn),
        }.items():  # fmt: skip
            w.add_tensor(f"{b}{name}.weight", weight(rows, cols))
        w.add_tensor(f"{b}attn_norm.weight", np.ones(a.hidden, dtype=np.float32))
        w.add_tensor(f"{b}ffn_norm.weight", np.ones(a.hidden, dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    print(a.out)


if __name__ == "__main__":
    main()
