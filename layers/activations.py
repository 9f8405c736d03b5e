"""Activation functions by their transformers config names (our own, so no forward code depends on HF). The GeLU
variants and SwiGLU are ops of `colozoo.kernels.activations`, which pick their Triton kernel or torch."""
from __future__ import annotations

import torch
import torch.nn.functional as F

from colozoo.kernels.activations import GELUS, swiglu


def quick_gelu(x):
    return x * torch.sigmoid(1.702 * x)


ACTIVATIONS = {
    **GELUS,
    "quick_gelu": quick_gelu,
    "relu": F.relu,
    "silu": F.silu,
    "swish": F.silu,
    "tanh": torch.tanh,
    "sigmoid": torch.sigmoid,
}


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


def clamped_swiglu(alpha: float, limit: float):
    """gpt-oss's gated activation: (up + 1) * gate * sigmoid(alpha * gate), gate clamped above at `limit` and up to
    [-limit, limit] first."""

    def gated(gate, up):
        gate, up = gate.clamp(max=limit), up.clamp(min=-limit, max=limit)
        return (up + 1) * (gate * torch.sigmoid(gate * alpha))

    gated.__name__ = f"clamped_swiglu_{alpha}_{limit}"
    return gated
