"""The Triton kernel of `colozoo.kernels.rope`: rotary embeddings of (batch, heads, seq, head_dim) tensors of any
strides, into a new tensor or in place.

`cos` and `sin` hold one angle per rotated pair: shape (seq, rotary_dim // 2) or (batch, seq, rotary_dim // 2)
(the first halves of what the models compute). Feature i pairs with i + rotary_dim/2 (LLaMA / NeoX "rotate half");
the features past `rotary_dim` pass through (partial rotary). The backward pass is the same rotation by -angle.

`rotate_qk_in_place_triton` rotates the q and k heads of a fused qkv projection where they lie: the attention then
keeps q, k and v as views of that one tensor, and the rotation's backward keeps only the angles (rotating into new
tensors keeps the projection for v and the rotated q and k besides).
"""
from __future__ import annotations

import sys

import torch
import triton
import triton.language as tl

from .fused_functions import checked_angles, rotary_in_place_function


@triton.jit
def _rotate(X, COS, SIN, Y, sxb, sxh, sxs, sxd, syb, syh, sys, syd, scb, scs, scd, H, S, HALF, D,
            CONJUGATE: tl.constexpr, BLOCK_S: tl.constexpr,
            BLOCK_HALF: tl.constexpr, BLOCK_REST: tl.constexpr):
    bh = tl.program_id(1)
    b = (bh // H).to(tl.int64)
    h = (bh % H).to(tl.int64)
    rows = tl.program_id(0) * BLOCK_S + tl.arange(0, BLOCK_S)
    pairs = tl.arange(0, BLOCK_HALF)
    inside = (rows[:, None] < S) & (pairs[None, :] < HALF)
    first, second = pairs, pairs + HALF
    X += b * sxb + h * sxh + rows[:, None] * sxs
    Y += b * syb + h * syh + rows[:, None] * sys
    angle = b * scb + rows[:, None] * scs + pairs[None, :] * scd
    cos = tl.load(COS + angle, mask=inside, other=0.0).to(tl.float32)
    sin = tl.load(SIN + angle, mask=inside, other=0.0).to(tl.float32)
    if CONJUGATE:
        sin = -sin
    x1 = tl.load(X + first[None, :] * sxd, mask=inside, other=0.0).to(tl.float32)
    x2 = tl.load(X + second[None, :] * sxd, mask=inside, other=0.0).to(tl.float32)
    tl.store(Y + first[None, :] * syd, (x1 * cos - x2 * sin).to(Y.dtype.element_ty), mask=inside)
    tl.store(Y + second[None, :] * syd, (x2 * cos + x1 * sin).to(Y.dtype.element_ty), mask=inside)
    if BLOCK_REST > 0:
        rest = 2 * HALF + tl.arange(0, BLOCK_REST)
        keep = (rows[:, None] < S) & (rest[None, :] < D)
        tl.store(Y + rest[None, :] * syd, tl.load(X + rest[None, :] * sxd, mask=keep, other=0.0), mask=keep)


def _launch(x, cos, sin, conjugate: bool, out=None):
    """x rotated into `out` (a new contiguous tensor by default; `out` may be x itself: each element is read before
    it is written, by the same program)."""
    b, h, s, d = x.shape
    half = cos.shape[-1]
    y = torch.empty(b, h, s, d, device=x.device, dtype=x.dtype) if out is None else out
    block_s = min(64, triton.next_power_of_2(max(s, 1)))
    rest = d - 2 * half
    if y.numel():
        _rotate[(triton.cdiv(s, block_s), b * h)](
            x, cos, sin, y, *x.stride(), *y.stride(), *cos.stride(), h, s, half, d, CONJUGATE=conjugate,
            BLOCK_S=block_s, BLOCK_HALF=triton.next_power_of_2(half),
            BLOCK_REST=triton.next_power_of_2(rest) if rest else 0)
    return y


class _Rotary(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, cos, sin):
        cos, sin = checked_angles(x, cos, sin)
        ctx.save_for_backward(cos, sin)
        return _launch(x, cos, sin, False)

    @staticmethod
    def backward(ctx, grad):
        cos, sin = ctx.saved_tensors
        return _launch(grad, cos, sin, True), None, None


_RotaryQKInPlace = rotary_in_place_function(sys.modules[__name__])


def apply_rotary_triton(x, cos, sin):
    return _Rotary.apply(x, cos, sin)


def rotate_qk_in_place_triton(qkv, cos, sin, heads: int, kv_heads: int):
    """The first `heads + kv_heads` heads (q, then k) of a contiguous (batch, seq, (heads + 2 kv_heads) * head_dim)
    projection rotated in place (the tensor returned is qkv); the values' heads are untouched."""
    return _RotaryQKInPlace.apply(qkv, cos, sin, heads, kv_heads)
