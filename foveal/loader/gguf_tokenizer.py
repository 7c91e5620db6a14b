"""Tokenizers for GGUF files: built by transformers from the GGUF metadata, then cached on disk.

transformers needs ~9 s to build the default model's tokenizer (it re-reads the file and converts the
vocab); loading the saved result takes ~0.5 s. This module owns the cache layout
`<cache root>/tokenizers/<key>/` (key: hash of absolute path, size, mtime and transformers version)
and the environment variable that moves the cache root. It must not read weights, and a cache it
cannot read or write only costs time: it never fails a load.
"""

from __future__ import annotations

import hashlib
import logging
import os
import shutil
import tempfile
import time

from foveal.config import cache_dir
from foveal.loader.errors import ModelLoadError

log = logging.getLogger(__name__)


def tokenizer_cache_dir(path: str) -> str:
    """Where the converted tokenizer of this exact GGUF file (and transformers version) is kept."""
    import transformers

    path = os.path.abspath(path)
    st = os.stat(path)
    ident = f"{path}\0{st.st_size}\0{st.st_mtime_ns}\0{transformers.__version__}"
    key = hashlib.sha256(ident.encode()).hexdigest()[:24]
    return os.path.join(cache_dir(), "tokenizers", key)


def load_gguf_tokenizer(path: str):
    """The tokenizer (with chat template, when the file has one) for a GGUF file, cached after first use."""
    from transformers import AutoTokenizer

    cached = tokenizer_cache_dir(path)
    if os.path.isdir(cached):
        t0 = time.perf_counter()
        try:
            tok = AutoTokenizer.from_pretrained(cached, trust_remote_code=False)
        except Exception as e:
            log.warning("cached tokenizer %s is unreadable (%s); rebuilding it from %s", cached, e, path)
        else:
            log.info(
                "loaded cached tokenizer for %s from %s in %.2f s", path, cached, time.perf_counter() - t0
            )
            return tok
    t0 = time.perf_counter()
    folder, filename = os.path.split(os.path.abspath(path))
    try:
        tok = AutoTokenizer.from_pretrained(folder, gguf_file=filename, trust_remote_code=False)
    except Exception as e:
        raise ModelLoadError(
            f"could not build a tokenizer from GGUF file {path}: {type(e).__name__}: {e}"
        ) from e
    log.info("built tokenizer from GGUF metadata of %s in %.2f s", path, time.perf_counter() - t0)
    _save(tok, cached)
    return tok


def _save(tok, cached: str) -> None:
    """Write to a temporary folder and rename it into place, so readers never see half a tokenizer."""
    parent = os.path.dirname(cached)
    tmp = None
    try:
        os.makedirs(parent, exist_ok=True)
        tmp = tempfile.mkdtemp(prefix=".tmp-", dir=parent)
        tok.save_pretrained(tmp)
        if os.path.isdir(cached):  # unreadable leftover
            shutil.rmtree(cached, ignore_errors=True)
        os.rename(tmp, cached)
        tmp = None
        log.info("cached tokenizer in %s", cached)
    except Exception as e:  # read-only home, disk full, a concurrent writer won the rename: not fatal
        log.warning("could not cache tokenizer in %s: %s", cached, e)
    finally:
        if tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)
