"""Dtype names, defined once: what users write (fp32, bfloat16, ...) as torch dtypes and what safetensors files
store (F32, BF16, ...). The torch-free part (the names, how sizes and counts are shown) is `colozoo.core.names`."""
from __future__ import annotations

import torch

from colozoo.core.names import (DTYPE_NAMES, FLOAT_CHOICES, check_dtype_name, human_bytes,  # noqa: F401 - re-exported
                                human_count)

NAMES = {name: getattr(torch, torch_name) for name, torch_name in DTYPE_NAMES.items()}
SAFETENSORS = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
               "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
               "BOOL": torch.bool}
SAFETENSORS_CODES = {v: k for k, v in SAFETENSORS.items()}


def parse_dtype(dtype, what: str = "dtype") -> torch.dtype | None:
    """A floating torch dtype from what transformers' `dtype` / `torch_dtype` accept: a torch.dtype, or a name of
    DTYPE_NAMES (torch's: "bfloat16", not "bf16"); None and "auto" are None (the checkpoint's dtype). `what`: the
    argument, as the one-line refusal names it."""
    if isinstance(dtype, torch.dtype):
        if not dtype.is_floating_point:
            raise ValueError(f"{what}={dtype} is not a floating-point dtype")
        return dtype
    if dtype is None:
        return None
    if not isinstance(dtype, str):
        raise ValueError(f"{what} must be a torch.dtype or its name, got {type(dtype).__name__} {dtype!r}")
    name = check_dtype_name(dtype, what)
    return None if name == "auto" else NAMES[name]


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")
