"""The training step: forward and backward of the global batch over the whole mesh.

Every rank is given the same global batch; dp rank d trains on its 1/dp slice of the rows, and its cp ranks
on their zigzag shares of those rows' sequence. Each micro-batch loss is weighted by its share of the global
batch's loss tokens, so the gradients and the returned loss are those of the mean loss over the whole global
batch, on every rank. See colozoo.runtime.training for how gradients are reduced.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from colozoo.core.sequence import SPLIT_REASON
from colozoo.layers.shard import local_part
from colozoo.runtime.errors import TrainingError
from colozoo.runtime.parallelize import training_setup
from colozoo.runtime.pipeline import run_schedule
from colozoo.runtime.stage import StepScales


def forward_backward(model, input_ids, labels, attention_mask=None, num_microbatches: int = 1,
                     schedule: str = "1f1b", position_ids=None, grad_scale: float = 1.0, cp_mode: str = "ring",
                     **inputs) -> torch.Tensor:
    """Forward and backward of the global batch over the whole mesh. Gradients accumulate on the local shards
    (tied embedding copies summed between their stages); returns the global mean loss on every rank.
    `grad_scale`: the backward runs on the loss times this (fp16 loss scaling, see colozoo.runtime.amp), so gradients,
    router losses' included, come out scaled by it; the returned loss is not. `cp_mode`: context parallelism's
    attention ("ring", the default, or "all_to_all"), as in the forward.
    `inputs`: further model inputs (e.g. BERT's token_type_ids); tensors, like input_ids, hold one row per
    sample and are split over dp ranks and micro-batches."""
    parallel = model.parallel
    check_batch(model, input_ids, labels, num_microbatches, inputs)
    total_tokens = int(model.loss_token_count(labels))
    # each micro-batch mean is weighted by its tokens / global tokens; * dp*cp undoes FSDP/DDP's dp*cp average
    replicas = parallel.size("dp_cp")
    step = StepScales(loss_scale=replicas / max(total_tokens, 1), router_loss_scale=replicas / num_microbatches,
                      grad_scale=grad_scale, data_group=parallel.group("dp_cp"), data_ranks=parallel.size("dp"))
    local_sum = run_step(model, input_ids, labels, attention_mask, position_ids, num_microbatches, schedule, step,
                         dict(inputs, cp_mode=cp_mode))
    if local_sum is not None and grad_scale != 1.0:
        local_sum = local_sum / grad_scale  # exact for a power-of-two scale
    loss = global_loss(model, local_sum)
    # no labelled token in the whole batch: the mean over none is NaN, as the forward's (and transformers') loss;
    # the gradients it leaves are 0 (router losses' aside)
    return loss if total_tokens else torch.full_like(loss, torch.nan)


def check_batch(model, input_ids, labels, num_microbatches, inputs: dict):
    """One clear error for a batch the mesh cannot split: rows over dp x micro-batches, the sequence over cp, labels
    and other inputs of another batch size."""
    parallel = model.parallel
    dp = parallel.size("dp")
    if not isinstance(num_microbatches, int) or num_microbatches < 1:
        raise TrainingError(f"num_microbatches must be a positive integer, got {num_microbatches!r}")
    batch = input_ids.shape[0]
    if batch % (dp * num_microbatches):
        raise TrainingError(f"global batch size {batch} is not divisible by dp * num_microbatches = {dp} * "
                            f"{num_microbatches}; every data-parallel rank needs {num_microbatches} equal "
                            f"micro-batches")
    multiple = parallel.config.sequence_multiple
    if not input_ids.is_floating_point() and input_ids.shape[1] % multiple:  # images: the model pads its patches
        raise TrainingError(f"sequence length {input_ids.shape[1]} is not a multiple of {multiple}: {SPLIT_REASON}")
    if labels is None or labels.shape[:1] != input_ids.shape[:1]:
        raise TrainingError(f"labels must have the batch size of the inputs ({batch}), got "
                            f"{None if labels is None else tuple(labels.shape)}")
    for name, t in inputs.items():
        if isinstance(t, torch.Tensor) and t.shape[:1] != input_ids.shape[:1]:
            raise TrainingError(f"{name} must have the batch size of the inputs ({batch}), got {tuple(t.shape)}")


def dp_rows(model, batch: int) -> slice:
    """The rows of a global batch of `batch` rows this data-parallel rank trains on."""
    dp, rank = model.parallel.size("dp"), model.parallel.rank("dp")
    return slice(rank * batch // dp, (rank + 1) * batch // dp)


def run_step(model, input_ids, labels, attention_mask, position_ids, num_microbatches: int, schedule: str,
             step: StepScales, inputs: dict) -> torch.Tensor | None:
    """This dp rank's rows of the global batch forward and backward through the stages by the schedule runner
    (colozoo.runtime.pipeline.run_schedule, at every pp), every stage's forward given `step`; gradients accumulate on
    the local shards, tied embedding copies and experts reduced. Returns the sum of the micro-batches' scaled losses on the last stage, None elsewhere."""
    setup = training_setup(model)
    rows = dp_rows(model, input_ids.shape[0])
    local = [t[rows] if t is not None else None for t in (input_ids, labels, attention_mask, position_ids)]
    inputs = {k: v[rows] if isinstance(v, torch.Tensor) else v for k, v in inputs.items() if v is not None}
    tied_grad = _stash_tied_grad(model, setup)
    expert_grads = _stash_expert_grads(model, setup)
    local_sum = run_schedule(model, *local[:2], attention_mask=local[2], position_ids=local[3],
                             num_microbatches=num_microbatches, schedule=schedule, step=step, **inputs)
    _sum_tied_grad(model, setup, tied_grad)
    _reduce_expert_grads(model, setup, expert_grads)
    return local_sum


def _tied_param(model, setup):
    tied = setup.tied
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
    if p is None or not p.requires_grad:  # frozen (LoRA): no gradient to sum
        return
    if p.grad is None:
        p.grad = torch.zeros_like(p)
    dist.all_reduce(local_part(p.grad), group=setup.tied[1])
    if previous is not None:
        p.grad += previous


def _stash_expert_grads(model, setup) -> dict | None:
    """Under DDP the experts are reduced by hand: keep gradients of earlier steps aside, as for the tied copy."""
    if setup.sharded or not setup.experts or setup.data_parallel is None:
        return None
    stash = {}
    for name, p in model.named_parameters():
        if name in setup.experts and p.requires_grad:  # frozen experts (LoRA): no gradient to reduce
            stash[name], p.grad = p.grad, None
    return stash


def _reduce_expert_grads(model, setup, stash):
    """Sum this step's expert gradients over the ranks holding the same experts, divided like the others."""
    if stash is None:
        return
    parallel = model.parallel
    for name, p in model.named_parameters():
        if name not in stash:
            continue
        if p.grad is None:
            p.grad = torch.zeros_like(p)
        dist.all_reduce(p.grad, group=parallel.group("edp"))
        p.grad /= parallel.size("dp_cp")
        if stash[name] is not None:
            p.grad += stash[name]


def global_loss(model, local_sum) -> torch.Tensor:
    """Sum of the weighted micro-batch losses over dp, undoing the * dp*cp (cp ranks hold the same value; router
    losses count 1/dp on each data rank, see StepScales.scaled_loss), then sent from the last stage to all."""
    parallel = model.parallel
    if local_sum is None:
        local_sum = torch.zeros((), device=parallel.device)
    loss = local_sum.float() / parallel.size("dp_cp")
    if parallel.size("dp") > 1:
        dist.all_reduce(loss, group=parallel.group("dp"))
    if parallel.config.pp > 1:
        dist.broadcast(loss, src=dist.get_global_rank(parallel.group("pp"), parallel.config.pp - 1),
                       group=parallel.group("pp"))
    return loss
