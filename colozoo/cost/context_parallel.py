"""What context parallelism costs attention, term by term (ring attention: Liu et al. 2023; Megatron-Core / Transformer
Engine's context parallelism; the Llama 3 report, §3.3.2):

- each rank holds 1/cp of the sequence and its queries meet the keys of every chunk, one block a ring step; keys
  and values pass from rank to rank, forward once (and again when the layer is recomputed) and back with their
  gradients (twice the bytes). Only keys and values travel: with grouped-query attention that is 2 x kv_heads x
  head_dim a token, far less than the hidden state (`kv_bytes_per_token`; MLA: its decompressed heads);
- a step's transfer runs behind the step's block of attention (a stream of its own), so a ring is exposed only
  where one block's transfer outlasts one block's compute (`ring_steps`): long sequences hide it, short ones don't;
- under a causal mask the chunks are placed zigzag (rank r holds chunks r and 2cp - 1 - r), so every rank computes
  the same share of the (query, key) pairs: a rank's core is cp times its local one, no rank busier than the mean.
"""
from __future__ import annotations

from colozoo.cost.hardware import Hardware
from colozoo.cost.network import collective_seconds


def kv_bytes_per_token(config, tp: int, itemsize: int) -> float | None:
    """Bytes of the keys and values of one token on one tensor-parallel rank, from the family's attention widths
    (grouped-query heads, MLA's decompressed heads); None where unknown (no colozoo family)."""
    from colozoo.models import model_class

    try:
        family = model_class(config.model_type)
    except (AttributeError, ValueError):
        return None
    heads = config.num_attention_heads
    kv = getattr(config, "num_key_value_heads", None) or heads
    width = family.attention_size(config)[1] * kv / heads  # K and V of every kv head
    local = max(1, kv // tp)  # fewer key/value heads than tp ranks: each rank keeps a copy of one
    return width * local / kv * itemsize


def ring_steps(core_fwd: float, core_bwd: float, kv_bytes: float, cp: int, hw: Hardware, span: int,
               recomputed: bool = False) -> list[tuple[float, float, int]]:
    """(compute, transfer, how many) of the ring's steps of one layer and micro-batch: cp - 1 steps forward (twice
    when recomputed), each a block of the attention core (1/cp of the rank's core) and one pass of the keys and
    values; cp - 1 backward, with their gradients too."""
    if cp <= 1:
        return []
    steps = cp - 1
    send = lambda nbytes: collective_seconds(hw, "send_recv", nbytes, cp, span, 1)  # noqa: E731
    return [(core_fwd / cp, send(kv_bytes), steps * (2 if recomputed else 1)),
            (core_bwd / cp, send(2 * kv_bytes), steps)]
