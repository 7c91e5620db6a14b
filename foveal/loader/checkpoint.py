"""`load_checkpoint`: turn a `--model` value into config, tokenizer and a lazy stream of HF-named weights.

Owns: deciding what the value is (None -> the embedded GGUF, a .gguf file, an HF folder, a Hub repo
id), the `Checkpoint` boundary type, the progress bar and the load-time logs. Format details live in
gguf_loader.py / safetensors_loader.py / hub.py. Must not build models: weights are yielded one
tensor at a time, already in the requested dtype and on the requested device, for the model to copy.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Collection, Iterator
from dataclasses import dataclass
from typing import Any

import torch

from foveal.loader.errors import ModelLoadError

log = logging.getLogger(__name__)


@dataclass(slots=True)
class Checkpoint:
    hf_config: Any  # transformers.PretrainedConfig, with .architectures set
    tokenizer: Any  # transformers.PreTrainedTokenizerBase, with chat_template when the source has one
    # lazy, HF names; no lm_head.weight when tied; None: random weights (--load-format dummy)
    weights: Iterator[tuple[str, torch.Tensor]] | None
    source: str  # resolved local path (file or folder)
    format: str  # "gguf" | "safetensors" | "dummy"
    name: str  # served model name
    processor: Any = None  # transformers processor (images); None for text-only models
    video_config: dict | None = None  # the folder's video preprocessor settings (VLMs that take video)


def load_checkpoint(
    model: str | None,
    *,
    dtype: torch.dtype,
    device: str | torch.device = "cpu",
    progress: bool = False,
    revision: str | None = None,
    load_format: str = "auto",
    keep_blocks: Collection[str] = (),
    keep_fp8: bool = True,
) -> Checkpoint:
    """Config and tokenizer now; weights as an iterator that reads one tensor per step (none for
    load_format "dummy": see dummy.py). `keep_blocks`: GGUF weights stored in these types also carry
    their raw blocks (gguf_loader.GGUFFile.weights). `keep_fp8`: a safetensors checkpoint's
    block-quantized experts come as stored, with their scales (safetensors_loader.HFFolder.weights;
    models/weights.py keeps or dequantizes them), else dequantized."""
    device = torch.device(device)
    t0 = time.perf_counter()
    if load_format == "dummy":
        if model is None or not os.path.exists(model):
            raise ModelLoadError("--load-format dummy needs --model: a config.json file or a folder with one")
        ckpt = _load_dummy(os.path.abspath(os.path.expanduser(model)))
    elif model is None:
        from foveal.loader.default_model import DEFAULT_MODEL_NAME, default_model_path

        try:
            path = default_model_path()
        except FileNotFoundError as e:
            raise ModelLoadError(str(e)) from e
        ckpt = _load_gguf(path, DEFAULT_MODEL_NAME, dtype, device, progress, keep_blocks)
    else:
        local = os.path.abspath(os.path.expanduser(model))
        if os.path.exists(local):
            if revision is not None:
                log.warning("--revision %s is ignored for the local path %s", revision, local)
            ckpt = _load_local(local, dtype, device, progress, keep_blocks, keep_fp8)
        elif model.lower().endswith(".gguf") or not _looks_like_repo_id(model):
            raise ModelLoadError(f"model path {model!r} does not exist")
        else:
            from foveal.loader.hub import download_repo

            folder = download_repo(model, revision)
            ckpt = _load_folder(folder, model, dtype, device, progress, keep_fp8)
    log.info(
        "loaded %s config and tokenizer (%s) from %s in %.2f s; weights stream on first use",
        ckpt.name,
        ckpt.format,
        ckpt.source,
        time.perf_counter() - t0,
    )
    return ckpt


def _looks_like_repo_id(model: str) -> bool:
    from foveal.loader.hub import looks_like_repo_id

    return looks_like_repo_id(model)


def _load_local(
    path: str,
    dtype: torch.dtype,
    device: torch.device,
    progress: bool,
    keep_blocks: Collection[str] = (),
    keep_fp8: bool = True,
) -> Checkpoint:
    if os.path.isdir(path):
        if os.path.isfile(os.path.join(path, "config.json")):
            return _load_folder(
                path, os.path.basename(path.rstrip(os.sep)), dtype, device, progress, keep_fp8
            )
        ggufs = sorted(f for f in os.listdir(path) if f.lower().endswith(".gguf"))
        hint = f"; for a GGUF, pass the file itself (found: {', '.join(ggufs[:4])})" if ggufs else ""
        raise ModelLoadError(f"model folder {path} has no config.json{hint}")
    if path.lower().endswith(".gguf") or _has_gguf_magic(path):
        name = os.path.basename(path)
        name = name[:-5] if name.lower().endswith(".gguf") else name
        return _load_gguf(path, name, dtype, device, progress, keep_blocks)
    raise ModelLoadError(
        f"model file {path} is not a GGUF file; pass a .gguf file, a folder with config.json and "
        "safetensors weights, or a Hugging Face repo id"
    )


def _load_dummy(path: str) -> Checkpoint:
    from foveal.loader import dummy
    from foveal.loader.processors import load_hf_processor, load_video_config
    from foveal.loader.safetensors_loader import load_hf_tokenizer

    config = dummy.load_config(path)
    folder = path if os.path.isdir(path) else None
    has_tokenizer = folder and any(
        os.path.isfile(os.path.join(folder, f)) for f in ("tokenizer.json", "tokenizer_config.json")
    )
    tokenizer = load_hf_tokenizer(folder, config) if has_tokenizer else dummy.synthetic_tokenizer(config)
    processor = load_hf_processor(folder) if folder else None
    if processor is None and config.get_text_config() is not config:  # a VLM: its family's processor
        processor = dummy.dummy_processor(config, tokenizer)
    name = os.path.basename(path.rstrip(os.sep)).removesuffix(".json")
    video = load_video_config(folder) if folder else None
    return Checkpoint(
        config,
        tokenizer,
        None,
        source=path,
        format="dummy",
        name=name,
        processor=processor,
        video_config=video,
    )


def _load_gguf(
    path: str,
    name: str,
    dtype: torch.dtype,
    device: torch.device,
    progress: bool,
    keep_blocks: Collection[str],
) -> Checkpoint:
    from foveal.loader.gguf_loader import open_gguf
    from foveal.loader.gguf_tokenizer import load_gguf_tokenizer

    g = open_gguf(path)
    tokenizer = load_gguf_tokenizer(path)
    weights = _stream(g.weights(dtype, device, keep_blocks), g.num_tensors, name, progress)
    return Checkpoint(g.hf_config, tokenizer, weights, source=path, format="gguf", name=name)


def _load_folder(
    path: str, name: str, dtype: torch.dtype, device: torch.device, progress: bool, keep_fp8: bool = True
) -> Checkpoint:
    from foveal.loader.processors import load_hf_processor, load_video_config
    from foveal.loader.safetensors_loader import load_hf_tokenizer, open_hf_folder

    folder = open_hf_folder(path)
    tokenizer = load_hf_tokenizer(path, folder.hf_config)
    processor = load_hf_processor(path)
    weights = _stream(folder.weights(dtype, device, keep_fp8), folder.num_tensors, name, progress)
    return Checkpoint(
        folder.hf_config,
        tokenizer,
        weights,
        source=path,
        format="safetensors",
        name=name,
        processor=processor,
        video_config=load_video_config(path),
    )


def _stream(weights: Iterator, total: int, name: str, progress: bool) -> Iterator[tuple[str, torch.Tensor]]:
    """Pass tensors through, with a tqdm bar if asked, and log the time once the stream is exhausted."""
    from tqdm.auto import tqdm

    t0 = time.perf_counter()
    n_bytes = 0
    with tqdm(total=total, desc=f"Loading {name}", unit="tensor", disable=not progress) as bar:
        for item in weights:
            t = item[1]  # a meta tensor carries raw GGUF blocks only (gguf_loader.py)
            n_bytes += t.gguf_blocks[1].numel() if t.is_meta else t.numel() * t.element_size()
            bar.update(1)
            yield item
    log.info(
        "streamed %d tensors (%.1f MiB) of %s in %.2f s",
        total,
        n_bytes / 2**20,
        name,
        time.perf_counter() - t0,
    )


def is_gguf(model: str | None) -> bool:
    """Whether `--model` names a GGUF file (None: the embedded default, one). Reads 4 bytes at most."""
    if model is None:
        return True
    path = os.path.abspath(os.path.expanduser(model))
    return os.path.isfile(path) and (path.lower().endswith(".gguf") or _has_gguf_magic(path))


def _has_gguf_magic(path: str) -> bool:
    try:
        with open(path, "rb") as f:
            return f.read(4) == b"GGUF"
    except OSError:
        return False
