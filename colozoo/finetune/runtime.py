"""The few places where fine-tuning meets the rest of colozoo: loading the model, one training step, the
optimizer, clipping, saving. Each prefers the library's own entry point (colozoo.api, colozoo.training,
colozoo.checkpoint) and falls back to a small local version while that piece is missing."""
from __future__ import annotations

import importlib
from pathlib import Path

import torch
import torch.distributed as dist

from colozoo.layers.shard import gather_tensor, spec_of

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def optional(module: str, name: str):
    """`module.name` if that module exists yet, else None."""
    try:
        return getattr(importlib.import_module(module), name, None)
    except ModuleNotFoundError as e:
        if e.name != module:
            raise
        return None


def model_dir(name_or_path: str) -> Path | None:
    """The local directory of a model (where its tokenizer lives), or None for a bare registry name."""
    path = Path(name_or_path)
    return path if path.is_dir() else None


TASK_HEADS = {"lm": None, "seqcls": "sequence_classification", "imgcls": "image_classification"}
MIXED_PRECISION = {"float32": None, "bfloat16": "bf16", "float16": "fp16"}


def load_model(cfg, task: str):
    """Build this rank's shard of the model on the mesh the config asks for; returns the model (model.pc is the mesh).
    With colozoo.training present, weights stay fp32 and a lower --dtype becomes mixed precision."""
    import inspect

    from_pretrained = optional("colozoo.api", "from_pretrained")
    mixed = optional("colozoo.training", "parallelize") is not None
    dtype = torch.float32 if mixed else DTYPES[cfg.dtype]
    degrees = dict(tp=cfg.tp, pp=cfg.pp, dp=cfg.dp, cp=cfg.cp, ep=cfg.ep, sequence_parallel=cfg.sequence_parallel)
    if TASK_HEADS[task] and optional("colozoo.api", "resolve") is not None:
        return _load_with_task_head(cfg, task, degrees, dtype)
    if from_pretrained is not None:
        kwargs = dict(degrees, dtype=dtype)
        if TASK_HEADS[task] and "task" in inspect.signature(from_pretrained).parameters:
            kwargs["task"] = TASK_HEADS[task]
        return from_pretrained(cfg.model, **kwargs)
    return _load_hf_directory(cfg.model, degrees, dtype)


def prepare_training(model, cfg):
    """Data-parallel wrapping, mixed precision and activation checkpointing (collective; before the optimizer)."""
    parallelize = optional("colozoo.training", "parallelize")
    if parallelize is not None:
        return parallelize(model, data_parallel=cfg.data_parallel, mixed_precision=MIXED_PRECISION[cfg.dtype],
                           activation_checkpointing="full" if cfg.activation_checkpointing else None)
    if cfg.activation_checkpointing:
        _checkpoint_layers(model)
    return model


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


def _load_with_task_head(cfg, task, degrees, dtype):
    """A classifier on top of a checkpoint that may hold only the base model (e.g. a sentence encoder): the head
    the checkpoint lacks starts fresh (normal(0, initializer_range), zero bias); everything else is loaded."""
    import copy

    from colozoo.api import resolve
    from colozoo.checkpoint_format import ModelLayout, load_global_tensors
    from colozoo.models import build_model
    from colozoo.parallel import init_parallel

    pc = init_parallel(**degrees)
    source = resolve(cfg.model, verify=False)
    config = copy.deepcopy(source.config)
    if cfg.num_labels is not None:
        config.num_labels = cfg.num_labels
    model = build_model(config, pc=pc, device="meta", dtype=dtype, task=TASK_HEADS[task])
    layout = ModelLayout(model.config)
    std = getattr(config, "initializer_range", 0.02)
    fresh = []

    def lookup(name):
        try:
            return source.tensor(name)
        except ValueError:  # CheckpointError: not in this checkpoint
            fresh.append(name)
            return FreshTensor(layout.tensors[name].shape, std, cfg.seed + len(fresh))

    load_global_tensors(model, lookup, device=pc.device)
    model.fresh_parameters = fresh
    return model


def _load_hf_directory(path, degrees, dtype):
    from transformers import AutoConfig

    from colozoo.converters import SafetensorsReader, load_hf_weights
    from colozoo.models import build_model
    from colozoo.parallel import init_parallel

    if model_dir(path) is None:
        raise FileNotFoundError(f"model {path} is not a local directory (registry names need colozoo.api)")
    pc = init_parallel(**degrees)
    config = AutoConfig.from_pretrained(str(path), local_files_only=True)
    model = build_model(config, pc=pc, device="meta", dtype=dtype)
    return load_hf_weights(model, SafetensorsReader(path), device=pc.device)


def uses_training(model) -> bool:
    """Whether colozoo.training runs this model's step (it was parallelized), or the local fallback does."""
    return getattr(model, "training_setup", None) is not None


def model_inputs(batch: dict) -> dict:
    return {k: v for k, v in batch.items() if k != "labels"}


def forward_backward(model, batch: dict, num_microbatches: int) -> torch.Tensor:
    """Forward and backward of the global batch (each dp rank trains on its rows); returns the mean loss on every rank."""
    if uses_training(model):
        inputs = model_inputs(batch)
        first = "input_ids" if "input_ids" in inputs else "pixel_values"
        return model.forward_backward(inputs.pop(first), batch["labels"], num_microbatches=num_microbatches, **inputs)
    from colozoo.finetune.data import microbatches

    dp, rank = model.pc.size("dp"), model.pc.rank("dp")
    rows = len(batch["labels"]) // dp
    batch = {k: v[rank * rows: (rank + 1) * rows] for k, v in batch.items()}
    total = torch.zeros((), device=model.pc.device)
    for mb in microbatches(batch, num_microbatches):
        loss = model(**mb).loss / num_microbatches
        loss.backward()
        total += loss.detach()
    _average_over_data_parallel(model, total)
    return total


def _average_over_data_parallel(model, loss):
    group, size = model.pc.group("dp_cp"), model.pc.size("dp_cp")
    if size == 1:
        return
    for p in model.parameters():
        if p.grad is not None:
            dist.all_reduce(p.grad, group=group)
            p.grad.div_(size)
    dist.all_reduce(loss, group=group)
    loss.div_(size)


def build_optimizer(model, lr: float, weight_decay: float):
    if uses_training(model):
        build = optional("colozoo.training", "build_optimizer")
        return build(model, lr=lr, betas=(0.9, 0.95), weight_decay=weight_decay)
    decay = [p for p in model.parameters() if p.requires_grad and p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.requires_grad and p.dim() < 2]
    return torch.optim.AdamW([{"params": decay, "weight_decay": weight_decay},
                              {"params": no_decay, "weight_decay": 0.0}], lr=lr, betas=(0.9, 0.95))


def clip_grad_norm(model, max_norm: float) -> float:
    """Clip by the norm of the whole (global) gradient; returns the norm before clipping."""
    if uses_training(model):
        clip = optional("colozoo.training", "clip_grad_norm_")
        return float(clip(model, max_norm))
    pc = model.pc
    sharded = torch.zeros((), dtype=torch.float64, device=pc.device)
    replicated = torch.zeros((), dtype=torch.float64, device=pc.device)
    for p in model.parameters():
        if p.grad is not None:
            sq = p.grad.detach().double().pow(2).sum()
            if spec_of(p):
                sharded += sq
            else:
                replicated += sq
    if pc.size("tp") > 1:
        dist.all_reduce(sharded, group=pc.group("tp"))
    total = sharded + replicated
    if pc.size("pp") > 1:
        dist.all_reduce(total, group=pc.group("pp"))
    norm = total.sqrt().item()
    if max_norm > 0 and norm > max_norm:
        scale = max_norm / (norm + 1e-6)
        for p in model.parameters():
            if p.grad is not None:
                p.grad.mul_(scale)
    return norm


def _checkpoint_layers(model):
    from functools import partial

    from torch.utils.checkpoint import checkpoint

    for layer in model.layers.values():
        layer.forward = partial(checkpoint, type(layer).forward.__get__(layer), use_reentrant=False)
    return model


def parameter_count(model) -> int:
    """Parameters of the whole model (every stage, unsharded), counted from the local shards."""
    pc = model.pc
    local = sum(p.numel() if spec_of(p) else p.numel() / pc.size("tp") for p in model.parameters())
    total = torch.tensor(float(local), dtype=torch.float64, device=pc.device)
    if dist.is_available() and dist.is_initialized():
        dist.all_reduce(total)
        total /= pc.size("dp_cp")
    return int(round(total.item()))


def export_hf(model, path):
    """Write a directory transformers can load (collective: every rank calls it)."""
    if optional("colozoo.checkpoint", "save_pretrained") is not None:
        return _without_fsdp_shards(model).save_pretrained(path, format="hf")
    return _export_hf_by_gathering(model, Path(path))


def _without_fsdp_shards(model):
    """The model itself, or when FSDP split its parameters over dp (DTensors) a copy holding each rank's whole
    tensor-parallel shards, which colozoo.checkpoint writes. Collective over dp when it copies."""
    from torch.distributed.tensor import DTensor

    params = dict(model.named_parameters())
    if not any(isinstance(p, DTensor) for p in params.values()):
        return model
    copy = type(model)(model.config, pc=model.pc, layer_ids=model.layer_ids, device="meta",
                       dtype=next(iter(params.values())).dtype)
    copy.to_empty(device=model.pc.device)
    buffers = dict(model.named_buffers())
    with torch.no_grad():
        for name, p in copy.named_parameters():  # the same order on every dp rank: full_tensor gathers over dp
            source = params[name]
            p.copy_(source.full_tensor() if isinstance(source, DTensor) else source)
        for name, b in copy.named_buffers():
            b.copy_(buffers[name])
    return copy


def _export_hf_by_gathering(model, path: Path):
    """Fallback export for pp=1: gather every tensor, undo the family's name map, rank 0 writes (temp dir + rename)."""
    import shutil

    from safetensors.torch import save_file

    from colozoo.converters import family_module
    from colozoo.parallel import coords_of

    pc = model.pc
    if pc.size("pp") > 1:
        raise NotImplementedError("HF export with pp > 1 needs colozoo.checkpoint")
    sources, coords, tensors = family_module(model.family).hf_sources(model.config), coords_of(pc), {}
    for name, p in model.named_parameters():
        shape = list(p.shape)
        for split in spec_of(p):
            size = coords.get(split.mesh_dim, (0, 1))[1]
            shape[split.dim] = split.logical_size or sum(split.chunks or ()) or shape[split.dim] * size
        full = gather_tensor(p, spec_of(p), shape, pc.groups, coords).contiguous()
        source = sources[name]
        chunks = next((s.chunks for s in spec_of(p) if s.chunks and s.dim == source.cat_dim), None)
        parts = full.split(list(chunks)) if chunks and len(chunks) == len(source.names) and source.cat_dim == 0 \
            else full.chunk(len(source.names), dim=source.cat_dim)
        for hf_name, part in zip(source.names, parts):
            tensors[hf_name] = (part.t() if source.transpose else part).contiguous().cpu()
    if (not dist.is_initialized()) or dist.get_rank() == 0:
        tmp = path.with_name(path.name + ".partial")
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
        save_file(tensors, str(tmp / "model.safetensors"), metadata={"format": "pt"})
        model.config.save_pretrained(str(tmp))
        shutil.rmtree(path, ignore_errors=True)
        tmp.rename(path)
    if dist.is_initialized():
        dist.barrier()
    return path
