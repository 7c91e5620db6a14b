"""Model loading: a `--model` value -> `Checkpoint` (HF config, tokenizer, lazy HF-named weights).

Sources: the embedded default GGUF, a .gguf file (llama, qwen2, qwen3), an HF folder with safetensors,
or a Hub repo id. Every failure is a ModelLoadError. Heavy imports (transformers, gguf) happen inside
the functions, so importing this package stays cheap.
"""

from foveal.loader.checkpoint import Checkpoint, load_checkpoint
from foveal.loader.default_model import DEFAULT_MODEL_NAME, default_model_path
from foveal.loader.errors import ModelLoadError
from foveal.loader.gguf_config import GGUF_ARCHS
from foveal.loader.gguf_loader import open_gguf, read_gguf_weights

__all__ = [
    "Checkpoint",
    "DEFAULT_MODEL_NAME",
    "GGUF_ARCHS",
    "ModelLoadError",
    "default_model_path",
    "load_checkpoint",
    "open_gguf",
    "read_gguf_weights",
]
