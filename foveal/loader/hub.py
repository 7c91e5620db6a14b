"""Hugging Face Hub repo ids -> a local snapshot folder (config, tokenizer files and safetensors only).

Owns: deciding whether a `--model` string is a repo id, the download patterns, and turning every hub
failure (offline, HF_HUB_OFFLINE, unknown repo or revision, no safetensors) into ModelLoadError.
Must not parse configs or weights (safetensors_loader.py does that on the returned folder).
"""

from __future__ import annotations

import glob
import logging
import os
import re
import time

from foveal.config import hub_offline
from foveal.loader.errors import ModelLoadError

log = logging.getLogger(__name__)

HUB_ALLOW_PATTERNS = ["*.json", "*.safetensors", "tokenizer*", "*.model", "*.txt", "*.jinja"]
_REPO_ID = re.compile(r"[A-Za-z0-9][\w.-]*/[A-Za-z0-9][\w.-]*")


def looks_like_repo_id(model: str) -> bool:
    return bool(_REPO_ID.fullmatch(model)) and not model.endswith((".gguf", ".safetensors"))


def download_repo(repo_id: str, revision: str | None = None) -> str:
    """The local snapshot folder of `repo_id` (from the HF cache, or downloaded into it)."""
    from huggingface_hub import snapshot_download

    t0 = time.perf_counter()
    try:
        folder = snapshot_download(repo_id, revision=revision, allow_patterns=HUB_ALLOW_PATTERNS)
    except Exception as e:
        offline = hub_offline()
        raise ModelLoadError(
            f"could not get {repo_id!r}{f' (revision {revision})' if revision else ''} from the Hugging Face "
            f"Hub: {type(e).__name__}: {str(e).rstrip('.')}. No local path {repo_id!r} exists either. "
            + (
                "HF_HUB_OFFLINE is set, so only repos already in the local HF cache can be used. "
                if offline
                else "HF_HUB_OFFLINE may be set or this machine may be offline. "
            )
            + "Check the repo id, or download the model and pass its local path."
        ) from e
    if not glob.glob(os.path.join(folder, "*.safetensors")):
        raise ModelLoadError(
            f"Hub repo {repo_id!r} has no safetensors weights (only safetensors repos are loaded from the "
            "Hub; for a GGUF repo download the .gguf file and pass its path)"
        )
    log.info("resolved %s to %s in %.2f s", repo_id, folder, time.perf_counter() - t0)
    return folder
