"""ViT names as transformers saves them (and as the published checkpoints have them):
`[vit.]encoder.layer.{i}.attention.attention.{query,key,value}` (separate) <-> our fused `layers.{i}.self_attn.qkv`,
the rest of a layer one to one onto our TransformerLayer (LAYER_PARTS).
ViTModel has no `vit.` prefix and a pooler; ViTForImageClassification adds `classifier.*`. transformers >= 5
renames them in memory (`vit.layers.{i}.attention.q_proj`, ...); NAME_ALIASES reads state dicts in that form."""
from __future__ import annotations

from colozoo.models.vit import ViTModel

from .bert import architecture, layer_sources
from .source import Source

CONVERTS = (ViTModel,)
HF_PREFIX = "vit."
IGNORED_HF = (r"(^|\.)pooler\.dense\.",)  # an image classifier drops the base model's pooler

# saved names -> transformers' in-memory names (order matters: attention.output before output)
NAME_ALIASES = ((r"(^|\.)encoder\.layer\.(\d+)\.", r"\1layers.\2."),
                (r"\.attention\.attention\.query\.", ".attention.q_proj."),
                (r"\.attention\.attention\.key\.", ".attention.k_proj."),
                (r"\.attention\.attention\.value\.", ".attention.v_proj."),
                (r"\.attention\.output\.dense\.", ".attention.o_proj."),
                (r"\.intermediate\.dense\.", ".mlp.fc1."), (r"\.output\.dense\.", ".mlp.fc2."))

LAYER_PARTS = {"self_attn.out_proj": "attention.output.dense", "self_attn_layer_norm": "layernorm_before",
               "final_layer_norm": "layernorm_after", "fc1": "intermediate.dense", "fc2": "output.dense"}


def hf_sources(config) -> dict[str, Source]:
    arch = architecture(config, "ViTModel")
    v = "" if arch == "ViTModel" else HF_PREFIX
    out = {"embeddings.cls_token": Source.of(f"{v}embeddings.cls_token"),
           "embeddings.position_embeddings": Source.of(f"{v}embeddings.position_embeddings")}
    for p in ("weight", "bias"):
        out[f"embeddings.projection.{p}"] = Source.of(f"{v}embeddings.patch_embeddings.projection.{p}")
        out[f"layernorm.{p}"] = Source.of(f"{v}layernorm.{p}")
    for i in range(config.num_hidden_layers):
        out.update(layer_sources(f"{v}encoder.layer.{i}.", f"layers.{i}.", "attention.attention", LAYER_PARTS,
                                 qkv_bias=config.qkv_bias))
    if arch == "ViTModel":
        for p in ("weight", "bias"):
            out[f"pooler.dense.{p}"] = Source.of(f"pooler.dense.{p}")
    else:
        for p in ("weight", "bias"):
            out[f"classifier.{p}"] = Source.of(f"classifier.{p}")
    return out
