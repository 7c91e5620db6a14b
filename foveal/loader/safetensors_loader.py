"""Hugging Face model folders: config.json, tokenizer files and safetensors weights (single or sharded).

Owns: finding the weight files (`model.safetensors`, or the shards named by
`model.safetensors.index.json`), checking every file's header before any weight is read, and yielding
tensors one at a time from `safe_open(..., device=...)`, cast to the requested dtype there. Must not
download anything (hub.py does) and must never hold more than one tensor of the model at a time.
"""

from __future__ import annotations

import glob
import json
import logging
import os
import re
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch

from foveal.layers.fp8 import FP8_DTYPES, dequantize_blocks
from foveal.loader.errors import ModelLoadError

log = logging.getLogger(__name__)

# model types whose config is another family's plus a few fields, their own config class being remote
# code: read with that family's class (the extra fields stay attributes)
CONFIG_ALIASES = {"mimo": "qwen2", "sdar": "qwen3"}

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"


@dataclass(slots=True)
class HFFolder:
    """An HF folder whose config parsed and whose safetensors headers were all readable."""

    path: str
    hf_config: Any  # transformers.PretrainedConfig
    files: dict[str, list[str]]  # safetensors file -> tensor names to take from it, in file order
    block_size: tuple[int, int] | None = None  # an FP8 checkpoint's weight_block_size (quantization_config)

    @property
    def num_tensors(self) -> int:
        return sum(1 for names in self.files.values() for n in names if not _is_scale(n))

    def weights(
        self, dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu", keep_fp8: bool = False
    ) -> Iterator[tuple[str, torch.Tensor]]:
        """Each tensor cast to `dtype`; an FP8 weight (a quantized checkpoint: Qwen3-*-FP8, DeepSeek's)
        comes dequantized with its scales, which are not yielded themselves. `keep_fp8`: an expert's
        block-quantized weight (`...experts.<e>.<proj>.weight`) comes as stored instead, its float32
        scales riding on it as `fp8_scale_inv` and the block as `fp8_block` (models/weights.py keeps
        them where the model runs its experts in FP8, else dequantizes them)."""
        from safetensors import safe_open

        dev = _safetensors_device(torch.device(device))
        scales = {n: file for file, names in self.files.items() for n in names if _is_scale(n)}
        for file, names in self.files.items():
            name = None
            try:
                with safe_open(file, framework="pt", device=dev) as f:
                    for name in names:
                        if _is_scale(name):
                            continue
                        t = f.get_tensor(name)
                        if t.dtype in FP8_DTYPES:
                            keep = keep_fp8 and _EXPERT.search(name) is not None
                            t = _fp8_weight(t, name, scales, dev, self.block_size, keep)
                        kept = t.dtype in FP8_DTYPES or not t.is_floating_point()
                        yield name, (t if kept else t.to(dtype))
            except ModelLoadError:
                raise
            except Exception as e:
                raise ModelLoadError(
                    f"could not read tensor {name} from {file}: {type(e).__name__}: {e}"
                ) from e


_EXPERT = re.compile(r"\.experts\.\d+\.\w+\.weight$")  # one expert's projection (a stack's rows)


def _is_scale(name: str) -> bool:
    """An FP8 weight's scale (block-wise `weight_scale_inv`, per-tensor `weight_scale`), or a static
    activation scale (unused: activations run in the model's dtype)."""
    return name.endswith(("weight_scale_inv", "weight_scale", "input_scale"))


def _fp8_weight(
    w: torch.Tensor, name: str, scales: dict[str, str], dev: str, block, keep: bool
) -> torch.Tensor:
    """An FP8 weight in float32: times its per-block scale (`*_scale_inv`, one per block_size block of
    [rows, cols]) or its per-tensor / per-row scale (`*_scale`). `keep`: a block-scaled one comes as
    stored, with `fp8_scale_inv` and `fp8_block` set on it."""
    from safetensors import safe_open

    for suffix in ("_scale_inv", "_scale"):
        file = scales.get(name + suffix)
        if file is None:
            continue
        with safe_open(file, framework="pt", device=dev) as f:
            s = f.get_tensor(name + suffix).float()
        if suffix == "_scale_inv" and s.dim() == 2 and w.dim() == 2:
            if block is None:
                raise ModelLoadError(f"{name}: block-wise FP8 scales but no weight_block_size in the config")
            if keep:
                w.fp8_scale_inv, w.fp8_block = s, tuple(block)
                return w
            return dequantize_blocks(w, s, block)
        out = w.float()
        if s.dim() == 1 and s.numel() == out.shape[0]:
            s = s[:, None]
        return out * s
    raise ModelLoadError(f"FP8 tensor {name} has no scale ({name}_scale_inv or {name}_scale)")


def open_hf_folder(path: str) -> HFFolder:
    """Parse config.json and every weight file's header; nothing is read from the weights yet."""
    from transformers import AutoConfig

    t0 = time.perf_counter()
    if not os.path.isfile(os.path.join(path, "config.json")):
        raise ModelLoadError(f"model folder {path} has no config.json")
    try:
        with open(os.path.join(path, "config.json")) as f:
            data = json.load(f)
        foreign = foreign_config(data)
        if foreign is not None:
            hf_config = AutoConfig.for_model(foreign[0], **foreign[1])
        else:
            hf_config = AutoConfig.from_pretrained(path, trust_remote_code=False)
    except Exception as e:
        raise ModelLoadError(
            f"could not parse {os.path.join(path, 'config.json')}: {type(e).__name__}: {e}"
        ) from e
    if not getattr(hf_config, "architectures", None):
        hf_config.architectures = [_causal_lm_architecture(hf_config, path)]
    files = _weight_files(path)
    log.info(
        "read config and %d safetensors headers of %s in %.2f s", len(files), path, time.perf_counter() - t0
    )
    return HFFolder(path=path, hf_config=hf_config, files=files, block_size=_fp8_block(hf_config, path))


def _fp8_block(hf_config, path: str) -> tuple[int, int] | None:
    """An FP8 checkpoint's scale block (quantization_config.weight_block_size); its weights are
    dequantized as they load (dense FP8 matmuls are not served: they run in the model's dtype), but for
    a mixture's experts, which can run as stored (layers/fp8.py)."""
    q = getattr(hf_config, "quantization_config", None)
    if q is None:
        return None
    q = q if isinstance(q, dict) else q.to_dict()
    method = q.get("quant_method")
    if method != "fp8":
        raise ModelLoadError(
            f"{path}: quantization {method!r} is not supported (FP8 checkpoints are; or a GGUF file)"
        )
    block = q.get("weight_block_size")
    return tuple(block) if block else None


def foreign_config(data: dict) -> tuple[str, dict] | None:
    """(transformers model type, its config fields) for a config.json whose own config class is remote
    code: an alias's fields as they are, a remapped family's (CONFIG_REMAPS) renamed; None for a model
    type transformers reads itself. Both the safetensors and the dummy loader go through here."""
    kind = data.get("model_type")
    if kind in CONFIG_REMAPS:
        return CONFIG_REMAPS[kind](data)
    if kind in CONFIG_ALIASES:
        # a null rope_scaling (SDAR's) is what transformers 5 assumes anyway, and it warns about the key
        drop = ("model_type", "auto_map") + (("rope_scaling",) if data.get("rope_scaling") is None else ())
        return CONFIG_ALIASES[kind], {k: v for k, v in data.items() if k not in drop}
    return None


# LLaDA (OLMo-style names) switches our Llama decoder cannot follow, with the only value it can run (a
# published config sets each of them so); any other value is refused rather than run wrongly, an absent
# or null one taken as that value
_LLADA_FIXED = {
    "block_type": "llama",
    "activation_type": "silu",
    "layer_norm_type": "rms",
    "layer_norm_with_affine": True,
    "bias_for_layer_norm": False,
    "attention_layer_norm": False,
    "rope": True,
    "alibi": False,
    "input_emb_norm": False,
    "scale_logits": False,
}
# fields kept as they are (token ids, dtype, the mask token the diffusion sampler needs)
_LLADA_KEPT = ("mask_token_id", "eos_token_id", "pad_token_id", "bos_token_id", "torch_dtype", "dtype")


def llada_config(data: dict) -> tuple[str, dict]:
    """LLaDA's config.json (model_type "llada", OLMo-style fields) -> ("llama", LlamaConfig fields).

    LLaDA-8B's decoder is the Llama layer (RMSNorm, RoPE, SwiGLU, no biases, no QK norm) under other
    names: d_model -> hidden_size, n_heads / n_kv_heads -> num_attention_heads / num_key_value_heads,
    n_layers -> num_hidden_layers, mlp_hidden_size -> intermediate_size, max_sequence_length ->
    max_position_embeddings, embedding_size (the padded vocabulary; else vocab_size) -> vocab_size,
    weight_tying -> tie_word_embeddings. `architectures` stays ["LLaDAModelLM"], so the registry picks
    the class that also renames its tensors, and `mask_token_id` stays on the config."""
    for key, value in _LLADA_FIXED.items():
        if data.get(key) is not None and data[key] != value:
            raise ValueError(f"LLaDA config: {key}={data[key]!r} is not supported (only {value!r})")
    for key in ("clip_qkv", "rope_scaling"):
        if data.get(key):
            raise ValueError(f"LLaDA config: {key}={data[key]!r} is not supported")
    if data.get("include_qkv_bias") and not data.get("include_bias"):
        raise ValueError(
            "LLaDA config: include_qkv_bias without include_bias (a q/k/v-only bias) is not supported"
        )
    missing = [k for k in ("d_model", "n_heads", "n_layers", "mlp_hidden_size") if data.get(k) is None]
    if missing:
        raise ValueError(f"LLaDA config lacks {', '.join(missing)}")
    bias = bool(data.get("include_bias", False))
    fields = dict(
        architectures=list(data.get("architectures") or ["LLaDAModelLM"]),
        hidden_size=data["d_model"],
        num_attention_heads=data["n_heads"],
        num_key_value_heads=data.get("n_kv_heads") or data["n_heads"],
        num_hidden_layers=data["n_layers"],
        intermediate_size=data["mlp_hidden_size"],
        hidden_act="silu",
        rms_norm_eps=data.get("rms_norm_eps", 1e-5),
        rope_parameters={"rope_type": "default", "rope_theta": float(data.get("rope_theta", 10000.0))},
        max_position_embeddings=data.get("max_sequence_length", 2048),
        vocab_size=data.get("embedding_size") or data["vocab_size"],
        tie_word_embeddings=bool(data.get("weight_tying", False)),
        attention_bias=bias,
        mlp_bias=bias,
    )
    fields.update({k: data[k] for k in _LLADA_KEPT if k in data})
    return "llama", fields


# model types whose config.json must be renamed into a transformers family's (see foreign_config)
CONFIG_REMAPS = {"llada": llada_config}


def load_hf_tokenizer(path: str, config=None):
    """The folder's tokenizer; no remote code, ever. `config`: the model's parsed config, so transformers
    does not parse config.json again on its own (for a remote-code family such as LLaDA or SDAR that
    would warn about an unknown model type)."""
    from transformers import AutoTokenizer

    kwargs = {} if config is None else {"config": config}
    try:
        return AutoTokenizer.from_pretrained(path, trust_remote_code=False, **kwargs)
    except Exception as e:
        raise ModelLoadError(f"could not load the tokenizer of {path}: {type(e).__name__}: {e}") from e


def _weight_files(path: str) -> dict[str, list[str]]:
    index = os.path.join(path, INDEX_FILE)
    if os.path.isfile(index):
        try:
            with open(index) as f:
                weight_map: dict[str, str] = json.load(f)["weight_map"]
        except Exception as e:
            raise ModelLoadError(f"could not parse the shard index {index}: {type(e).__name__}: {e}") from e
        wanted: dict[str, set[str]] = {}
        for name, shard in weight_map.items():
            wanted.setdefault(os.path.join(path, shard), set()).add(name)
        files = {}
        for file in sorted(wanted):
            if not os.path.isfile(file):
                raise ModelLoadError(f"shard {file} named in {index} is missing")
            keys = _header_keys(file)
            missing = wanted[file] - set(keys)
            if missing:
                raise ModelLoadError(
                    f"shard {file} lacks tensors its index lists: {', '.join(sorted(missing)[:8])}"
                )
            files[file] = [k for k in keys if k in wanted[file]]
        return files
    single = os.path.join(path, SINGLE_FILE)
    candidates = (
        [single] if os.path.isfile(single) else sorted(glob.glob(os.path.join(path, "*.safetensors")))
    )
    if not candidates:
        raise ModelLoadError(
            f"model folder {path} has no safetensors weights (expected {SINGLE_FILE} or {INDEX_FILE}; "
            "PyTorch .bin weights are not supported)"
        )
    return {file: _header_keys(file) for file in candidates}


def _header_keys(file: str) -> list[str]:
    from safetensors import safe_open

    try:
        with safe_open(file, framework="pt") as f:  # reads and checks the header only
            return list(f.keys())
    except Exception as e:
        raise ModelLoadError(
            f"could not read safetensors file {file}: {type(e).__name__}: {e} (truncated or corrupt?)"
        ) from e


def _safetensors_device(device: torch.device) -> str:
    if device.type == "cuda" and device.index is None:
        return f"cuda:{torch.cuda.current_device()}"
    return str(device)


def _causal_lm_architecture(hf_config, path: str) -> str:
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    arch = MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.get(getattr(hf_config, "model_type", None))
    if arch is None:
        raise ModelLoadError(
            f"{path}/config.json names no architectures and model_type has no causal-LM class"
        )
    return arch
