"""Where LoRA goes in a model (`LoRALayout`) and one adapter's weights in host memory (`HostAdapter`).

The layout lists the model's LoRA-capable linears: every decoder layer's qkv_proj, o_proj, gate_up_proj
and down_proj (of the language model, for a VLM), never embeddings, the LM head or a vision tower.
A fused linear has slices, one per HF module it fuses (q, k, v; gate, up), each a row range:

    qkv_proj   [q | k | v]     slices ((0, q), (q, kv), (q + kv, kv))
    o_proj     [o]             slices ((0, hidden),)

An adapter tensor names an HF module (`model.layers.3.self_attn.k_proj`); the layout routes that name
through the model's own checkpoint routing (`model.load_weight`, with a recorder in place of the
filler), so every family's renames and VLM prefixes apply unchanged, and gets (linear, slice).

A `HostAdapter` holds, per linear, the pieces (slice, A [r, in], s * B [rows, r]) in the model dtype
(scaling folded into B in fp32, as vLLM does), pinned when the model is on a GPU. It is plain data:
requests carry it to the runner, which copies it into a device slot (foveal/lora/slots.py), so the
model thread never reads an adapter from disk. `uid` is unique per load, never reused: the prefix
cache keys on it, so an adapter reloaded under the same name never meets the old one's K/V.
"""

from __future__ import annotations

import itertools
import os
import re
from dataclasses import dataclass, field

import torch

from foveal.lora.peft import WEIGHTS_FILE, AdapterConfig, AdapterError, module_name

# our fused linears per decoder layer, and how their rows split into the HF modules they fuse
_TARGET = re.compile(r"(^|\.)layers\.\d+\.(self_attn\.(qkv_proj|o_proj)|mlp\.(gate_up_proj|down_proj))$")
_uids = itertools.count(1)


@dataclass(frozen=True, slots=True)
class Target:
    name: str  # the linear's module name in the model
    in_features: int
    out_features: int
    slices: tuple[tuple[int, int], ...]  # (row offset, rows) of each fused HF module, in row order


class _Recorder:
    """Stands in for a ParamFiller: remembers where the model would put a tensor."""

    def __init__(self):
        self.put_at: tuple[str, int, int | None] | None = None

    def put(self, target, tensor, source, offset=0, rows=None):
        self.put_at = (target, offset, rows)


class LoRALayout:
    def __init__(self, model):
        from foveal.layers.linear import Linear

        self.model = model
        self.targets: dict[str, Target] = {}
        for name, mod in model.named_modules():
            if isinstance(mod, Linear) and _TARGET.search(name):
                parent = model.get_submodule(name.rpartition(".")[0])
                out = mod.out_features
                if name.endswith("qkv_proj"):
                    q, kv = parent.q_size, parent.kv_size
                    slices = ((0, q), (q, kv), (q + kv, kv))
                elif name.endswith("gate_up_proj"):
                    slices = ((0, out // 2), (out // 2, out // 2))
                else:
                    slices = ((0, out),)
                self.targets[name] = Target(name, mod.in_features, out, slices)
        if not self.targets:
            raise ValueError(f"{type(model).__name__} has no linears LoRA can target")

    def route(self, module: str) -> tuple[Target, int]:
        """An adapter's HF module name -> (our linear, slice index); AdapterError if it has no place."""
        rec = _Recorder()
        try:
            self.model.load_weight(rec, module + ".weight", None)
        except (ValueError, KeyError, AttributeError):
            rec.put_at = None
        if rec.put_at is not None:
            target, offset, rows = rec.put_at
            t = self.targets.get(target.removesuffix(".weight"))
            if t is not None:
                for j, (off, n) in enumerate(t.slices):
                    if off == offset and (rows is None or rows == n):
                        return t, j
        raise AdapterError(
            f"LoRA on module {module!r} is not supported: adapters may target the decoder layers' q/k/v/o "
            "and gate/up/down projections"
        )


@dataclass(eq=False)
class HostAdapter:
    name: str
    path: str
    uid: int
    rank: int  # the largest rank of any module
    # linear name -> [(slice index, A [r, in], scaled B [rows, r])]
    weights: dict[str, list[tuple[int, torch.Tensor, torch.Tensor]]] = field(default_factory=dict)

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes + b.nbytes for pieces in self.weights.values() for _, a, b in pieces)


def load_adapter(
    name: str, folder: str, layout: LoRALayout, dtype: torch.dtype, max_rank: int, pin: bool = False
) -> HostAdapter:
    """Read and check a PEFT adapter folder against the model (AdapterError says what does not fit)."""
    from safetensors import safe_open

    config = AdapterConfig.read(folder)
    path = os.path.join(folder, WEIGHTS_FILE)
    if not os.path.isfile(path):
        raise AdapterError(f"{folder} has no {WEIGHTS_FILE} (only safetensors adapters are loaded)")
    pairs: dict[str, dict[str, torch.Tensor]] = {}
    try:
        with safe_open(path, framework="pt") as f:
            for key in f.keys():
                module, which = module_name(key)
                pairs.setdefault(module, {})[which] = f.get_tensor(key)
    except AdapterError:
        raise
    except Exception as e:  # a truncated or foreign file
        raise AdapterError(f"cannot read {path}: {type(e).__name__}: {e}") from None
    if not pairs:
        raise AdapterError(f"{path} holds no LoRA weights")
    adapter = HostAdapter(name, folder, next(_uids), 0)
    taken: set[tuple[str, int]] = set()
    for module, ab in pairs.items():
        if set(ab) != {"A", "B"}:
            raise AdapterError(f"{path}: module {module!r} has lora_{set('AB') - set(ab)} missing")
        a, b = ab["A"], ab["B"]
        target, j = layout.route(module)
        rows = target.slices[j][1]
        r = a.shape[0]
        if a.dim() != 2 or b.dim() != 2 or a.shape[1] != target.in_features or b.shape != (rows, r):
            raise AdapterError(
                f"{path}: {module}: lora_A {tuple(a.shape)} / lora_B {tuple(b.shape)} do not fit the model's "
                f"[{rows} x {target.in_features}] projection (is the adapter for another base model?)"
            )
        if r > max_rank:
            raise AdapterError(f"{path}: {module} has rank {r}, above --max-lora-rank {max_rank}")
        if (target.name, j) in taken:
            raise AdapterError(f"{path}: two tensors target {module!r}")
        taken.add((target.name, j))
        scaled = (b.float() * config.scaling(module, r)).to(dtype)
        a = a.to(dtype)
        if pin:
            a, scaled = a.pin_memory(), scaled.pin_memory()
        adapter.weights.setdefault(target.name, []).append((j, a.contiguous(), scaled.contiguous()))
        adapter.rank = max(adapter.rank, r)
    return adapter
