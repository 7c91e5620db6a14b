"""Shared fixtures. The real embedded model and its transformers reference load once per session."""

from __future__ import annotations

import contextlib
import json
import os

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # no test may reach a model hub
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# Triton kernels run in Triton's interpreter on CPU tensors where there is no GPU; it is chosen when
# a kernel is defined, so it must be set before any kernel module is imported
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
if os.environ.get("TRITON_INTERPRET") == "1":
    from tests.interpreter import speed_up_interpreter

    try:
        speed_up_interpreter()
    except ImportError:  # no triton: its tests skip
        pass


def pytest_configure(config):
    from tests.heldout import missing_in_ci

    if reason := missing_in_ci():
        raise pytest.UsageError(reason)


@pytest.fixture(scope="session")
def smollm_path() -> str:
    from foveal.loader.default_model import default_model_path

    try:
        return default_model_path()
    except FileNotFoundError:
        if os.environ.get("FOVEAL_TESTS_WITHOUT_MODEL") == "1":  # the GPU machine cannot carry 98 MB
            pytest.skip("embedded model not installed")
        raise


@pytest.fixture(scope="session")
def hf_smollm(smollm_path, pytestconfig):
    """transformers' own GGUF loader on the embedded model: the independent reference (fp32, CPU).

    That loader takes ~50 s here (it parses the file twice and maps the tensor names slowly), and each
    test worker needs it: its weights are kept (fp32 safetensors, exact) with its config in pytest's
    cache folder (.pytest_cache/d/smollm-reference/), keyed by the file and the versions of
    transformers and gguf, and a later worker or run builds the same transformers model from them in a
    few seconds."""
    from transformers import AutoConfig, AutoModelForCausalLM

    cached = os.path.join(pytestconfig.cache.mkdir("smollm-reference"), _reference_key(smollm_path))
    if os.path.isfile(os.path.join(cached, "model.safetensors")):
        from safetensors.torch import load_model

        model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(cached), dtype=torch.float32)
        load_model(model, os.path.join(cached, "model.safetensors"))
        return model.eval()
    d, f = os.path.split(smollm_path)
    with _gguf_read_once():
        model = AutoModelForCausalLM.from_pretrained(d, gguf_file=f, dtype=torch.float32).eval()
    _keep(model, cached)
    return model


@contextlib.contextmanager
def _gguf_read_once():
    """transformers' GGUF loader with two of its repeated works done once: it parses the file twice
    (config, then weights) and builds gguf's tensor-name map for every tensor (397 times). Both are pure
    functions of their arguments (the reader is read-only), so the model is the same: same config, every
    tensor equal (checked when this was written; a fresh cache's first test 42-44 -> 27-28 s here)."""
    import functools

    import gguf

    reader, names = gguf.GGUFReader, gguf.get_tensor_name_map
    opened: dict = {}

    def read(path, *args, **kw):
        key = (os.fspath(path), args, tuple(sorted(kw.items())))
        if key not in opened:
            opened[key] = reader(path, *args, **kw)
        return opened[key]

    gguf.GGUFReader, gguf.get_tensor_name_map = read, functools.cache(names)
    try:
        yield
    finally:
        gguf.GGUFReader, gguf.get_tensor_name_map = reader, names


def _reference_key(path: str) -> str:
    import hashlib
    from importlib.metadata import version

    st = os.stat(path)
    parts = (os.path.abspath(path), st.st_size, st.st_mtime_ns, version("transformers"), version("gguf"))
    return hashlib.sha256("\0".join(map(str, parts)).encode()).hexdigest()[:24]


def _keep(model, cached: str) -> None:
    """Config and weights into a temporary folder renamed into place (a reader never sees half of it); a
    cache that cannot be written only costs the next worker the load."""
    import shutil
    import tempfile

    from safetensors.torch import save_model

    parent = os.path.dirname(cached)
    tmp = None
    try:
        os.makedirs(parent, exist_ok=True)
        tmp = tempfile.mkdtemp(prefix=".tmp-", dir=parent)
        config = model.config.to_dict()
        config.pop("quantization_config", None)  # the GGUF's: the kept weights are the dequantized ones
        with open(os.path.join(tmp, "config.json"), "w") as f:
            json.dump(config, f)
        save_model(model, os.path.join(tmp, "model.safetensors"))
        os.rename(tmp, cached)
        tmp = None
    except OSError:  # read-only, full, or another worker's rename won
        pass
    finally:
        if tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)


@pytest.fixture(scope="session")
def smollm_tokenizer(smollm_path):
    from transformers import AutoTokenizer

    d, f = os.path.split(smollm_path)
    return AutoTokenizer.from_pretrained(d, gguf_file=f)


@pytest.fixture(scope="session")
def llm_fp32(smollm_path):
    """Foveal on the embedded model, dense fp32 on CPU (shared by the real-model tests, which compare it
    with transformers: the quantized default has its own reference checks in test_quant_linear.py)."""
    from foveal.engine.llm import LLM

    smollm_path  # noqa: B018 (skips with it when the model is absent)
    return LLM(dtype="float32", quantization="none", kv_cache_memory=256 * 2**20)


@pytest.fixture(autouse=True)
def _no_leaked_blocks(request):
    """After every test that used the shared engine: no request left, no block held, pool consistent."""
    yield
    if "llm_fp32" in request.fixturenames:
        eng = request.getfixturevalue("llm_fp32").engine
        eng.kv.check_integrity()
        assert eng.kv.num_used_blocks == 0, "KV blocks leaked"
        assert not eng.has_unfinished()
