"""Triton kernels for the hot paths, each module an autograd.Function beside its pure-torch reference.

    norms            LayerNorm / RMSNorm, optionally fused with the residual add
    flash_attention  causal / padding-masked / grouped-query flash attention
    decode           flash-decoding: one new token per sequence against a KV cache
    rope             rotary position embeddings
    activations      SwiGLU, bias + GeLU
    cross_entropy    vocab-parallel cross entropy, alone or chunked and fused with the LM-head matmul
    moe              MoE token permute / unpermute

`dispatch` picks Triton or torch (COLOZOO_KERNELS=auto|triton|torch, or `set_kernels`). Norms, attention, the
activations and the logits' cross entropy dispatch inside `colozoo.layers`; the functions below do the same for
the models' rotary embedding, decode attention over a KV cache and the MoE layer's token permutation (the LM
head calls the fused loss of `cross_entropy` itself on the Triton path; its torch reference is
`colozoo.layers.vocab`).
Kernel modules are imported only when used: triton decides at decoration time whether to interpret.
"""
from __future__ import annotations

import torch

from .dispatch import interpreting, kernel_mode, set_kernels, triton_available, use_kernels, use_triton


def apply_rotary(x, cos, sin):
    """`rope.apply_rotary` for cos/sin of one angle per rotated pair, (batch, seq, rotary_dim / 2) or (seq, ...); for
    models/llama.py's apply_rope until layers/rope.py takes its place."""
    from .rope import apply_rotary as rotate

    return rotate(x, torch.cat((cos, cos), dim=-1), torch.cat((sin, sin), dim=-1))


__all__ = ["apply_rotary", "interpreting", "kernel_mode", "set_kernels", "triton_available", "use_kernels", "use_triton"]
