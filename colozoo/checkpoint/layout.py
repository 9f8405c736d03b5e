"""Which global tensors a model has (canonical names, shapes, shard specs) and on which pipeline stage: read off
meta models of one stage built with a virtual parallel context, so no job and no weights are needed."""
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


def build_virtual(config, pp: int = 1, pp_rank: int = 0, layer_ids: list[int] | None = None):
    """A meta model of one pipeline stage at tp=1, whose parameter shapes are the global shapes."""
    from colozoo.models import build_model

    return build_model(config, pc=ParallelContext.virtual(pp=pp, pp_rank=pp_rank), layer_ids=layer_ids,
                       device="meta")


def _with_lora(model, lora):
    if lora is not None:
        from colozoo.runtime.lora import apply_lora

        apply_lora(model, r=lora.r, alpha=lora.alpha, dropout=lora.dropout, targets=lora.targets,
                   use_rslora=lora.use_rslora)
    return model


def check_mesh(config, tp: int = 1, pp: int = 1, ep: int = 1):
    """Let every stage's model check the degrees (heads, kv heads, ffn divisible by tp ...) without a job."""
    from colozoo.models import build_model

    for rank in range(pp):
        build_model(config, pc=ParallelContext.virtual(pp=pp, pp_rank=rank, tp=tp, dp=ep, ep=ep), device="meta")


@dataclass
class TensorInfo:
    shape: tuple[int, ...]
    spec: tuple[Split, ...]
    stage: int = 0


class ModelLayout:
    """The global tensors of a model (canonical names, in model order), their specs and pipeline stages."""

    def __init__(self, config, pp: int = 1, stage_layers: list[list[int]] | None = None, lora=None):
        """`stage_layers`: every pp rank's global layer indices, where a model was split other than by default;
        `lora`: the LoraSettings of the model's adapters (colozoo.runtime.lora), whose tensors it then has too."""
        full = _with_lora(build_virtual(config), lora)
        self.config, self.pp, self.lora = config, pp, lora
        self.aliases = _tied_aliases(full)
        self.tensors = {name: TensorInfo(tuple(p.shape), spec_of(p)) for name, p in full.named_parameters()}
        if pp > 1:
            seen = set()
            for rank in range(pp):
                layer_ids = stage_layers[rank] if stage_layers is not None else None
                stage = _with_lora(build_virtual(config, pp, rank, layer_ids), lora)
                for name, _ in stage.named_parameters():
                    name = self.canonical(name)
                    if name not in seen:
                        self.tensors[name].stage = rank
                        seen.add(name)

    def canonical(self, name: str) -> str:
        return self.aliases.get(name, name)

    @property
    def family(self) -> str:
        return self.config.model_type
