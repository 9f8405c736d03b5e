"""The Triton kernels of `colozoo.kernels.activations`: SwiGLU (silu(gate) * up) and bias + GeLU (exact erf or tanh
approximation), elementwise with fp32 math. SwiGLU reads gate and up where they lie, the two halves of one gate | up
projection (no copies), and `swiglu_linear_triton` fuses it with the linear layer after it, keeping gate | up alone
for backward."""
from __future__ import annotations

import math
import sys

import torch
import triton
import triton.language as tl

from .fused_functions import swiglu_linear_function

BLOCK = 1024
SQRT_2_OVER_PI = math.sqrt(2.0 / math.pi)


@triton.jit
def _sigmoid(x):
    return 1.0 / (1.0 + tl.exp(-x))


@triton.jit
def _swiglu_forward(G, U, Y, n, N, stride_in, stride_out, BLOCK: tl.constexpr):
    """Y = silu(G) * U over n elements of rows of N: G and U rows `stride_in` apart (the halves of one gate | up
    tensor: 2N), Y rows `stride_out` apart."""
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    inside = offs < n
    at = offs // N * stride_in + offs % N
    g = tl.load(G + at, mask=inside, other=0.0).to(tl.float32)
    u = tl.load(U + at, mask=inside, other=0.0).to(tl.float32)
    tl.store(Y + offs // N * stride_out + offs % N, (g * _sigmoid(g) * u).to(Y.dtype.element_ty), mask=inside)


@triton.jit
def _swiglu_backward(G, U, DY, DG, DU, n, N, stride_in, stride_dy, stride_grad, BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    inside = offs < n
    row, col = offs // N, offs % N
    g = tl.load(G + row * stride_in + col, mask=inside, other=0.0).to(tl.float32)
    u = tl.load(U + row * stride_in + col, mask=inside, other=0.0).to(tl.float32)
    dy = tl.load(DY + row * stride_dy + col, mask=inside, other=0.0).to(tl.float32)
    sig = _sigmoid(g)
    at = row * stride_grad + col
    tl.store(DG + at, (dy * u * sig * (1.0 + g * (1.0 - sig))).to(DG.dtype.element_ty), mask=inside)
    tl.store(DU + at, (dy * g * sig).to(DU.dtype.element_ty), mask=inside)


@triton.jit
def _gelu_and_slope(x, TANH: tl.constexpr):
    if TANH:
        # tanh saturates in fp32 long before |inner| = 15; the clamp keeps exp() finite
        inner = tl.minimum(tl.maximum(0.7978845608028654 * (x + 0.044715 * x * x * x), -15.0), 15.0)
        t = 2.0 * _sigmoid(2.0 * inner) - 1.0
        y = 0.5 * x * (1.0 + t)
        slope = 0.5 * (1.0 + t) + 0.5 * x * (1.0 - t * t) * 0.7978845608028654 * (1.0 + 0.134145 * x * x)
    else:
        cdf = 0.5 * (1.0 + tl.math.erf(x * 0.7071067811865476))
        y = x * cdf
        slope = cdf + x * 0.3989422804014327 * tl.exp(-0.5 * x * x)
    return y, slope


@triton.jit
def _bias_gelu(X, B, Y, DY, DX, n, N, HAS_BIAS: tl.constexpr, BACKWARD: tl.constexpr, TANH: tl.constexpr,
               BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    inside = offs < n
    x = tl.load(X + offs, mask=inside, other=0.0).to(tl.float32)
    if HAS_BIAS:
        x += tl.load(B + offs % N, mask=inside, other=0.0).to(tl.float32)
    y, slope = _gelu_and_slope(x, TANH)
    if BACKWARD:
        dy = tl.load(DY + offs, mask=inside, other=0.0).to(tl.float32)
        tl.store(DX + offs, (dy * slope).to(DX.dtype.element_ty), mask=inside)
    else:
        tl.store(Y + offs, y.to(Y.dtype.element_ty), mask=inside)


def _grid(n):
    return (triton.cdiv(n, BLOCK),)


def _swiglu_rows(gate, up):
    """gate and up as (rows, N) with one row stride and unit column stride: views where they already are (the two
    halves of a gate | up projection), contiguous copies otherwise."""
    n = gate.shape[-1]
    gate, up = gate.reshape(-1, n), up.reshape(-1, n)
    if gate.stride(-1) != 1 or up.stride(-1) != 1 or gate.stride(0) != up.stride(0):
        gate, up = gate.contiguous(), up.contiguous()
    return gate, up


def _swiglu_into(gate, up, y):
    if y.numel():
        _swiglu_forward[_grid(y.numel())](gate, up, y, y.numel(), y.shape[-1], max(gate.stride(0), 1),
                                          y.stride(0), BLOCK=BLOCK)
    return y


def _swiglu_grad_into(gate, up, dy, dgate, dup):
    if dy.numel():
        _swiglu_backward[_grid(dy.numel())](gate, up, dy, dgate, dup, dy.numel(), dy.shape[-1],
                                            max(gate.stride(0), 1), dy.stride(0), dgate.stride(0), BLOCK=BLOCK)


class _SwiGLU(torch.autograd.Function):
    @staticmethod
    def forward(ctx, gate, up):
        if gate.shape != up.shape or gate.dtype != up.dtype:
            raise ValueError(f"swiglu gate {tuple(gate.shape)} {gate.dtype} and up {tuple(up.shape)} {up.dtype} differ")
        ctx.shape = gate.shape
        gate, up = _swiglu_rows(gate, up)
        ctx.save_for_backward(gate, up)
        return _swiglu_into(gate, up, torch.empty(gate.shape, device=gate.device, dtype=gate.dtype)).view(ctx.shape)

    @staticmethod
    def backward(ctx, dy):
        gate, up = ctx.saved_tensors
        dy = dy.reshape(gate.shape).contiguous()
        dgate, dup = torch.empty_like(dy), torch.empty_like(dy)
        _swiglu_grad_into(gate, up, dy, dgate, dup)
        return dgate.view(ctx.shape), dup.view(ctx.shape)


_SwiGLULinear = swiglu_linear_function(sys.modules[__name__])


class _BiasGelu(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, bias, tanh):
        if bias is not None and bias.shape != x.shape[-1:]:
            raise ValueError(f"bias shape {tuple(bias.shape)} does not match the last dim of input {tuple(x.shape)}")
        x = x.contiguous()
        y = torch.empty_like(x)
        if y.numel():
            _bias_gelu[_grid(x.numel())](x, bias, y, None, None, x.numel(), x.shape[-1], HAS_BIAS=bias is not None,
                                         BACKWARD=False, TANH=tanh, BLOCK=BLOCK)
        ctx.save_for_backward(x, bias)
        ctx.tanh = tanh
        return y

    @staticmethod
    def backward(ctx, dy):
        x, bias = ctx.saved_tensors
        dy = dy.contiguous()
        dx = torch.empty_like(x)
        if dx.numel():
            _bias_gelu[_grid(x.numel())](x, bias, None, dy, dx, x.numel(), x.shape[-1], HAS_BIAS=bias is not None,
                                         BACKWARD=True, TANH=ctx.tanh, BLOCK=BLOCK)
        dbias = dx.reshape(-1, x.shape[-1]).float().sum(0).to(bias.dtype) if bias is not None else None
        return dx, dbias, None


def _approximate(approximate: str) -> bool:
    if approximate not in ("none", "tanh"):
        raise ValueError(f"gelu approximate must be 'none' or 'tanh', got {approximate!r}")
    return approximate == "tanh"


def swiglu_triton(gate, up):
    return _SwiGLU.apply(gate, up)


def swiglu_linear_triton(gate_up, weight, bias=None):
    """F.linear(silu(gate) * up, weight, bias) for gate, up = gate_up.chunk(2, dim=-1)."""
    return _SwiGLULinear.apply(gate_up, weight, bias)


def bias_gelu_triton(x, bias=None, approximate: str = "none"):
    return _BiasGelu.apply(x, bias, _approximate(approximate))
