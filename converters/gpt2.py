"""GPT-2 names: HF `transformer.h.{i}.attn.c_attn` (Conv1D, stored (in, out)) <-> our `layers.{i}.attn.c_attn` (out, in)."""
from __future__ import annotations

from colozoo.models.gpt2 import GPT2ForCausalLM

from .source import Source

CONVERTS = (GPT2ForCausalLM,)
HF_PREFIX = "transformer."
IGNORED_HF = (r"\.attn\.bias$", r"\.attn\.masked_bias$")  # causal-mask buffers in old checkpoints


def hf_sources(config) -> dict[str, Source]:
    t = HF_PREFIX
    out = {"wte.weight": Source.of(f"{t}wte.weight"), "wpe.weight": Source.of(f"{t}wpe.weight")}
    for i in range(config.num_hidden_layers):
        hf, ours = f"{t}h.{i}.", f"layers.{i}."
        for norm in ("ln_1", "ln_2"):
            out[f"{ours}{norm}.weight"] = Source.of(f"{hf}{norm}.weight")
            out[f"{ours}{norm}.bias"] = Source.of(f"{hf}{norm}.bias")
        for linear in ("attn.c_attn", "attn.c_proj", "mlp.c_fc", "mlp.c_proj"):
            out[f"{ours}{linear}.weight"] = Source.of(f"{hf}{linear}.weight", transpose=True)
            out[f"{ours}{linear}.bias"] = Source.of(f"{hf}{linear}.bias")
    out["ln_f.weight"] = Source.of(f"{t}ln_f.weight")
    out["ln_f.bias"] = Source.of(f"{t}ln_f.bias")
    if not config.tie_word_embeddings:
        out["lm_head.weight"] = Source.of("lm_head.weight")
    return out
