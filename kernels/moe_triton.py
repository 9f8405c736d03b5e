"""The Triton kernels of `colozoo.kernels.moe` (permute / unpermute, whose contract is described there). The sort is
the op's (`moe.route`, in torch); the kernels move the rows, one program per row copy.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl


BLOCK_H = 1024


@triton.jit
def _scatter_rows(SRC, ROW_MAP, W, DST, Y, DW, K, H, HAS_WEIGHT: tl.constexpr, WANT_DW: tl.constexpr,
                  BLOCK_H: tl.constexpr):
    """DST[row_map[e]] = W[e] * SRC[e // K] for entry e = t*K + j; optionally DW[e] = <Y[row_map[e]], SRC[e // K]>."""
    entry = tl.program_id(0).to(tl.int64)
    dest = tl.load(ROW_MAP + entry).to(tl.int64)
    SRC += (entry // K) * H
    DST += dest * H
    scale = 1.0
    if HAS_WEIGHT:
        scale = tl.load(W + entry).to(tl.float32)
    dot = tl.zeros((BLOCK_H,), dtype=tl.float32)
    for start in range(0, H, BLOCK_H):
        cols = start + tl.arange(0, BLOCK_H)
        x = tl.load(SRC + cols, mask=cols < H, other=0.0).to(tl.float32)
        tl.store(DST + cols, (x * scale).to(DST.dtype.element_ty), mask=cols < H)
        if WANT_DW:
            dot += x * tl.load(Y + dest * H + cols, mask=cols < H, other=0.0).to(tl.float32)
    if WANT_DW:
        tl.store(DW + entry, tl.sum(dot, axis=0))


@triton.jit
def _gather_rows(SRC, ROW_MAP, W, DST, K, H, HAS_WEIGHT: tl.constexpr, BLOCK_H: tl.constexpr):
    """DST[t] = sum_j W[t, j] * SRC[row_map[t*K + j]]."""
    token = tl.program_id(0).to(tl.int64)
    for start in range(0, H, BLOCK_H):
        cols = start + tl.arange(0, BLOCK_H)
        acc = tl.zeros((BLOCK_H,), dtype=tl.float32)
        for j in range(0, K):
            entry = token * K + j
            row = tl.load(ROW_MAP + entry).to(tl.int64)
            x = tl.load(SRC + row * H + cols, mask=cols < H, other=0.0).to(tl.float32)
            if HAS_WEIGHT:
                x *= tl.load(W + entry).to(tl.float32)
            acc += x
        tl.store(DST + token * H + cols, acc.to(DST.dtype.element_ty), mask=cols < H)


def _scatter(src, row_map, weights, k, y=None):
    t, h = src.shape
    dst = torch.empty(t * k, h, device=src.device, dtype=src.dtype)
    dw = torch.empty(t * k, device=src.device, dtype=torch.float32) if y is not None else None
    if dst.numel():
        _scatter_rows[(t * k,)](src, row_map, weights, dst, y, dw, k, h, HAS_WEIGHT=weights is not None,
                                WANT_DW=y is not None, BLOCK_H=min(BLOCK_H, triton.next_power_of_2(h)))
    return dst, dw


def _gather(src, row_map, weights, k):
    h = src.shape[1]
    t = row_map.numel() // k
    dst = torch.empty(t, h, device=src.device, dtype=src.dtype)
    if dst.numel():
        _gather_rows[(t,)](src, row_map, weights, dst, k, h, HAS_WEIGHT=weights is not None,
                           BLOCK_H=min(BLOCK_H, triton.next_power_of_2(h)))
    return dst


class _Permute(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, row_map, k):
        ctx.save_for_backward(row_map)
        ctx.k = k
        return _scatter(hidden.contiguous(), row_map, None, k)[0]

    @staticmethod
    def backward(ctx, grad):
        (row_map,) = ctx.saved_tensors
        return _gather(grad.contiguous(), row_map, None, ctx.k), None, None


class _Unpermute(torch.autograd.Function):
    @staticmethod
    def forward(ctx, expert_out, row_map, weights):
        k = weights.shape[1] if weights is not None else 1
        expert_out = expert_out.contiguous()
        flat_w = weights.reshape(-1).contiguous() if weights is not None else None
        ctx.save_for_backward(expert_out, row_map, flat_w)
        ctx.k, ctx.weights_shape = k, weights.shape if weights is not None else None
        return _gather(expert_out, row_map, flat_w, k)

    @staticmethod
    def backward(ctx, grad):
        expert_out, row_map, flat_w = ctx.saved_tensors
        want_dw = flat_w is not None and ctx.needs_input_grad[2]
        dout, dw = _scatter(grad.contiguous(), row_map, flat_w, ctx.k, y=expert_out if want_dw else None)
        dw = dw.view(ctx.weights_shape).to(flat_w.dtype) if want_dw else None
        return dout, None, dw


def moe_permute_triton(hidden, row_map, top_k: int):
    """(tokens * top_k, hidden): row row_map[t * top_k + j] is token t's copy (`moe.route` sorts them)."""
    return _Permute.apply(hidden, row_map, top_k)


def moe_unpermute_triton(expert_out, row_map, weights=None):
    """Sum each token's expert outputs, weighted by its routing weights (T, k); with weights=None, k must be 1."""
    return _Unpermute.apply(expert_out, row_map, weights)
