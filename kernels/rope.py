"""Rotary position embeddings applied to (batch, heads, seq, head_dim) tensors of any strides.

`cos` and `sin` hold one angle per rotated pair: shape (seq, rotary_dim // 2) or (batch, seq, rotary_dim // 2),
built by the model from its position ids. The first `rotary_dim` features rotate, the rest pass through
(partial rotary, as in GPT-NeoX). Pairs are (i, i + rotary_dim/2) by default (LLaMA / NeoX "rotate half")
or adjacent (2i, 2i+1) with interleaved=True (GPT-J). The backward pass is the same rotation by -angle.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _rotate(X, COS, SIN, Y, sxb, sxh, sxs, sxd, scb, scs, scd, H, S, HALF, D,
            CONJUGATE: tl.constexpr, INTERLEAVED: tl.constexpr, BLOCK_S: tl.constexpr,
            BLOCK_HALF: tl.constexpr, BLOCK_REST: tl.constexpr):
    bh = tl.program_id(1)
    b = (bh // H).to(tl.int64)
    h = (bh % H).to(tl.int64)
    rows = tl.program_id(0) * BLOCK_S + tl.arange(0, BLOCK_S)
    pairs = tl.arange(0, BLOCK_HALF)
    inside = (rows[:, None] < S) & (pairs[None, :] < HALF)
    if INTERLEAVED:
        first, second = 2 * pairs, 2 * pairs + 1
    else:
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


def _launch(x, cos, sin, conjugate: bool, interleaved: bool):
    b, h, s, d = x.shape
    half = cos.shape[-1]
    y = torch.empty(b, h, s, d, device=x.device, dtype=x.dtype)
    block_s = min(64, triton.next_power_of_2(max(s, 1)))
    rest = d - 2 * half
    if y.numel():
        _rotate[(triton.cdiv(s, block_s), b * h)](
            x, cos, sin, y, *x.stride(), *cos.stride(), h, s, half, d, CONJUGATE=conjugate, INTERLEAVED=interleaved,
            BLOCK_S=block_s, BLOCK_HALF=triton.next_power_of_2(half),
            BLOCK_REST=triton.next_power_of_2(rest) if rest else 0)
    return y


class _Rotary(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, cos, sin, interleaved):
        if x.dim() != 4:
            raise ValueError(f"rotary embedding takes (batch, heads, seq, head_dim), got shape {tuple(x.shape)}")
        b, _, s, d = x.shape
        cos, sin = _angles(cos, b, s), _angles(sin, b, s)
        if cos.shape != sin.shape or 2 * cos.shape[-1] > d:
            raise ValueError(f"rotary cos {tuple(cos.shape)} / sin {tuple(sin.shape)} do not fit head_dim {d}")
        ctx.save_for_backward(cos, sin)
        ctx.interleaved = interleaved
        return _launch(x, cos, sin, False, interleaved)

    @staticmethod
    def backward(ctx, grad):
        cos, sin = ctx.saved_tensors
        return _launch(grad, cos, sin, True, ctx.interleaved), None, None, None


def apply_rotary_triton(x, cos, sin, interleaved: bool = False):
    return _Rotary.apply(x, cos, sin, interleaved)


def apply_rotary_reference(x, cos, sin, interleaved: bool = False):
    half = cos.shape[-1]
    rot, rest = x[..., : 2 * half].float(), x[..., 2 * half:]
    if cos.dim() == 3:  # (batch, seq, half) -> broadcast over heads
        cos, sin = cos[:, None], sin[:, None]
    cos, sin = cos.float(), sin.float()
    if interleaved:
        x1, x2 = rot[..., 0::2], rot[..., 1::2]
        out = torch.stack((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).flatten(-2)
    else:
        x1, x2 = rot[..., :half], rot[..., half:]
        out = torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)
    return torch.cat((out.to(x.dtype), rest), dim=-1)
