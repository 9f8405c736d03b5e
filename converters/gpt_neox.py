"""GPT-NeoX / Pythia names: HF `gpt_neox.layers.{i}.attention.query_key_value` stores q, k and v per head, its output
dim laid out (heads, 3, head_dim); ours `layers.{i}.attention.qkv` is [q; k; v] ((3, heads, head_dim)), so the shard
spec's chunks give each rank whole heads of each. The Source's `regroup` reorders the rows both ways, bit exact.
The rest maps one to one; our `lm_head` is the checkpoint's `embed_out` (transformers >= 5 renames it `lm_head` in
memory, which NAME_ALIASES reads)."""
from __future__ import annotations

from colozoo.models.gpt_neox import GPTNeoXForCausalLM

from .llama import params
from .source import Source

CONVERTS = (GPTNeoXForCausalLM,)
HF_PREFIX = "gpt_neox."
# causal-mask and RoPE buffers that older checkpoints (the published Pythia ones) carry
IGNORED_HF = (r"\.attention\.bias$", r"\.attention\.masked_bias$", r"\.rotary_emb\.inv_freq$")
NAME_ALIASES = ((r"^embed_out\.", "lm_head."),)  # saved name -> transformers' in-memory name


def hf_sources(config) -> dict[str, Source]:
    g = HF_PREFIX
    out = {"embed_in.weight": Source.of(f"{g}embed_in.weight")}
    for i in range(config.num_hidden_layers):
        hf, ours = f"{g}layers.{i}.", f"layers.{i}."
        for p in params(config.attention_bias):
            out[f"{ours}attention.qkv.{p}"] = Source.of(f"{hf}attention.query_key_value.{p}",
                                                       regroup=(config.num_attention_heads, 3))
            out[f"{ours}attention.dense.{p}"] = Source.of(f"{hf}attention.dense.{p}")
        for p in ("weight", "bias"):
            for module in ("input_layernorm", "post_attention_layernorm", "mlp.dense_h_to_4h", "mlp.dense_4h_to_h"):
                out[f"{ours}{module}.{p}"] = Source.of(f"{hf}{module}.{p}")
    out["final_layer_norm.weight"] = Source.of(f"{g}final_layer_norm.weight")
    out["final_layer_norm.bias"] = Source.of(f"{g}final_layer_norm.bias")
    if not config.tie_word_embeddings:
        out["lm_head.weight"] = Source.of("embed_out.weight")
    return out
