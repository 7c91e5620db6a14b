"""Random LoRA adapters in PEFT's own format, made by PEFT (`get_peft_model` + `save_pretrained`) on
the tiny models of tests/tiny.py and tests/test_loader.py: what the LoRA tests load and compare with."""

from __future__ import annotations

import torch


def peft_model(hf, r: int, seed: int, scale: float = 0.3, **config):
    """`hf` with a random LoRA adapter of rank r (A and B both random: PEFT's init_lora_weights=False;
    scaled down so logits stay in a sane range). Mutates and wraps hf."""
    from peft import LoraConfig, get_peft_model

    kw = dict(r=r, lora_alpha=2 * r, target_modules="all-linear", init_lora_weights=False)
    torch.manual_seed(seed)
    pm = get_peft_model(hf, LoraConfig(**{**kw, **config}))
    with torch.no_grad():
        for name, p in pm.named_parameters():
            if "lora_" in name:
                p.mul_(scale)
    return pm.eval()


def save_adapter(folder, hf, r: int, seed: int, **config):
    """Write a PEFT adapter of rank r for `hf` into folder; returns the PeftModel (the reference)."""
    pm = peft_model(hf, r, seed, **config)
    pm.save_pretrained(str(folder))
    return pm


def base_folder(folder, family: str = "qwen3", seed: int = 0):
    """A tiny base checkpoint with a tokenizer (tests/test_loader.py's), loadable by LLM(...)."""
    from tests.test_loader import tiny_hf_tokenizer, tiny_model

    tiny_model(family, seed=seed).save_pretrained(str(folder))
    tiny_hf_tokenizer().save_pretrained(str(folder))
    return str(folder)


def adapter_folders(tmp_factory, family: str = "qwen3", ranks=(8, 16, 8, 16)) -> list[tuple[str, object]]:
    """(folder, PeftModel) for one adapter per rank, each on a fresh copy of the base of base_folder."""
    from tests.test_loader import tiny_model

    out = []
    for i, r in enumerate(ranks):
        folder = tmp_factory.mktemp(f"adapter{i}")
        out.append((str(folder), save_adapter(folder, tiny_model(family), r, seed=100 + i)))
    return out


MODULES = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
           "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")  # fmt: skip


def random_adapter(folder, layout, rank: int, seed: int, scale: float = 0.05) -> str:
    """A random PEFT adapter (safetensors + config written directly) on every projection of every layer
    of the model behind `layout` (foveal.lora.adapter.LoRALayout): for models PEFT cannot wrap here."""
    import json
    import os

    from safetensors.torch import save_file

    layers = max(int(name.split(".")[-3]) for name in layout.targets) + 1
    g = torch.Generator().manual_seed(seed)
    tensors = {}
    for i in range(layers):
        for m in MODULES:
            name = f"model.layers.{i}.{m}"
            target, j = layout.route(name)
            rows = target.slices[j][1]
            tensors[f"base_model.model.{name}.lora_A.weight"] = torch.randn(
                rank, target.in_features, generator=g
            )
            tensors[f"base_model.model.{name}.lora_B.weight"] = torch.randn(rows, rank, generator=g) * scale
    os.makedirs(folder, exist_ok=True)
    save_file(tensors, os.path.join(folder, "adapter_model.safetensors"))
    with open(os.path.join(folder, "adapter_config.json"), "w") as f:
        json.dump({"peft_type": "LORA", "r": rank, "lora_alpha": rank, "target_modules": list(MODULES)}, f)
    return str(folder)
