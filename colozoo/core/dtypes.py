"""Dtype names, defined once: what users write (fp32, bfloat16, ...), what safetensors files store (F32, BF16,
...), and how sizes and counts are shown."""
from __future__ import annotations

import torch

NAMES = {"fp32": torch.float32, "float32": torch.float32, "fp16": torch.float16, "float16": torch.float16,
         "half": torch.float16, "bf16": torch.bfloat16, "bfloat16": torch.bfloat16}
FLOAT_CHOICES = ("float32", "bfloat16", "float16")   # what CLIs offer
SAFETENSORS = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
               "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
               "BOOL": torch.bool}
SAFETENSORS_CODES = {v: k for k, v in SAFETENSORS.items()}


def parse_dtype(dtype) -> torch.dtype | None:
    """A torch dtype from a dtype or one of NAMES (None stays None)."""
    if dtype is None or isinstance(dtype, torch.dtype):
        return dtype
    try:
        return NAMES[str(dtype).lower()]
    except KeyError:
        raise ValueError(f"unsupported dtype {dtype!r}; use fp32, fp16 or bf16") from None


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def human_bytes(nbytes: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(nbytes) < 1024 or unit == "TiB":
            return f"{nbytes:.0f} {unit}" if unit == "B" else f"{nbytes:.2f} {unit}"
        nbytes /= 1024


def human_count(n: int | None) -> str:
    """A parameter count as 124.4M, 1.2B (? when unknown)."""
    if n is None:
        return "?"
    for unit, scale in (("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if n >= scale:
            return f"{n / scale:.1f}{unit}"
    return str(n)
