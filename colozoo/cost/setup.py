"""What a profile is of: the model (a registry name, a config, or a fallback config), the Plan that runs the step
(mesh, micro-batching, schedule, ZeRO, checkpointing, offload: colozoo.runtime.plan, the one plan type) and the
Workload it processes (sequence length, dtype, optimizer, whose kernels, LoRA)."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from colozoo.core.mesh import ParallelConfig
from colozoo.core.dtypes import NAMES as DTYPES
from colozoo.cost.priced import OPTIMIZER_BYTES, PRICED_SCHEDULES
from colozoo.cost.trace import TARGETS
from colozoo.runtime.lora import ALL_LINEAR, LoraSettings
from colozoo.runtime.plan import Plan


class ProfilerError(ValueError):
    pass


# Configs for names the registry does not carry (yet): real hyperparameters of the published models.
FALLBACK_CONFIGS = {
    "llama-2-70b": ("llama", dict(hidden_size=8192, intermediate_size=28672, num_hidden_layers=80,
                                  num_attention_heads=64, num_key_value_heads=8, vocab_size=32000,
                                  max_position_embeddings=4096, rms_norm_eps=1e-5, tie_word_embeddings=False)),
    "llama-3-70b": ("llama", dict(hidden_size=8192, intermediate_size=28672, num_hidden_layers=80,
                                  num_attention_heads=64, num_key_value_heads=8, vocab_size=128256,
                                  max_position_embeddings=8192, rope_theta=500000.0, tie_word_embeddings=False)),
    "llama-2-7b": ("llama", dict(hidden_size=4096, intermediate_size=11008, num_hidden_layers=32,
                                 num_attention_heads=32, num_key_value_heads=32, vocab_size=32000,
                                 max_position_embeddings=4096, tie_word_embeddings=False)),
}


def get_config(name: str):
    """A transformers config by registered name (colozoo.registry), falling back to FALLBACK_CONFIGS."""
    import transformers

    if name in FALLBACK_CONFIGS:
        model_type, kwargs = FALLBACK_CONFIGS[name]
        return transformers.AutoConfig.for_model(model_type, **kwargs)
    from colozoo import registry

    return registry.get_config(name)


def parse_mesh(mesh) -> ParallelConfig:
    """A ParallelConfig from a ParallelConfig, a dict, or 'tp=2,pp=2,dp=4,cp=1,ep=1,sp'."""
    if mesh is None:
        return ParallelConfig()
    if isinstance(mesh, ParallelConfig):
        return mesh
    if isinstance(mesh, dict):
        return ParallelConfig(**mesh)
    if isinstance(mesh, str):
        degrees = {}
        for part in filter(None, (p.strip() for p in mesh.split(","))):
            if part in ("sp", "sequence_parallel"):
                degrees["sequence_parallel"] = True
                continue
            key, sep, value = part.partition("=")
            if not sep or key not in ("tp", "pp", "dp", "cp", "ep") or not value.isdigit():
                raise ProfilerError(f"bad mesh entry {part!r} in {mesh!r}; write e.g. 'tp=2,pp=2,dp=4,sp'")
            degrees[key] = int(value)
        return ParallelConfig(**degrees)
    raise ProfilerError(f"mesh must be a ParallelConfig, a dict or a string like 'tp=2,pp=2', got {mesh!r}")


def plan_of(mesh, **choices) -> Plan:
    """The Plan a profile prices: the mesh (see parse_mesh) with the step's choices (micro_batch_size,
    num_microbatches, schedule, zero, checkpointing, checkpoint_layers, offload)."""
    try:
        return Plan(parse_mesh(mesh), **choices)
    except ValueError as e:
        raise ProfilerError(str(e)) from None


def check_priced(plan: Plan):
    """The cost model prices every plan but the schedules it has no formula for."""
    if plan.schedule not in PRICED_SCHEDULES:
        raise ProfilerError(f"schedule {plan.schedule!r} is not priced; the profiler prices {PRICED_SCHEDULES}")


@dataclass(frozen=True)
class Workload:
    """What a step processes, besides the plan that runs it: the sequence, the dtypes, the optimizer, whose kernels,
    and for LoRA fine-tuning the adapters' settings."""
    seq_len: int | None = None           # None: the model's default (min(2048, max positions))
    dtype: str = "bfloat16"              # parameter and activation dtype; 16-bit keeps fp32 master weights
    optimizer: str = "adamw"
    target: str = "cuda"                 # whose attention kernels: cuda (flash), cpu or eager (unfused GPU)
    lora: LoraSettings | None = None     # LoRA fine-tuning: base frozen, only fp32 adapters (and the modules to
    #                                      save; None there: the task head's default, as apply_lora) train
    task: str | None = None              # the model's task head ("sequence_classification": a classifier)

    def check(self):
        if self.dtype not in DTYPES:
            raise ProfilerError(f"dtype {self.dtype!r} not one of {sorted(DTYPES)}")
        if self.optimizer not in OPTIMIZER_BYTES:
            raise ProfilerError(f"optimizer {self.optimizer!r} not one of {sorted(OPTIMIZER_BYTES)}")
        if self.target not in TARGETS:
            raise ProfilerError(f"target {self.target!r} not one of {TARGETS}")
        if self.lora is not None and not isinstance(self.lora, LoraSettings):
            raise ProfilerError(f"lora must be a colozoo.runtime.lora.LoraSettings or None, got {self.lora!r}")
        if self.lora is not None and (not isinstance(self.lora.r, int) or self.lora.r < 1):
            raise ProfilerError(f"LoRA rank r must be a positive integer, got {self.lora.r!r}")
        if self.seq_len is None or self.seq_len < 1:
            raise ProfilerError(f"seq_len must be >= 1, got {self.seq_len}")

    @property
    def torch_dtype(self) -> torch.dtype:
        return DTYPES[self.dtype]

    def to_dict(self) -> dict:
        """The workload as reports write it (LoRA as the flat lora_r / lora_targets / lora_modules_to_save fields
        the JSON has always had; lora_r 0: no LoRA)."""
        lora = self.lora
        return {"seq_len": self.seq_len, "dtype": self.dtype, "optimizer": self.optimizer, "target": self.target,
                "lora_r": lora.r if lora else 0, "lora_targets": lora.targets if lora else ALL_LINEAR,
                "lora_modules_to_save": lora.modules_to_save if lora else None, "task": self.task}

    @classmethod
    def from_dict(cls, d: dict) -> "Workload":
        """The inverse of to_dict (e.g. a report's workload)."""
        targets, saved = d.get("lora_targets", ALL_LINEAR), d.get("lora_modules_to_save")
        lora = LoraSettings(r=d["lora_r"], targets=targets if isinstance(targets, str) else tuple(targets),
                            modules_to_save=None if saved is None else tuple(saved)) if d.get("lora_r") else None
        return cls(seq_len=d["seq_len"], dtype=d["dtype"], optimizer=d["optimizer"], target=d["target"], lora=lora,
                   task=d.get("task"))
