"""LayerNorm and RMSNorm over the last dimension, optionally fused with the residual add before them; the modules
that hold the weights are `colozoo.layers.norm`.

    layer_norm(x, weight, bias, eps, residual=None)           y, or (y, x + residual) given a residual
    rms_norm(x, weight, eps, residual=None, offset=False)     the same; offset=True (Gemma) scales by (1 + weight)
    rms_norm_linear(x, norm_weight, eps, weight, bias, residual=None, offset=False, linear=F.linear)
                                                              linear(rms_norm(...), weight, bias), (and x + residual)

Each op runs the Triton kernel (`norms_triton`) where `dispatch.use_triton` says so for an elementwise op and the
residual and parameters share x's dtype (the kernel returns x's dtype, where torch would promote a mixed-dtype sum);
otherwise its torch reference, the `*_reference` function here. `rms_norm_linear` fuses only where that saves
memory, a training forward (grad enabled, no autocast) on the Triton path: one function that keeps x and the fp32
statistic and normalises again in backward, where the linear after the norm would keep the normed tensor too.
Elsewhere it is `rms_norm` and then `linear` (F.linear or the caller's, e.g. `colozoo.layers.matmul.linear`).
Priced on meta tensors (`priced.pricing_fusions`), the Triton path takes `priced`'s stand-ins.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from . import priced
from .dispatch import autocasting


def _kernel_fits(x, residual, *params) -> bool:
    same_dtype = all(t is None or t.dtype == x.dtype for t in (residual, *params))
    return same_dtype and priced.on_fused_path(x, residual)


def layer_norm(x, weight=None, bias=None, eps: float = 1e-5, residual=None):
    """LayerNorm of x; given `residual`, of x + residual, returning (normed, x + residual)."""
    if _kernel_fits(x, residual, weight, bias):
        return priced.fused(x, "norms_triton", "layer_norm")(x, weight, bias, eps, residual)
    if residual is not None:  # summed by torch; its norm alone may still fit the kernel
        summed = x + residual
        return layer_norm(summed, weight, bias, eps), summed
    return layer_norm_reference(x, weight, bias, eps)


def rms_norm(x, weight=None, eps: float = 1e-6, residual=None, *, offset: bool = False):
    """RMSNorm of x (see rms_norm_reference); given `residual`, of x + residual, returning (normed, x + residual)."""
    if _kernel_fits(x, residual, *(() if offset else (weight,))):
        # the kernel multiplies in fp32 too, so an fp32 (1 + weight) is exact whatever x's dtype
        return priced.fused(x, "norms_triton", "rms_norm")(x, 1 + weight.float() if offset else weight, eps, residual)
    if residual is not None:
        summed = x + residual
        return rms_norm(summed, weight, eps, offset=offset), summed
    return rms_norm_reference(x, weight, eps, offset=offset)


def rms_norm_linear(x, norm_weight, eps: float, weight, bias=None, residual=None, *, offset: bool = False,
                    linear=F.linear):
    """linear(rms_norm(x, norm_weight, eps), weight, bias); given `residual`, of x + residual, returning
    (that, x + residual)."""
    fused = torch.is_grad_enabled() and not autocasting(x)
    if fused and _kernel_fits(x, residual, weight, bias, *(() if offset else (norm_weight,))):
        fused_op = priced.fused(x, "norms_triton", "rms_norm_linear")
        return fused_op(x, 1 + norm_weight.float() if offset else norm_weight, eps, weight, bias, residual)
    if residual is None:
        return linear(rms_norm(x, norm_weight, eps, offset=offset), weight, bias)
    normed, summed = rms_norm(x, norm_weight, eps, residual, offset=offset)
    return linear(normed, weight, bias), summed


def layer_norm_reference(x, weight=None, bias=None, eps: float = 1e-5, residual=None):
    if residual is not None:
        summed = x + residual
        return layer_norm_reference(summed, weight, bias, eps), summed
    return F.layer_norm(x, (x.shape[-1],), weight, bias, eps)


def rms_norm_reference(x, weight=None, eps: float = 1e-6, residual=None, *, offset: bool = False):
    """y = x / rms(x) * weight, the statistics in fp32 like the LLaMA reference, cast back to x's dtype before the
    weight multiplies. `offset=True` (Gemma): y = x / rms(x) * (1 + weight), the product taken in fp32 before the
    cast (the stored weight is zero-centred, as in the checkpoints)."""
    if residual is not None:
        summed = x + residual
        return rms_norm_reference(summed, weight, eps, offset=offset), summed
    dtype = x.dtype
    x = x.float()
    x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
    if offset:
        return (x * (1 + weight.float())).to(dtype)
    return x.to(dtype) if weight is None else weight * x.to(dtype)
