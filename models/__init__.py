"""One file per family, each built from colozoo.layers and declaring its family (colozoo.models.family)."""
from __future__ import annotations

from colozoo.models.family import Family, families, family_of, text_model


def text_config(config):
    """The config of the model colozoo builds from `config`: a multimodal checkpoint's text model (Gemma 3 4b, 12b
    and 27b are published as Gemma3ForConditionalGeneration), else `config` itself."""
    found = text_model(config.model_type)
    if found is None:
        return config
    text = config.text_config
    text.architectures = [found[0]]
    return text


def model_class(model_type: str):
    return family_of(model_type).model


def build_shard(config, parallel=None, layer_ids=None, device=None, dtype=None, task: str | None = None,
                layers_per_stage: list[int] | None = None, balance: str | None = None):
    """This rank's shard of a model of `config`, without a run (colozoo.build_model builds one with its run). `task`
    picks the head of families that have several (bert: base / masked_lm / sequence_classification, vit: base /
    image_classification); by default the one `config.architectures` names. Under pipeline parallelism the rank's
    layers are `layer_ids`, else `layers_per_stage[pp rank]` layers, else a partition balanced by `balance`
    ("params", the default; "flops"; "layers": equal counts), see colozoo.models.partition."""
    if layers_per_stage is not None or balance is not None:
        if layer_ids is not None:
            raise ValueError("give either layer_ids or layers_per_stage/balance, not both")
        from colozoo.core.mesh import single_process
        from colozoo.models.partition import model_rank_layers

        pp = (parallel or single_process()).config.pp
        rank = parallel.rank("pp") if parallel is not None else 0
        layer_ids = model_rank_layers(config, pp, rank, balance=balance or "params", layers_per_stage=layers_per_stage)
    cls = model_class(config.model_type)
    if hasattr(cls, "for_task"):
        cls = cls.for_task(config, task)
    elif task not in (None, cls.task):
        raise ValueError(f"model type {config.model_type!r} has no {task!r} head; it is a {cls.__name__}")
    return cls(config, parallel=parallel, layer_ids=layer_ids, device=device, dtype=dtype)


__all__ = ["Family", "build_shard", "families", "family_of", "model_class", "text_config", "text_model"]
