"""What the tracer counts for the ops torch.utils.flop_counter leaves out or counts as one product: the FLOPs of
the CPU flash attention kernel and of torch._grouped_mm (MoE experts in bf16), and the (batch, m, n, k) shape a
grouped expert GEMM runs as. Below the tracer (colozoo.cost.trace) and the pricing modules both: shapes only."""
from __future__ import annotations

from math import prod

import torch
from torch.utils.flop_counter import flop_registry, sdpa_backward_flop_count, sdpa_flop_count, shape_wrapper

aten = torch.ops.aten


def _cpu_flash_flops(query, key, value, *args, out_shape=None, **kwargs):
    return sdpa_flop_count(query, key, value)


def _cpu_flash_backward_flops(grad_out, query, key, value, *args, out_shape=None, **kwargs):
    return sdpa_backward_flop_count(grad_out, query, key, value)


def _grouped_mm_flops(a_shape, b_shape, *args, out_shape=None, **kwargs):
    """torch._grouped_mm (MoE experts in bf16): (tokens, k) x (experts, k, n) forward; in the weight gradient
    (k, tokens) x (tokens, n) -> (experts, k, n), each token counts in one group only."""
    if len(a_shape) == 2 and len(b_shape) == 2:
        return 2 * a_shape[0] * a_shape[1] * b_shape[1]
    return 2 * prod(out_shape) * a_shape[-1]


# flop_counter knows the CUDA attention kernels but not the CPU flash kernel; same formula (full s x s, as
# flop_counter counts the CUDA ones). Pass these to FlopCounterMode(custom_mapping=...) to compare.
EXTRA_FLOP_FORMULAS = {
    aten._scaled_dot_product_flash_attention_for_cpu: _cpu_flash_flops,
    aten._scaled_dot_product_flash_attention_for_cpu_backward: _cpu_flash_backward_flops,
    aten._grouped_mm: _grouped_mm_flops,
}
FLOP_REGISTRY = {**flop_registry, **{op: shape_wrapper(f) for op, f in EXTRA_FLOP_FORMULAS.items()}}


def grouped_gemm_shape(op: str, args: tuple, kwargs: dict, out, flops: int) -> tuple | None:
    """(batch, m, n, k) of a grouped GEMM (torch._grouped_mm) with a 2-D output (tokens, n) over the experts its
    offsets end: each expert's tokens are a GEMM of their own (balanced routing: tokens / experts each); None for
    any other op (the weight gradient's (experts, k, n) output is a batched GEMM already)."""
    if op != "_grouped_mm" or not flops or getattr(out, "dim", lambda: 0)() != 2:
        return None
    offs = args[2] if len(args) > 2 else kwargs.get("offs")
    if offs is None:
        return None
    (tokens, n), groups = out.shape, max(1, len(offs))
    return (groups, max(1, tokens // groups), n, max(1, flops // (2 * tokens * n)))
