"""GGUF checkpoints: one header read per file (gguf_file.py), HF names, tensors dequantized one at a time.

Owns: opening and validating the file (its header parsed once by gguf_file.py: ~0.1 s for the 98 MB
default model), the llama.cpp -> HF tensor-name table, dequantization with
`gguf.quants.dequantize`, and undoing the q/k row permutation llama.cpp applies to `llama` models.
Must not build tokenizers (gguf_tokenizer.py) nor hold more than one dequantized tensor at a time.
"""

from __future__ import annotations

import logging
import re
import time
from collections.abc import Collection, Iterator
from dataclasses import dataclass
from typing import Any

import torch

from foveal.loader.errors import ModelLoadError
from foveal.loader.gguf_config import GGUFArch, build_hf_config, gguf_architecture

log = logging.getLogger(__name__)

_TOP_LEVEL = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
_PER_LAYER = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "ffn_gate_inp": "mlp.gate",  # a mixture of experts' router
}
# a mixture of experts' stacked tensors [E, rows, cols]: yielded one expert at a time, by the Hub's names
_EXPERTS = {"ffn_gate_exps": "gate_proj", "ffn_up_exps": "up_proj", "ffn_down_exps": "down_proj"}
_EXPERT_STACK = re.compile(r"model\.layers\.(\d+)\.mlp\.experts\.(\w+)\.weight")
_LAYER_NAME = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)")
_EMBEDDING = "model.embed_tokens.weight"
_CONSUMED = {"rope_freqs.weight"}  # folded into the config's rope parameters, not a parameter


def hf_name(gguf_name: str) -> str | None:
    """The HF parameter name for a llama.cpp tensor name; None if it is not one we know."""
    if m := _LAYER_NAME.fullmatch(gguf_name):
        if m[2] in _EXPERTS and m[3] == "weight":  # split into experts by `GGUFFile.weights`
            return f"model.layers.{m[1]}.mlp.experts.{_EXPERTS[m[2]]}.weight"
        part = _PER_LAYER.get(m[2])
        return f"model.layers.{m[1]}.{part}.{m[3]}" if part else None
    base, _, suffix = gguf_name.rpartition(".")
    return f"{_TOP_LEVEL[base]}.{suffix}" if base in _TOP_LEVEL and suffix in ("weight", "bias") else None


def unpermute_qk(w: torch.Tensor, n_head: int) -> torch.Tensor:
    """Inverse of llama.cpp's `permute` (convert_hf_to_gguf.py), as transformers' GGUF loader undoes it.

    llama.cpp stores each head's rows as [pairs, 2] (interleaved rope halves); HF keeps [2, pairs].
    Works for weights [rows, in] and biases [rows].
    """
    rows = w.shape[0]
    return w.reshape(n_head, rows // n_head // 2, 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)


@dataclass(slots=True)
class GGUFFile:
    """An open, validated GGUF file. `weights()` may be iterated more than once (re-reads the mmap)."""

    path: str
    reader: Any  # gguf_file.GGUFContents; tensor data are views into its memory map
    arch: GGUFArch
    hf_config: Any  # transformers.PretrainedConfig
    names: dict[str, str]  # gguf name -> HF name, in file order, for every tensor we yield

    @property
    def num_tensors(self) -> int:
        return len(self.names)

    def weights(
        self,
        dtype: torch.dtype = torch.float32,
        device: str | torch.device = "cpu",
        keep_blocks: Collection[str] = (),
    ) -> Iterator[tuple[str, torch.Tensor]]:
        """HF-named tensors, dequantized to `dtype`. A 2-D tensor stored in one of the GGUF types named
        in `keep_blocks` (e.g. "Q4_1") comes as its raw blocks instead, rows in HF order, on a meta
        tensor of the dense shape: `tensor.gguf_blocks = (type name, uint8 [rows, bytes per row])`
        (models/weights.py packs them for layers/quant.py, and dequantizes them only where a weight
        cannot run packed). The token embedding comes dequantized and, in such a type and tied to the LM
        head, with its blocks too: lookups read its rows, the head runs packed."""
        from gguf.quants import dequantize

        from foveal.layers import quant

        cfg = self.hf_config
        qk_heads = {".attn_q.": cfg.num_attention_heads, ".attn_k.": cfg.num_key_value_heads}
        for t in self.reader.tensors:
            name = self.names.get(t.name)
            if name is None:
                continue
            # ggml lists dims fastest-first; reversed, they are the row-major (HF) shape
            shape = tuple(reversed(t.shape))
            if len(shape) == 3:  # a mixture of experts' stack
                yield from self._experts(t, name, shape, dtype, device, keep_blocks)
                continue
            n_head = next((n for marker, n in qk_heads.items() if marker in t.name), None)
            n_head = n_head if self.arch.permuted_qk else None
            raw = None
            if t.tensor_type.name in keep_blocks and len(shape) == 2:
                raw = torch.from_numpy(t.data.reshape(shape[0], -1).copy())
                if n_head is not None:
                    raw = unpermute_qk(raw, n_head)  # whole rows move
                if name != _EMBEDDING:
                    w = torch.empty(shape, dtype=dtype, device="meta")
                    w.gguf_blocks = (t.tensor_type.name, raw)
                    yield name, w
                    continue
            if raw is not None:  # the embedding: its blocks are unpermuted already
                w = quant.dequantize(raw, t.tensor_type.name, shape[1])  # vectorized: gguf's loops rows
            else:
                try:
                    arr = dequantize(t.data, t.tensor_type).reshape(shape)
                except Exception as e:
                    raise ModelLoadError(
                        f"GGUF file {self.path}: could not dequantize tensor {t.name} "
                        f"({t.tensor_type.name}): {e}"
                    ) from e
                if not arr.flags.writeable:  # F32 tensors come back as views into the read-only mmap
                    arr = arr.copy()
                w = torch.from_numpy(arr)
                if n_head is not None:
                    w = unpermute_qk(w, n_head)
            w = w.to(dtype).to(device)
            if raw is not None and getattr(cfg, "tie_word_embeddings", False):  # the head runs packed
                w.gguf_blocks = (t.tensor_type.name, raw)
            yield name, w

    def _experts(self, t, name: str, shape, dtype, device, keep_blocks) -> Iterator[tuple[str, torch.Tensor]]:
        """A stacked expert tensor [E, rows, cols] as E tensors named as the Hub's files name them
        (model.layers.L.mlp.experts.e.gate_proj.weight): raw blocks per expert where kept, else
        dequantized (the whole stack at once: one tensor, as for any other)."""
        from gguf.quants import dequantize

        layer, proj = _EXPERT_STACK.fullmatch(name).groups()
        names = [f"model.layers.{layer}.mlp.experts.{e}.{proj}.weight" for e in range(shape[0])]
        if t.tensor_type.name in keep_blocks:
            raw = t.data.reshape(shape[0], shape[1], -1)
            for e, n in enumerate(names):
                w = torch.empty(shape[1:], dtype=dtype, device="meta")
                w.gguf_blocks = (t.tensor_type.name, torch.from_numpy(raw[e].copy()))
                yield n, w
            return
        try:
            arr = dequantize(t.data, t.tensor_type).reshape(shape)
        except Exception as e:
            raise ModelLoadError(
                f"GGUF file {self.path}: could not dequantize tensor {t.name} ({t.tensor_type.name}): {e}"
            ) from e
        stack = torch.from_numpy(arr.copy() if not arr.flags.writeable else arr)
        for e, n in enumerate(names):
            yield n, stack[e].to(dtype).to(device)


def open_gguf(path: str) -> GGUFFile:
    """Read the file's metadata and tensor table once, check it and build the HF config."""
    from foveal.loader.gguf_file import read_gguf

    t0 = time.perf_counter()
    try:
        reader = read_gguf(path)
    except Exception as e:  # GGUFFormatError: bad magic, version or types, a truncated header
        raise ModelLoadError(
            f"could not read GGUF file {path}: {type(e).__name__}: {e} (is the file truncated or not a GGUF?)"
        ) from e
    arch = gguf_architecture(reader, path)
    hf_config = build_hf_config(reader, path)
    names: dict[str, str] = {}
    unknown: list[str] = []
    for t in reader.tensors:
        if t.name in _CONSUMED:
            continue
        name = hf_name(t.name)
        if name is None:
            unknown.append(t.name)
        elif t.data.nbytes != t.n_bytes:
            raise ModelLoadError(
                f"GGUF file {path}: tensor {t.name} has {t.data.nbytes} of {t.n_bytes} bytes "
                "(truncated file?)"
            )
        else:
            names[t.name] = name
    if unknown:
        raise ModelLoadError(
            f"GGUF file {path} has tensors we cannot map to HF names: {', '.join(unknown[:8])}"
        )
    n_layers = hf_config.num_hidden_layers
    if not any(n.startswith(f"model.layers.{n_layers - 1}.") for n in names.values()):
        raise ModelLoadError(
            f"GGUF file {path}: block_count is {n_layers} but layer {n_layers - 1} has no tensors"
        )
    log.info(
        "read GGUF %s (%s, %d tensors) in %.2f s",
        path,
        hf_config.architectures[0],
        len(names),
        time.perf_counter() - t0,
    )
    return GGUFFile(path=path, reader=reader, arch=arch, hf_config=hf_config, names=names)


def read_gguf_weights(
    path: str, dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu"
) -> tuple[Any, Iterator[tuple[str, torch.Tensor]]]:
    """(hf_config, weights) of a GGUF file without building its tokenizer (tests, tools)."""
    g = open_gguf(path)
    return g.hf_config, g.weights(dtype, device)
