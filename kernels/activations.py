"""Activations with a Triton kernel: SwiGLU, bias + GeLU, and the GeLU variants of transformers' config names.

    swiglu(gate, up)                          silu(gate) * up
    swiglu_linear(gate_up, weight, bias, linear)  linear(swiglu(*gate_up.chunk(2, -1)), weight, bias)
    bias_gelu(x, bias, approximate)           gelu(x + bias), "none" (erf) or "tanh"
    gelu, gelu_tanh, gelu_new, gelu_fast      GELUS[config name]
    linear_gelu(linear, x, weight, bias, name)  a GeLU of linear(x, weight, bias), the bias fused into the kernel

Each op runs the Triton kernel (`activations_triton`) where `dispatch.use_triton` says so (SwiGLU as an elementwise
op: a decode step's inputs stay on torch), otherwise its torch reference, the `*_reference` function here (F.gelu
for the exact GeLU). Every GeLU variant takes the one bias-GeLU kernel, exact or tanh-approximated. `swiglu_linear`
fuses where that saves memory, a training forward (grad enabled, no autocast) on the Triton path: one function that
keeps gate | up and computes the product again in backward, where the linear after it would keep the product too;
elsewhere it is `swiglu` and then `linear` (F.linear or the caller's, e.g. `colozoo.layers.matmul.linear`).
Priced on meta tensors (`priced.pricing_fusions`), the fused one takes `priced`'s stand-in.
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from . import priced
from .dispatch import autocasting, use_triton

GELU_APPROXIMATION = {"gelu": "none", "gelu_new": "tanh", "gelu_pytorch_tanh": "tanh", "gelu_fast": "tanh"}


def swiglu(gate, up):
    if use_triton(gate, up, elementwise=True):
        from .activations_triton import swiglu_triton

        return swiglu_triton(gate, up)
    return swiglu_reference(gate, up)


def swiglu_linear(gate_up, weight, bias=None, linear=F.linear):
    """linear(silu(gate) * up, weight, bias) for gate, up = gate_up.chunk(2, dim=-1) (a fused gate | up
    projection's output)."""
    same_dtype = weight.dtype == gate_up.dtype and (bias is None or bias.dtype == gate_up.dtype)
    fused = torch.is_grad_enabled() and not autocasting(gate_up) and same_dtype
    if fused and priced.on_fused_path(gate_up):
        return priced.fused(gate_up, "activations_triton", "swiglu_linear")(gate_up, weight, bias)
    return linear(swiglu(*gate_up.chunk(2, dim=-1)), weight, bias)


def bias_gelu(x, bias=None, approximate: str = "none"):
    """gelu(x + bias), fused into one kernel on the Triton path."""
    if use_triton(x, bias):
        from .activations_triton import bias_gelu_triton

        return bias_gelu_triton(x, bias, approximate)
    return bias_gelu_reference(x, bias, approximate)


def _gelu(x, approximate: str, reference):
    if use_triton(x):
        from .activations_triton import bias_gelu_triton

        return bias_gelu_triton(x, None, approximate)
    return reference(x)


def gelu(x):
    return _gelu(x, "none", F.gelu)


def gelu_tanh(x):
    return _gelu(x, "tanh", gelu_tanh_reference)


def gelu_new(x):
    return _gelu(x, "tanh", gelu_new_reference)


def gelu_fast(x):
    return _gelu(x, "tanh", gelu_fast_reference)


GELUS = {"gelu": gelu, "gelu_new": gelu_new, "gelu_pytorch_tanh": gelu_tanh, "gelu_fast": gelu_fast}


def linear_gelu(linear, x, weight, bias, name: str):
    """GELUS[name](linear(x, weight, bias)), for a linear layer's `linear` (F.linear or a parallel one). The Triton path
    leaves the bias out of the matmul and adds it inside the fused bias-GeLU kernel."""
    if use_triton(x, weight, bias):
        from .activations_triton import bias_gelu_triton

        return bias_gelu_triton(linear(x, weight, None), bias, GELU_APPROXIMATION[name])
    return GELUS[name](linear(x, weight, bias))


def swiglu_reference(gate, up):
    return F.silu(gate) * up


def bias_gelu_reference(x, bias=None, approximate: str = "none"):
    return F.gelu(x if bias is None else x + bias, approximate=approximate)


def gelu_tanh_reference(x):
    return F.gelu(x, approximate="tanh")


def gelu_new_reference(x):
    if x.dtype == torch.float32:
        # torch's fused tanh GeLU is the same function in one pass instead of seven, within fp32 rounding of the
        # composed form; not in bf16 / fp16, where it rounds differently from transformers' composed gelu_new
        return gelu_tanh_reference(x)
    return 0.5 * x * (1.0 + torch.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * torch.pow(x, 3.0))))


def gelu_fast_reference(x):
    return 0.5 * x * (1.0 + torch.tanh(x * 0.7978845608 * (1.0 + 0.044715 * x * x)))
