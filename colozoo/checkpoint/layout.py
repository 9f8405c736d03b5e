"""Which global tensors a model has (canonical names, shapes, shard specs) and on which pipeline stage: read off
meta models of each stage built with a virtual parallel context, so no job and no weights are needed."""
from __future__ import annotations

from dataclasses import dataclass

from colozoo.core.mesh import ParallelContext
from colozoo.layers.shard import Split, spec_of


def _tied_aliases(model) -> dict[str, str]:
    """{alias: owner} for weights a module borrows from another (the LM head tied to the embedding)."""
    names = {id(m): n for n, m in model.named_modules()}
    out = {}
    for name, module in model.named_modules():
        if getattr(module, "tied", False) and hasattr(module, "_tied"):
            owner = names[id(module._tied[0])]
            out[f"{name}.weight"] = f"{owner}.weight"
    return out


def build_virtual(config, pp: int = 1, pp_rank: int = 0, layer_ids: list[int] | None = None, tp: int = 1,
                  ep: int = 1):
    """A meta model of one pipeline stage with global parameter shapes, built on a virtual parallel context of
    (tp, ep) (no job), which checks those degrees (heads, kv heads, ffn, experts divisible ...)."""
    from colozoo.models import build_shard

    return build_shard(config, parallel=ParallelContext.virtual(pp=pp, pp_rank=pp_rank, tp=tp, dp=ep, ep=ep),
                       layer_ids=layer_ids, device="meta")


def _with_lora(model, lora):
    if lora is not None:
        lora.apply(model)
    return model


def check_mesh(config, tp: int = 1, pp: int = 1, ep: int = 1) -> "ModelLayout":
    """Let every stage's model check the degrees without a job; returns the layout, read off those models."""
    return ModelLayout(config, pp, tp=tp, ep=ep)


@dataclass
class TensorInfo:
    shape: tuple[int, ...]
    spec: tuple[Split, ...]
    stage: int = 0


class ModelLayout:
    """The global tensors of a model (canonical names, in model order), their specs and pipeline stages."""

    def __init__(self, config, pp: int = 1, stage_layers: list[list[int]] | None = None, tp: int = 1, ep: int = 1,
                 lora=None):
        """`stage_layers`: every pp rank's global layer indices, where a model was split other than by default.
        Each stage's meta model is built once, at (tp, ep), which checks those degrees; a tensor belongs to the
        first stage that holds it (a tied copy on the last stage is not another tensor). `lora`: the LoraSettings
        of the model's adapters (colozoo.runtime.lora), whose tensors it then has too."""
        self.config, self.pp, self.lora = config, pp, lora
        self.aliases, self.tensors = {}, {}
        for rank in range(pp):
            layer_ids = stage_layers[rank] if stage_layers is not None else None
            stage = _with_lora(build_virtual(config, pp, rank, layer_ids, tp, ep), lora)
            self.aliases.update(_tied_aliases(stage))
            for name, p in stage.named_parameters():
                name = self.canonical(name)
                if name not in self.tensors:
                    self.tensors[name] = TensorInfo(tuple(p.shape), spec_of(p), rank)

    def canonical(self, name: str) -> str:
        return self.aliases.get(name, name)

    @property
    def family(self) -> str:
        return self.config.model_type
