"""What the memory benches share: the peak bytes of the tensors a call allocates (torch.cuda.max_memory_allocated
above what was allocated before on CUDA, a tracking dispatch mode elsewhere: tests/helpers/live_bytes.py, the tensors
made before the call excluded), and their --repeats, --device and --dtype."""
from __future__ import annotations

import os
import sys

import torch


def peak_bytes(call, device: str):
    """(peak bytes, call's result) of `call()` on `device`."""
    if device == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        start = torch.cuda.memory_allocated()
        result = call()
        torch.cuda.synchronize()
        return torch.cuda.max_memory_allocated() - start, result
    sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests", "helpers"))
    from live_bytes import LiveBytes

    with LiveBytes() as counted:
        result = call()
    return counted.peak, result


def add_device_arguments(parser):
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--dtype", default=None, help="default: float32 on CPU, bfloat16 on CUDA")


def device_and_dtype(args) -> tuple[str, torch.dtype]:
    return args.device, getattr(torch, args.dtype or ("bfloat16" if args.device == "cuda" else "float32"))
