"""PEFT's LoRA checkpoint format: `adapter_config.json` + `adapter_model.safetensors`.

Reads the config, refuses what Foveal does not run (with the field that says so), and gives each
module's scaling as PEFT computes it: `lora_alpha / r` (or `/ sqrt(r)` with rsLoRA), with `r` and
`alpha` overridden per module by `rank_pattern` / `alpha_pattern`, whose keys match a module's full
name the way PEFT's `get_pattern_key` does (the first key `k` with `(.*\\.)?(k)$` matching).

Tensor names are `base_model.model.<module>.lora_A.weight` ([r, in]) and `...lora_B.weight`
([out, r]); the tensors, not `target_modules`, say which modules carry LoRA (`module_name`).
Owns no weights and no model knowledge (foveal/lora/adapter.py maps modules onto the model).
"""

from __future__ import annotations

import json
import math
import os
import re
from dataclasses import dataclass, field

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
_PREFIX = "base_model.model."
_SUFFIXES = (".lora_A.weight", ".lora_B.weight")

# init_lora_weights values that rewrite the base weights when the adapter is created: an adapter saved
# that way only works on the rewritten base (PEFT converts it to plain LoRA when asked to on saving)
_BASE_REWRITING_INITS = ("pissa", "olora", "corda", "loftq", "lora_ga", "eva")


class AdapterError(ValueError):
    """An adapter that cannot be loaded: the message says which file, field or tensor, and why."""


@dataclass(frozen=True, slots=True)
class AdapterConfig:
    r: int
    lora_alpha: float
    use_rslora: bool = False
    rank_pattern: dict[str, int] = field(default_factory=dict)
    alpha_pattern: dict[str, float] = field(default_factory=dict)
    base_model_name_or_path: str | None = None

    @classmethod
    def parse(cls, raw: dict, source: str = CONFIG_FILE) -> AdapterConfig:
        """The config of a plain LoRA adapter; AdapterError naming the field for anything else."""

        def refuse(name: str, why: str):
            raise AdapterError(f"{source}: {name}={raw.get(name)!r}: {why}")

        if str(raw.get("peft_type", "LORA")).upper() != "LORA":
            refuse("peft_type", "only LoRA adapters are supported")
        if raw.get("use_dora"):
            refuse("use_dora", "DoRA adapters are not supported")
        if raw.get("modules_to_save"):
            refuse("modules_to_save", "adapters that replace whole modules are not supported (LoRA only)")
        if raw.get("bias", "none") not in ("none", None):
            refuse("bias", "adapters that train biases are not supported (bias must be 'none')")
        if raw.get("lora_bias"):
            refuse("lora_bias", "LoRA with a bias on B is not supported")
        if raw.get("fan_in_fan_out"):
            refuse("fan_in_fan_out", "only nn.Linear-layout adapters are supported")
        if raw.get("target_parameters"):  # PEFT's LoRA on bare parameters: a mixture's experts, router
            why = "LoRA on parameters (a mixture of experts' expert stacks or router) is not supported"
            refuse("target_parameters", why + "; adapters may target attention projections and dense MLPs")
        for name in ("trainable_token_indices", "alora_invocation_tokens"):
            if raw.get(name):
                refuse(name, "is not supported")
        if raw.get("layer_replication"):
            refuse("layer_replication", "adapters that replicate layers are not supported")
        init = raw.get("init_lora_weights")
        if isinstance(init, str) and init.lower().startswith(_BASE_REWRITING_INITS):
            refuse("init_lora_weights", "this initialization rewrites the base weights; save the adapter "
                   "converted to plain LoRA (PEFT's path_initial_model_for_weight_conversion)")  # fmt: skip
        try:
            r = int(raw["r"])
            alpha = float(raw.get("lora_alpha", r))
            ranks = {str(k): int(v) for k, v in (raw.get("rank_pattern") or {}).items()}
            alphas = {str(k): float(v) for k, v in (raw.get("alpha_pattern") or {}).items()}
        except KeyError:
            raise AdapterError(f"{source}: no 'r' (the LoRA rank)") from None
        except (TypeError, ValueError) as e:
            raise AdapterError(
                f"{source}: r, lora_alpha, rank_pattern, alpha_pattern must be numbers: {e}"
            ) from e
        if r <= 0 or any(v <= 0 for v in ranks.values()):
            refuse("r", "ranks must be positive")
        return cls(
            r, alpha, bool(raw.get("use_rslora", False)), ranks, alphas, raw.get("base_model_name_or_path")
        )

    @classmethod
    def read(cls, folder: str) -> AdapterConfig:
        path = os.path.join(folder, CONFIG_FILE)
        try:
            with open(path) as f:
                raw = json.load(f)
        except OSError as e:
            raise AdapterError(f"no LoRA adapter config at {path}: {e.strerror or e}") from None
        except json.JSONDecodeError as e:
            raise AdapterError(f"{path} is not valid JSON: {e}") from None
        if not isinstance(raw, dict):
            raise AdapterError(f"{path} must hold a JSON object")
        return cls.parse(raw, path)

    def rank_of(self, module: str) -> int:
        return self.rank_pattern[k] if (k := _pattern_key(self.rank_pattern, module)) else self.r

    def scaling(self, module: str, rank: int | None = None) -> float:
        """PEFT's scaling of `module` (its full name, as in the tensor names). `rank` is the module's
        rank as its tensors have it (the config's rank for it when None)."""
        r = self.rank_of(module) if rank is None else rank
        k = _pattern_key(self.alpha_pattern, module)
        alpha = self.alpha_pattern[k] if k else self.lora_alpha
        return alpha / math.sqrt(r) if self.use_rslora else alpha / r


def _pattern_key(patterns: dict, module: str) -> str | None:
    for key in patterns:
        if re.match(rf"(.*\.)?({key})$", module):
            return key
    return None


def module_name(tensor_name: str) -> tuple[str, str]:
    """`base_model.model.<module>.lora_A.weight` -> (<module>, "A"); AdapterError for any other tensor
    (embedding LoRA, DoRA magnitudes, biases, saved modules), naming it."""
    for suffix in _SUFFIXES:
        if tensor_name.endswith(suffix) and tensor_name.startswith(_PREFIX):
            return tensor_name[len(_PREFIX) : -len(suffix)], suffix[6]
    raise AdapterError(
        f"tensor {tensor_name!r} is not a LoRA A/B weight of a linear layer (embedding LoRA, DoRA, trained "
        "biases and saved modules are not supported)"
    )


def resolve(path: str) -> str:
    """A local adapter folder, or a Hub repo id downloaded into the HF cache."""
    if os.path.isdir(path):
        return path
    from foveal.loader.errors import ModelLoadError
    from foveal.loader.hub import download_repo, looks_like_repo_id

    if not looks_like_repo_id(path):
        raise AdapterError(f"LoRA adapter path {path!r} is neither a folder nor a Hub repo id")
    try:
        return download_repo(path)
    except ModelLoadError as e:
        raise AdapterError(str(e)) from None
