"""The distributed training step over every mesh: data parallel wrapping (FSDP2 or DDP) composed with tensor
and pipeline parallelism, one forward/backward API, gradient clipping by the true global norm, AdamW over
local shards, mixed precision and per-layer activation checkpointing.

    parallelize(model, data_parallel="fsdp", mixed_precision="bf16", activation_checkpointing="selective")
    optimizer = build_optimizer(model, lr=3e-4)
    loss = model.forward_backward(input_ids, labels, num_microbatches=8, schedule="1f1b")
    clip_grad_norm_(model, 1.0); optimizer.step(); optimizer.zero_grad()

Every rank is given the same global batch; dp rank d trains on its 1/dp slice of the rows, and its cp ranks
on their zigzag shares of those rows' sequence. Each micro-batch loss is weighted by its share of the global
batch's loss tokens, so the gradients and the returned loss are those of the mean loss over the whole global
batch, on every rank.

Gradient reduction. cp ranks hold partial gradients of the same samples, so parameters are reduced over the
dp*cp ranks (FSDP2 shards them there, or DDP replicates them there) and the loss carries a factor dp*cp that
the reduction's average divides out. With ep > 1 the experts (parameters split over "ep") are instead
reduced over the ranks holding the same experts (the "edp" group) with the same divisor dp*cp: each expert
owner already summed its ep group's tokens. MoE router losses are statistics of each micro-batch over every
data rank (the model sums its router statistics over dp*cp); each micro-batch's counts 1/num_microbatches,
so with one micro-batch the step is that of the whole batch's router loss.
"""
from __future__ import annotations

import contextlib
import functools
import math

import torch
import torch.distributed as dist
from torch.utils.checkpoint import checkpoint

from colozoo.layers.shard import local_part, spec_of
from colozoo.layers.vocab import VocabParallelLMHead
from colozoo.offload import OffloadedAdamW, fsdp2_offload_policy
from colozoo.pipeline import PipelineError, build_stage_modules, run_schedule, stages_of, unwrap
from colozoo.rng import get_rng_tracker

DATA_PARALLEL = ("fsdp", "ddp")
MIXED_PRECISION = {None: None, "bf16": torch.bfloat16, "fp16": torch.float16}
CHECKPOINTING = (None, "full", "selective")
OFFLOAD = (None, "optimizer", "params")  # see colozoo.offload


class TrainingError(ValueError):
    pass


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


ATTENTION_BLOCK_NAMES = ("attn", "self_attn", "attention")  # for layers that declare no `attention_block`


def _checkpointed(fn):
    return functools.partial(checkpoint, fn, use_reentrant=False, context_fn=_rng_tracker_contexts)


def apply_activation_checkpointing(model, mode: str, layers: int | None = None):
    """Recompute each layer ("full") or only its attention block ("selective") in backward. With "full",
    `layers` recomputes only the first that many layers of this rank's stage (what the planner's
    checkpoint_layers means): the fewest that fit cost the least recomputation. Forwards are wrapped in
    place, so module names stay global. A layer names its attention block in `attention_block`: a child
    module or a method of the layer (encoders whose attention is not a module of its own)."""
    if layers is not None and (mode != "full" or not isinstance(layers, int) or layers < 0):
        raise TrainingError(f"checkpoint layers must be a count >= 0 with activation_checkpointing='full', got "
                            f"{layers!r} with {mode!r}")
    for position, (idx, layer) in enumerate(model.layers.items()):
        if mode == "full":
            if layers is None or position < layers:
                layer.forward = _checkpointed(layer.forward)
            continue
        name = getattr(layer, "attention_block", None)
        if name is None:
            names = [n for n, _ in layer.named_children() if n in ATTENTION_BLOCK_NAMES]
            name = names[0] if len(names) == 1 else None
        block = getattr(layer, name, None) if name is not None else None
        if block is None:
            raise TrainingError(f"selective checkpointing found no attention block in layer {idx} "
                                f"({type(layer).__name__}: {[n for n, _ in layer.named_children()]}); "
                                f"the layer should name it in `attention_block`")
        if isinstance(block, torch.nn.Module):
            block.forward = _checkpointed(block.forward)
        else:
            setattr(layer, name, _checkpointed(block))  # shadows the method on this instance


def tied_embedding(model):
    """(name, process group) of an embedding tied to an LM head on another pipeline stage, or None.
    Collective: every rank creates the first+last stage groups (one per dp/cp/tp coordinate)."""
    pc = model.pc
    if pc.config.pp == 1 or not getattr(model.config, "tie_word_embeddings", False):
        return None
    name = getattr(model, "tied_embedding", None)
    if name is None and not any(getattr(m, "tied", False) for m in model.modules() if isinstance(m, VocabParallelLMHead)):
        return None  # no LM head shares the embedding (an encoder, a classifier), whatever the config says
    if name is None:
        raise TrainingError(f"{type(model).__name__} ties its LM head to the input embedding but does not declare "
                            f"`tied_embedding` (the parameter the first and last pipeline stages share)")
    mine = pc.stage_ends_group()
    if (model.is_first or model.is_last) and name not in dict(model.named_parameters()):
        raise TrainingError(f"{type(model).__name__} on pipeline stage {pc.rank('pp')} lacks the tied parameter "
                            f"{name!r}: the last stage must hold its own copy of the tied embedding")
    return name, mine


def parallelize(model, data_parallel: str = "fsdp", mixed_precision: str | None = None,
                activation_checkpointing: str | None = None, reshard_after_forward: bool = True,
                offload: str | None = None, checkpoint_layers: int | None = None):
    """Build the pipeline stages of `model` and wrap them for data parallelism over the dp mesh dimension.
    Collective over the whole job. Call once, before building the optimizer. `offload="optimizer"` keeps
    the fp32 master weights and AdamW states in CPU memory (build_optimizer then returns an OffloadedAdamW);
    `offload="params"` also keeps the sharded parameters and gradients there (FSDP2's CPUOffloadPolicy).
    `checkpoint_layers` with activation_checkpointing="full" recomputes only the first that many layers of
    each stage."""
    if getattr(model, "training_setup", None) is not None:
        raise TrainingError("parallelize() was already called on this model")
    if data_parallel not in DATA_PARALLEL:
        raise TrainingError(f"data_parallel must be one of {DATA_PARALLEL}, got {data_parallel!r}")
    if mixed_precision not in MIXED_PRECISION:
        raise TrainingError(f"mixed_precision must be one of {list(MIXED_PRECISION)}, got {mixed_precision!r}")
    if activation_checkpointing not in CHECKPOINTING:
        raise TrainingError(f"activation_checkpointing must be one of {CHECKPOINTING}, got {activation_checkpointing!r}")
    offload = None if offload == "none" else offload
    if offload not in OFFLOAD:
        raise TrainingError(f"offload must be one of {OFFLOAD}, got {offload!r}")
    pc = model.pc
    if offload == "params" and (data_parallel != "fsdp" or pc.size("dp_cp") == 1):
        raise TrainingError(f"offload='params' needs FSDP2 (data_parallel='fsdp' over dp*cp > 1 ranks; here "
                            f"data_parallel={data_parallel!r}, dp*cp={pc.size('dp_cp')}): its CPUOffloadPolicy "
                            f"is what moves parameters to CPU memory; use offload='optimizer' instead")
    experts = _expert_parameters(model)
    if hasattr(model, "router_stats_group"):  # router losses of the global batch, not of each rank's rows
        model.router_stats_group = pc.group("dp_cp")
    if activation_checkpointing:
        apply_activation_checkpointing(model, activation_checkpointing, checkpoint_layers)
    elif checkpoint_layers is not None:
        raise TrainingError("checkpoint_layers needs activation_checkpointing='full'")
    tied = tied_embedding(model)
    if tied is not None and (model.is_first or model.is_last):
        with torch.no_grad():  # the first stage's copy wins, whatever the last stage was initialised with
            src = dist.get_global_rank(pc.group("pp"), 0)
            dist.broadcast(dict(model.named_parameters())[tied[0]], src=src, group=tied[1])
    specs = {name: spec_of(p) for name, p in model.named_parameters()}
    compute_dtype = MIXED_PRECISION[mixed_precision]
    stages = build_stage_modules(model)
    replicas = pc.size("dp_cp")
    sharded = replicas > 1 and data_parallel == "fsdp"
    wrapped = []
    for stage in stages:
        if sharded:
            from torch.distributed.device_mesh import DeviceMesh
            from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

            policy = MixedPrecisionPolicy(param_dtype=compute_dtype, reduce_dtype=torch.float32)
            kw = dict(mp_policy=policy, reshard_after_forward=reshard_after_forward,
                      offload_policy=fsdp2_offload_policy(offload))
            mesh = pc.mesh["dp_cp"]
            expert_mesh = DeviceMesh.from_group(pc.group("edp"), pc.device.type) if experts else None
            for layer in stage.layers.values():
                for module in _expert_modules(layer, experts):  # nested first: the layer's FSDP leaves them out
                    fully_shard(module, mesh=expert_mesh, **kw)
                    module.set_gradient_divide_factor(replicas)  # the divisor of every other gradient
                    if pc.size("edp") > 1:  # gloo lacks PREMUL_SUM; on one rank torch would divide twice
                        module.set_force_sum_reduction_for_comms(True)
                fully_shard(layer, mesh=mesh, **kw)
            fully_shard(stage, mesh=mesh, **kw)
            stage.activation_dtype = compute_dtype
        else:
            stage.autocast_dtype = stage.activation_dtype = compute_dtype
            if replicas > 1:
                DDP = torch.nn.parallel.DistributedDataParallel  # experts are reduced over edp by hand
                DDP._set_params_and_buffers_to_ignore_for_model(
                    stage, [n for n, p in stage.named_parameters() if id(p) in experts])
                stage = torch.nn.parallel.DistributedDataParallel(stage, process_group=pc.group("dp_cp"),
                                                                  broadcast_buffers=False)
        wrapped.append(stage)
    for name, p in model.named_parameters():  # FSDP replaces the Parameter objects that carried the specs
        if specs[name]:
            p.shard_spec = specs[name]
    model.pipeline_stages = wrapped
    model.training_setup = dict(data_parallel=data_parallel if replicas > 1 else None, sharded=sharded,
                                mixed_precision=mixed_precision, tied=tied, specs=specs, offload=offload,
                                experts={n for n, p in model.named_parameters() if id(p) in experts})
    return model


def apply_plan(model, plan=None, mixed_precision: str | None = None) -> dict:
    """Apply the rest of a planner's plan to a model built on its mesh (from_pretrained(plan="auto") sets
    only the degrees and leaves the plan on `model.plan`): data parallelism (FSDP2 for ZeRO >= 1, DDP for 0),
    activation checkpointing and CPU offload. Returns forward_backward's keyword arguments (micro-batch count
    and schedule) for a global batch of dp * micro_batch_size * num_microbatches sequences:

        model = colozoo.from_pretrained("opt-1.3b", plan="auto")
        step = apply_plan(model); optimizer = build_optimizer(model)
        loss = model.forward_backward(ids, labels, **step)
    """
    plan = getattr(model, "plan", None) if plan is None else plan
    if plan is None:
        raise TrainingError("apply_plan needs a plan: none given and model.plan is unset "
                            "(from_pretrained(..., plan='auto') sets it)")
    plan = plan.degrees() if hasattr(plan, "degrees") else dict(plan)
    pc = model.pc
    mesh = {k: pc.size(k) for k in ("tp", "pp", "dp", "cp", "ep")}
    wrong = {k: (plan[k], mesh[k]) for k in mesh if k in plan and plan[k] != mesh[k]}
    if wrong:
        raise TrainingError(f"the plan's degrees differ from the model's mesh (plan, mesh): {wrong}; build the "
                            f"model on the plan's mesh (from_pretrained(..., plan='auto') does)")
    checkpointing = plan.get("checkpointing", "none")
    parallelize(model, data_parallel="fsdp" if plan.get("zero", 0) >= 1 else "ddp", mixed_precision=mixed_precision,
                activation_checkpointing=None if checkpointing == "none" else checkpointing,
                checkpoint_layers=plan.get("checkpoint_layers") if checkpointing == "full" else None,
                offload=plan.get("offload", "none"))
    return {"num_microbatches": plan.get("num_microbatches", 1), "schedule": plan.get("schedule", "1f1b")}


def _expert_parameters(model) -> set[int]:
    """ids of the parameters split over ep (each rank holds other experts), when ep > 1."""
    if model.pc.size("ep") == 1:
        return set()
    return {id(p) for p in model.parameters() if any(s.mesh_dim == "ep" for s in spec_of(p))}


def _expert_modules(layer, experts: set[int]) -> list[torch.nn.Module]:
    """The modules of a layer that directly own expert parameters (FSDP shards them over the edp group)."""
    found = []
    for name, module in layer.named_modules():
        own = list(module.parameters(recurse=False))
        mine = [id(p) in experts for p in own]
        if any(mine):
            if not all(mine):
                raise TrainingError(f"{type(module).__name__} ({name}) holds expert and non-expert parameters; "
                                    f"FSDP reduces them over different groups, so they need separate modules")
            found.append(module)
    return found


def _setup(model) -> dict:
    if getattr(model, "training_setup", None) is None:
        parallelize(model)
    return model.training_setup


def build_optimizer(model, lr: float = 1e-3, betas=(0.9, 0.999), eps: float = 1e-8, weight_decay: float = 0.01,
                    offload: str | None = None, **kwargs):
    """AdamW over this rank's local shards (FSDP's DTensor shards or the tp/pp-local parameters). With
    offload="optimizer" (by default what parallelize() was given) an OffloadedAdamW keeping master weights
    and states in CPU memory; under offload="params" FSDP2 already keeps the shards there."""
    setup = _setup(model)
    offload = setup.get("offload") if offload is None else (None if offload == "none" else offload)
    if offload not in OFFLOAD:
        raise TrainingError(f"offload must be one of {OFFLOAD}, got {offload!r}")
    if offload == "params" and setup.get("offload") != "params":
        raise TrainingError("build_optimizer(offload='params') needs parallelize(model, offload='params'): "
                            "FSDP2 moves the parameters, not the optimizer")
    if offload == "optimizer":
        return OffloadedAdamW(model.parameters(), lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, **kwargs)
    return torch.optim.AdamW(model.parameters(), lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, **kwargs)


# ----------------------------------------------------------------------------------------- the step

def forward_backward(model, input_ids, labels, attention_mask=None, num_microbatches: int = 1,
                     schedule: str = "1f1b", position_ids=None, grad_scale: float = 1.0, **inputs) -> torch.Tensor:
    """Forward and backward of the global batch over the whole mesh. Gradients accumulate on the local shards
    (tied embedding copies summed between their stages); returns the global mean loss on every rank.
    `grad_scale`: the backward runs on the loss times this (fp16 loss scaling, see colozoo.amp), so gradients,
    router losses' included, come out scaled by it; the returned loss is not.
    `inputs`: further model inputs (e.g. BERT's token_type_ids); tensors, like input_ids, hold one row per
    sample and are split over dp ranks and micro-batches."""
    setup = _setup(model)
    pc = model.pc
    dp, m = pc.size("dp"), num_microbatches
    if not isinstance(m, int) or m < 1:
        raise TrainingError(f"num_microbatches must be a positive integer, got {m!r}")
    batch = input_ids.shape[0]
    if batch % (dp * m):
        raise TrainingError(f"global batch size {batch} is not divisible by dp * num_microbatches = {dp} * {m}; "
                            f"every data-parallel rank needs {m} equal micro-batches")
    cp = pc.size("cp")
    if cp > 1 and input_ids.shape[1] % (2 * cp):
        raise TrainingError(f"sequence length {input_ids.shape[1]} is not divisible by 2 * cp = {2 * cp}: context "
                            f"parallelism gives every cp rank two equal chunks of the sequence")
    if labels is None or labels.shape[:1] != input_ids.shape[:1]:
        raise TrainingError(f"labels must have the batch size of the inputs ({batch}), got "
                            f"{None if labels is None else tuple(labels.shape)}")
    total_tokens = int(model.loss_token_count(labels))
    # each micro-batch mean is weighted by its tokens / global tokens; * dp*cp undoes FSDP/DDP's dp*cp average
    replicas = pc.size("dp_cp")
    loss_scale = replicas / max(total_tokens, 1)
    for name, t in inputs.items():
        if isinstance(t, torch.Tensor) and t.shape[:1] != input_ids.shape[:1]:
            raise TrainingError(f"{name} must have the batch size of the inputs ({batch}), got {tuple(t.shape)}")
    rows = slice(pc.rank("dp") * batch // dp, (pc.rank("dp") + 1) * batch // dp)
    local = [t[rows] if t is not None else None for t in (input_ids, labels, attention_mask, position_ids)]
    inputs = {k: v[rows] if isinstance(v, torch.Tensor) else v for k, v in inputs.items() if v is not None}

    tied_grad = _stash_tied_grad(model, setup)
    expert_grads = _stash_expert_grads(model, setup)
    for stage in stages_of(model):
        unwrap(stage).router_loss_scale = replicas / m
        unwrap(stage).router_losses = []
        unwrap(stage).grad_scale = grad_scale
    if pc.config.pp > 1:
        local_sum = run_schedule(model, *local[:2], attention_mask=local[2], position_ids=local[3],
                                 num_microbatches=m, schedule=schedule, loss_scale=loss_scale, **inputs)
    else:
        local_sum = _single_stage(model, *local, m, loss_scale, inputs)
    _sum_tied_grad(model, setup, tied_grad)
    _reduce_expert_grads(model, setup, expert_grads)
    if local_sum is not None and grad_scale != 1.0:
        local_sum = local_sum / grad_scale  # exact for a power-of-two scale
    return _global_loss(model, local_sum)


def _single_stage(model, input_ids, labels, attention_mask, position_ids, m, loss_scale, inputs):
    stage, = stages_of(model)
    unwrap(stage).loss_scale = loss_scale
    batch = dict(labels=labels, attention_mask=attention_mask, position_ids=position_ids, **inputs)
    batch = {k: v for k, v in batch.items() if v is not None}
    chunks = {k: v.tensor_split(m) if isinstance(v, torch.Tensor) else [v] * m for k, v in batch.items()}
    total = torch.zeros((), device=input_ids.device)
    for i, ids in enumerate(input_ids.tensor_split(m)):
        with _gradient_sync(stage, last=i == m - 1):
            loss = stage(ids, token_ids=ids, **{k: v[i] for k, v in chunks.items()})
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
    dist.all_reduce(local_part(p.grad), group=setup["tied"][1])
    if previous is not None:
        p.grad += previous


def _stash_expert_grads(model, setup) -> dict | None:
    """Under DDP the experts are reduced by hand: keep gradients of earlier steps aside, as for the tied copy."""
    if setup["sharded"] or not setup["experts"] or setup["data_parallel"] is None:
        return None
    stash = {}
    for name, p in model.named_parameters():
        if name in setup["experts"]:
            stash[name], p.grad = p.grad, None
    return stash


def _reduce_expert_grads(model, setup, stash):
    """Sum this step's expert gradients over the ranks holding the same experts, divided like the others."""
    if stash is None:
        return
    pc = model.pc
    for name, p in model.named_parameters():
        if name not in stash:
            continue
        if p.grad is None:
            p.grad = torch.zeros_like(p)
        dist.all_reduce(p.grad, group=pc.group("edp"))
        p.grad /= pc.size("dp_cp")
        if stash[name] is not None:
            p.grad += stash[name]


def _global_loss(model, local_sum) -> torch.Tensor:
    """Sum of the weighted micro-batch losses over dp (undoing the * dp*cp; cp ranks hold the same value), plus
    the router losses (the same on every data rank) once, then sent from the last stage to all."""
    pc = model.pc
    if local_sum is None:
        local_sum = torch.zeros((), device=pc.device)
    replicas = pc.size("dp_cp")
    router = [loss for stage in stages_of(model) for loss in unwrap(stage).router_losses]
    router_sum = torch.stack(router).sum() if router else torch.zeros((), device=pc.device)
    router_scale = unwrap(stages_of(model)[0]).router_loss_scale
    loss = (local_sum.float() - router_sum * router_scale) / replicas
    if pc.size("dp") > 1:
        dist.all_reduce(loss, group=pc.group("dp"))
    loss = loss + router_sum * router_scale / replicas
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
        replicated_over = "edp" if name in setup["experts"] else "dp_cp"
        if not setup["sharded"] and pc.rank(replicated_over) != 0:
            continue
        g = local_part(p.grad).float()
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
            local_part(p.grad).mul_(coef)
    return total


__all__ = ["parallelize", "apply_plan", "build_optimizer", "forward_backward", "clip_grad_norm_", "global_grad_norm",
           "apply_activation_checkpointing", "PipelineError", "TrainingError"]
