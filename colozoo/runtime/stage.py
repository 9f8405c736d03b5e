"""The one forward path: a model's (virtual) pipeline stage, the module every forward runs through.

A rank holds one or more stages of the same ParallelModel. Each `Stage` owns a contiguous run of global layers, plus
the model's other children (embeddings) on stage 0 and (final norm, head, a tied embedding copy) on the last stage;
at pp = 1 the one stage holds the whole model. Virtual stage k of rank r is stage r + k*pp, the looped placement of
torch's interleaved schedules; the model's `layer_ids` (colozoo.core.partition.rank_layers) decide how many virtual
stages a rank has: one per contiguous run. The run builds the stages once, with itself (colozoo.runtime.run.Run).

A stage's forward takes the whole batch's inputs as keywords (every stage rebuilds the batch context from them:
masks, positions, BERT's token types, split into micro-batches like the ids), shards the batch for context
parallelism, runs its part and returns: hidden states to the next stage (with MoE router losses, also the router
statistics of the layers so far); on the last stage the ModelOutput, or with `step` (a training step) the loss
scaled for the global batch. Gradients follow the caller: a stage never switches them on or off.
"""
from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist
from torch import nn

from colozoo.layers.vocab import LogitsRequest
from colozoo.runtime.errors import PipelineError


class StepScales:
    """What a training step hands every stage's forward (an argument, never module state). A plain class, not a
    dataclass: DDP and FSDP copy dataclass arguments."""

    def __init__(self, loss_scale: float = 1.0, router_loss_scale: float | None = None, grad_scale: float = 1.0,
                 data_group=None, data_ranks: int = 1):
        self.loss_scale = loss_scale                # turns a micro-batch mean into its share of the global mean
        self.router_loss_scale = router_loss_scale  # MoE: the weight of a micro-batch's router losses
        self.grad_scale = grad_scale                # fp16 loss scaling multiplies the loss the backward starts from
        self.data_group = data_group                # where MoE router statistics are summed (every data rank's rows)
        self.data_ranks = data_ranks                # dp: the ranks whose losses the step sums

    objective = None  # a step on per-token log-probabilities (colozoo.runtime.logprobs.ObjectiveStep) sets one

    def scaled_loss(self, out, token_count) -> torch.Tensor:
        """The loss a micro-batch's backward starts from. Router losses are statistics of the whole micro-batch over
        every data rank, not token means: each data rank's backward weighs them by router_loss_scale, and its value
        counts 1 / data_ranks of that, so the sum of the ranks' values holds them once."""
        with_router = out.router_loss is not None and self.router_loss_scale is not None
        router = out.router_loss.float() if with_router else None
        token_part = out.loss.float() - router if with_router else out.loss.float()
        # a micro-batch without a labelled token (its mean is NaN) weighs 0, not NaN x 0; its gradient is 0
        loss = torch.where(token_count > 0, token_part, 0.0) * token_count * self.loss_scale
        if with_router:
            weighted = router * self.router_loss_scale
            loss = loss + weighted + (weighted / self.data_ranks - weighted).detach()
        return loss * self.grad_scale if self.grad_scale != 1.0 else loss


def layer_runs(layer_ids: list[int]) -> list[list[int]]:
    """Split a rank's global layer indices into contiguous runs: one per virtual stage."""
    runs: list[list[int]] = []
    for i in layer_ids:
        if runs and i == runs[-1][-1] + 1:
            runs[-1].append(i)
        else:
            runs.append([i])
    return runs


class Stage(nn.Module):
    def __init__(self, model, index: int, num_stages: int, layer_ids: list[int]):
        super().__init__()
        self.__dict__["model"] = model  # a plain attribute, not a child: a stage owns only its part of the model
        self.index, self.num_stages = index, num_stages
        self.is_first, self.is_last = index == 0, index == num_stages - 1
        self.layers = nn.ModuleDict({str(i): model.layers[str(i)] for i in layer_ids})
        if self.is_first or self.is_last:  # the embeddings and the head: pp > 1 puts them on different ranks
            self.ends = nn.ModuleDict({name: module for name, module in model.named_children() if name != "layers"})
        # what setting the run up decides, once, before its first call (parallelize, compile_layers)
        self.autocast_dtype = None    # mixed precision by autocast (parallelize without FSDP's policy)
        self.activation_dtype = None  # dtype of the hidden states sent between stages (None: the parameters')
        self.compiled = None          # the torch.compile backend its layers' bodies run with (runtime.compile)

    def forward(self, x, router_stats=None, *, token_ids, labels=None, attention_mask=None,
                logits: LogitsRequest = LogitsRequest(), cp_mode: str = "ring", step: StepScales | None = None,
                cache=None, token_rows=None, row_ids=None, **inputs):
        """x: the input_ids (pixel_values) on the first stage, else the previous stage's hidden states; token_ids:
        the input_ids (every stage rebuilds the batch context from them and the other model `inputs`, e.g.
        position_ids). `router_stats`: the MoE router statistics of earlier stages, handed on summed with this
        stage's. `logits`: what the last stage returns of them; `cp_mode`: context parallelism's attention ("ring"
        or "all_to_all"); `step`: a training step's scales (the last stage then returns the scaled loss); `cache`:
        the KV cache of incremental decoding; `token_rows`: the token embedding's rows of x, known already (greedy
        decoding under tensor parallelism; a forward's inputs_embeds); `row_ids`: the micro-batch's rows of the step's
        per-row values (a step with an objective on per-token log-probabilities, whose loss the last stage returns)."""
        model = self.model
        autocast = self.autocast_dtype is not None
        with torch.autocast(x.device.type, dtype=self.autocast_dtype) if autocast else contextlib.nullcontext():
            if step is not None or cache is not None:  # hidden states are outputs of a plain forward only
                inputs["output_hidden_states"] = False
            batch = model.context(token_ids, attention_mask, **inputs)
            batch.cache = cache
            batch.data_group = step.data_group if step is not None else None
            if router_stats is not None:
                batch.router_stats_in = router_stats
            if model.parallel.config.cp > 1:  # context parallel: this rank's zigzag share of the sequence
                sp_tp = model.parallel.tp_size if model.sequence_parallel else 1
                batch = batch.shard_sequence(model.parallel.group("cp"), cp_mode, sp_tp)
                x = batch.cp.shard(x) if self.is_first else x
                token_rows = batch.cp.shard(token_rows) if token_rows is not None and self.is_first else None
            batch.token_rows = token_rows
            hidden = model.embed(x, batch) if self.is_first else x
            hidden = model.forward_layers(hidden, batch, self.layers)
            if not self.is_last:
                hidden = hidden.to(self.activation_dtype or hidden.dtype).contiguous()  # p2p sends need contiguous
                if model.carries_router_stats(batch.output_router_logits):
                    return hidden, model.router_statistics(batch, hidden.device)
                return hidden
            on_logps = step is not None and step.objective is not None
            if on_logps:  # the loss is the step's, from the log-probs of the labels on this rank's vocab slice
                out = model.head(hidden, batch, logits=LogitsRequest("vocab_slice"))
            else:
                out = model.head(hidden, batch, labels=labels, logits=logits if step is None else LogitsRequest("none"))
        if step is None:
            return out
        if on_logps:
            return step.objective_loss(model.get_output_embeddings(), out.logits, labels, row_ids, cp=batch.cp)
        return step.scaled_loss(out, model.loss_token_count(labels))


def build_stages(model) -> list[Stage]:
    """This rank's (virtual) stages of `model` (collective over the pp group)."""
    pp = model.parallel.config.pp
    runs = layer_runs(model.layer_ids)
    every_rank = [runs]
    if pp > 1 and model.parallel.mesh is None:  # a virtual context (a meta model built offline): no ranks to ask
        every_rank = None
    elif pp > 1:
        every_rank = [None] * pp
        dist.all_gather_object(every_rank, runs, group=model.parallel.group("pp"))
    if every_rank is not None:
        _check_placement(model, every_rank)
    if model._parameters:
        raise PipelineError(f"{type(model).__name__} holds parameters directly ({list(model._parameters)}); "
                            f"stages only place whole child modules")
    num_stages = pp * len(runs)
    rank = model.parallel.rank("pp")
    return [Stage(model, rank + k * pp, num_stages, layers) for k, layers in enumerate(runs)]


def _check_placement(model, every_rank: list[list[list[int]]]):
    """Every pp rank holds as many virtual stages, and they are in stage order."""
    counts = [len(r) for r in every_rank]
    if len(set(counts)) != 1:
        raise PipelineError(f"every pp rank needs the same number of virtual stages (contiguous layer runs); "
                            f"got {counts} (build layer_ids with colozoo.core.partition.rank_layers)")
    in_stage_order = [i for k in range(counts[0]) for rank_runs in every_rank for i in rank_runs[k]]
    if in_stage_order != list(range(model.num_layers(model.config))):
        raise PipelineError(f"layers per pp rank {every_rank} are not in stage order: virtual stage k of rank r "
                            f"must follow stage k of rank r-1 (build layer_ids with colozoo.core.partition.rank_layers)")


def unwrap(stage: nn.Module) -> Stage:
    return stage.module if isinstance(stage, nn.parallel.DistributedDataParallel) else stage
