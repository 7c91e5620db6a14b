"""Tiny random-weight models from the real transformers config classes, and a harness that drives our
model through the scheduler and paged KV cache without a tokenizer (for logits-level parity tests)."""

from __future__ import annotations

import torch

from foveal.attention import get_backend
from foveal.cache.kv_cache_manager import KVCacheManager
from foveal.config import SchedulerConfig
from foveal.models import build_model
from foveal.request import Request, SamplingParams
from foveal.sched.scheduler import Scheduler
from foveal.worker.model_runner import ModelRunner

COMMON = dict(
    vocab_size=256,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=512,
    rms_norm_eps=1e-6,
)


GEMMA3 = dict(  # 4 layers alternating sliding (window 8) and full attention, local/global rope
    num_hidden_layers=4,
    head_dim=16,
    query_pre_attn_scalar=24,
    sliding_window=8,
    layer_types=["sliding_attention", "full_attention", "sliding_attention", "full_attention"],
    rope_parameters={
        "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
        "full_attention": {"rope_type": "linear", "factor": 4.0, "rope_theta": 1000000.0},
    },
    pad_token_id=0,
    bos_token_id=1,
    eos_token_id=2,
)


def tiny_config(family: str, **overrides):
    """A tiny config of the family (for gemma3, `overrides` replace any value: the VLM test reuses it)."""
    import transformers as tf

    if family == "gemma3":
        return tf.Gemma3TextConfig(**{**COMMON, **GEMMA3, **overrides})
    if family == "gemma3_softcap":  # final logit softcapping and an untied head
        return tiny_config("gemma3", final_logit_softcapping=3.0, tie_word_embeddings=False)

    if family == "llama":
        return tf.LlamaConfig(**COMMON, tie_word_embeddings=False)
    if family == "llama3":  # llama3 rope scaling, tied embeddings, attention bias
        return tf.LlamaConfig(
            **COMMON,
            tie_word_embeddings=True,
            attention_bias=True,
            rope_parameters=dict(
                rope_type="llama3",
                rope_theta=500000.0,
                factor=8.0,
                low_freq_factor=1.0,
                high_freq_factor=4.0,
                original_max_position_embeddings=64,
            ),
        )
    if family == "mistral":
        return tf.MistralConfig(**COMMON, sliding_window=None, head_dim=32)
    if family == "qwen2":
        return tf.Qwen2Config(**COMMON, tie_word_embeddings=False)
    if family == "qwen3":
        return tf.Qwen3Config(**COMMON, head_dim=32, tie_word_embeddings=True)
    if family == "qwen3_moe":  # 8 experts, top 2 renormalized; layer 1 dense (mlp_only_layers)
        return tf.Qwen3MoeConfig(
            **COMMON, head_dim=32, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
            norm_topk_prob=True, mlp_only_layers=[1], tie_word_embeddings=False,
        )  # fmt: skip
    if family == "qwen3_moe_unnormed":  # top 3 of 6 not renormalized, every layer sparse, 3 layers
        return tf.Qwen3MoeConfig(
            **{**COMMON, "num_hidden_layers": 3}, head_dim=16, num_experts=6, num_experts_per_tok=3,
            moe_intermediate_size=48, norm_topk_prob=False, tie_word_embeddings=True,
        )  # fmt: skip
    if family == "gpt_oss":  # sliding (window 8) then full attention, sinks, YaRN, 4 experts of 32, top 2
        # YaRN over 16 x 32 = the 512 positions
        yarn = {"rope_type": "yarn", "rope_theta": 150000.0, "factor": 32.0, "beta_fast": 32.0,
                "beta_slow": 1.0, "truncate": False, "original_max_position_embeddings": 16}  # fmt: skip
        return tf.GptOssConfig(
            **{**COMMON, "intermediate_size": 32}, head_dim=16, sliding_window=8, num_local_experts=4,
            num_experts_per_tok=2, tie_word_embeddings=False, rope_parameters=yarn,
        )  # fmt: skip
    if family == "mixtral":  # 4 experts of 128, top 2
        return tf.MixtralConfig(**COMMON, num_local_experts=4, num_experts_per_tok=2, sliding_window=None)
    raise ValueError(family)


def tiny_llama_config_file(folder) -> str:
    """A tiny Llama config written as folder/tiny.json, for LLM(path, load_format="dummy"): random
    weights and the synthetic tokenizer (every id decodes to text, " t<id>")."""
    cfg = tiny_config("llama")
    cfg.architectures = ["LlamaForCausalLM"]
    path = folder / "tiny.json"
    path.write_text(cfg.to_json_string())
    return path


def tiny_hf_model(family: str, seed: int = 0, **config):
    """The family's tiny transformers model; `config`: values set on its config first."""
    import transformers as tf

    cfg = tiny_config(family)
    for key, value in config.items():
        setattr(cfg, key, value)
    torch.manual_seed(seed)
    model = tf.AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).eval()
    # random init leaves norms at 1 and biases at 0: perturb them so those paths are tested too
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight") or name.endswith(".bias"):
                p.add_(torch.randn_like(p) * 0.1)
            if name.endswith(("mlp.gate.weight", "mlp.router.weight")):  # a router: no ties in the top k
                p.normal_(0, 0.5)
            if name.endswith(("self_attn.sinks", "experts.gate_up_proj_bias", "experts.down_proj_bias")):
                p.normal_(0, 1.0)  # sinks, expert biases: initialized small or zero
    cfg.architectures = [type(model).__name__]
    return model


class Harness:
    """Our model + paged cache + scheduler, fed token ids directly."""

    def __init__(
        self,
        hf_model,
        *,
        num_blocks=64,
        block_size=4,
        budget=512,
        max_num_seqs=16,
        dtype=torch.float32,
        backend="torch",
        lora: tuple | None = None,
    ):
        cfg = hf_model.config
        backend = get_backend(backend, "cpu")
        self.model = build_model(
            cfg,
            backend,
            max_positions=cfg.max_position_embeddings,
            dtype=dtype,
            device="cpu",
            weights=hf_model.state_dict().items(),
        )
        layers, kvh, hd = self.model.kv_shape
        caches = [torch.zeros(2, num_blocks * block_size, kvh, hd, dtype=dtype) for _ in range(layers)]
        self.kv = KVCacheManager(num_blocks, block_size)
        slots = driver = None
        if lora is not None:  # (adapter slots, max rank[, fused: the CUDA path, in Triton's interpreter])
            from foveal.lora.driver import LoRADriver
            from foveal.lora.slots import LoRASlots

            slots = LoRASlots(self.model, lora[0], lora[1], dtype, "cpu", *lora[2:])
            driver = LoRADriver(lora[0])
        config = SchedulerConfig(budget, max_num_seqs)
        self.sched = Scheduler(config, self.kv, cfg.max_position_embeddings, lora=driver)
        self.runner = ModelRunner(self.model, caches, backend, block_size, "cpu", cfg.vocab_size, lora=slots)

    def use_backend(self, backend) -> None:
        """Swap the attention backend (same cache layout) between steps: in-process A/B runs."""
        self.runner.backend = backend
        for m in self.model.modules():
            if hasattr(m, "backend"):
                m.backend = backend

    def add(self, rid: str, ids: list[int], max_tokens: int = 32, lora=None) -> Request:
        req = Request(rid, list(ids), SamplingParams(temperature=0.0, max_tokens=max_tokens), lora=lora)
        self.sched.add(req)
        return req


def fp8_blocks(w: torch.Tensor, block: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(float8_e4m3fn weight, float32 scale_inv per block, the weight they give back): each block scaled
    to e4m3's 448 maximum."""
    br, bc = block
    rows, cols = w.shape
    nr, nc = -(-rows // br), -(-cols // bc)
    scale = torch.zeros(nr, nc)
    for i in range(nr):
        for j in range(nc):
            scale[i, j] = w[i * br : (i + 1) * br, j * bc : (j + 1) * bc].abs().max().clamp(min=1e-12) / 448
    full = scale.repeat_interleave(br, 0)[:rows].repeat_interleave(bc, 1)[:, :cols]
    q = (w / full).to(torch.float8_e4m3fn)
    return q, scale, q.float() * full
