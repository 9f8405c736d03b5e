"""The autograd functions of the fusions that keep less for the backward, written once over their kernels: the
Triton modules build them on their launchers (`norms_triton`, `rope_triton`, `activations_triton`), and the
profiler's stand-ins on torch ops (`priced`), so both save the same tensors by construction.

    norm_function(kernels)             LayerNorm / RMSNorm [+ residual]
    rms_norm_linear_function(kernels)  linear(rms_norm(x [+ residual]))
    rotary_in_place_function(kernels)  q and k rotated inside a fused qkv projection
    swiglu_linear_function(kernels)    linear(silu(gate) * up) of one gate | up tensor

`kernels` is the module whose launches the function calls, by the Triton modules' names and contracts (`_forward`,
`_backward`, `_normalise_again` of `norms_triton`, `_launch` of `rope_triton`, `_swiglu_into` and
`_swiglu_grad_into` of `activations_triton`), looked up at each call. Nothing here imports triton.
"""
from __future__ import annotations

import torch


def linear_of_its_own(x, weight, bias=None):
    """F.linear(x, weight, bias) as a tensor of its own: F.linear returns a view of its 2-D product where it adds a
    bias to a 3-D input, and a custom function's output that is a view cannot be changed in place (the rotary turns
    a qkv projection's q and k in place). The same storage, no copy: aten's _unsafe_view, which at::matmul uses for
    the same reason."""
    out = torch.nn.functional.linear(x, weight, bias)
    return torch.ops.aten._unsafe_view(out, out.shape) if out._is_view() else out


def norm_function(kernels) -> type:
    """Keeps the rows it normalised (x, or the new sum h) and the fp32 statistics."""

    class _Norm(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x, residual, weight, bias, eps, is_rms):
            ctx.set_materialize_grads(False)  # a post-norm layer drops the sum h: backward then skips its gradient
            y, h, h_rows, mean, rstd = kernels._forward(x, residual, weight, bias, eps, is_rms)
            ctx.save_for_backward(h_rows, weight, bias, mean, rstd)
            ctx.has_residual, ctx.shape = residual is not None, x.shape
            return y if residual is None else (y, h)

        @staticmethod
        def backward(ctx, dy, dh=None):
            h, weight, bias, mean, rstd = ctx.saved_tensors
            dx, dweight, dbias = kernels._backward(h, weight, bias, mean, rstd, dy, dh)
            dx = dx.view(ctx.shape)
            return dx, (dx if ctx.has_residual else None), dweight, dbias, None, None

    return _Norm


def rms_norm_linear_function(kernels) -> type:
    """linear(rms_norm(x [+ residual], norm_weight), weight, bias) [, x + residual]. Keeps the rows it normalised
    (x, or the sum) and rstd, not the normed rows the linear multiplies: the backward normalises again."""

    class _RMSNormLinear(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x, residual, norm_weight, eps, weight, bias):
            normed, h, h_rows, _, rstd = kernels._forward(x, residual, norm_weight, None, eps, True)
            out = linear_of_its_own(normed, weight, bias)
            ctx.save_for_backward(h_rows, norm_weight, rstd, weight)
            ctx.has_residual, ctx.has_bias, ctx.shape = residual is not None, bias is not None, x.shape
            return out if residual is None else (out, h)

        @staticmethod
        def backward(ctx, dout, dh=None):
            h, norm_weight, rstd, weight = ctx.saved_tensors
            dout = dout.reshape(-1, dout.shape[-1])
            dweight = dbias = None
            if ctx.needs_input_grad[4]:
                dweight = dout.t().mm(kernels._normalise_again(h, norm_weight, None, None, rstd))
            if ctx.has_bias and ctx.needs_input_grad[5]:
                dbias = dout.sum(0)
            dx, dnorm_weight, _ = kernels._backward(h, norm_weight, None, None, rstd, dout.mm(weight), dh)
            dx = dx.view(ctx.shape)
            return dx, (dx if ctx.has_residual else None), dnorm_weight, None, dweight, dbias

    return _RMSNormLinear


def qk_heads(qkv: torch.Tensor, heads: int, kv_heads: int) -> torch.Tensor:
    """The q and k heads of a contiguous (batch, seq, (heads + 2 kv_heads) * head_dim) projection, as a
    (batch, heads + kv_heads, seq, head_dim) view."""
    b, s, width = qkv.shape
    heads_of_qkv = qkv.view(b, s, heads + 2 * kv_heads, width // (heads + 2 * kv_heads))
    return heads_of_qkv[:, :, :heads + kv_heads].transpose(1, 2)


def _angles(t: torch.Tensor, b: int, s: int) -> torch.Tensor:
    if t.dim() == 2:
        t = t.unsqueeze(0)
    if t.dim() != 3 or t.shape[1] != s or t.shape[0] not in (1, b):
        raise ValueError(f"rotary cos/sin must be (seq, rotary_dim/2) or (batch, seq, rotary_dim/2) with seq={s}, "
                         f"batch={b}; got {tuple(t.shape)}")
    return t.expand(b, s, t.shape[2])


def checked_angles(x, cos, sin):
    """cos and sin (one angle per rotated pair) as (batch, seq, rotary_dim / 2) views for x (batch, heads, seq,
    head_dim)."""
    if x.dim() != 4:
        raise ValueError(f"rotary embedding takes (batch, heads, seq, head_dim), got shape {tuple(x.shape)}")
    b, _, s, d = x.shape
    cos, sin = _angles(cos, b, s), _angles(sin, b, s)
    if cos.shape != sin.shape or 2 * cos.shape[-1] > d:
        raise ValueError(f"rotary cos {tuple(cos.shape)} / sin {tuple(sin.shape)} do not fit head_dim {d}")
    return cos, sin


def rotary_in_place_function(kernels) -> type:
    """Rotates q and k where they lie in the projection: the attention then keeps q, k and v as views of that one
    tensor, and the rotation keeps only the angles. `kernels._launch(x, cos, sin, conjugate, out=x)` rotates in
    place."""

    class _RotaryQKInPlace(torch.autograd.Function):
        @staticmethod
        def forward(ctx, qkv, cos, sin, heads, kv_heads):
            if qkv.dim() != 3 or not qkv.is_contiguous() or qkv.shape[-1] % (heads + 2 * kv_heads):
                raise ValueError(f"a fused qkv projection of {heads} + 2 x {kv_heads} heads must be a contiguous "
                                 f"(batch, seq, heads * head_dim) tensor, got shape {tuple(qkv.shape)}")
            qk = qk_heads(qkv, heads, kv_heads)
            cos, sin = checked_angles(qk, cos, sin)
            kernels._launch(qk, cos, sin, False, out=qk)
            ctx.mark_dirty(qkv)
            ctx.save_for_backward(cos, sin)
            ctx.heads, ctx.kv_heads = heads, kv_heads
            return qkv

        @staticmethod
        def backward(ctx, grad):
            cos, sin = ctx.saved_tensors
            dqkv = grad.clone(memory_format=torch.contiguous_format)  # the values' part as it is; autograd owns grad
            dqk = qk_heads(dqkv, ctx.heads, ctx.kv_heads)
            kernels._launch(dqk, cos, sin, True, out=dqk)
            return dqkv, None, None, None, None

    return _RotaryQKInPlace


def swiglu_linear_function(kernels) -> type:
    """linear(silu(gate) * up, weight, bias) of one gate | up tensor: keeps gate_up, not the product the linear
    multiplies (which backward computes again, the same kernel on the same inputs: the same bits).
    `kernels._swiglu_into(gate, up, y)` writes the product into y and returns it; `kernels._swiglu_grad_into(gate,
    up, dy, dgate, dup)` writes the two gradients."""

    class _SwiGLULinear(torch.autograd.Function):
        @staticmethod
        def forward(ctx, gate_up, weight, bias):
            n = gate_up.shape[-1] // 2
            rows = gate_up.reshape(-1, 2 * n).contiguous()
            product = torch.empty(*gate_up.shape[:-1], n, device=rows.device, dtype=rows.dtype)
            kernels._swiglu_into(rows[:, :n], rows[:, n:], product.view(-1, n))
            ctx.save_for_backward(rows, weight)
            ctx.shape, ctx.has_bias = gate_up.shape, bias is not None
            return linear_of_its_own(product, weight, bias)

        @staticmethod
        def backward(ctx, dout):
            rows, weight = ctx.saved_tensors
            n = rows.shape[1] // 2
            gate, up = rows[:, :n], rows[:, n:]
            dout = dout.reshape(-1, dout.shape[-1])
            dweight = dbias = None
            if ctx.needs_input_grad[1]:
                product = kernels._swiglu_into(gate, up, torch.empty(rows.shape[0], n, device=rows.device,
                                                                    dtype=rows.dtype))
                dweight = dout.t().mm(product)
                del product
            if ctx.has_bias and ctx.needs_input_grad[2]:
                dbias = dout.sum(0)
            dproduct = dout.mm(weight)
            dgate_up = torch.empty_like(rows)
            kernels._swiglu_grad_into(gate, up, dproduct, dgate_up[:, :n], dgate_up[:, n:])
            return dgate_up.view(ctx.shape), dweight, dbias

    return _SwiGLULinear
