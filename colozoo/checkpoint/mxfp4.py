"""MXFP4 weights (the published gpt-oss checkpoints), dequantised on read.

A quantised tensor W (experts, out, in) is stored as two: `W_blocks` (experts, out, in / 32, 16) uint8, two 4-bit
E2M1 codes a byte (the low nibble first), and `W_scales` (experts, out, in / 32) uint8, one power-of-two exponent
(E8M0, biased by 127) per block of 32 values: value = E2M1(code) * 2 ** (scale - 127). transformers holds the
dequantised weights as (experts, in, out), the layout of gpt-oss's bf16 checkpoints, and so does `MXFP4Reader`:
it presents each pair under the plain name W, (experts, in, out), and reads only the experts and output rows a
slice asks for, one tensor at a time.
"""
from __future__ import annotations

import copy

import torch

from colozoo.checkpoint.readers import TensorReader

E2M1 = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)  # code -> value
BLOCK = 32
BLOCKS, SCALES = "_blocks", "_scales"


def is_mxfp4(config) -> bool:
    quantization = getattr(config, "quantization_config", None) or {}
    if not isinstance(quantization, dict):
        quantization = quantization.to_dict()
    return quantization.get("quant_method") == "mxfp4"


def dequantized_config(config):
    """The config of the dequantised weights: the same without its quantization_config."""
    config = copy.deepcopy(config)
    if hasattr(config, "quantization_config"):
        delattr(config, "quantization_config")
    return config


def dequantize(blocks: torch.Tensor, scales: torch.Tensor, dtype=torch.bfloat16) -> torch.Tensor:
    """(..., rows, groups, 16) codes and (..., rows, groups) exponents -> (..., rows, groups * 32) values (exact:
    every E2M1 value times a power of two is representable in bf16)."""
    codes = torch.stack((blocks & 0x0F, blocks >> 4), dim=-1).flatten(-2).long()
    values = torch.tensor(E2M1, dtype=torch.float32, device=blocks.device)[codes]
    values = values * torch.exp2(scales.float() - 127)[..., None]
    return values.flatten(-2).to(dtype)


class MXFP4Reader(TensorReader):
    """Another reader's tensors, each `W_blocks` / `W_scales` pair replaced by W dequantised to `dtype`."""

    def __init__(self, inner: TensorReader, dtype=torch.bfloat16):
        self.inner, self.dtype_ = inner, dtype
        names = inner.names()
        present = set(names)
        self.quantized = {n.removesuffix(BLOCKS) for n in names
                          if n.endswith(BLOCKS) and n.removesuffix(BLOCKS) + SCALES in present}
        packed = {base + suffix for base in self.quantized for suffix in (BLOCKS, SCALES)}
        self._names = [n for n in names if n not in packed] + sorted(self.quantized)

    def names(self):
        return list(self._names)

    def __contains__(self, name):
        return name in self.quantized or name in self.inner

    def shape(self, name):
        if name not in self.quantized:
            return self.inner.shape(name)
        experts, rows, groups, _ = self.inner.shape(name + BLOCKS)
        return experts, groups * BLOCK, rows

    def dtype(self, name):
        return self.dtype_ if name in self.quantized else self.inner.dtype(name)

    def read(self, name, index=None):
        if name not in self.quantized:
            return self.inner.read(name, index)
        index = tuple(index or ()) + (slice(None),) * (3 - len(tuple(index or ())))
        squeeze = [d for d, i in enumerate(index) if isinstance(i, int)]
        experts, inputs, rows = (slice(i, i + 1) if isinstance(i, int) else i for i in index)
        blocks = self.inner.read(name + BLOCKS, (experts, rows))
        scales = self.inner.read(name + SCALES, (experts, rows))
        out = dequantize(blocks, scales, self.dtype_).transpose(1, 2)[:, inputs].contiguous()
        for d in reversed(squeeze):
            out = out.squeeze(d)
        return out
