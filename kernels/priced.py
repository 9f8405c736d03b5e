"""What colozoo's Triton fusions keep for the backward, priced on meta tensors: the profiler's stand-ins.

On a GPU a colozoo layer takes four fusions that keep less than the torch composition does: the norms
(`norms_triton._Norm`: the rows normalised and fp32 statistics), a norm fused with the projection after it
(`_RMSNormLinear`: not the normed rows either), q and k rotated in place inside the qkv projection
(`rope_triton._RotaryQKInPlace`: the angles only) and SwiGLU fused with the down projection
(`activations_triton._SwiGLULinear`: gate | up, not their product). Under `pricing_fusions()` the ops of
`colozoo.kernels` take these stand-ins on meta tensors where the Triton path would take those functions: the same
autograd functions (`fused_functions`), built on a torch op for each Triton launch, so they save the same tensors,
the tracer prices each launch's traffic, and pricing a GPU run needs no triton. `tests/test_priced_fusions.py` holds
each to its Triton function.
"""
from __future__ import annotations

import contextlib
import contextvars
import sys

import torch

from .dispatch import use_triton
from .fused_functions import norm_function, rms_norm_linear_function, rotary_in_place_function, swiglu_linear_function

_PRICING = contextvars.ContextVar("colozoo_pricing_fusions", default=False)


@contextlib.contextmanager
def pricing_fusions(enabled: bool = True):
    """Inside the block, the fused ops on meta tensors take the stand-ins (for this context only)."""
    token = _PRICING.set(enabled)
    try:
        yield
    finally:
        _PRICING.reset(token)


def pricing() -> bool:
    """True inside pricing_fusions()."""
    return _PRICING.get()


def priced(x: torch.Tensor) -> bool:
    """True where an op on `x` is priced as colozoo's Triton path runs it (meta tensors under pricing_fusions)."""
    return x.is_meta and _PRICING.get()


def on_fused_path(x: torch.Tensor, *others) -> bool:
    """Whether an op on `x` (and `others`) takes colozoo's fused path: the Triton kernels where dispatch.use_triton
    says so for an elementwise op, or their stand-ins where `x` is priced."""
    return priced(x) or use_triton(x, *others, elementwise=True)


def fused(x: torch.Tensor, module: str, name: str):
    """The fusion `name` an op on `x` takes on the Triton path: this module's stand-in where `x` is priced, else
    `colozoo.kernels.<module>.<name>_triton` (imported only then, so pricing needs no triton; by an import
    statement, which torch.compile traces, where importlib would break the graph)."""
    if priced(x):
        return globals()[name]
    if module == "norms_triton":
        from . import norms_triton as triton_module
    elif module == "rope_triton":
        from . import rope_triton as triton_module
    else:
        from . import activations_triton as triton_module
    return getattr(triton_module, f"{name}_triton")


# The launches' stand-ins: each reads what its kernel reads and writes what it writes, in one op and the tensors'
# own dtype, allocating no more than the kernel does (its fp32 arithmetic stays in registers), so the tracer prices
# the kernels' traffic and temporaries. They do not compute the kernels' values: meta tensors have none.

def _forward(x, residual, weight, bias, eps, is_rms):
    """norms_triton._forward's outputs: (y, h, rows, mean, rstd), rows x's (or the new sum h's) as (m, n)."""
    h = x + residual if residual is not None else None
    rows = (h if h is not None else x).reshape(-1, x.shape[-1])
    statistic = torch.empty(rows.shape[0], device=x.device, dtype=torch.float32)
    mean = None if is_rms else torch.empty_like(statistic)
    return _normalise_again(rows, weight, bias, mean, statistic).view(x.shape), h, rows, mean, statistic


def _normalise_again(rows, weight, bias, mean, rstd):
    return rows * weight if weight is not None else rows.clone()


def _backward(rows, weight, bias, mean, rstd, dy, dh):
    """norms_triton._backward's outputs: (dx as rows, dweight, dbias)."""
    dy = dy.reshape(rows.shape) if dy is not None else torch.zeros_like(rows)
    dx = dy * rows if dh is None else torch.addcmul(dh.reshape(rows.shape), dy, rows)
    dweight = dy.sum(0).to(weight.dtype) if weight is not None else None
    dbias = dy.sum(0).to(bias.dtype) if bias is not None else None
    return dx, dweight, dbias


def _launch(x, cos, sin, conjugate: bool, out):
    """rope_triton._launch into `out`, here always x itself (in place)."""
    return out.mul_(1)


def _swiglu_into(gate, up, y):
    return torch.mul(gate, up, out=y)


def _swiglu_grad_into(gate, up, dy, dgate, dup):
    torch.mul(dy, up, out=dgate)
    torch.mul(dy, gate, out=dup)


_STAND_INS = sys.modules[__name__]
_Norm = norm_function(_STAND_INS)
_RMSNormLinear = rms_norm_linear_function(_STAND_INS)
_RotaryQKInPlace = rotary_in_place_function(_STAND_INS)
_SwiGLULinear = swiglu_linear_function(_STAND_INS)


def layer_norm(x, weight=None, bias=None, eps: float = 1e-5, residual=None):
    return _Norm.apply(x, residual, weight, bias, eps, False)


def rms_norm(x, weight=None, eps: float = 1e-6, residual=None):
    return _Norm.apply(x, residual, weight, None, eps, True)


def rms_norm_linear(x, norm_weight, eps: float, weight, bias=None, residual=None):
    return _RMSNormLinear.apply(x, residual, norm_weight, eps, weight, bias)


def rotate_qk_in_place(qkv, cos, sin, heads: int, kv_heads: int):
    """As rope_triton.rotate_qk_in_place_triton: cos / sin hold one angle per rotated pair."""
    return _RotaryQKInPlace.apply(qkv, cos, sin, heads, kv_heads)


def swiglu_linear(gate_up, weight, bias=None):
    return _SwiGLULinear.apply(gate_up, weight, bias)
