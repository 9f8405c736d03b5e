"""Steps whose loss is a function of per-token log-probabilities (preference tuning, policy gradients), on any mesh.

    def objective(logps, labels, rows):          # logps (n, L): log p(labels[t] | tokens before t), 0 where unlabelled
        share = ...                              # this micro-batch's share of the global batch's loss
        return share, {"name": per_row_tensor}   # per-row values to report (detached by the step)

    loss, stats = forward_backward_logps(model, input_ids, labels, objective, rows={"ref_logps": ref})
    stats = forward_logps(model, input_ids, labels)["logps"]      # no gradients: the per-token log-probs alone

The log-probabilities come from each tensor-parallel rank's vocabulary slice of the logits through the
vocab-parallel cross entropy (the vocabulary is never gathered). `rows` are per-row tensors of the global batch
(reference log-probs, advantages, old log-probs) that travel with their rows: each micro-batch's objective sees
exactly its rows' values. They stay in the step object and only the rows' indices travel through the stages and
the pipeline schedule (an integer tensor, which mixed precision never casts), so the objective reads them in full
precision. The objective runs on the last pipeline stage; its per-row values come back from every rank in the
global batch's row order. Rows of one micro-batch stay together: a pair of sequences in one row (or any group of
rows whose objective needs them together) never straddles two micro-batches or two data-parallel ranks.

`temperature` divides the logits first (the log-probs of the distribution a sampler drew from at that temperature);
with `entropy=True` the objective also finds rows["entropy"] (n, L): the entropy of each labelled position's
next-token distribution, laid out like the log-probs (a metric: no gradient).
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from colozoo.runtime.pipeline import through_stages
from colozoo.runtime.stage import StepScales
from colozoo.runtime.step import check_batch, dp_rows, global_loss, run_step


class ObjectiveStep(StepScales):
    """The scales of a step whose last stage hands the per-token log-probs of the labels to `objective` (see the
    module), with the global batch's `rows` at the micro-batch's row indices; it keeps each micro-batch's reported
    values until the step returns them."""

    def __init__(self, objective, rows: dict, replicas: int, grad_scale: float = 1.0, data_group=None,
                 data_ranks: int = 1, temperature: float = 1.0, entropy: bool = False):
        super().__init__(loss_scale=replicas, grad_scale=grad_scale, data_group=data_group, data_ranks=data_ranks)
        self.objective, self.rows = objective, rows
        self.temperature, self.entropy = temperature, entropy
        self.reported: list[tuple[torch.Tensor, dict]] = []

    def objective_loss(self, head, logits, labels, row_ids, cp=None) -> torch.Tensor:
        """The micro-batch's loss for the backward from the last stage's vocab slice of the logits (`head`: the
        vocab-parallel LM head): its share of the global loss times dp*cp (undoing the data-parallel gradient average)
        and the fp16 loss scale."""
        if self.temperature != 1.0:
            logits = logits / self.temperature
        rows = {k: v[row_ids] for k, v in self.rows.items()}
        if self.entropy:  # from the same pass over the vocab slice as the log-probs
            logps, rows["entropy"] = head.label_log_probs_and_entropy(logits, labels, cp=cp)
        else:
            logps = head.label_log_probs(logits, labels, cp=cp)
        with torch.autocast(logps.device.type, enabled=False):
            share, values = self.objective(logps.float(), labels, rows)
        self.reported.append((row_ids, {k: v.detach() for k, v in values.items()}))
        loss = share.float() * self.loss_scale
        return loss * self.grad_scale if self.grad_scale != 1.0 else loss


def forward_backward_logps(model, input_ids, labels, objective, attention_mask=None, position_ids=None,
                           rows: dict | None = None, num_microbatches: int = 1, schedule: str = "1f1b",
                           grad_scale: float = 1.0, temperature: float = 1.0, entropy: bool = False,
                           cp_mode: str = "ring") -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Forward and backward of the global batch over the whole mesh with the loss `objective(logps, labels, rows)`
    (see the module): each dp rank trains on its rows, in `num_microbatches` micro-batches (the pipeline schedule at
    pp > 1). Gradients accumulate on the local shards. Returns (the global loss, the objective's per-row values for
    every row of the global batch), the same on every rank; `grad_scale` and `cp_mode` as in forward_backward;
    `temperature` and `entropy` as in the module. An MoE model whose config asks for the router losses is refused:
    this loss does not add them (set config.output_router_logits = False to train without them)."""
    if model.router_stats_width() and getattr(model.config, "output_router_logits", False):
        raise ValueError("a loss on per-token log-probabilities does not add the MoE router losses the config asks for "
                         "(output_router_logits): set it to False to train without them")
    step, row_ids = _step(model, input_ids, labels, objective, rows, num_microbatches, grad_scale, temperature,
                          entropy)
    local_sum = run_step(model, input_ids, labels, attention_mask, position_ids, num_microbatches, schedule, step,
                         {"row_ids": row_ids, "cp_mode": cp_mode})  # row_ids: split over dp and micro-batches
    if local_sum is not None and grad_scale != 1.0:
        local_sum = local_sum / grad_scale
    return global_loss(model, local_sum), gather_reported(model, step)


def token_logps_objective(logps, labels, rows):
    """The objective of forward_logps' default: no loss, the per-token log-probs reported as "logps"."""
    return logps.sum() * 0.0, {"logps": logps}


@torch.no_grad()
def forward_logps(model, input_ids, labels, objective=token_logps_objective, attention_mask=None, position_ids=None,
                  rows: dict | None = None, num_microbatches: int = 1, temperature: float = 1.0,
                  entropy: bool = False, cp_mode: str = "ring") -> dict[str, torch.Tensor]:
    """The objective's per-row values of the global batch without gradients (and its loss as "loss"): each dp rank
    runs its rows, micro-batch by micro-batch, through its stages; the default objective reports the per-token
    log-probs of the labels as "logps" (n, L). Every dp rank must call it (a sharded forward is collective).
    `cp_mode`: context parallelism's attention, "ring" (the default) or "all_to_all"."""
    step, row_ids = _step(model, input_ids, labels, objective, rows, num_microbatches, 1.0, temperature, entropy)
    mine = dp_rows(model, input_ids.shape[0])
    local_rows = row_ids[mine]
    local = [t[mine] if t is not None else None for t in (input_ids, labels, attention_mask, position_ids)]
    carry = model.carries_router_stats()
    local_sum = None
    for i, row_ids in enumerate(local_rows.tensor_split(num_microbatches)):
        ids, lab, mask, pos = (t.tensor_split(num_microbatches)[i] if t is not None else None for t in local)
        out = through_stages(model, ids, carry=carry, token_ids=ids, labels=lab, step=step, row_ids=row_ids,
                             cp_mode=cp_mode, **{k: v for k, v in (("attention_mask", mask), ("position_ids", pos))
                                                 if v is not None})
        if out is not None:
            local_sum = out if local_sum is None else local_sum + out
    return {**gather_reported(model, step), "loss": global_loss(model, local_sum)}


def _step(model, input_ids, labels, objective, rows, num_microbatches, grad_scale=1.0, temperature=1.0,
          entropy=False):
    """The ObjectiveStep of the global batch's `rows`, and the indices of all its rows (which travel with the rows
    through the split over dp ranks and micro-batches)."""
    parallel = model.parallel
    rows = {k: v.to(parallel.device) for k, v in (rows or {}).items()}
    check_batch(model, input_ids, labels, num_microbatches, rows)
    step = ObjectiveStep(objective, rows, parallel.size("dp_cp"), grad_scale, parallel.group("dp_cp"),
                         parallel.size("dp"),
                         temperature, entropy)
    return step, torch.arange(input_ids.shape[0], device=parallel.device)


def gather_reported(model, step: ObjectiveStep) -> dict[str, torch.Tensor]:
    """The per-row values the objective reported, for every row of the global batch in order, on every rank:
    gathered over dp from the last stage's micro-batches, then sent to the other pipeline stages."""
    parallel = model.parallel
    values = None
    if step.reported:
        order = torch.cat([row_ids for row_ids, _ in step.reported]).argsort()
        values = {k: torch.cat([v[k] for _, v in step.reported])[order] for k in step.reported[0][1]}
        if parallel.size("dp") > 1:
            values = {k: _all_gather(v, parallel.group("dp"), parallel.size("dp")) for k, v in values.items()}
    if parallel.config.pp > 1:
        box = [None if values is None else {k: v.cpu() for k, v in values.items()}]
        group = parallel.group("pp")
        dist.broadcast_object_list(box, src=dist.get_global_rank(group, parallel.config.pp - 1), group=group)
        values = {k: v.to(parallel.device) for k, v in box[0].items()}
    return values or {}


def _all_gather(t: torch.Tensor, group, size: int) -> torch.Tensor:
    parts = [torch.empty_like(t) for _ in range(size)]
    dist.all_gather(parts, t.contiguous(), group=group)
    return torch.cat(parts)
