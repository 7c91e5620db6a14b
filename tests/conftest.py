"""Shared fixtures. The real embedded model and its transformers reference load once per session."""

from __future__ import annotations

import os

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # no test may reach a model hub
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


@pytest.fixture(scope="session")
def smollm_path() -> str:
    from foveal.loader.default_model import default_model_path

    return default_model_path()


@pytest.fixture(scope="session")
def hf_smollm(smollm_path):
    """transformers' own GGUF loader on the embedded model: the independent reference (fp32, CPU)."""
    from transformers import AutoModelForCausalLM

    d, f = os.path.split(smollm_path)
    model = AutoModelForCausalLM.from_pretrained(d, gguf_file=f, dtype=torch.float32)
    return model.eval()


@pytest.fixture(scope="session")
def smollm_tokenizer(smollm_path):
    from transformers import AutoTokenizer

    d, f = os.path.split(smollm_path)
    return AutoTokenizer.from_pretrained(d, gguf_file=f)
