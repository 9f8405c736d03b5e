"""The distributed training step over every mesh: data parallel wrapping (FSDP2 or DDP) composed with tensor
and pipeline parallelism, one forward/backward API, gradient clipping by the true global norm, AdamW over
local shards, mixed precision and per-layer activation checkpointing.

    parallelize(model, data_parallel="fsdp", mixed_precision="bf16", activation_checkpointing="selective")
    optimizer = build_optimizer(model, lr=3e-4)
    loss = model.forward_backward(input_ids, labels, num_microbatches=8, schedule="1f1b")
    clip_grad_norm_(model, 1.0); optimizer.step(); optimizer.zero_grad()

Every rank is given the same global batch; dp rank d trains on its 1/dp slice of the rows. Each micro-batch
loss is weighted by its share of the global batch's loss tokens, so the gradients (after FSDP/DDP average
over dp) and the returned loss are those of the mean loss over the whole global batch, on every rank.
"""
from __future__ import annotations

import contextlib
import functools
import math

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor
from torch.utils.checkpoint import checkpoint

from colozoo.layers.shard import spec_of
from colozoo.pipeline import PipelineError, build_stage_modules, run_schedule, stages_of, unwrap
from colozoo.rng import get_rng_tracker

DATA_PARALLEL = ("fsdp", "ddp")
MIXED_PRECISION = {None: None, "bf16": torch.bfloat16, "fp16": torch.float16}
CHECKPOINTING = (None, "full", "selective")


class TrainingError(ValueError):
    pass


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


# ---------------------------------------------------------------------------------------------- setup

def _rng_tracker_contexts():
    """Recompute with the tracked (tensor-parallel) RNG states of the forward, so dropout masks on sharded
    activations match; torch's checkpoint restores only the default generators."""
    tracker = get_rng_tracker()
    saved = tracker.get_states()

    @contextlib.contextmanager
    def recompute():
        current = tracker.get_states()
        tracker.set_states(saved)
        try:
            yield
        finally:
            tracker.set_states(current)

    return contextlib.nullcontext(), recompute()


def apply_activation_checkpointing(model, mode: str):
    """Recompute each layer ("full") or only its attention block ("selective") in backward. Forwards are
    wrapped in place, so module names stay global."""
    for idx, layer in model.layers.items():
        if mode == "full":
            targets = [layer]
        else:
            targets = [m for name, m in layer.named_children() if "attn" in name or "attention" in name]
            if not targets:
                raise TrainingError(f"selective checkpointing found no attention block in layer {idx} "
                                    f"({type(layer).__name__}: {[n for n, _ in layer.named_children()]})")
        for module in targets:
            module.forward = functools.partial(checkpoint, module.forward, use_reentrant=False,
                                               context_fn=_rng_tracker_contexts)


def tied_embedding(model):
    """(name, process group) of an embedding tied to an LM head on another pipeline stage, or None.
    Collective: every rank creates the first+last stage groups (one per dp/cp/tp coordinate)."""
    pc = model.pc
    if pc.config.pp == 1 or not getattr(model.config, "tie_word_embeddings", False):
        return None
    name = getattr(model, "tied_embedding", None)
    if name is None:
        raise TrainingError(f"{type(model).__name__} ties its LM head to the input embedding but does not declare "
                            f"`tied_embedding` (the parameter the first and last pipeline stages share)")
    mesh = pc.mesh.mesh  # (pp, dp, cp, tp) global ranks
    mine = None
    for pair in torch.stack([mesh[0], mesh[-1]], dim=-1).reshape(-1, 2).tolist():
        group = dist.new_group(pair)
        if dist.get_rank() in pair:
            mine = group
    if (model.is_first or model.is_last) and name not in dict(model.named_parameters()):
        raise TrainingError(f"{type(model).__name__} on pipeline stage {pc.rank('pp')} lacks the tied parameter "
                            f"{name!r}: the last stage must hold its own copy of the tied embedding")
    return name, mine


def parallelize(model, data_parallel: str = "fsdp", mixed_precision: str | None = None,
                activation_checkpointing: str | None = None, reshard_after_forward: bool = True):
    """Build the pipeline stages of `model` and wrap them for data parallelism over the dp mesh dimension.
    Collective over the whole job. Call once, before building the optimizer."""
    if getattr(model, "training_setup", None) is not None:
        raise TrainingError("parallelize() was already called on this model")
    if data_parallel not in DATA_PARALLEL:
        raise TrainingError(f"data_parallel must be one of {DATA_PARALLEL}, got {data_parallel!r}")
    if mixed_precision not in MIXED_PRECISION:
        raise TrainingError(f"mixed_precision must be one of {list(MIXED_PRECISION)}, got {mixed_precision!r}")
    if activation_checkpointing not in CHECKPOINTING:
        raise TrainingError(f"activation_checkpointing must be one of {CHECKPOINTING}, got {activation_checkpointing!r}")
    pc = model.pc
    if pc.config.cp > 1 or pc.config.ep > 1:
        raise TrainingError("the training step covers dp x pp x tp meshes; cp > 1 and ep > 1 are not supported yet")
    if activation_checkpointing:
        apply_activation_checkpointing(model, activation_checkpointing)
    tied = tied_embedding(model)
    if tied is not None and (model.is_first or model.is_last):
        with torch.no_grad():  # the first stage's copy wins, whatever the last stage was initialised with
            src = dist.get_global_rank(pc.group("pp"), 0)
            dist.broadcast(dict(model.named_parameters())[tied[0]], src=src, group=tied[1])
    specs = {name: spec_of(p) for name, p in model.named_parameters()}
    compute_dtype = MIXED_PRECISION[mixed_precision]
    stages = build_stage_modules(model)
    dp = pc.size("dp")
    sharded = dp > 1 and data_parallel == "fsdp"
    wrapped = []
    for stage in stages:
        if sharded:
            from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

            policy = MixedPrecisionPolicy(param_dtype=compute_dtype, reduce_dtype=torch.float32)
            kw = dict(mesh=pc.mesh["dp"], mp_policy=policy, reshard_after_forward=reshard_after_forward)
            for layer in stage.layers.values():
                fully_shard(layer, **kw)
            fully_shard(stage, **kw)
            stage.activation_dtype = compute_dtype
        else:
            stage.autocast_dtype = stage.activation_dtype = compute_dtype
            if dp > 1:
                stage = torch.nn.parallel.DistributedDataParallel(stage, process_group=pc.group("dp"),
                                                                  broadcast_buffers=False)
        wrapped.append(stage)
    for name, p in model.named_parameters():  # FSDP replaces the Parameter objects that carried the specs
        if specs[name]:
            p.shard_spec = specs[name]
    model.pipeline_stages = wrapped
    model.training_setup = dict(data_parallel=data_parallel if dp > 1 else None, sharded=sharded,
                                mixed_precision=mixed_precision, tied=tied, specs=specs)
    return model


def _setup(model) -> dict:
    if getattr(model, "training_setup", None) is None:
        parallelize(model)
    return model.training_setup


def build_optimizer(model, lr: float = 1e-3, betas=(0.9, 0.999), eps: float = 1e-8, weight_decay: float = 0.01,
                    **kwargs) -> torch.optim.AdamW:
    """AdamW over this rank's local shards (FSDP's DTensor shards or the tp/pp-local parameters)."""
    _setup(model)
    return torch.optim.AdamW(model.parameters(), lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, **kwargs)


# ----------------------------------------------------------------------------------------- the step

def forward_backward(model, input_ids, labels, attention_mask=None, num_microbatches: int = 1,
                     schedule: str = "1f1b", position_ids=None) -> torch.Tensor:
    """Forward and backward of the global batch over the whole mesh. Gradients accumulate on the local shards
    (tied embedding copies summed between their stages); returns the global mean loss on every rank."""
    setup = _setup(model)
    pc = model.pc
    dp, m = pc.size("dp"), num_microbatches
    if not isinstance(m, int) or m < 1:
        raise TrainingError(f"num_microbatches must be a positive integer, got {m!r}")
    batch = input_ids.shape[0]
    if batch % (dp * m):
        raise TrainingError(f"global batch size {batch} is not divisible by dp * num_microbatches = {dp} * {m}; "
                            f"every data-parallel rank needs {m} equal micro-batches")
    if labels is None or labels.shape[:1] != input_ids.shape[:1]:
        raise TrainingError(f"labels must have the batch size of the inputs ({batch}), got "
                            f"{None if labels is None else tuple(labels.shape)}")
    total_tokens = int(model.loss_token_count(labels))
    # each micro-batch mean is weighted by its tokens / global tokens; * dp undoes FSDP/DDP's dp average
    loss_scale = dp / max(total_tokens, 1)
    rows = slice(pc.rank("dp") * batch // dp, (pc.rank("dp") + 1) * batch // dp)
    local = [t[rows] if t is not None else None for t in (input_ids, labels, attention_mask, position_ids)]

    tied_grad = _stash_tied_grad(model, setup)
    if pc.config.pp > 1:
        local_sum = run_schedule(model, *local[:2], attention_mask=local[2], position_ids=local[3],
                                 num_microbatches=m, schedule=schedule, loss_scale=loss_scale)
    else:
        local_sum = _single_stage(model, *local, m, loss_scale)
    _sum_tied_grad(model, setup, tied_grad)
    return _global_loss(model, local_sum)


def _single_stage(model, input_ids, labels, attention_mask, position_ids, m, loss_scale):
    stage, = stages_of(model)
    unwrap(stage).loss_scale = loss_scale
    chunks = [t.tensor_split(m) if t is not None else [None] * m
              for t in (input_ids, labels, attention_mask, position_ids)]
    total = torch.zeros((), device=input_ids.device)
    for i, (ids, lab, mask, pos) in enumerate(zip(*chunks)):
        with _gradient_sync(stage, last=i == m - 1):
            kwargs = {k: v for k, v in dict(attention_mask=mask, position_ids=pos).items() if v is not None}
            loss = stage(ids, ids, labels=lab, **kwargs)
            loss.backward()
        total += loss.detach()
    return total


def _gradient_sync(stage, last: bool):
    """Reduce gradients over dp only after the last micro-batch."""
    if isinstance(stage, torch.nn.parallel.DistributedDataParallel):
        return contextlib.nullcontext() if last else stage.no_sync()
    if hasattr(stage, "set_requires_gradient_sync"):  # an FSDP2 module
        stage.set_requires_gradient_sync(last)
    return contextlib.nullcontext()


def _tied_param(model, setup):
    tied = setup["tied"]
    if tied is None or not (model.is_first or model.is_last):
        return None
    return dict(model.named_parameters())[tied[0]]


def _stash_tied_grad(model, setup):
    """Keep the gradient accumulated before this step aside, so only this step's part is summed across stages."""
    p = _tied_param(model, setup)
    if p is None or p.grad is None:
        return None
    previous, p.grad = p.grad, None
    return previous


def _sum_tied_grad(model, setup, previous):
    p = _tied_param(model, setup)
    if p is None:
        return
    if p.grad is None:
        p.grad = torch.zeros_like(p)
    dist.all_reduce(_local(p.grad), group=setup["tied"][1])
    if previous is not None:
        p.grad += previous


def _global_loss(model, local_sum) -> torch.Tensor:
    """Sum of the weighted micro-batch losses over dp (undoing the * dp), then sent from the last stage to all."""
    pc = model.pc
    if local_sum is None:
        local_sum = torch.zeros((), device=pc.device)
    loss = local_sum.float() / pc.size("dp")
    if pc.size("dp") > 1:
        dist.all_reduce(loss, group=pc.group("dp"))
    if pc.config.pp > 1:
        dist.broadcast(loss, src=dist.get_global_rank(pc.group("pp"), pc.config.pp - 1), group=pc.group("pp"))
    return loss


# ------------------------------------------------------------------------------------ clipping

@torch.no_grad()
def global_grad_norm(model, norm_type: float = 2.0) -> torch.Tensor:
    """The norm of the full model's gradient: every element counted once, whatever holds it (tp/ep shards,
    FSDP dp shards, pipeline stages; tp-replicated, dp-replicated and tied-copy gradients only once)."""
    setup = _setup(model)
    pc = model.pc
    if norm_type not in (2.0, math.inf):
        raise TrainingError(f"norm_type must be 2 or inf, got {norm_type!r}")
    tied = setup["tied"]
    acc = torch.zeros((), dtype=torch.float32, device=pc.device)
    for name, p in model.named_parameters():
        if p.grad is None:
            continue
        if tied is not None and name == tied[0] and not model.is_first:
            continue  # the last stage's copy of the tied embedding
        dims = {split.mesh_dim for split in setup["specs"][name]}
        if "tp" not in dims and pc.rank("tp") != 0:
            continue
        if not setup["sharded"] and pc.rank("dp") != 0:
            continue
        g = _local(p.grad).float()
        acc = torch.maximum(acc, g.abs().max()) if norm_type == math.inf else acc + g.pow(2).sum()
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(acc, op=dist.ReduceOp.MAX if norm_type == math.inf else dist.ReduceOp.SUM)
    return acc if norm_type == math.inf else acc.sqrt()


@torch.no_grad()
def clip_grad_norm_(model, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
    """Scale all local gradients so the global norm is at most max_norm (torch's rule); returns the norm before."""
    total = global_grad_norm(model, norm_type)
    coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
    for p in model.parameters():
        if p.grad is not None:
            _local(p.grad).mul_(coef)
    return total


__all__ = ["parallelize", "build_optimizer", "forward_backward", "clip_grad_norm_", "global_grad_norm",
           "apply_activation_checkpointing", "PipelineError", "TrainingError"]
