"""The few places where fine-tuning meets the rest of colozoo: loading the model, one training step, the
optimizer, clipping, saving; each is the library's own entry point (colozoo.api, colozoo.runtime.training,
colozoo.checkpoint.convert) with the fine-tuning defaults."""
from __future__ import annotations

from dataclasses import asdict

import torch
import torch.distributed as dist

from colozoo.layers.shard import spec_of
from colozoo.runtime.plan import DEGREES

TASK_HEADS = {"lm": None, "seqcls": "sequence_classification", "imgcls": "image_classification"}
MIXED_PRECISION = {"float32": None, "bfloat16": "bf16", "float16": "fp16"}


def plan_training(cfg, config, global_batch: int):
    """--plan auto: the planner's best plan for this world size, `global_batch` sequences of the run's length and
    its dtype, for LoRA under --lora-r (only the adapters and a classifier's head train) (collective: rank 0 plans,
    every rank gets the same plan): a colozoo.runtime.plan.Plan."""
    from colozoo.core.mesh import init_distributed
    from colozoo.cost.planner import best_plan_for_world
    from colozoo.cost.setup import Workload

    seq_len = cfg.seq_len
    if cfg.task == "imgcls":  # a ViT's sequence is its patches and the class token
        from colozoo.models.vit import num_patches

        seq_len = num_patches(config) + 1
    lora = cfg.lora_settings()
    workload = Workload(seq_len=seq_len, dtype=cfg.dtype, lora=lora, task=TASK_HEADS[cfg.task] if lora else None)
    return best_plan_for_world(config, init_distributed(), workload, global_batch=global_batch)


def mesh_degrees(cfg, plan=None) -> dict:
    """tp, pp, dp, cp, ep and sequence_parallel of the run: the plan's under --plan auto, else the options'."""
    return asdict(plan.degrees) if plan is not None else {k: getattr(cfg, k) for k in DEGREES}


def load_model(cfg, task: str, plan=None, labels: dict[int, str] | None = None):
    """Build this rank's shard of the model on the mesh the config (or `plan`, kept on model.run.plan) asks for;
    returns (model, names of the parameters initialised fresh because the checkpoint lacks them); model.parallel is the
    mesh. A classifier's config names its classes `labels` (id -> name, as the data names them), so saved
    checkpoints and the export do too. Weights stay fp32: a lower --dtype becomes mixed precision in
    prepare_training. Checksums are verified."""
    from colozoo.api import from_pretrained

    degrees = mesh_degrees(cfg, plan)
    fresh = []
    if TASK_HEADS[task]:
        model, fresh = _load_with_task_head(cfg, task, degrees, torch.float32, labels)
    else:
        model = from_pretrained(cfg.model, dtype=torch.float32, verify=True, **degrees)
    model.run.plan = plan
    lora = cfg.lora_settings()
    if lora is not None:  # adapters on the targeted linears (before data-parallel wrapping), everything else frozen
        lora.apply(model, seed=cfg.seed)
    return model, fresh


def prepare_training(model, cfg) -> dict | None:
    """Data-parallel wrapping, mixed precision and activation checkpointing (collective; before the optimizer);
    under a plan, apply_plan's choices, returning its micro-batching for forward_backward."""
    from colozoo.runtime.compile import compile_layers
    from colozoo.runtime.training import apply_plan, parallelize

    if model.run.plan is not None:
        step = apply_plan(model, mixed_precision=MIXED_PRECISION[cfg.dtype])
    else:
        step = None
        parallelize(model, data_parallel=cfg.data_parallel or "fsdp", mixed_precision=MIXED_PRECISION[cfg.dtype],
                    activation_checkpointing="full" if cfg.activation_checkpointing else None,
                    offload=cfg.offload)
    if cfg.compile:
        compile_layers(model)
    return step


class FreshTensor:
    """A newly initialised global tensor (a task head the checkpoint lacks), sliced like a checkpoint tensor.
    Built from a fixed seed so every rank cuts its shard out of the same global values."""

    def __init__(self, shape, std: float, seed: int):
        self.shape = tuple(shape)
        if len(self.shape) >= 2:
            self.value = torch.randn(self.shape, generator=torch.Generator().manual_seed(seed)) * std
        else:
            self.value = torch.zeros(self.shape)

    def read(self, index=None):
        return self.value if index is None else self.value[index]


def _load_with_task_head(cfg, task, degrees, dtype, labels: dict[int, str] | None):
    """A classifier on top of a checkpoint that may hold only the base model (e.g. a sentence encoder): the head
    the checkpoint lacks starts fresh (normal(0, initializer_range), zero bias); everything else is loaded.
    Returns (model, names of the fresh parameters)."""
    import copy

    from colozoo.api import build_model, resolve
    from colozoo.checkpoint.layout import ModelLayout
    from colozoo.checkpoint.load import load_global_tensors
    from colozoo.core.mesh import init_parallel

    parallel = init_parallel(**degrees)
    source = resolve(cfg.model, verify=True)
    config = copy.deepcopy(source.config)
    if cfg.num_labels is not None:
        config.num_labels = cfg.num_labels
    if labels:
        config.id2label, config.label2id = dict(labels), {name: i for i, name in labels.items()}
    model = build_model(config, parallel=parallel, device="meta", dtype=dtype, task=TASK_HEADS[task])
    layout = ModelLayout(model.config)
    std = getattr(config, "initializer_range", 0.02)
    fresh = []

    def lookup(name):
        try:
            return source.tensor(name)
        except ValueError:  # CheckpointError: not in this checkpoint
            fresh.append(name)
            return FreshTensor(layout.tensors[name].shape, std, cfg.seed + len(fresh))

    load_global_tensors(model, lookup, device=parallel.device)
    return model, fresh


def model_inputs(batch: dict) -> dict:
    return {k: v for k, v in batch.items() if k != "labels"}


def forward_backward(model, batch: dict, num_microbatches: int = 1, schedule: str = "1f1b",
                     grad_scale: float = 1.0) -> torch.Tensor:
    """Forward and backward of the global batch (each dp rank trains on its rows); returns the mean loss on every rank.
    `grad_scale`: fp16 loss scaling (gradients come out scaled by it, the loss does not)."""
    inputs = model_inputs(batch)
    first = "input_ids" if "input_ids" in inputs else "pixel_values"
    return model.forward_backward(inputs.pop(first), batch["labels"], num_microbatches=num_microbatches,
                                  schedule=schedule, grad_scale=grad_scale, **inputs)


def build_optimizer(model, lr: float, weight_decay: float):
    from colozoo.runtime.training import build_optimizer as build

    return build(model, lr=lr, betas=(0.9, 0.95), weight_decay=weight_decay)


def clip_grad_norm(model, max_norm: float) -> float:
    """Clip by the norm of the whole (global) gradient; returns the norm before clipping."""
    from colozoo.runtime.training import clip_grad_norm_

    return float(clip_grad_norm_(model, max_norm))


def parameter_count(model, trainable: bool = False) -> int:
    """Parameters of the whole model (every stage, unsharded), counted from the local shards (collective);
    `trainable`: only those that train (LoRA: the adapters, and a classifier's head)."""
    parallel = model.parallel
    local = sum(p.numel() if spec_of(p) else p.numel() / parallel.size("tp") for p in model.parameters()
                if p.requires_grad or not trainable)
    total = torch.tensor(float(local), dtype=torch.float64, device=parallel.device)
    if dist.is_available() and dist.is_initialized():
        dist.all_reduce(total)
        total /= parallel.size("dp_cp")
    return int(round(total.item()))


def export_hf(model, path, merge_lora: bool = False):
    """Write a directory transformers can load (collective: every rank calls it); LoRA adapters merged in."""
    return model.save_pretrained(path, format="hf", merge_lora=merge_lora)


def export_adapter(model, path):
    """The LoRA adapters as a PEFT adapter directory, replacing an earlier one (collective)."""
    import shutil
    from pathlib import Path

    if (not dist.is_initialized() or dist.get_rank() == 0) and Path(path).exists():
        shutil.rmtree(path)
    if dist.is_available() and dist.is_initialized():
        dist.barrier()
    model.save_pretrained(path, format="peft")
    return Path(path)
