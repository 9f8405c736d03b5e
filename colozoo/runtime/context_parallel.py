"""A batch on a context-parallel mesh: every rank keeps its zigzag share of the sequence (see
colozoo.layers.context_parallel for the sharding and the attention across ranks)."""
from __future__ import annotations

from colozoo.layers.context_parallel import ContextParallel


def shard_batch(model, ctx, cp_mode: str = "ring"):
    """Turn the family's BatchContext of the full batch into this rank's cp share (in place).

    Positions come from the full batch (they may depend on the padding, as in OPT) and are then sharded; the
    dense (S, S) mask is dropped: cp attention builds its masks per block from the padding mask, positions and the
    packed documents' ids."""
    pc = model.pc
    # packed document ids come from the full batch's positions, before they are sharded
    cp = ContextParallel(pc.group("cp"), cp_mode, ctx.seq_len, ctx.attention_mask, documents=ctx.documents)
    local = ctx.seq_len // cp.size
    if model.sequence_parallel and local % pc.tp_size:
        raise ValueError(f"sequence parallel needs the per-rank sequence ({local} = {ctx.seq_len}/cp) divisible by "
                         f"tp={pc.tp_size}")
    ctx.mask, ctx.seq_len, ctx.cp = None, local, cp
    ctx.position_ids = cp.shard(ctx.position_ids)
    return ctx


def context_parallel_forward(model, input_ids, attention_mask=None, labels=None, return_logits=False,
                             cp_mode: str = "ring", **kwargs):
    """The model's forward under cp > 1 (pp == 1): shard the batch in zigzag order, run embed / layers / head.
    With pp > 1 the pipeline's stages call `shard_batch` themselves."""
    ctx = shard_batch(model, model.context(input_ids, attention_mask, **kwargs), cp_mode)
    hidden = model.embed(ctx.cp.shard(input_ids), ctx)
    hidden = model.run_layers(hidden, ctx)
    return model.head(hidden, ctx, labels=labels, return_logits=return_logits)
