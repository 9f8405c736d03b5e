"""The Triton kernels of `colozoo.kernels.norms`: LayerNorm and RMSNorm over the last dimension, optionally fused with
the residual add before them, and RMSNorm fused with the linear layer after it.

    h = x + residual          (when a residual is given, rounded to x's dtype as torch's add would; h is returned
                               too, it is the next residual)
    y = norm(h) * weight + bias

Statistics are kept in fp32 whatever the input dtype. One program normalises one row in the forward pass;
in the backward pass each program walks a band of rows and writes its partial weight/bias gradients to
one row of a small fp32 buffer that torch sums afterwards (no atomics, deterministic).

`rms_norm_linear_triton` is linear(rms_norm(h)) as one autograd function: it keeps h and the fp32 rstd, which the
norm's backward needs anyway, instead of the normed tensor the linear would keep, and normalises h again in backward
with the saved rstd (the same kernel, the same bits).
"""
from __future__ import annotations

import sys

import torch
import triton
import triton.language as tl

from .fused_functions import norm_function, rms_norm_linear_function

MAX_FEATURES = 65536


@triton.jit
def _norm_forward(X, R, W, B, Y, H, Mean, Rstd, stride_x, stride_r, stride_y, stride_h, N, eps,
                  IS_RMS: tl.constexpr, HAS_RESIDUAL: tl.constexpr, HAS_WEIGHT: tl.constexpr,
                  HAS_BIAS: tl.constexpr, RECOMPUTE: tl.constexpr, BLOCK_N: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK_N)
    inside = cols < N
    x = tl.load(X + row * stride_x + cols, mask=inside, other=0.0).to(tl.float32)
    if HAS_RESIDUAL:  # normalised as stored: what the backward and a torch add see
        h = (x + tl.load(R + row * stride_r + cols, mask=inside, other=0.0).to(tl.float32)).to(H.dtype.element_ty)
        tl.store(H + row * stride_h + cols, h, mask=inside)
        x = h.to(tl.float32)
    if IS_RMS:
        centred = x
    else:
        if RECOMPUTE:
            mean = tl.load(Mean + row)
        else:
            mean = tl.sum(x, axis=0) / N
            tl.store(Mean + row, mean)
        centred = tl.where(inside, x - mean, 0.0)
    if RECOMPUTE:  # the saved statistics, so the output is bit for bit the forward's
        rstd = tl.load(Rstd + row)
    else:
        rstd = 1.0 / tl.sqrt(tl.sum(centred * centred, axis=0) / N + eps)
        tl.store(Rstd + row, rstd)
    y = centred * rstd
    if HAS_WEIGHT:
        y = y * tl.load(W + cols, mask=inside, other=0.0).to(tl.float32)
    if HAS_BIAS:
        y = y + tl.load(B + cols, mask=inside, other=0.0).to(tl.float32)
    tl.store(Y + row * stride_y + cols, y.to(Y.dtype.element_ty), mask=inside)


@triton.jit
def _norm_backward(H, W, DY, DH, DX, DW, DB, Mean, Rstd, stride_h, stride_dy, stride_dh, stride_dx, M, N,
                   rows_per_program, IS_RMS: tl.constexpr, HAS_DH: tl.constexpr, HAS_WEIGHT: tl.constexpr,
                   HAS_BIAS: tl.constexpr, BLOCK_N: tl.constexpr):
    pid = tl.program_id(0)
    cols = tl.arange(0, BLOCK_N)
    inside = cols < N
    if HAS_WEIGHT:
        w = tl.load(W + cols, mask=inside, other=0.0).to(tl.float32)
    dw = tl.zeros((BLOCK_N,), dtype=tl.float32)
    db = tl.zeros((BLOCK_N,), dtype=tl.float32)
    first = pid * rows_per_program
    last = tl.minimum(first + rows_per_program, M)
    for row in range(first, last):
        row64 = tl.cast(row, tl.int64)
        x = tl.load(H + row64 * stride_h + cols, mask=inside, other=0.0).to(tl.float32)
        dy = tl.load(DY + row64 * stride_dy + cols, mask=inside, other=0.0).to(tl.float32)
        rstd = tl.load(Rstd + row)
        if IS_RMS:
            xhat = x * rstd
        else:
            xhat = tl.where(inside, (x - tl.load(Mean + row)) * rstd, 0.0)
        if HAS_WEIGHT:
            wdy = w * dy
            dw += dy * xhat
        else:
            wdy = dy
        if HAS_BIAS:
            db += dy
        if IS_RMS:
            dx = (wdy - xhat * (tl.sum(wdy * xhat, axis=0) / N)) * rstd
        else:
            dx = (wdy - xhat * (tl.sum(wdy * xhat, axis=0) / N) - tl.sum(wdy, axis=0) / N) * rstd
        if HAS_DH:
            dx += tl.load(DH + row64 * stride_dh + cols, mask=inside, other=0.0).to(tl.float32)
        tl.store(DX + row64 * stride_dx + cols, dx.to(DX.dtype.element_ty), mask=inside)
    if HAS_WEIGHT:
        tl.store(DW + pid * N + cols, dw, mask=inside)
    if HAS_BIAS:
        tl.store(DB + pid * N + cols, db, mask=inside)


def _rows(t: torch.Tensor, n: int) -> torch.Tensor:
    t = t.reshape(-1, n)
    return t if t.stride(-1) == 1 else t.contiguous()


def _block(n: int) -> tuple[int, int]:
    if n > MAX_FEATURES:
        raise ValueError(f"triton norm supports at most {MAX_FEATURES} features, got {n}")
    block = triton.next_power_of_2(n)
    return block, min(max(block // 256, 1), 16)


def _check_shapes(x, residual, weight, bias):
    n = x.shape[-1]
    for name, p in (("weight", weight), ("bias", bias)):
        if p is not None and p.shape != (n,):
            raise ValueError(f"norm {name} has shape {tuple(p.shape)}, expected ({n},) for input {tuple(x.shape)}")
    if residual is not None and residual.shape != x.shape:
        raise ValueError(f"residual shape {tuple(residual.shape)} differs from input shape {tuple(x.shape)}")


def _forward(x, residual, weight, bias, eps, is_rms):
    """(y, h, h_rows, mean, rstd): y and h = x + residual new tensors of x's shape (h None without a residual), h_rows
    the rows normalised (h's, or x's), mean None for RMSNorm."""
    _check_shapes(x, residual, weight, bias)
    n = x.shape[-1]
    x2 = _rows(x, n)
    r2 = _rows(residual, n) if residual is not None else None
    m = x2.shape[0]
    y = torch.empty(x.shape, device=x.device, dtype=x.dtype)
    h = torch.empty(x.shape, device=x.device, dtype=x.dtype) if residual is not None else None
    h_rows = h.view(-1, n) if h is not None else x2
    mean = None if is_rms else torch.empty(m, device=x.device, dtype=torch.float32)
    rstd = torch.empty(m, device=x.device, dtype=torch.float32)
    block, warps = _block(n)
    if m:
        _norm_forward[(m,)](x2, r2, weight, bias, y, h_rows, rstd if mean is None else mean, rstd, x2.stride(0),
                            r2.stride(0) if r2 is not None else 0, n, h_rows.stride(0), n, eps, IS_RMS=is_rms,
                            HAS_RESIDUAL=residual is not None, HAS_WEIGHT=weight is not None,
                            HAS_BIAS=bias is not None, RECOMPUTE=False, BLOCK_N=block, num_warps=warps)
    return y, h, h_rows, mean, rstd


def _normalise_again(h, weight, bias, mean, rstd):
    """The forward's y from the rows h it normalised and their saved statistics."""
    m, n = h.shape
    y = torch.empty_like(h)
    block, warps = _block(n)
    if m:
        _norm_forward[(m,)](h, None, weight, bias, y, None, rstd if mean is None else mean, rstd, h.stride(0), 0,
                            y.stride(0), 0, n, 0.0, IS_RMS=mean is None, HAS_RESIDUAL=False,
                            HAS_WEIGHT=weight is not None, HAS_BIAS=bias is not None, RECOMPUTE=True, BLOCK_N=block,
                            num_warps=warps)
    return y


def _backward(h, weight, bias, mean, rstd, dy, dh):
    """(dx, dweight, dbias) as rows; dy None where the normed output took no gradient, dh the sum's gradient."""
    m, n = h.shape
    dy2 = _rows(dy, n) if dy is not None else torch.zeros_like(h)
    dh2 = _rows(dh, n) if dh is not None else None
    dx = torch.empty_like(h)
    block, warps = _block(n)
    programs = max(1, min(m, 4 * torch.cuda.get_device_properties(h.device).multi_processor_count
                          if h.is_cuda else 8))
    rows_per_program = triton.cdiv(max(m, 1), programs)
    programs = triton.cdiv(max(m, 1), rows_per_program)
    dw = torch.zeros(programs, n, device=h.device, dtype=torch.float32) if weight is not None else None
    db = torch.zeros(programs, n, device=h.device, dtype=torch.float32) if bias is not None else None
    if m:
        _norm_backward[(programs,)](h, weight, dy2, dh2, dx, dw, db, rstd if mean is None else mean, rstd,
                                    h.stride(0), dy2.stride(0), dh2.stride(0) if dh2 is not None else 0, dx.stride(0),
                                    m, n, rows_per_program, IS_RMS=mean is None, HAS_DH=dh2 is not None,
                                    HAS_WEIGHT=weight is not None, HAS_BIAS=bias is not None, BLOCK_N=block,
                                    num_warps=warps)
    dweight = dw.sum(0).to(weight.dtype) if weight is not None else None
    dbias = db.sum(0).to(bias.dtype) if bias is not None else None
    return dx, dweight, dbias


_Norm = norm_function(sys.modules[__name__])
_RMSNormLinear = rms_norm_linear_function(sys.modules[__name__])


def layer_norm_triton(x, weight=None, bias=None, eps: float = 1e-5, residual=None):
    """LayerNorm of `x` (or of `x + residual`, then returning `(y, x + residual)`)."""
    return _Norm.apply(x, residual, weight, bias, eps, False)


def rms_norm_triton(x, weight=None, eps: float = 1e-6, residual=None):
    """RMSNorm of `x` (or of `x + residual`, then returning `(y, x + residual)`)."""
    return _Norm.apply(x, residual, weight, None, eps, True)


def rms_norm_linear_triton(x, norm_weight, eps: float, weight, bias=None, residual=None):
    """F.linear(RMSNorm of `x`, weight, bias) (of `x + residual`, then returning `(that, x + residual)`)."""
    return _RMSNormLinear.apply(x, residual, norm_weight, eps, weight, bias)
