"""Pipeline parallelism: a model's layers split into stages, run by torch.distributed.pipelining schedules.

A pp rank holds one or more (virtual) stages of the same ParallelModel. Each is a `StageModule` owning a
contiguous run of global layers, plus the model's other children (embeddings) on stage 0 and (final norm,
head, a tied embedding copy) on the last stage. Virtual stage k of rank r is stage r + k*pp, the looped
placement of torch's interleaved schedules; the model's `layer_ids` (see `partition.rank_layers`) decide
how many virtual stages a rank has: one per contiguous run.

Stage inputs and outputs are declared statically (their shapes follow from the batch), so torch never runs
its shape-inference pass through our tensor-parallel collectives. Every rank gets the same batch, and
every stage rebuilds the BatchContext (masks, positions, and extra per-sample inputs such as BERT's
token_type_ids, split into micro-batches like input_ids) from it; only hidden states travel between stages
(with MoE router losses, also the router statistics of the layers so far: see `carries_router_stats`).
"""
from __future__ import annotations

from dataclasses import fields

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.pipelining import (PipelineStage, Schedule1F1B, ScheduleGPipe, ScheduleInterleaved1F1B,
                                          ScheduleInterleavedZeroBubble)

from colozoo.models.base import ModelOutput
from colozoo.runtime.context_parallel import shard_batch
from colozoo.runtime.errors import PipelineError
from colozoo.runtime.options import SCHEDULES as SCHEDULE_NAMES

SCHEDULES = {
    "gpipe": ScheduleGPipe,
    "1f1b": Schedule1F1B,
    "interleaved_1f1b": ScheduleInterleaved1F1B,
    "zero_bubble": ScheduleInterleavedZeroBubble,  # ZB1P: input and weight gradients split to fill the bubble
}
assert tuple(SCHEDULES) == SCHEDULE_NAMES
MULTI_STAGE = {"interleaved_1f1b", "zero_bubble"}
LOGITS = [f.name for f in fields(ModelOutput)].index("logits")  # where a stage's eval tuple holds the logits


class StepScales:
    """Per-step values a training step hands every stage's forward (an argument, never module state). A plain
    class, not a dataclass: DDP and FSDP copy dataclass arguments, and `router_losses` is written to."""

    def __init__(self, loss_scale: float = 1.0, router_loss_scale: float | None = None, grad_scale: float = 1.0):
        self.loss_scale = loss_scale                # turns a micro-batch mean into its share of the global mean
        self.router_loss_scale = router_loss_scale  # MoE: the weight of a micro-batch's router losses
        self.grad_scale = grad_scale                # fp16 loss scaling multiplies the loss the backward starts from
        self.router_losses: list[torch.Tensor] = []  # out: their detached values, for the reported loss


def layer_runs(layer_ids: list[int]) -> list[list[int]]:
    """Split a rank's global layer indices into contiguous runs: one per virtual stage."""
    runs: list[list[int]] = []
    for i in layer_ids:
        if runs and i == runs[-1][-1] + 1:
            runs[-1].append(i)
        else:
            runs.append([i])
    return runs


class StageModule(nn.Module):
    """One (virtual) stage: forward(first stage: input_ids | later: hidden, **batch) -> hidden, or on the last
    stage the loss scaled for the global batch (training) / the ModelOutput's fields with `eval_outputs=True`."""

    def __init__(self, model, index: int, num_stages: int, layer_ids: list[int], *, autocast_dtype=None,
                 activation_dtype=None, data_group=None):
        super().__init__()
        self._model = [model]  # not a child: each stage owns only its part of the model's parameters
        self.index, self.num_stages = index, num_stages
        self.is_first, self.is_last = index == 0, index == num_stages - 1
        self.layers = nn.ModuleDict({str(i): model.layers[str(i)] for i in layer_ids})
        if self.is_first or self.is_last:  # pp > 1 puts them on different ranks; pp == 1 has one stage
            self.edges = nn.ModuleDict({name: m for name, m in model.named_children() if name != "layers"})
        self.autocast_dtype = autocast_dtype      # mixed precision by autocast (without FSDP's policy)
        self.activation_dtype = activation_dtype  # dtype of the hidden states sent between stages (None: the parameters')
        self.data_group = data_group              # where batch statistics (MoE router losses) are summed

    @property
    def model(self):
        return self._model[0]

    def forward(self, x, router_stats=None, *, token_ids, labels=None, attention_mask=None,
                eval_outputs: bool = False, return_logits: bool = False, step: StepScales | None = None,
                cache=None, token_rows=None, **inputs):
        """x: the input_ids on the first stage, else the previous stage's hidden states; token_ids: the input_ids
        (every stage rebuilds the batch context from them and the other model `inputs`, e.g. position_ids).
        With MoE router losses, earlier stages' `router_stats` come along with the hidden states and this stage
        hands on the sum with its own layers' (the last stage's losses need every layer's). `step`: the training
        step's scales (a forward without labels needs none); `cache`: the KV cache of incremental decoding;
        `token_rows`: the token embedding's rows of x, known already (greedy decoding, runtime.generate)."""
        model = self.model
        with torch.autocast(x.device.type, dtype=self.autocast_dtype, enabled=self.autocast_dtype is not None):
            if not eval_outputs or cache is not None:  # hidden states are outputs of an eval forward only
                inputs["output_hidden_states"] = False
            ctx = model.context(token_ids, attention_mask, **inputs)
            ctx.data_group, ctx.cache, ctx.token_rows = self.data_group, cache, token_rows
            if router_stats is not None:
                ctx.router_stats_in = router_stats
            if model.pc.config.cp > 1:  # context parallel: this rank's zigzag share of the sequence
                ctx = shard_batch(model, ctx, model.run.cp_mode)
                x = ctx.cp.shard(x) if self.is_first else x
            hidden = model.embed(x, ctx) if self.is_first else x
            hidden = model.run_layers(hidden, ctx, self.layers)
            if cache is not None and self.is_last:
                hidden = hidden[:, -1:]  # generating: only the last position's logits are wanted
            if not self.is_last:
                hidden = hidden.to(self.activation_dtype or hidden.dtype).contiguous()  # p2p sends need contiguous
                if carries_router_stats(model, getattr(ctx, "output_router_logits", None)):
                    return hidden, model.router_statistics(ctx, hidden.device)
                return hidden
            out = model.head(hidden, ctx, labels=labels, return_logits=eval_outputs and return_logits)
        if eval_outputs:  # a plain tuple: DDP/FSDP wrappers look for tensors in what a stage returns
            return tuple(getattr(out, f.name) for f in fields(out))
        step = step or StepScales()
        loss = out.loss.float() * model.loss_token_count(labels) * step.loss_scale
        if out.router_loss is not None and step.router_loss_scale is not None:
            # router losses are statistics of the whole micro-batch (over every data rank), not token means
            router = out.router_loss.float()
            loss = loss + router * (step.router_loss_scale - model.loss_token_count(labels) * step.loss_scale)
            step.router_losses.append(router.detach())
        return loss * step.grad_scale if step.grad_scale != 1.0 else loss


def carries_router_stats(model, output_router_logits: bool | None = None) -> bool:
    """Do stages hand MoE router statistics on? With the router losses on (the batch's choice, else the config's)
    and pp > 1."""
    if not hasattr(model, "router_statistics") or model.pc.config.pp == 1:
        return False
    if output_router_logits is None:
        output_router_logits = getattr(model.config, "output_router_logits", False)
    return bool(output_router_logits)


def build_stage_modules(model, **options) -> list[StageModule]:
    """This rank's (virtual) stages of `model`; `options` go to every StageModule."""
    pp = model.pc.config.pp
    runs = layer_runs(model.layer_ids)
    every_rank = [runs]
    if pp > 1:
        every_rank = [None] * pp
        dist.all_gather_object(every_rank, runs, group=model.pc.group("pp"))
    counts = [len(r) for r in every_rank]
    if len(set(counts)) != 1:
        raise PipelineError(f"every pp rank needs the same number of virtual stages (contiguous layer runs); "
                            f"got {counts} (build layer_ids with colozoo.core.partition.rank_layers)")
    in_stage_order = [i for k in range(counts[0]) for rank_runs in every_rank for i in rank_runs[k]]
    if in_stage_order != list(range(model.num_layers(model.config))):
        raise PipelineError(f"layers per pp rank {every_rank} are not in stage order: virtual stage k of rank r "
                            f"must follow stage k of rank r-1 (build layer_ids with colozoo.core.partition.rank_layers)")
    if model._parameters:
        raise PipelineError(f"{type(model).__name__} holds parameters directly ({list(model._parameters)}); "
                            f"stages only place whole child modules")
    num_stages = pp * len(runs)
    rank = model.pc.rank("pp")
    return [StageModule(model, rank + k * pp, num_stages, layers, **options) for k, layers in enumerate(runs)]


def stages_of(model) -> list[nn.Module]:
    """The (possibly FSDP/DDP-wrapped) stage modules of a model's run, built on first use."""
    return model.run.stages


def unwrap(stage: nn.Module) -> StageModule:
    return stage.module if isinstance(stage, nn.parallel.DistributedDataParallel) else stage


def hidden_shape(model, batch: int, input_ids) -> tuple[int, ...]:
    """Shape of the hidden states between stages; a family with other activations defines `stage_hidden_shape`."""
    if hasattr(model, "stage_hidden_shape"):
        return tuple(model.stage_hidden_shape(batch, input_ids))
    local_seq = input_ids.shape[1] // model.pc.config.cp  # context parallel: the rank's share of the sequence
    local_seq = local_seq // model.pc.tp_size if model.sequence_parallel else local_seq
    return batch, local_seq, model.config.hidden_size


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
    """One forward+backward of the whole batch through the pipeline; returns the sum of the scaled micro-batch
    losses on the ranks that hold the last stage, None elsewhere. Gradients accumulate on the local shards.
    `inputs`: further model inputs (e.g. token_type_ids); tensors are split into micro-batches by rows."""
    schedule = schedule_name(schedule)
    stages = stages_of(model)
    if schedule not in MULTI_STAGE and len(stages) > 1:
        raise PipelineError(f"schedule {schedule!r} runs one stage per rank, but this model holds {len(stages)} "
                            f"virtual stages per rank; use one of {sorted(MULTI_STAGE)}")
    if schedule != "gpipe" and num_microbatches < model.pc.config.pp:
        raise PipelineError(f"schedule {schedule!r} needs at least as many micro-batches as pipeline ranks "
                            f"({model.pc.config.pp}), got {num_microbatches}; raise num_microbatches or use 'gpipe'")
    runner = _runner(model, stages, schedule, num_microbatches, input_ids)
    losses: list[torch.Tensor] = []
    args = (input_ids,) if unwrap(stages[0]).is_first else ()
    # `step` is no tensor: torch's micro-batch split hands the same object to every micro-batch
    runner.step(*args, target=labels, losses=losses, return_outputs=False, step=step or StepScales(),
                **_batch_kwargs(input_ids, labels, attention_mask, dict(position_ids=position_ids, **inputs)))
    holds_last = any(unwrap(s).is_last for s in stages)
    return torch.stack([l.detach() for l in losses]).sum() if holds_last else None


def _runner(model, stages, schedule, num_microbatches, input_ids):
    """The torch schedule over this rank's stages, with static input/output shapes; cached per batch shape."""
    micro = input_ids.shape[0] // num_microbatches
    dtype = unwrap(stages[0]).activation_dtype or next(model.parameters()).dtype
    carry = carries_router_stats(model)
    key = (schedule, num_microbatches, tuple(input_ids.shape), input_ids.dtype, dtype, carry)
    cache = model.run.runners
    if key in cache:
        return cache[key]
    device = input_ids.device
    pipe_stages = []
    for stage in stages:
        inner = unwrap(stage)
        hidden = torch.empty(hidden_shape(model, micro, input_ids), dtype=dtype, device=device, requires_grad=True)
        first_input = torch.empty((micro, *input_ids.shape[1:]), dtype=input_ids.dtype, device=device)
        between = (hidden,)
        if carry:
            between += (torch.empty(model.router_stats_width(), device=device, requires_grad=True),)
        inputs = (first_input,) if inner.is_first else between
        outputs = (torch.empty((), device=device, requires_grad=True),) if inner.is_last else between
        pipe_stages.append(PipelineStage(stage, inner.index, inner.num_stages, device, input_args=inputs,
                                         output_args=outputs, group=model.pc.group("pp")))
    # the last stage already returns its loss scaled for the global batch: no loss_fn work, no grad scaling
    stage_arg = pipe_stages if schedule in MULTI_STAGE else pipe_stages[0]
    cache[key] = SCHEDULES[schedule](stage_arg, num_microbatches, loss_fn=_take_loss, scale_grads=False)
    return cache[key]


def _take_loss(output, target):
    return output


def _p2p_peer(model, stage_index: int) -> int:
    return dist.get_global_rank(model.pc.group("pp"), stage_index % model.pc.config.pp)


@torch.no_grad()
def pipeline_forward(model, input_ids, attention_mask=None, labels=None, return_logits=False,
                     **inputs) -> ModelOutput:
    """Eval forward of the whole batch through the stages (no micro-batching); every output the last stage
    computes (loss, logits, hidden states, pooled output) on every rank."""
    kwargs = _batch_kwargs(input_ids, labels, attention_mask, inputs)
    carry = carries_router_stats(model, inputs.get("output_router_logits"))
    outputs = through_stages(model, input_ids, carry=carry, eval_outputs=True, return_logits=return_logits, **kwargs)
    if model.pc.config.pp > 1:
        outputs = _from_last_stage(model, outputs)
    return ModelOutput(*outputs)


def through_stages(model, input_ids, carry: bool = False, **kwargs):
    """One batch through this rank's stages in order, hidden states passed to the next pp rank by p2p; returns
    what the last stage returns on the ranks holding it, None elsewhere. `kwargs` go to every stage."""
    stages = stages_of(model)
    dtype = unwrap(stages[0]).activation_dtype or next(model.parameters()).dtype
    outputs = None
    for stage in stages:
        inner = unwrap(stage)
        received = (input_ids,)
        if not inner.is_first:
            received = (torch.empty(hidden_shape(model, input_ids.shape[0], input_ids), dtype=dtype,
                                    device=input_ids.device),)
            if carry:
                received += (torch.empty(model.router_stats_width(), device=input_ids.device),)
            for t in received:
                dist.recv(t, src=_p2p_peer(model, inner.index - 1), group=None)
        out = stage(*received, **kwargs)
        if inner.is_last:
            outputs = out
        else:
            for t in (out if isinstance(out, tuple) else (out,)):
                dist.send(t.contiguous(), dst=_p2p_peer(model, inner.index + 1))
    return outputs


def _from_last_stage(model, values):
    """Broadcast the tuple of tensors (or Nones) the last stage computed to every pp rank."""
    group = model.pc.group("pp")
    src = dist.get_global_rank(group, model.pc.config.pp - 1)
    meta = [None if values is None else [(tuple(v.shape), v.dtype) if v is not None else None for v in values]]
    dist.broadcast_object_list(meta, src=src, group=group)
    received = []
    for i, shape_dtype in enumerate(meta[0]):
        if shape_dtype is None:
            received.append(None)
            continue
        value = values[i].contiguous() if values is not None else \
            torch.empty(shape_dtype[0], dtype=shape_dtype[1], device=model.pc.device)
        dist.broadcast(value, src=src, group=group)
        received.append(value)
    return tuple(received)
