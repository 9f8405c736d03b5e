"""The hot paths' kernels, one op per module; layers call only the ops.

    norms                 layer_norm, rms_norm (optionally fused with the residual add; Gemma's 1 + weight)
    rope                  apply_rotary: rotary position embeddings, partial rotary passing the rest through
    activations           swiglu, bias_gelu, the GeLU variants by config name, linear_gelu (the bias into the GeLU)
    attention             local_attention: SDPA, GPT-2's upcast order, capped scores, packed documents, dropout
    decode                decode_attention: one new token per sequence against a KV cache
    cross_entropy         vocab_parallel_cross_entropy
    linear_cross_entropy  linear_cross_entropy: the LM head fused with its summed loss
    moe                   permute / unpermute: MoE tokens grouped by expert and combined back

Each op module exports the op, which picks the Triton kernel or its torch reference with `dispatch`'s policy
(COLOZOO_KERNELS=auto|triton|torch, or `set_kernels` / `use_kernels`), and that torch reference, which is the CPU
path. The Triton kernels live in `<op>_triton` modules (the two cross entropies share `cross_entropy_triton`; the
flash-decoding kernel is `decode_triton`), imported only when an op picks them: triton decides at decoration time
whether to interpret, and an op module never imports triton.
"""
from __future__ import annotations

import torch

from .dispatch import interpreting, kernel_mode, kernels_interpreted, set_kernels, triton_available, use_kernels

# models/llama.py's apply_rope still decides Triton vs torch itself and hands the kernel one angle per rotated pair,
# until layers/rope.py takes its place; then these two names go (outside kernels/, nothing calls use_triton).
from .dispatch import use_triton


def apply_rotary(x, cos, sin):
    """`rope.apply_rotary` for cos/sin of one angle per rotated pair, (batch, seq, rotary_dim / 2) or (seq, ...)."""
    from .rope import apply_rotary as rotate

    return rotate(x, torch.cat((cos, cos), dim=-1), torch.cat((sin, sin), dim=-1))


__all__ = ["apply_rotary", "interpreting", "kernel_mode", "kernels_interpreted", "set_kernels", "triton_available",
           "use_kernels", "use_triton"]
