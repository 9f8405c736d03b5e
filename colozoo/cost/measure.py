"""Measuring the hardware fields the cost model prices kernels with, on the device given, written as a JSON file
that `get_hardware` and `colozoo plan --hardware file.json` load over a preset (colozoo.cost.hardware.load_measured).

What is measured is what colozoo.cost.compute_time uses: the rate of large bf16 matrix products held for a few
seconds (clocks settle under sustained load: `matmul_efficiency` of the datasheet's peak) and in short bursts; a grid
of (m, n, k) products whose output tiles fill the streaming multiprocessors unevenly, against the model's tile and
wave quantization (`small_tile` and `small_tile_efficiency`: the smaller tile, and its rate, that fits the grid best
beside the large `gemm_tile`; `sm_count` the device's own); a fused
attention forward and backward (`attention_efficiency`); a large device copy (`hbm_efficiency` of the datasheet's
bandwidth; a large read beside it); pinned host-device copies each way (`pcie_bw`: the slower); one tiny kernel in
a stream of them (`kernel_floor_s`). A device with no datasheet preset (a CPU, an unknown GPU) gets its measured peak
and bandwidth as `peak_flops` and `hbm_bw`; the other fields (links, network) stay those of the `links` preset, named
in the file; `gpu_memory` is always the measured device's (a CPU's: the machine's memory), never a preset's. Every
field written names the device it ran on and the date: a CPU's figures are never a GPU's.
"""
from __future__ import annotations

import datetime
import json
import math
import os
import platform
import statistics
import time
from dataclasses import dataclass, replace
from pathlib import Path

import torch

from colozoo.core.files import fsync_write
from colozoo.cost.compute_time import gemm_seconds
from colozoo.cost.hardware import PRESETS, Hardware, HardwareError

TILES = ((256, 128), (128, 128), (128, 64), (64, 64))  # candidate cuBLAS output tiles for the grid's fit


@dataclass(frozen=True)
class Sizes:
    square: int                # the large product's m = n = k
    grid_m: tuple              # rows of the grid's products (tokens a GPU multiplies)
    grid_n: tuple              # output features (a tensor-parallel slice of a layer)
    grid_k: int
    copy_bytes: int
    host_bytes: int
    attention: tuple           # batch, heads, sequence, head dim
    sustain_s: float           # how long the large product is held for the sustained rate
    sample_s: float = 0.005    # each timed sample repeats its kernel for about this long


# the grid's smallest product (512 x 1536 x 8192) still takes longer on an H100 than Python takes to launch it
GPU_SIZES = Sizes(8192, (512, 2048, 8192), (1536, 4608, 6144), 8192, 1 << 30, 1 << 28, (4, 16, 4096, 128), 5.0)
CPU_SIZES = Sizes(256, (16, 96), (48, 160), 128, 1 << 24, 1 << 20, (1, 2, 128, 32), 0.2)


def device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return f"{device.type} ({platform.processor() or platform.machine()})"


def datasheet_preset(name: str) -> str | None:
    """The preset whose datasheet describes a CUDA device of this name (SXM parts; PCIe and NVL parts have other
    peaks: None)."""
    upper = name.upper()
    if any(part in upper for part in ("PCIE", "NVL", "GH200", "GB200")):
        return None
    for key, preset in (("H200", "H200"), ("H100", "H100-80GB"), ("H800", "H800"), ("B200", "B200"), ("L40S", "L40S"),
                        ("V100", "V100-32GB"), ("4090", "RTX4090"), ("A100-SXM4-40GB", "A100-40GB"),
                        ("A100", "A100-80GB")):
        if key in upper.replace(" ", "-"):
            return preset
    return None


def synchronize(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def seconds_each(fn, device, samples: int = 5, sample_s: float = 0.005) -> float:
    """Median seconds of one call of fn, each sample repeating it for about sample_s (launches amortised)."""
    fn()
    synchronize(device)
    start = time.perf_counter()
    fn()
    synchronize(device)
    repeat = max(1, math.ceil(sample_s / max(time.perf_counter() - start, 1e-9)))
    times = []
    for _ in range(samples):
        synchronize(device)
        start, calls = time.perf_counter(), 0
        while calls < repeat and (calls == 0 or time.perf_counter() - start < 4 * sample_s):  # a stalled CPU ends early
            fn()
            calls += 1
        synchronize(device)
        times.append((time.perf_counter() - start) / calls)
    return statistics.median(times)


def copy_bandwidth(device, nbytes: int = 1 << 30) -> float:
    """Bytes read + written per second by a device copy of nbytes."""
    src, dst = (torch.empty(nbytes, dtype=torch.uint8, device=device) for _ in range(2))
    return 2 * nbytes / seconds_each(lambda: dst.copy_(src), device)


def read_bandwidth(device, nbytes: int) -> float:
    x = torch.ones(nbytes // 4, dtype=torch.float32, device=device)
    return nbytes / seconds_each(lambda: x.sum(), device)


def host_bandwidth(device, nbytes: int) -> dict | None:
    """Pinned host -> device and device -> host bytes/s (None off CUDA: no host link to measure)."""
    if device.type != "cuda":
        return None
    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    dev = torch.empty(nbytes, dtype=torch.uint8, device=device)
    return {"to_device": nbytes / seconds_each(lambda: dev.copy_(host, non_blocking=True), device),
            "to_host": nbytes / seconds_each(lambda: host.copy_(dev, non_blocking=True), device)}


def matmul_rate(device, dtype, m: int, n: int, k: int, sample_s: float) -> float:
    a, b = torch.randn(m, k, device=device, dtype=dtype), torch.randn(k, n, device=device, dtype=dtype)
    return 2 * m * n * k / seconds_each(lambda: a @ b, device, sample_s=sample_s)


def sustained_rate(device, dtype, size: int, hold_s: float) -> float:
    """FLOP/s of size^3 products held back to back for hold_s: the median of the last third of the samples."""
    a, b = torch.randn(size, size, device=device, dtype=dtype), torch.randn(size, size, device=device, dtype=dtype)
    rates, end = [], time.monotonic() + hold_s
    while time.monotonic() < end or len(rates) < 3:
        rates.append(2 * size ** 3 / seconds_each(lambda: a @ b, device, samples=1, sample_s=0.05))
    return statistics.median(rates[-max(1, len(rates) // 3):])


def attention_rate(device, dtype, shape) -> float:
    """FLOP/s of a fused attention forward and backward, no mask: 2 products forward, 5 backward (as
    torch.utils.flop_counter counts them)."""
    batch, heads, seq, dim = shape
    q, k, v = (torch.randn(shape, device=device, dtype=dtype, requires_grad=True) for _ in range(3))
    grad = torch.randn(shape, device=device, dtype=dtype)

    def step():
        torch.nn.functional.scaled_dot_product_attention(q, k, v).backward(grad)
    return 7 * 2 * batch * heads * seq * seq * dim / seconds_each(step, device, samples=3)


def tiny_kernel_seconds(device) -> float:
    x = torch.zeros(1, device=device)

    def hundred():
        for _ in range(100):
            x.add_(1)
    return seconds_each(hundred, device) / 100


def grid(device, dtype, sizes: Sizes) -> list[dict]:
    return [{"m": m, "n": n, "k": sizes.grid_k, "flops_per_s": matmul_rate(device, dtype, m, n, sizes.grid_k,
                                                                            sizes.sample_s)}
            for m in sizes.grid_m for n in sizes.grid_n]


def modelled_rate(row: dict, hw: Hardware, itemsize: int) -> float:
    m, n, k = row["m"], row["n"], row["k"]
    flops, nbytes = 2 * m * n * k, (m * k + k * n + m * n) * itemsize
    return flops / gemm_seconds(flops, nbytes, (1, m, n, k), hw)


def fit_small_tile(rows: list[dict], hw: Hardware, itemsize: int) -> tuple[tuple, float, float]:
    """(tile, its rate over the large tile's, mean |log error|): the candidate smaller than `hw.gemm_tile`, at the
    rate in 0.50-1.00, whose tile and wave quantization beside the large tile explains the grid best (a grid of
    large products cannot tell the large tile apart, so it stays the preset's)."""
    def error(candidate):
        tiled = replace(hw, small_tile=candidate[0], small_tile_efficiency=candidate[1])
        return statistics.mean(abs(math.log(r["flops_per_s"] / modelled_rate(r, tiled, itemsize))) for r in rows)
    smaller = [t for t in TILES if t[0] * t[1] < hw.gemm_tile[0] * hw.gemm_tile[1]]
    best = min(((tile, rate / 100) for tile in smaller for rate in range(50, 101)), key=error)
    return (*best, error(best))


class Record:
    """The fields measured so far, each with its source: where it ran and how."""

    def __init__(self, where: str):
        self.where, self.fields, self.sources = where, {}, {}

    def set(self, field: str, value, how: str):
        self.fields[field], self.sources[field] = value, f"{self.where}: {how}"


def measure(device, preset: str | None = None, sizes: Sizes | None = None, by: str = "colozoo.cost.measure",
            links: str = "H100-80GB", progress=None) -> dict:
    """The measured hardware JSON of `device`: fields, their "sources", and the "evidence" they came from.
    `preset`: the datasheet preset of this device (default: found from a CUDA device's name); None for a CPU or an
    unknown GPU, whose peak and bandwidth are then measured and whose other fields stay `links`'."""
    device = torch.device(device)
    name, cuda = device_name(device), device.type == "cuda"
    preset = preset or (datasheet_preset(name) if cuda else None)
    sizes = sizes or (GPU_SIZES if cuda else CPU_SIZES)
    dtype = torch.bfloat16 if cuda else torch.float32
    note, record = progress or (lambda line: None), Record(f"measured by {by} on {name}, {datetime.date.today()}")
    note(f"{name}: copy and read bandwidth, {sizes.square}^3 products in bursts and {sizes.sustain_s:g} s sustained")
    copy, read = copy_bandwidth(device, sizes.copy_bytes), read_bandwidth(device, sizes.copy_bytes)
    burst = matmul_rate(device, dtype, sizes.square, sizes.square, sizes.square, sizes.sample_s)
    sustained = sustained_rate(device, dtype, sizes.square, sizes.sustain_s)
    rates = dict(burst_flops_per_s=burst, sustained_flops_per_s=sustained, copy_bytes_per_s=copy)
    peak, hbm = record_sustained_efficiencies(record, PRESETS[preset] if preset else None, rates, sizes, dtype)
    at_burst = replace(PRESETS[preset or links], peak_flops=peak, hbm_bw=hbm, matmul_efficiency=burst / peak,
                       hbm_efficiency=copy / hbm)  # the grid's products are timed in bursts too
    at_burst = device_fields(record, device, at_burst)
    note(f"{name}: a grid of {len(sizes.grid_m) * len(sizes.grid_n)} products")
    rows = gemm_grid(record, device, dtype, sizes, at_burst)
    note(f"{name}: attention, pinned host copies, tiny kernels")
    attention = attention_rate(device, dtype, sizes.attention)
    record.set("attention_efficiency", attention / peak, "scaled_dot_product_attention forward + backward, "
               f"{'x'.join(map(str, sizes.attention))} (batch x heads x seq x dim), no mask")
    record.set("attention_speed", {}, "none: the attention_efficiency measured here prices attention (a preset's "
               "table of published speeds would take precedence over it)")
    host = host_bandwidth(device, sizes.host_bytes)
    if host:
        record.set("pcie_bw", min(host.values()), f"pinned {sizes.host_bytes >> 20} MiB copies, the slower direction")
    record.set("kernel_floor_s", tiny_kernel_seconds(device), "one tiny kernel in a stream of them")
    evidence = {"device": name, "dtype": str(dtype)[6:], "burst_flops_per_s": burst, "sustained_flops_per_s": sustained,
                "copy_bytes_per_s": copy, "read_bytes_per_s": read, "host_bytes_per_s": host,
                "attention_flops_per_s": attention, "gemm_grid": rows,
                "over": preset or f"{links} (links and network; no datasheet preset for this device)"}
    return {"preset": preset or links, "name": f"{preset} measured on {name}" if preset else f"{name}, measured",
            **record.fields, "sources": record.sources, "evidence": evidence}


def record_sustained_efficiencies(record: Record, datasheet: Hardware | None, rates: dict, sizes: Sizes,
                                  dtype) -> tuple[float, float]:
    """Records matmul_efficiency (the sustained rate: a training step is sustained load) and hbm_efficiency, of the
    datasheet's peaks, or with no datasheet of the measured ones (the better matmul rate, the copy), recorded as
    peak_flops and hbm_bw; returns (peak FLOP/s, HBM bytes/s)."""
    sustained, copy = rates["sustained_flops_per_s"], rates["copy_bytes_per_s"]
    peak = datasheet.peak_flops if datasheet else max(rates["burst_flops_per_s"], sustained)
    hbm = datasheet.hbm_bw if datasheet else copy
    square, copied = f"{sizes.square}^3 {str(dtype)[6:]} products", f"a {sizes.copy_bytes >> 20} MiB copy"
    record.set("matmul_efficiency", sustained / peak, f"{square} held {sizes.sustain_s:g} s, "
               f"{sustained / 1e12:.4g} TFLOP/s of {peak / 1e12:.4g}")
    record.set("hbm_efficiency", copy / hbm, f"{copied}, {copy / 1e9:.4g} GB/s read + written of {hbm / 1e9:.4g}")
    if not datasheet:
        record.set("peak_flops", peak, f"no datasheet preset: the best rate of {square}")
        record.set("hbm_bw", hbm, f"no datasheet preset: {copied}, read + written")
    return peak, hbm


def host_memory_bytes() -> int:
    """This machine's memory (psutil where installed, else POSIX sysconf); refused where neither can tell."""
    try:
        import psutil
        return int(psutil.virtual_memory().total)
    except ImportError:
        pass
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (AttributeError, ValueError, OSError):
        raise HardwareError("cannot read this machine's memory (no psutil, no os.sysconf); a measured preset takes "
                            "its memory from the device it measured and does not guess") from None


def device_fields(record: Record, device, hw: Hardware) -> Hardware:
    """The SMs and memory of a GPU; a CPU has the machine's memory, no SM waves and no vector units apart. The
    memory is always the measured device's (a links preset's GPU memory is not this device's)."""
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        record.set("sm_count", props.multi_processor_count, "torch.cuda.get_device_properties")
        record.set("gpu_memory", props.total_memory, "torch.cuda.get_device_properties")
        return replace(hw, sm_count=props.multi_processor_count, gpu_memory=props.total_memory)
    if device.type != "cpu":
        raise HardwareError(f"measure({device.type!r}): only CUDA devices and the CPU are measured")
    memory = host_memory_bytes()
    record.set("gpu_memory", memory, "the machine's memory (a CPU run's tensors live there)")
    record.set("sm_count", None, "a CPU (no SM waves)")
    record.set("vector_flops", 0.0, "a CPU (no vector units apart)")
    return replace(hw, gpu_memory=memory, sm_count=None, vector_flops=0.0)


def gemm_grid(record: Record, device, dtype, sizes: Sizes, hw: Hardware) -> list[dict]:
    """The grid's rates against the model's at burst efficiency (`hw`); on a GPU the small tile, and its rate, that
    fit them best beside the large tile."""
    rows, itemsize = grid(device, dtype, sizes), torch.empty((), dtype=dtype).element_size()
    if device.type == "cuda":
        tile, rate, error = fit_small_tile(rows, hw, itemsize)
        how = (f"with its rate, the tile of {[list(t) for t in TILES]} smaller than {list(hw.gemm_tile)} whose tile "
               f"and wave quantization beside it fits the grid of products best (mean |log error| {error:.3f})")
        record.set("small_tile", list(tile), how)
        record.set("small_tile_efficiency", rate, how)
        hw = replace(hw, small_tile=tile, small_tile_efficiency=rate)
    for row in rows:
        row.update(of_peak=float(f'{row["flops_per_s"] / hw.peak_flops:.4g}'),  # significant digits: a slow
                   model_of_peak=float(f"{modelled_rate(row, hw, itemsize) / hw.peak_flops:.4g}"))  # row is not 0
    return rows


def write_measured(path, measured: dict) -> Path:
    """The measured hardware as JSON at `path`, written whole or not at all."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fsync_write(path, lambda f: f.write((json.dumps(measured, indent=1) + "\n").encode()))
    return path
