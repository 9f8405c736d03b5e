"""One file per family, each built from colozoo.layers."""
from __future__ import annotations

import importlib

MODEL_CLASSES = {
    "gpt2": ("colozoo.models.gpt2", "GPT2ForCausalLM"),
    "opt": ("colozoo.models.opt", "OPTForCausalLM"),
    "bert": ("colozoo.models.bert", "BertModel"),  # task heads are chosen by build_model(task=...)
    "vit": ("colozoo.models.vit", "ViTModel"),
    "llama": ("colozoo.models.llama", "LlamaForCausalLM"),
    "mistral": ("colozoo.models.llama", "LlamaForCausalLM"),
    "mixtral": ("colozoo.models.mixtral", "MixtralForCausalLM"),
    "qwen2_moe": ("colozoo.models.qwen2_moe", "Qwen2MoeForCausalLM"),
    "qwen2": ("colozoo.models.qwen", "Qwen2ForCausalLM"),
    "qwen3": ("colozoo.models.qwen", "Qwen3ForCausalLM"),
    "qwen3_moe": ("colozoo.models.qwen", "Qwen3MoeForCausalLM"),
    "gemma2": ("colozoo.models.gemma", "GemmaForCausalLM"),
    "gemma3_text": ("colozoo.models.gemma", "GemmaForCausalLM"),
    "phi3": ("colozoo.models.phi3", "Phi3ForCausalLM"),
    "gpt_neox": ("colozoo.models.gpt_neox", "GPTNeoXForCausalLM"),
}

# multimodal checkpoints whose text model colozoo builds: model_type -> (the text model's architecture, what is left)
TEXT_MODELS = {"gemma3": ("Gemma3ForCausalLM", "the vision tower and multimodal projector")}


def text_config(config):
    """The config of the model colozoo builds from `config`: a multimodal checkpoint's text model (Gemma 3 4b, 12b
    and 27b are published as Gemma3ForConditionalGeneration), else `config` itself."""
    if config.model_type not in TEXT_MODELS:
        return config
    text = config.text_config
    text.architectures = [TEXT_MODELS[config.model_type][0]]
    return text


def model_class(model_type: str):
    try:
        module, name = MODEL_CLASSES[model_type]
    except KeyError:
        raise ValueError(f"unsupported model type {model_type!r}; supported: {sorted(MODEL_CLASSES)}") from None
    return getattr(importlib.import_module(module), name)


def build_model(config, pc=None, layer_ids=None, device=None, dtype=None, task: str | None = None,
                layers_per_stage: list[int] | None = None, balance: str | None = None):
    """`task` picks the head of families that have several (bert: base / masked_lm / sequence_classification,
    vit: base / image_classification); by default the one `config.architectures` names. Under pipeline
    parallelism the rank's layers are `layer_ids`, else `layers_per_stage[pp rank]` layers, else a partition
    balanced by `balance` ("params", the default; "flops"; "layers": equal counts), see colozoo.core.partition."""
    if layers_per_stage is not None or balance is not None:
        if layer_ids is not None:
            raise ValueError("give either layer_ids or layers_per_stage/balance, not both")
        from colozoo.core.mesh import single_process
        from colozoo.core.partition import model_rank_layers

        pp = (pc or single_process()).config.pp
        rank = pc.rank("pp") if pc is not None else 0
        layer_ids = model_rank_layers(config, pp, rank, balance=balance or "params", layers_per_stage=layers_per_stage)
    cls = model_class(config.model_type)
    if hasattr(cls, "for_task"):
        cls = cls.for_task(config, task)
    elif task not in (None, getattr(cls, "task", "causal_lm")):
        raise ValueError(f"model type {config.model_type!r} has no {task!r} head; it is a {cls.__name__}")
    return cls(config, pc=pc, layer_ids=layer_ids, device=device, dtype=dtype)
