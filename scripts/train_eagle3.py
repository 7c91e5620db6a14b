"""Train a small EAGLE-3 head for the embedded SmolLM2-135M-Instruct on its own greedy generations (CPU,
minutes), written in the published layout that `--speculative-config '{"method": "eagle3", ...}'` loads.

    python scripts/train_eagle3.py --out /tmp/smollm2-eagle3      # then (k = the trained depth, 3):
    python benchmarks/speculative.py --cpu --modes none,eagle3,eagle3_fixed --eagle3 /tmp/smollm2-eagle3 \
        --k 3 --prompts heldout --batches 1,16 [--quantization gguf]

1. prompts: instruction templates x topics (train and held-out topics apart); Foveal generates each
   answer greedily (the target's own continuations: what the head must predict).
2. transformers' reference model (the GGUF dequantized, fp32) gives the hidden states entering the
   target layers the head reads (EAGLE-3's default 2, L / 2, L - 3).
3. The head (foveal/speculative/eagle3.py's math in plain torch: fc over the three states, one decoder layer
   over [embedding, hidden], norm, a draft-vocabulary LM head) is trained with EAGLE-3's training-time
   test: step s at position i reads the head's own output of step s - 1 at i - 1 as its hidden state and
   sees the step-1 keys up to i - s + 1 plus its chain's keys (step m at i - s + m), as a chain of
   drafts sees them at inference; the loss is every step's next-next-token cross-entropy.
4. Init: the LM head from the target's (tied) embedding rows of the draft vocabulary, the final norm
   from the target's; the draft vocabulary is the most frequent tokens of the generations (d2t / t2d).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import time
from collections import Counter

import torch
import torch.nn.functional as F
from torch import nn

TEMPLATES = [
    "Explain {} to a ten-year-old in a short paragraph.",
    "Write three bullet points about {}.",
    "What are the main advantages and disadvantages of {}?",
    "Write a short story that involves {}.",
    "Give me a step-by-step guide related to {}.",
    "Summarize the history of {} in a few sentences.",
    "Write a haiku and then a short explanation about {}.",
    "What questions should a beginner ask about {}?",
]
TOPICS = [
    "volcanoes", "the moon", "photosynthesis", "bicycles", "coffee", "the internet", "honeybees",
    "rainbows", "chess", "the ocean", "electric cars", "pyramids", "recycling", "the human heart",
    "music theory", "gardening", "earthquakes", "dinosaurs", "solar panels", "the stock market",
    "cooking pasta", "learning a language", "sleep", "clouds", "airplanes", "vaccines", "glaciers",
    "video games", "libraries", "friendship", "money", "the Roman Empire", "computers", "penguins",
    "mountains", "exercise", "tea", "robots", "weather forecasts", "bridges", "deserts", "fireworks",
    "the printing press", "public speaking", "cats", "trains", "water", "maps", "time zones", "soap",
    # held out (never trained on)
    "lighthouses", "octopuses", "wind turbines", "bread baking", "the Olympic Games", "telescopes",
    "coral reefs", "origami", "submarines", "vitamins",
]  # fmt: skip
HELD_OUT = 10  # the last topics


def prompts(held_out: bool) -> list[str]:
    topics = TOPICS[-HELD_OUT:] if held_out else TOPICS[:-HELD_OUT]
    return [t.format(topic) for topic in topics for t in TEMPLATES]


def generate(texts: list[str], max_tokens: int) -> list[list[int]]:
    """Prompt + greedy answer token ids from Foveal on the embedded model."""
    from foveal import SamplingParams
    from foveal.engine.llm import LLM

    llm = LLM(dtype="float32", kv_cache_memory=1 << 30, max_num_seqs=32)
    chats = [llm.processor.apply_chat_template([{"role": "user", "content": t}]) for t in texts]
    outs = llm.generate(chats, SamplingParams(temperature=0, max_tokens=max_tokens))
    return [list(o.prompt_token_ids) + list(o.outputs[0].token_ids) for o in outs]


def rotate(x, cos, sin):
    from transformers.models.llama.modeling_llama import rotate_half

    return x * cos + rotate_half(x) * sin


class Head(nn.Module):
    """EAGLE-3's draft layer (the math of foveal/speculative/eagle3.py), trainable, over one sequence."""

    def __init__(self, cfg, draft_vocab: int, embed: torch.Tensor, final_norm: torch.Tensor, dv_ids):
        super().__init__()
        H, inter = cfg.hidden_size, cfg.intermediate_size
        self.nh, self.nkv, self.hd = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        self.eps = cfg.rms_norm_eps
        self.register_buffer("embed", embed, persistent=False)
        self.fc = nn.Linear(3 * H, H, bias=False)
        self.input_layernorm = nn.Parameter(torch.ones(H))
        self.hidden_norm = nn.Parameter(torch.ones(H))
        self.post_attention_layernorm = nn.Parameter(torch.ones(H))
        self.q_proj = nn.Linear(2 * H, self.nh * self.hd, bias=False)
        self.k_proj = nn.Linear(2 * H, self.nkv * self.hd, bias=False)
        self.v_proj = nn.Linear(2 * H, self.nkv * self.hd, bias=False)
        self.o_proj = nn.Linear(self.nh * self.hd, H, bias=False)
        self.gate_proj = nn.Linear(H, inter, bias=False)
        self.up_proj = nn.Linear(H, inter, bias=False)
        self.down_proj = nn.Linear(inter, H, bias=False)
        self.norm = nn.Parameter(final_norm.clone())
        self.lm_head = nn.Linear(H, draft_vocab, bias=False)
        for m in (self.fc, self.q_proj, self.k_proj, self.v_proj, self.o_proj, self.gate_proj,
                  self.up_proj, self.down_proj):  # fmt: skip
            nn.init.normal_(m.weight, std=0.02)
        with torch.no_grad():
            self.lm_head.weight.copy_(embed[dv_ids])
        rope = getattr(cfg, "rope_parameters", None) or {}
        self.theta = float(rope.get("rope_theta") or getattr(cfg, "rope_theta", 10000.0))
        self.inv_freq = 1.0 / self.theta ** (torch.arange(0, self.hd, 2, dtype=torch.float32) / self.hd)

    def rms(self, x, w):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * w

    def forward(self, aux: torch.Tensor, ids: torch.Tensor, depth: int) -> list[tuple[torch.Tensor, int]]:
        """Per step s = 1 .. depth: (logits [N, draft vocab], the first position whose are valid: s - 1).
        aux [T, 3H] the target's states, ids [T]; pair i = (state i, token i + 1) predicts token i + 2
        (N = T - 1 pairs; the last one's target is past the sequence)."""
        N = ids.shape[0] - 1
        e = self.rms(self.embed[ids[1 : N + 1]], self.input_layernorm)  # [N, H]
        ang = torch.arange(N, dtype=torch.float32)[:, None] * self.inv_freq[None]
        cos, sin = torch.cat([ang.cos()] * 2, -1)[:, None], torch.cat([ang.sin()] * 2, -1)[:, None]
        h = self.fc(aux[:N])
        keys, vals, outs = [], [], []
        rep = self.nh // self.nkv
        for s in range(1, depth + 1):
            x = torch.cat([e, self.rms(h, self.hidden_norm)], -1)
            q = rotate(self.q_proj(x).view(N, self.nh, self.hd), cos, sin)
            k = rotate(self.k_proj(x).view(N, self.nkv, self.hd), cos, sin).repeat_interleave(rep, 1)
            v = self.v_proj(x).view(N, self.nkv, self.hd).repeat_interleave(rep, 1)
            keys.append(k)
            vals.append(v)
            scale = 1 / math.sqrt(self.hd)
            # step-1 keys at p <= i - s + 1
            sc = torch.einsum("ihd,phd->hip", q, keys[0]) * scale
            i = torch.arange(N)
            sc = sc.masked_fill(i[None, :, None] - s + 1 < i[None, None, :], float("-inf"))
            diag = []  # the chain's own keys: step m at i - s + m (m = 2 .. s)
            for m in range(2, s + 1):
                shift = s - m
                km = torch.roll(keys[m - 1], shift, 0)
                d = (q * km).sum(-1).T * scale  # [heads, N]
                diag.append(d.masked_fill(i[None] < shift, float("-inf")))
            allsc = torch.cat([sc] + [d[..., None] for d in diag], -1)
            p = torch.softmax(allsc, -1).nan_to_num(0.0)
            a = torch.einsum("hip,phd->ihd", p[..., :N], vals[0])
            for m in range(2, s + 1):
                a = a + p[..., N + m - 2].T[..., None] * torch.roll(vals[m - 1], s - m, 0)
            r = self.o_proj(a.reshape(N, -1)) + h
            y = self.rms(r, self.post_attention_layernorm)
            o = self.down_proj(F.silu(self.gate_proj(y)) * self.up_proj(y)) + r
            outs.append((self.lm_head(self.rms(o, self.norm)), s - 1))
            h = torch.roll(o, 1, 0)  # step s + 1 at position i reads this step's output at i - 1
        return outs

    @torch.no_grad()
    def load_tensors(self, tensors: dict[str, torch.Tensor]) -> None:
        """The published layout's tensors (as `tensors` names them; d2t / t2d are not the head's)."""
        mine = self._named()
        for name, value in tensors.items():
            if name in mine:
                mine[name].copy_(value)

    def tensors(self) -> dict[str, torch.Tensor]:
        """The published layout's names (midlayer.*)."""
        return {k: v.detach().contiguous() for k, v in self._named().items()}

    def _named(self) -> dict[str, torch.Tensor]:
        t = {"fc.weight": self.fc.weight, "norm.weight": self.norm, "lm_head.weight": self.lm_head.weight,
             "midlayer.input_layernorm.weight": self.input_layernorm,
             "midlayer.hidden_norm.weight": self.hidden_norm,
             "midlayer.post_attention_layernorm.weight": self.post_attention_layernorm}  # fmt: skip
        for n in ("q_proj", "k_proj", "v_proj", "o_proj"):
            t[f"midlayer.self_attn.{n}.weight"] = getattr(self, n).weight
        for n in ("gate_proj", "up_proj", "down_proj"):
            t[f"midlayer.mlp.{n}.weight"] = getattr(self, n).weight
        return t


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="/tmp/smollm2-eagle3")
    ap.add_argument("--gen-tokens", type=int, default=192)
    ap.add_argument("--draft-vocab", type=int, default=8192)
    ap.add_argument("--depth", type=int, default=3, help="training-time test steps")
    ap.add_argument("--epochs", type=int, default=4)
    ap.add_argument("--lr", type=float, default=2e-3)
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args()
    torch.manual_seed(a.seed)
    random.seed(a.seed)
    torch.set_num_threads(os.cpu_count() or 1)
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM

    from foveal.loader.default_model import default_model_path

    t0 = time.perf_counter()
    seqs = generate(prompts(held_out=False), a.gen_tokens)
    took = time.perf_counter() - t0
    print(f"generated {len(seqs)} sequences, {sum(map(len, seqs))} tokens in {took:.0f} s", flush=True)

    d, f = os.path.split(default_model_path())
    target = AutoModelForCausalLM.from_pretrained(d, gguf_file=f, dtype=torch.float32).eval()
    cfg = target.config
    L = cfg.num_hidden_layers
    layers = (2, L // 2, L - 3)  # EAGLE-3's default: the states entering these layers
    t0 = time.perf_counter()
    data = []
    with torch.no_grad():  # (not inference mode: these tensors enter the training graph as inputs)
        for ids in seqs:
            x = torch.tensor(ids)
            hs = target(x[None], output_hidden_states=True).hidden_states
            data.append((torch.cat([hs[i][0] for i in layers], -1), x))
    print(f"target states in {time.perf_counter() - t0:.0f} s")

    counts = Counter(t for ids in seqs for t in ids[2:])
    dv_ids = torch.tensor(sorted(t for t, _ in counts.most_common(a.draft_vocab)))
    if len(dv_ids) < a.draft_vocab:  # pad with unused ids (they never win after training)
        used = set(dv_ids.tolist())
        rest = [t for t in range(cfg.vocab_size) if t not in used]
        dv_ids = torch.tensor(sorted(dv_ids.tolist() + rest[: a.draft_vocab - len(dv_ids)]))
    t2d = torch.full((cfg.vocab_size,), -1, dtype=torch.long)
    t2d[dv_ids] = torch.arange(len(dv_ids))
    embed = target.model.embed_tokens.weight.detach().clone()
    head = Head(cfg, a.draft_vocab, embed, target.model.norm.weight.detach(), dv_ids)
    opt = torch.optim.AdamW([p for p in head.parameters() if p.requires_grad], lr=a.lr, weight_decay=0.0)
    total = a.epochs * len(data)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda n: min(1.0, (n + 1) / 50) * 0.5 * (1 + math.cos(math.pi * min(n / total, 1.0)))
    )
    t0 = time.perf_counter()
    for epoch in range(a.epochs):
        random.shuffle(data)
        seen = Counter()
        for aux, ids in data:
            outs = head(aux, ids, a.depth)
            loss = 0.0
            for s, (logits, lo) in enumerate(outs):
                tgt, logits = t2d[ids[2 + lo :]], logits[lo:-1]
                loss = loss + 0.8**s * F.cross_entropy(logits, tgt, ignore_index=-1)
                with torch.no_grad():
                    ok = tgt >= 0
                    seen[f"acc{s + 1}"] += int((logits.argmax(-1) == tgt)[ok].sum())
                    seen[f"n{s + 1}"] += int(ok.sum())
            opt.zero_grad()
            loss.backward()
            torch.nn.utils.clip_grad_norm_(head.parameters(), 1.0)
            opt.step()
            sched.step()
            seen["loss"] += loss.item()
        steps = range(1, a.depth + 1)
        accs = " ".join(f"step{s} {seen[f'acc{s}'] / max(seen[f'n{s}'], 1):.3f}" for s in steps)
        print(f"epoch {epoch}: loss {seen['loss'] / len(data):.3f}, top-1 ({accs}), "
              f"{time.perf_counter() - t0:.0f} s", flush=True)  # fmt: skip

    os.makedirs(a.out, exist_ok=True)
    tensors = head.tensors()
    tensors["d2t"] = dv_ids - torch.arange(len(dv_ids))
    tensors["t2d"] = t2d >= 0
    save_file(tensors, os.path.join(a.out, "model.safetensors"))
    hc = {
        "architectures": ["LlamaForCausalLMEagle3"], "model_type": "llama",
        "hidden_size": cfg.hidden_size, "intermediate_size": cfg.intermediate_size,
        "num_attention_heads": cfg.num_attention_heads, "num_key_value_heads": cfg.num_key_value_heads,
        "head_dim": cfg.head_dim, "num_hidden_layers": 1, "rms_norm_eps": cfg.rms_norm_eps,
        "vocab_size": cfg.vocab_size, "draft_vocab_size": a.draft_vocab,
        "max_position_embeddings": cfg.max_position_embeddings, "rope_theta": head.theta,
        "eagle_aux_hidden_state_layer_ids": list(layers), "target_hidden_size": cfg.hidden_size,
    }  # fmt: skip
    with open(os.path.join(a.out, "config.json"), "w") as fh:
        json.dump(hc, fh, indent=1)
    print(json.dumps({"out": a.out, "sequences": len(seqs), "draft_vocab": a.draft_vocab, "depth": a.depth,
                      "epochs": a.epochs, "layers": list(layers)}))  # fmt: skip


if __name__ == "__main__":
    main()
