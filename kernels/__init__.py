"""The hot paths' kernels, one op per module; layers call only the ops.

    norms                 layer_norm, rms_norm (optionally fused with the residual add; Gemma's 1 + weight),
                          rms_norm_linear (fused with the projection after it: the normed tensor is not kept)
    rope                  apply_rotary: rotary position embeddings, partial rotary passing the rest through;
                          rotary_qkv (q and k rotated inside the fused qkv projection)
    activations           swiglu, bias_gelu, the GeLU variants by config name, linear_gelu (the bias into the GeLU),
                          swiglu_linear (fused with down_proj: the product is not kept)
    attention             local_attention: SDPA, GPT-2's upcast order, capped scores, packed documents, dropout
    decode                decode_attention: one new token per sequence against a KV cache
    cross_entropy         vocab_parallel_cross_entropy; vocab_parallel_cross_entropy_and_entropy (the entropy of the
                          softmax from the same pass: a metric)
    linear_cross_entropy  linear_cross_entropy: the LM head fused with its summed loss, gradients taken in the forward
    head_loss             shared by both cross entropies: softmax statistics of vocab slices, the chunked head
    moe                   permute / unpermute: MoE tokens grouped by expert and combined back

Each op module exports the op, which picks the Triton kernel or its torch reference with `dispatch`'s policy
(COLOZOO_KERNELS=auto|triton|torch, or `set_kernels` / `use_kernels`), and that torch reference, which is the CPU
path. The Triton kernels live in `<op>_triton` modules (the two cross entropies share `cross_entropy_triton`; the
flash-decoding kernel is `decode_triton`), imported only when an op picks them: triton decides at decoration time
whether to interpret, and an op module never imports triton.
"""
from __future__ import annotations

from .dispatch import interpreting, kernel_mode, kernels_interpreted, set_kernels, triton_available, use_kernels

__all__ = ["interpreting", "kernel_mode", "kernels_interpreted", "set_kernels", "triton_available", "use_kernels"]
