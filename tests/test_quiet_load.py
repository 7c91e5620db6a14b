"""Foveal runs no remote code: a model folder whose config.json names remote classes (`auto_map`, as
the published LLaDA and SDAR configs do) loads without transformers asking "Do you wish to run the
custom code? [y/N]" on stdin, and without its warnings about the unknown model type or the config's
deprecated keys. Checked on what the process writes to its stderr (file descriptor 2) and logs."""

from __future__ import annotations

import builtins
import logging
import warnings

import pytest
import torch

from foveal.loader import load_checkpoint
from tests.diffusion_models import write_llada, write_sdar


@pytest.mark.parametrize("write", [write_llada, write_sdar], ids=["llada", "sdar"])
def test_remote_code_configs_load_without_prompt_or_warning(tmp_path, write, monkeypatch, capfd, caplog):
    path = write(str(tmp_path / "m"))

    def no_prompt(*a, **k):
        raise AssertionError(f"something asked on stdin: {a}")

    monkeypatch.setattr(builtins, "input", no_prompt)
    capfd.readouterr()
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a FutureWarning / UserWarning from the load fails the test
        with caplog.at_level(logging.WARNING):
            ckpt = load_checkpoint(path, dtype=torch.float32, progress=False)
            sum(1 for _ in ckpt.weights)
    err = capfd.readouterr().err
    assert "[transformers]" not in err and "custom code" not in err, err
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING], caplog.records
    assert ckpt.tokenizer.mask_token == "<|mdm_mask|>"
