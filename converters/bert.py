"""BERT names: HF `[bert.]encoder.layer.{i}.attention.self.{query,key,value}` (separate) <-> our fused
`layers.{i}.self_attn.qkv`, and the rest of a layer one to one onto our TransformerLayer (LAYER_PARTS); the other
names follow the HF class in config.architectures (BertModel has no `bert.` prefix, BertForMaskedLM adds
`cls.predictions.*`, BertForSequenceClassification adds `classifier.*`)."""
from __future__ import annotations

from colozoo.models.bert import BertModel

from .source import Source

CONVERTS = (BertModel,)
HF_PREFIX = "bert."
# buffers of old checkpoints, the pre-training NSP head and pooler a masked-LM model drops, and the decoder's
# copies of the tied word embedding and bias
IGNORED_HF = (r"embeddings\.position_ids$", r"^cls\.seq_relationship\.", r"(^|\.)pooler\.dense\.",
              r"^cls\.predictions\.decoder\.(weight|bias)$", r"^cls\.predictions\.bias$")

LAYER_PARTS = {"self_attn.out_proj": "attention.output.dense", "self_attn_layer_norm": "attention.output.LayerNorm",
               "fc1": "intermediate.dense", "fc2": "output.dense", "final_layer_norm": "output.LayerNorm"}


def architecture(config, default: str = "BertModel") -> str:
    return (getattr(config, "architectures", None) or [default])[0]


def layer_sources(hf: str, ours: str, qkv: str, parts: dict[str, str], qkv_bias: bool = True) -> dict[str, Source]:
    """One encoder layer (BERT, ViT): HF `{hf}{qkv}.{query,key,value}` fused into our `{ours}self_attn.qkv`, and
    `parts` (our name -> HF name) one to one."""
    out = {}
    for p in ("weight", "bias"):
        if p == "weight" or qkv_bias:
            out[f"{ours}self_attn.qkv.{p}"] = Source.of(*(f"{hf}{qkv}.{x}.{p}" for x in ("query", "key", "value")))
        for name, hf_name in parts.items():
            out[f"{ours}{name}.{p}"] = Source.of(f"{hf}{hf_name}.{p}")
    return out


def hf_sources(config) -> dict[str, Source]:
    arch = architecture(config)
    b = "" if arch == "BertModel" else HF_PREFIX
    out = {}
    for name in ("word_embeddings", "position_embeddings", "token_type_embeddings"):
        out[f"embeddings.{name}.weight"] = Source.of(f"{b}embeddings.{name}.weight")
    for p in ("weight", "bias"):
        out[f"embeddings.LayerNorm.{p}"] = Source.of(f"{b}embeddings.LayerNorm.{p}")
    for i in range(config.num_hidden_layers):
        out.update(layer_sources(f"{b}encoder.layer.{i}.", f"layers.{i}.", "attention.self", LAYER_PARTS))
    if arch in ("BertModel", "BertForSequenceClassification"):
        for p in ("weight", "bias"):
            out[f"pooler.dense.{p}"] = Source.of(f"{b}pooler.dense.{p}")
    if arch == "BertForSequenceClassification":
        for p in ("weight", "bias"):
            out[f"classifier.{p}"] = Source.of(f"classifier.{p}")
    if arch == "BertForMaskedLM":
        for p in ("weight", "bias"):
            out[f"transform.{p}"] = Source.of(f"cls.predictions.transform.dense.{p}")
            out[f"transform_norm.{p}"] = Source.of(f"cls.predictions.transform.LayerNorm.{p}")
        if config.tie_word_embeddings:  # transformers ties decoder.bias to predictions.bias only then
            out["lm_head.bias"] = Source.of("cls.predictions.bias")
        else:  # predictions.bias is then an unused parameter (matched by IGNORED_HF)
            out["lm_head.weight"] = Source.of("cls.predictions.decoder.weight")
            out["lm_head.bias"] = Source.of("cls.predictions.decoder.bias")
    return out
