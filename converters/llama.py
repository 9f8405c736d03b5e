"""LLaMA / Mistral names: HF `model.layers.{i}.self_attn.{q,k,v}_proj` and `mlp.{gate,up}_proj` (separate) <-> our
fused `layers.{i}.self_attn.qkv` and `layers.{i}.mlp.gate_up` (concatenated along the output dim; the shard spec's
chunks cut each part separately, so grouped-query attention keeps whole kv heads per rank)."""
from __future__ import annotations

from colozoo.models.llama import LlamaForCausalLM, MistralForCausalLM
from colozoo.models.smollm3 import SmolLM3ForCausalLM

from .source import Source

CONVERTS = (LlamaForCausalLM, MistralForCausalLM, SmolLM3ForCausalLM)
HF_PREFIX = "model."
IGNORED_HF = (r"\.rotary_emb\.inv_freq$",)  # a buffer some old checkpoints carry


def hf_sources(config) -> dict[str, Source]:
    out = attention_and_norms(config)
    for i in range(config.num_hidden_layers):
        out.update(dense_mlp(f"{HF_PREFIX}layers.{i}.mlp.", f"layers.{i}.mlp.", getattr(config, "mlp_bias", False)))
    return out


QK_NORMS = ("self_attn.q_norm", "self_attn.k_norm")  # Qwen3's and Gemma 3's per-head norms


def per_layer(config, *names: str) -> dict[str, Source]:
    """Weights every layer holds under the same name in HF and ours (`layers.{i}.{name}.weight`): extra norms."""
    return {f"layers.{i}.{name}.weight": Source.of(f"{HF_PREFIX}layers.{i}.{name}.weight")
            for i in range(config.num_hidden_layers) for name in names}


def params(bias: bool) -> tuple[str, ...]:
    return ("weight", "bias") if bias else ("weight",)


def attention_and_norms(config, qkv_bias: bool | None = None, out_bias: bool | None = None,
                        fused_qkv: bool = False) -> dict[str, Source]:
    """Embeddings, final norm, LM head and every layer's attention and norms: what the families on this decoder
    share (the biases default to config.attention_bias, as in models.llama.LlamaAttention). `fused_qkv`: the
    checkpoint stores q/k/v as one `qkv_proj` in our [q; k; v] layout (Phi-3)."""
    m, bias = HF_PREFIX, getattr(config, "attention_bias", False)
    out = {"embed_tokens.weight": Source.of(f"{m}embed_tokens.weight"), "norm.weight": Source.of(f"{m}norm.weight")}
    for i in range(config.num_hidden_layers):
        hf, ours = f"{m}layers.{i}.", f"layers.{i}."
        for p in params(bias if qkv_bias is None else qkv_bias):
            parts = ("qkv",) if fused_qkv else tuple("qkv")
            out[f"{ours}self_attn.qkv.{p}"] = Source.of(*(f"{hf}self_attn.{x}_proj.{p}" for x in parts))
        for p in params(bias if out_bias is None else out_bias):
            out[f"{ours}self_attn.o_proj.{p}"] = Source.of(f"{hf}self_attn.o_proj.{p}")
        for norm in ("input_layernorm", "post_attention_layernorm"):
            out[f"{ours}{norm}.weight"] = Source.of(f"{hf}{norm}.weight")
    if not config.tie_word_embeddings:
        out["lm_head.weight"] = Source.of("lm_head.weight")
    return out


def dense_mlp(hf: str, ours: str, bias: bool = False, fused: bool = False) -> dict[str, Source]:
    """A SwiGLU MLP: HF `{hf}{gate,up}_proj` fused into our `{ours}gate_up` (or already fused as `{hf}gate_up_proj`),
    `{hf}down_proj` one to one."""
    out = {}
    for p in params(bias):
        gate_up = (f"{hf}gate_up_proj.{p}",) if fused else (f"{hf}gate_proj.{p}", f"{hf}up_proj.{p}")
        out[f"{ours}gate_up.{p}"] = Source.of(*gate_up)
        out[f"{ours}down_proj.{p}"] = Source.of(f"{hf}down_proj.{p}")
    return out
