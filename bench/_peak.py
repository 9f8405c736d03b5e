"""What the memory benches share: the peak bytes of the tensors a call allocates (torch.cuda.max_memory_allocated
above what was allocated before on CUDA, a tracking dispatch mode elsewhere: tests/helpers/live_bytes.py, the tensors
made before the call excluded), a call's milliseconds, and their --repeats, --device and --dtype."""
from __future__ import annotations

import os
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests", "helpers"))
from live_bytes import LiveBytes  # noqa: E402


def peak_bytes(call, device: str):
    """(peak bytes, call's result) of `call()` on `device`."""
    if device == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        start = torch.cuda.memory_allocated()
        result = call()
        torch.cuda.synchronize()
        return torch.cuda.max_memory_allocated() - start, result
    with LiveBytes() as counted:
        result = call()
    return counted.peak, result


def elapsed_ms(call, device: str) -> tuple[float, float]:
    """(wall, process CPU) milliseconds of `call()` (on CUDA, synchronized before and after)."""
    if device == "cuda":
        torch.cuda.synchronize()
    wall, cpu = time.perf_counter(), time.process_time()
    call()
    if device == "cuda":
        torch.cuda.synchronize()
    return (time.perf_counter() - wall) * 1e3, (time.process_time() - cpu) * 1e3


def add_device_arguments(parser):
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--dtype", default=None, help="default: float32 on CPU, bfloat16 on CUDA")


def device_and_dtype(args) -> tuple[str, torch.dtype]:
    return args.device, getattr(torch, args.dtype or ("bfloat16" if args.device == "cuda" else "float32"))
