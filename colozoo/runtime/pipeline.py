"""The one driver above the stages, at every pp: a forward runs a batch through this rank's stages in order, a
training step runs its micro-batches through them by a schedule. At pp = 1 both are the trivial case of the same
code: one stage, nothing sent.

    through_stages(model, input_ids, **kw)   # one batch, stage after stage, hidden states passed on by p2p: every
                                             # forward, evaluation, log-probs and generation step (the KV cache's too)
    pipeline_forward(model, input_ids, **kw) # the same, with the last stage's outputs on every rank (model(...))
    run_schedule(model, input_ids, labels, num_microbatches=, schedule=, step=)  # a training step: at pp > 1 a
                                             # torch.distributed.pipelining schedule; at pp = 1 its trivial case,
                                             # each micro-batch forward then backward, one after another

Stage inputs and outputs are declared statically (their shapes follow from the batch), so torch never runs its
shape-inference pass through our tensor-parallel collectives. Every rank gets the same batch, and every stage
rebuilds the batch context from it; only hidden states travel between stages (with MoE router losses, also the
router statistics of the layers so far: `model.carries_router_stats`). A schedule is built for the call that runs it
(it depends on the stages, the batch and the options, and nothing of it is kept). Measured at pp=4, 8 micro-batches,
on 4 gloo ranks sharing 2 CPU cores: building it takes 0.2 ms and the set-up torch does on a schedule's first step
11 ms, against 110 ms for a step of a 64-wide GPT-2 with a reused schedule (about 10% there, far less on a real
model).
"""
from __future__ import annotations

import contextlib
from dataclasses import fields

import torch
import torch.distributed as dist
from torch.distributed.pipelining import (PipelineStage, Schedule1F1B, ScheduleGPipe, ScheduleInterleaved1F1B,
                                          ScheduleInterleavedZeroBubble)

from colozoo.models.outputs import ModelOutput
from colozoo.runtime.errors import PipelineError
from colozoo.runtime.options import MULTI_STAGE_SCHEDULES, SCHEDULES as SCHEDULE_NAMES
from colozoo.runtime.stage import StepScales, unwrap

SCHEDULES = {
    "gpipe": ScheduleGPipe,
    "1f1b": Schedule1F1B,
    "interleaved_1f1b": ScheduleInterleaved1F1B,
    "zero_bubble": ScheduleInterleavedZeroBubble,  # ZB1P: input and weight gradients split to fill the bubble
}
assert tuple(SCHEDULES) == SCHEDULE_NAMES


def stages_of(model) -> list:
    """The (possibly FSDP/DDP-wrapped) stage modules of a model's run."""
    return model._run().stages


def _batch_kwargs(input_ids, labels, attention_mask, inputs: dict):
    """The stage keywords; tensors among them are split into micro-batches along the batch dimension."""
    kwargs = dict(token_ids=input_ids, labels=labels, attention_mask=attention_mask, **inputs)
    return {k: v for k, v in kwargs.items() if v is not None}


def schedule_name(name: str) -> str:
    """Canonical schedule name: case, '-' and '_' do not matter ("GPipe", "1F1B", "Interleaved1F1B", ...)."""
    key = name.lower().replace("_", "").replace("-", "")
    aliases = {n.replace("_", ""): n for n in SCHEDULES} | {"interleavedzerobubble": "zero_bubble", "zb1p": "zero_bubble"}
    if key not in aliases:
        raise PipelineError(f"unknown pipeline schedule {name!r}; choose one of {sorted(SCHEDULES)}")
    return aliases[key]


def run_schedule(model, input_ids, labels, attention_mask=None, position_ids=None, num_microbatches: int = 1,
                 schedule: str = "1f1b", step: StepScales | None = None, **inputs) -> torch.Tensor | None:
    """One forward+backward of the whole batch through this rank's stages, in `num_microbatches` micro-batches;
    returns the sum of the scaled micro-batch losses on the ranks that hold the last stage, None elsewhere. Gradients
    accumulate on the local shards (reduced over data parallelism after the last micro-batch). `inputs`: further model
    inputs (e.g. token_type_ids); tensors are split into micro-batches by rows, like input_ids."""
    schedule = schedule_name(schedule)
    stages = stages_of(model)
    kwargs = _batch_kwargs(input_ids, labels, attention_mask, dict(position_ids=position_ids, **inputs))
    step = step or StepScales()
    if model.parallel.config.pp == 1:
        stage, = stages
        return _one_after_another(stage, input_ids, kwargs, num_microbatches, step)
    if schedule not in MULTI_STAGE_SCHEDULES and len(stages) > 1:
        raise PipelineError(f"schedule {schedule!r} runs one stage per rank, but this model holds {len(stages)} "
                            f"virtual stages per rank; use one of {sorted(MULTI_STAGE_SCHEDULES)}")
    if schedule != "gpipe" and num_microbatches < model.parallel.config.pp:
        raise PipelineError(f"schedule {schedule!r} needs at least as many micro-batches as pipeline ranks "
                            f"({model.parallel.config.pp}), got {num_microbatches}; raise num_microbatches or use "
                            f"'gpipe'")
    carry = model.carries_router_stats(inputs.get("output_router_logits"))
    runner = _runner(model, stages, schedule, num_microbatches, input_ids, carry)
    losses: list[torch.Tensor] = []
    args = (input_ids,) if unwrap(stages[0]).is_first else ()
    # `step` is no tensor: torch's micro-batch split hands the same object to every micro-batch
    runner.step(*args, target=labels, losses=losses, return_outputs=False, step=step, **kwargs)
    holds_last = any(unwrap(s).is_last for s in stages)
    return torch.stack([l.detach() for l in losses]).sum() if holds_last else None


def _one_after_another(stage, input_ids, kwargs: dict, num_microbatches: int, step: StepScales) -> torch.Tensor:
    """The schedule of one stage (pp = 1): each micro-batch forward, then its backward, one after another."""
    chunks = {k: v.tensor_split(num_microbatches) if isinstance(v, torch.Tensor) else [v] * num_microbatches
              for k, v in kwargs.items()}
    total = torch.zeros((), device=input_ids.device)
    for i, ids in enumerate(input_ids.tensor_split(num_microbatches)):
        with _gradient_sync(stage, last=i == num_microbatches - 1):
            loss = stage(ids, step=step, **{k: v[i] for k, v in chunks.items()})
            loss.backward()
        total += loss.detach()
    return total


def _gradient_sync(stage, last: bool):
    """DDP reduces gradients over dp only after the last micro-batch; FSDP2 reduce-scatters every micro-batch's,
    so that no rank holds its stage's gradients whole (torch's schedules at pp > 1 keep them whole to the last)."""
    if isinstance(stage, torch.nn.parallel.DistributedDataParallel):
        return contextlib.nullcontext() if last else stage.no_sync()
    return contextlib.nullcontext()


def _runner(model, stages, schedule, num_microbatches, input_ids, carry: bool):
    """The torch schedule over this rank's stages for this batch, with static input/output shapes (`carry`: the MoE
    router statistics travel with the hidden states)."""
    micro = input_ids.shape[0] // num_microbatches
    dtype = unwrap(stages[0]).activation_dtype or next(model.parameters()).dtype
    device = input_ids.device
    pipe_stages = []
    for stage in stages:
        inner = unwrap(stage)
        hidden = torch.empty(model.stage_hidden_shape(micro, input_ids), dtype=dtype, device=device,
                             requires_grad=True)
        first_input = torch.empty((micro, *input_ids.shape[1:]), dtype=input_ids.dtype, device=device)
        between = (hidden,)
        if carry:
            between += (torch.empty(model.router_stats_width(), device=device, requires_grad=True),)
        inputs = (first_input,) if inner.is_first else between
        outputs = (torch.empty((), device=device, requires_grad=True),) if inner.is_last else between
        pipe_stages.append(PipelineStage(stage, inner.index, inner.num_stages, device, input_args=inputs,
                                         output_args=outputs, group=model.parallel.group("pp")))
    # the last stage already returns its loss scaled for the global batch: no loss_fn work, no grad scaling
    stage_arg = pipe_stages if schedule in MULTI_STAGE_SCHEDULES else pipe_stages[0]
    return SCHEDULES[schedule](stage_arg, num_microbatches, loss_fn=_take_loss, scale_grads=False)


def _take_loss(output, target):
    return output


def _p2p_peer(model, stage_index: int) -> int:
    return dist.get_global_rank(model.parallel.group("pp"), stage_index % model.parallel.config.pp)


def pipeline_forward(model, input_ids, **kwargs) -> ModelOutput:
    """A forward of the whole batch through the stages (no micro-batching): every output the last stage computes, on
    every rank. At pp = 1 the one stage's output, with the graph the caller's mode gives it; at pp > 1 no graph crosses
    the stages (the caller runs it without gradients)."""
    carry = model.carries_router_stats(kwargs.get("output_router_logits"))
    out = through_stages(model, input_ids, carry=carry, token_ids=input_ids, **kwargs)
    if model.parallel.config.pp == 1:
        return out
    values = None if out is None else tuple(getattr(out, f.name) for f in fields(ModelOutput))
    return ModelOutput(*_from_last_stage(model, values))


def through_stages(model, input_ids, carry: bool = False, **kwargs):
    """One batch through this rank's stages in order, hidden states passed to the next pp rank by p2p; returns
    what the last stage returns on the ranks holding it, None elsewhere. `kwargs` go to every stage. At pp = 1: the
    one stage's output."""
    stages = stages_of(model)
    outputs = None
    for stage in stages:
        inner = unwrap(stage)
        received = (input_ids,) if inner.is_first else _receive(model, inner, input_ids, carry)
        out = stage(*received, **kwargs)
        if inner.is_last:
            outputs = out
        else:
            for t in (out if isinstance(out, tuple) else (out,)):
                dist.send(t.contiguous(), dst=_p2p_peer(model, inner.index + 1))
    return outputs


def _receive(model, stage, input_ids, carry: bool) -> tuple[torch.Tensor, ...]:
    """The hidden states (and with `carry` the router statistics) the previous stage sends `stage`."""
    device = input_ids.device
    dtype = stage.activation_dtype or next(model.parameters()).dtype
    received = (torch.empty(model.stage_hidden_shape(input_ids.shape[0], input_ids), dtype=dtype, device=device),)
    if carry:
        received += (torch.empty(model.router_stats_width(), device=device),)
    for t in received:
        dist.recv(t, src=_p2p_peer(model, stage.index - 1), group=None)
    return received


def _from_last_stage(model, values):
    """Broadcast the tuple of tensors (or Nones) the last stage computed to every pp rank."""
    group = model.parallel.group("pp")
    src = dist.get_global_rank(group, model.parallel.config.pp - 1)
    meta = [None if values is None else [(tuple(v.shape), v.dtype) if v is not None else None for v in values]]
    dist.broadcast_object_list(meta, src=src, group=group)
    received = []
    for i, shape_dtype in enumerate(meta[0]):
        if shape_dtype is None:
            received.append(None)
            continue
        value = values[i].contiguous() if values is not None else \
            torch.empty(shape_dtype[0], dtype=shape_dtype[1], device=model.parallel.device)
        dist.broadcast(value, src=src, group=group)
        received.append(value)
    return tuple(received)
