"""Dtype names, defined once: what users write (fp32, bfloat16, ...) as torch dtypes and what safetensors files
store (F32, BF16, ...). The torch-free part (the names, how sizes and counts are shown) is `colozoo.core.names`."""
from __future__ import annotations

import torch

from colozoo.core.names import DTYPE_NAMES, FLOAT_CHOICES, human_bytes, human_count  # noqa: F401 - re-exported

NAMES = {name: getattr(torch, torch_name) for name, torch_name in DTYPE_NAMES.items()}
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
