"""ViT names (transformers >= 5 layout): HF `[vit.]layers.{i}.attention.{q,k,v}_proj` (separate) <-> our fused
`layers.{i}.qkv`; ViTModel has no `vit.` prefix and a pooler, ViTForImageClassification adds `classifier.*`."""
from __future__ import annotations

from .sources import Source

HF_PREFIX = "vit."
IGNORED_HF = (r"(^|\.)pooler\.dense\.",)  # an image classifier drops the base model's pooler

LAYER_PARTS = {"o_proj": "attention.o_proj", "layernorm_before": "layernorm_before",
               "layernorm_after": "layernorm_after", "fc1": "mlp.fc1", "fc2": "mlp.fc2"}


def architecture(config) -> str:
    return (getattr(config, "architectures", None) or ["ViTModel"])[0]


def hf_sources(config) -> dict[str, Source]:
    arch = architecture(config)
    v = "" if arch == "ViTModel" else HF_PREFIX
    out = {"embeddings.cls_token": Source.of(f"{v}embeddings.cls_token"),
           "embeddings.position_embeddings": Source.of(f"{v}embeddings.position_embeddings")}
    for p in ("weight", "bias"):
        out[f"embeddings.projection.{p}"] = Source.of(f"{v}embeddings.patch_embeddings.projection.{p}")
        out[f"layernorm.{p}"] = Source.of(f"{v}layernorm.{p}")
    for i in range(config.num_hidden_layers):
        hf, ours = f"{v}layers.{i}.", f"layers.{i}."
        for p in ("weight", "bias") if config.qkv_bias else ("weight",):
            out[f"{ours}qkv.{p}"] = Source.of(*(f"{hf}attention.{x}_proj.{p}" for x in "qkv"))
        for p in ("weight", "bias"):
            for name, hf_name in LAYER_PARTS.items():
                out[f"{ours}{name}.{p}"] = Source.of(f"{hf}{hf_name}.{p}")
    if arch == "ViTModel":
        for p in ("weight", "bias"):
            out[f"pooler.dense.{p}"] = Source.of(f"pooler.dense.{p}")
    else:
        for p in ("weight", "bias"):
            out[f"classifier.{p}"] = Source.of(f"classifier.{p}")
    return out
