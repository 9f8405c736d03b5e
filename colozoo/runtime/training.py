"""The distributed training step over every mesh: data parallel wrapping (FSDP2 or DDP) composed with tensor
and pipeline parallelism, one forward/backward API, gradient clipping by the true global norm, AdamW over
local shards, mixed precision and per-layer activation checkpointing.

    parallelize(model, data_parallel="fsdp", mixed_precision="bf16", activation_checkpointing="selective")
    optimizer = build_optimizer(model, lr=3e-4)     # after parallelize: FSDP replaces the parameters
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

import torch

from colozoo.runtime.checkpointing import apply_activation_checkpointing
from colozoo.runtime.clipping import clip_grad_norm_, global_grad_norm
from colozoo.runtime.errors import PipelineError, TrainingError
from colozoo.runtime.offload import OffloadedAdamW
from colozoo.runtime.options import OFFLOAD, ZERO
from colozoo.runtime.parallelize import parallelize, training_setup
from colozoo.runtime.plan import Plan
from colozoo.runtime.step import forward_backward


def apply_plan(model, plan: Plan | None = None, mixed_precision: str | None = None) -> dict:
    """Apply the rest of a Plan to a model built on its mesh (from_pretrained(plan="auto") sets only the degrees
    and leaves the plan on `model.run.plan`): data parallelism (FSDP2 for ZeRO 3, DDP for 0),
    activation checkpointing and CPU offload. Returns forward_backward's keyword arguments (micro-batch count
    and schedule) for a global batch of dp * micro_batch_size * num_microbatches sequences:

        model = colozoo.from_pretrained("opt-1.3b", plan="auto")
        step = apply_plan(model); optimizer = build_optimizer(model)
        loss = model.forward_backward(ids, labels, **step)
    """
    plan = model.run.plan if plan is None else plan
    if plan is None:
        raise TrainingError("apply_plan needs a plan: none given and model.run.plan is unset "
                            "(from_pretrained(..., plan='auto') sets it)")
    if not isinstance(plan, Plan):
        raise TrainingError(f"apply_plan takes a colozoo.runtime.plan.Plan, got {type(plan).__name__}")
    if plan.zero not in ZERO:
        raise TrainingError(f"ZeRO-{plan.zero} is priced by the profiler but not run; a plan to run has zero in {ZERO} "
                            f"(0: DDP, 3: FSDP2)")
    parallel = model.parallel
    wrong = {k: (getattr(plan, k), parallel.size(k)) for k in ("tp", "pp", "dp", "cp", "ep")
             if getattr(plan, k) != parallel.size(k)}
    if wrong:
        raise TrainingError(f"the plan's degrees differ from the model's mesh (plan, mesh): {wrong}; build the "
                            f"model on the plan's mesh (from_pretrained(..., plan='auto') does)")
    _check_stages(model, plan)
    full = plan.checkpointing == "full"
    parallelize(model, data_parallel="fsdp" if plan.zero == 3 else "ddp", mixed_precision=mixed_precision,
                activation_checkpointing=plan.checkpointing, checkpoint_layers=plan.checkpoint_layers if full else None,
                offload=plan.offload, reshard_after_forward=plan.reshard_after_forward)
    return {"num_microbatches": plan.num_microbatches, "schedule": plan.schedule}


def _check_stages(model, plan: Plan):
    """The model's (virtual) stages are the plan's: their number per rank and, when the plan says, their layers."""
    stages = model.run.stages
    if len(stages) != plan.virtual_stages:
        raise TrainingError(f"the plan has {plan.virtual_stages} virtual stage(s) per pipeline rank, the model "
                            f"{len(stages)}; build it with layer_ids from colozoo.core.partition.rank_layers(..., "
                            f"virtual_stages={plan.virtual_stages})")
    if plan.layers_per_stage is not None:
        built = {stage.index: len(stage.layers) for stage in stages}
        wrong = {i: (plan.layers_per_stage[i], n) for i, n in built.items() if plan.layers_per_stage[i] != n}
        if wrong:
            raise TrainingError(f"stage layer counts differ from the plan's layers_per_stage (plan, model): {wrong}")


def build_optimizer(model, lr: float = 1e-3, betas=(0.9, 0.999), eps: float = 1e-8, weight_decay: float = 0.01,
                    offload: str | None = None, **kwargs):
    """AdamW over this rank's trainable local shards (FSDP's DTensor shards or the tp/pp-local parameters), run by
    torch's fused kernel where the parameters' device has one (one pass over the states, not foreach's eight; pass
    foreach=True or fused=False to choose otherwise). With offload="optimizer" (by default what parallelize() was
    given) an OffloadedAdamW keeping master weights and states in CPU memory; under offload="params" FSDP2 already
    keeps the shards there."""
    setup = training_setup(model)
    offload = offload or setup.offload
    if offload not in OFFLOAD:
        raise TrainingError(f"offload must be one of {OFFLOAD}, got {offload!r}")
    if offload == "params" and setup.offload != "params":
        raise TrainingError("build_optimizer(offload='params') needs parallelize(model, offload='params'): "
                            "FSDP2 moves the parameters, not the optimizer")
    trainable = [p for p in model.parameters() if p.requires_grad]  # with LoRA: the adapters only
    if offload == "optimizer":
        return OffloadedAdamW(trainable, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, **kwargs)
    if "fused" not in kwargs and "foreach" not in kwargs:
        kwargs["fused"] = _fused_kernel_runs(trainable)
    return torch.optim.AdamW(trainable, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, **kwargs)


def _fused_kernel_runs(params) -> bool:
    """torch's fused AdamW takes these parameters: floating point, on a device it has the kernel for."""
    from torch.optim.optimizer import _get_fused_kernels_supported_devices

    devices = _get_fused_kernels_supported_devices()
    return bool(params) and all(p.is_floating_point() and p.device.type in devices for p in params)


__all__ = ["parallelize", "apply_plan", "build_optimizer", "forward_backward", "clip_grad_norm_", "global_grad_norm",
           "apply_activation_checkpointing", "training_setup", "PipelineError", "TrainingError"]
