"""The Triton kernel of `colozoo.kernels.rope`: rotary embeddings of (batch, heads, seq, head_dim) tensors of any
strides.

`cos` and `sin` hold one angle per rotated pair: shape (seq, rotary_dim // 2) or (batch, seq, rotary_dim // 2)
(the first halves of what the models compute). Feature i pairs with i + rotary_dim/2 (LLaMA / NeoX "rotate half");
the features past `rotary_dim` pass through (partial rotary). The backward pass is the same rotation by -angle.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _rotate(X, COS, SIN, Y, sxb, sxh, sxs, sxd, scb, scs, scd, H, S, HALF, D,
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
    Y += bh.to(tl.int64) * S * D + rows[:, None] * D
    angle = b * scb + rows[:, None] * scs + pairs[None, :] * scd
    cos = tl.load(COS + angle, mask=inside, other=0.0).to(tl.float32)
    sin = tl.load(SIN + angle, mask=inside, other=0.0).to(tl.float32)
    if CONJUGATE:
        sin = -sin
    x1 = tl.load(X + first[None, :] * sxd, mask=inside, other=0.0).to(tl.float32)
    x2 = tl.load(X + second[None, :] * sxd, mask=inside, other=0.0).to(tl.float32)
    tl.store(Y + first[None, :], (x1 * cos - x2 * sin).to(Y.dtype.element_ty), mask=inside)
    tl.store(Y + second[None, :], (x2 * cos + x1 * sin).to(Y.dtype.element_ty), mask=inside)
    if BLOCK_REST > 0:
        rest = 2 * HALF + tl.arange(0, BLOCK_REST)
        keep = (rows[:, None] < S) & (rest[None, :] < D)
        tl.store(Y + rest[None, :], tl.load(X + rest[None, :] * sxd, mask=keep, other=0.0), mask=keep)


def _angles(t: torch.Tensor, b: int, s: int) -> torch.Tensor:
    if t.dim() == 2:
        t = t.unsqueeze(0)
    if t.dim() != 3 or t.shape[1] != s or t.shape[0] not in (1, b):
        raise ValueError(f"rotary cos/sin must be (seq, rotary_dim/2) or (batch, seq, rotary_dim/2) with seq={s}, "
                         f"batch={b}; got {tuple(t.shape)}")
    return t.expand(b, s, t.shape[2])


def _launch(x, cos, sin, conjugate: bool):
    b, h, s, d = x.shape
    half = cos.shape[-1]
    y = torch.empty(b, h, s, d, device=x.device, dtype=x.dtype)
    block_s = min(64, triton.next_power_of_2(max(s, 1)))
    rest = d - 2 * half
    if y.numel():
        _rotate[(triton.cdiv(s, block_s), b * h)](
            x, cos, sin, y, *x.stride(), *cos.stride(), h, s, half, d, CONJUGATE=conjugate, BLOCK_S=block_s,
            BLOCK_HALF=triton.next_power_of_2(half), BLOCK_REST=triton.next_power_of_2(rest) if rest else 0)
    return y


class _Rotary(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, cos, sin):
        if x.dim() != 4:
            raise ValueError(f"rotary embedding takes (batch, heads, seq, head_dim), got shape {tuple(x.shape)}")
        b, _, s, d = x.shape
        cos, sin = _angles(cos, b, s), _angles(sin, b, s)
        if cos.shape != sin.shape or 2 * cos.shape[-1] > d:
            raise ValueError(f"rotary cos {tuple(cos.shape)} / sin {tuple(sin.shape)} do not fit head_dim {d}")
        ctx.save_for_backward(cos, sin)
        return _launch(x, cos, sin, False)

    @staticmethod
    def backward(ctx, grad):
        cos, sin = ctx.saved_tensors
        return _launch(grad, cos, sin, True), None, None


def apply_rotary_triton(x, cos, sin):
    return _Rotary.apply(x, cos, sin)
