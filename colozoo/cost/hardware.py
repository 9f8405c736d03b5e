"""Hardware descriptions for the planner: per-GPU memory, speed and the links between GPUs, nodes and CPU.

Bandwidths are per GPU and per direction, in bytes/s, as the busiest collective sees them (NVLink inside a
node, the node's network share between nodes, PCIe to host memory). Peak FLOP/s are dense bf16.
"""
from __future__ import annotations

import re
from dataclasses import asdict, dataclass, field, replace

GB, GiB = 10 ** 9, 2 ** 30


class HardwareError(ValueError):
    pass


@dataclass(frozen=True)
class Hardware:
    name: str
    gpu_memory: float            # bytes per GPU
    peak_flops: float            # dense bf16 FLOP/s per GPU
    gpus_per_node: int = 8
    nodes: int = 1
    intra_node_bw: float = 300 * GB
    inter_node_bw: float = 25 * GB
    cpu_memory: float = 1024 * GiB  # per node
    pcie_bw: float = 25 * GB
    hbm_bw: float = 2000 * GB
    mfu: float = 0.5             # fraction of peak that large matmuls reach in practice
    usable_memory: float = 0.92  # CUDA context, allocator fragmentation, NCCL buffers take the rest
    cpu_adam_params_per_s: float = 0.5e9  # CPU Adam throughput available to one GPU's share of the cores
    layer_overhead_s: float = 40e-6  # kernel launches per layer and micro-batch (fwd + bwd)
    collective_latency_s: float = 8e-6  # per step of a ring collective (a ring all-reduce takes 2(n-1) steps)
    comm_overlap: float = 1.0    # how much of the overlappable traffic compute hides: 1 when the collectives
    #                              have engines of their own (NCCL), 0 when they share busy cores (gloo on CPU)
    collective_efficiency: dict = field(default_factory=dict)  # collective -> fraction of the link it reaches

    def bandwidth(self, collective: str, span: int) -> float:
        """Bytes/s one collective reaches in a group whose ranks lie within `span` consecutive ranks: NVLink
        when that fits in a node, else the network."""
        link = self.intra_node_bw if span <= self.gpus_per_node else self.inter_node_bw
        return link * self.collective_efficiency.get(collective, 1.0)

    @property
    def gpus(self) -> int:
        return self.gpus_per_node * self.nodes

    @property
    def memory_limit(self) -> float:
        return self.gpu_memory * self.usable_memory

    def with_(self, **changes) -> "Hardware":
        return replace(self, **{k: v for k, v in changes.items() if v is not None})

    def to_dict(self) -> dict:
        return asdict(self)


PRESETS = {
    "A100-40GB": Hardware("A100-40GB", 40 * GiB, 312e12, intra_node_bw=300 * GB, inter_node_bw=25 * GB,
                          pcie_bw=25 * GB, hbm_bw=1555 * GB),
    "A100-80GB": Hardware("A100-80GB", 80 * GiB, 312e12, intra_node_bw=300 * GB, inter_node_bw=25 * GB,
                          pcie_bw=25 * GB, hbm_bw=2039 * GB),
    "H100-80GB": Hardware("H100-80GB", 80 * GiB, 989e12, intra_node_bw=450 * GB, inter_node_bw=50 * GB,
                          pcie_bw=55 * GB, hbm_bw=3350 * GB),
    "H200": Hardware("H200", 141 * GB, 989e12, intra_node_bw=450 * GB, inter_node_bw=50 * GB, pcie_bw=55 * GB,
                     hbm_bw=4800 * GB),
    "L40S": Hardware("L40S", 48 * GiB, 362e12, intra_node_bw=25 * GB, inter_node_bw=25 * GB, pcie_bw=25 * GB,
                     hbm_bw=864 * GB, cpu_memory=512 * GiB),
    "V100-32GB": Hardware("V100-32GB", 32 * GiB, 125e12, intra_node_bw=150 * GB, inter_node_bw=12.5 * GB,
                          pcie_bw=12 * GB, hbm_bw=900 * GB),
    "RTX4090": Hardware("RTX4090", 24 * GiB, 165e12, gpus_per_node=4, intra_node_bw=25 * GB,
                        inter_node_bw=12.5 * GB, pcie_bw=25 * GB, hbm_bw=1008 * GB, cpu_memory=256 * GiB),
}


def parse_bytes(value) -> float:
    """'80GB' (10^9), '80GiB' (2^30), '512MB', or a number of bytes."""
    if isinstance(value, (int, float)):
        return float(value)
    m = re.fullmatch(r"\s*([\d.]+)\s*([KMGT]i?B)?\s*", str(value), flags=re.IGNORECASE)
    if not m:
        raise HardwareError(f"cannot read a memory size from {value!r}; write e.g. '80GB' or '40GiB'")
    number, unit = float(m.group(1)), (m.group(2) or "B").upper()
    scale = {"B": 1, "KB": 1e3, "MB": 1e6, "GB": 1e9, "TB": 1e12,
             "KIB": 2 ** 10, "MIB": 2 ** 20, "GIB": 2 ** 30, "TIB": 2 ** 40}[unit]
    return number * scale


def get_hardware(name_or_hw=None, *, gpus: int | None = None, gpu_memory=None, gpus_per_node: int | None = None,
                 **overrides) -> Hardware:
    """A preset by name (case-insensitive) or a Hardware, adjusted: total `gpus` sets the node count."""
    if isinstance(name_or_hw, Hardware):
        hw = name_or_hw
    else:
        key = {k.lower(): k for k in PRESETS}.get(str(name_or_hw or "H100-80GB").lower())
        if key is None:
            raise HardwareError(f"unknown hardware {name_or_hw!r}; presets: {', '.join(PRESETS)}")
        hw = PRESETS[key]
    if gpu_memory is not None:
        hw = hw.with_(gpu_memory=parse_bytes(gpu_memory))
    if gpus_per_node is not None:
        hw = hw.with_(gpus_per_node=gpus_per_node)
    if gpus is not None:
        if gpus < 1:
            raise HardwareError(f"gpus must be >= 1, got {gpus}")
        per_node = min(hw.gpus_per_node, gpus)
        if gpus % per_node:
            raise HardwareError(f"{gpus} GPUs do not fill whole nodes of {per_node}")
        hw = hw.with_(gpus_per_node=per_node, nodes=gpus // per_node)
    return hw.with_(**overrides)
