"""Activation functions by their transformers config names (our own, so no forward code depends on HF)."""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from colozoo.kernels.dispatch import use_triton


def gelu_tanh(x):
    return F.gelu(x, approximate="tanh")


def gelu_new(x):
    if x.dtype == torch.float32:
        # torch's fused tanh GeLU is the same function in one pass instead of seven, within fp32 rounding of the
        # composed form; not in bf16 / fp16, where it rounds differently from transformers' composed gelu_new
        return gelu_tanh(x)
    return 0.5 * x * (1.0 + torch.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * torch.pow(x, 3.0))))


def gelu_fast(x):
    return 0.5 * x * (1.0 + torch.tanh(x * 0.7978845608 * (1.0 + 0.044715 * x * x)))


def quick_gelu(x):
    return x * torch.sigmoid(1.702 * x)


ACTIVATIONS = {
    "gelu": F.gelu,
    "gelu_new": gelu_new,
    "gelu_pytorch_tanh": gelu_tanh,
    "gelu_fast": gelu_fast,
    "quick_gelu": quick_gelu,
    "relu": F.relu,
    "silu": F.silu,
    "swish": F.silu,
    "tanh": torch.tanh,
    "sigmoid": torch.sigmoid,
}


def bias_gelu(x, bias=None, approximate: str = "none"):
    """gelu(x + bias), fused into one kernel on the Triton path."""
    if use_triton(x, bias):
        from colozoo.kernels.activations import bias_gelu_triton

        return bias_gelu_triton(x, bias, approximate)
    return F.gelu(x if bias is None else x + bias, approximate=approximate)


def swiglu(gate, up):
    """silu(gate) * up, fused into one kernel on the Triton path."""
    if use_triton(gate, up, elementwise=True):
        from colozoo.kernels.activations import swiglu_triton

        return swiglu_triton(gate, up)
    return F.silu(gate) * up


def _gelu_with_kernel(torch_fn, approximate: str):
    def act(x):
        return bias_gelu(x, None, approximate) if use_triton(x) else torch_fn(x)

    act.__name__ = getattr(torch_fn, "__name__", "gelu")
    return act


GELU_APPROXIMATION = {"gelu": "none", "gelu_new": "tanh", "gelu_pytorch_tanh": "tanh", "gelu_fast": "tanh"}
for _name, _approximate in GELU_APPROXIMATION.items():
    ACTIVATIONS[_name] = _gelu_with_kernel(ACTIVATIONS[_name], _approximate)


def get_activation(name: str):
    try:
        return ACTIVATIONS[name]
    except KeyError:
        raise ValueError(f"unsupported activation {name!r}; supported: {sorted(ACTIVATIONS)}") from None


def get_gated_activation(name: str):
    """(gate, up) -> act(gate) * up, the fused SwiGLU kernel when act is silu."""
    if name in ("silu", "swish"):
        return swiglu
    act = get_activation(name)

    def gated(gate, up):
        return act(gate) * up

    gated.__name__ = f"gated_{name}"
    return gated
