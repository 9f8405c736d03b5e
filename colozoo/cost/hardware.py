"""Hardware descriptions for the planner: per-GPU memory, speed and the links between GPUs, nodes and CPU.

Bandwidths are per GPU and per direction, in bytes/s: NVLink inside a node, the GPU's own network adapter between
nodes, PCIe to host memory. Peak FLOP/s are dense bf16. Every preset says where each number comes from
(`Hardware.sources`): a datasheet, a published measurement with its source, or an estimate said to be one. Fields
measured on your own GPUs can be loaded from a JSON file over a preset (`get_hardware(..., measured="gpu.json")`,
`colozoo plan --hardware gpu.json`), for example (illustrative numbers; colozoo.cost.measure writes such files):

    {"preset": "H100-80GB", "matmul_efficiency": 0.78, "hbm_efficiency": 0.91,
     "sources": {"matmul_efficiency": "my 8192^3 bf16 matmul, 2026-08-01"}}
"""
from __future__ import annotations

import json
import re
from dataclasses import asdict, dataclass, field, fields, replace
from pathlib import Path

from colozoo.cost import attention_speed
from colozoo.cost.hardware_sources import DEFAULT_SOURCES, ESTIMATE, NOT_SOURCED, PRESET_SOURCES, TILE

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
    intra_node_bw: float = 300 * GB  # NVLink, per direction
    inter_node_bw: float = 25 * GB   # the GPU's own network adapter (rail): a collective leaving the node runs at it
    cpu_memory: float = 1024 * GiB  # per node
    pcie_bw: float = 25 * GB
    hbm_bw: float = 2000 * GB
    sm_count: int | None = None  # streaming multiprocessors a GEMM's output tiles are spread over (None: no waves)
    gemm_tile: tuple = (256, 128)  # the output tile of cuBLAS's large bf16 GEMMs
    small_tile: tuple | None = (128, 64)  # the tile cuBLAS takes where the large one leaves SMs idle (None: never)
    small_tile_efficiency: float = 0.92  # the small tile's rate over the large one's, both filling their waves
    vector_flops: float = 0.0    # non-tensor FP32 FLOP/s (GEMV kernels of skinny products; 0: none)
    matmul_efficiency: float = 0.7  # fraction of peak the best-shaped large bf16 GEMMs sustain (measured)
    attention_efficiency: float = 0.5  # fraction of peak a fused attention kernel reaches on the pairs it computes,
    #                                    where attention_speed has no measurement of its implementation
    attention_speed: dict = field(default_factory=dict)  # measured fused attention TFLOP/s by implementation, head
    #                                    dim, mask and sequence (colozoo.cost.attention_speed)
    hbm_efficiency: float = 0.85  # fraction of hbm_bw a large copy reaches (memory-bound kernels)
    kernel_floor_s: float = 3e-6  # the shortest a kernel takes (launch and tail)
    launch_s: float = 0.0        # host time to issue one kernel: a unit takes at least its kernels x this
    usable_memory: float = 0.92  # CUDA context, allocator fragmentation, NCCL buffers take the rest
    cpu_adam_params_per_s: float = 0.5e9  # CPU Adam throughput available to one GPU's share of the cores
    layer_overhead_s: float = 0.0  # host time per layer and micro-batch beyond the kernels (the CPU bench fits it)
    collective_latency_s: float = 8e-6  # per step of a collective inside a node (a ring all-reduce takes 2(n-1))
    inter_node_latency_s: float = 15e-6  # per step of a collective across nodes
    intra_node_efficiency: float = 1.0  # fraction of the NVLink rate NCCL's bus bandwidth reaches
    inter_node_efficiency: float = 1.0  # fraction of the adapter's rate NCCL's bus bandwidth reaches
    comm_contention: float = 0.0  # share of the GPU a collective's kernels take from the compute it overlaps
    comm_overlap: float = 1.0    # how much of the overlappable traffic compute hides: 1 when the collectives
    #                              have engines of their own (NCCL), 0 when they share busy cores (gloo on CPU)
    collective_efficiency: dict = field(default_factory=dict)  # collective -> fraction of the link it reaches
    sources: dict = field(default_factory=dict, compare=False)  # field -> where its number comes from

    def __post_init__(self):  # a table given as a dict (a measured file, a caller) is shared no less than a preset's
        object.__setattr__(self, "attention_speed", attention_speed.frozen(self.attention_speed))

    def bandwidth(self, collective: str, span: int) -> float:
        """Bytes/s one collective reaches in a group whose ranks lie within `span` consecutive ranks: NVLink
        when that fits in a node, else each GPU's network adapter."""
        inside = span <= self.gpus_per_node
        link = self.intra_node_bw * self.intra_node_efficiency if inside else \
            self.inter_node_bw * self.inter_node_efficiency
        return link * self.collective_efficiency.get(collective, 1.0)

    @property
    def gpus(self) -> int:
        return self.gpus_per_node * self.nodes

    @property
    def memory_limit(self) -> float:
        return self.gpu_memory * self.usable_memory

    @property
    def memory_bandwidth(self) -> float:
        """What memory-bound kernels reach: a large copy's share of the datasheet bandwidth."""
        return self.hbm_bw * self.hbm_efficiency

    def with_(self, **changes) -> "Hardware":
        return replace(self, **{k: v for k, v in changes.items() if v is not None})

    def to_dict(self) -> dict:
        return {**asdict(replace(self, attention_speed={})),
                "attention_speed": {key: dict(series) for key, series in self.attention_speed.items()}}


def _nvidia(name, memory, peak, vector, hbm, sms, matmul, nvlink, network, sources, **extra) -> Hardware:
    return Hardware(name, memory, peak, vector_flops=vector, sm_count=sms, matmul_efficiency=matmul,
                    intra_node_bw=nvlink, inter_node_bw=network, hbm_bw=hbm, sources=sources, **extra)


MAMF = ("stas00/ml-engineering compute/accelerator/README.md, 'Maximum Achievable Matmul FLOPS comparison table' "
        "(bf16 matmul bursts, mean of 100 iterations at the best shape found)")
MSMF = ("stas00/ml-engineering compute/accelerator/benchmarks/README.md: an H200 sustains 702.9 TFLOP/s (MSMF, "
        "saturated clocks) against 828.0 in bursts (MAMF); a training step is sustained load")
NCCL_A100 = ("nccl-tests issues #149 and #178: all_reduce busbw ~200-208 GB/s on 8 x A100 SXM over NVLink "
             "(300 GB/s a direction)")
IB = "nccl-tests issue #267 (NVIDIA): a 400 Gb/s ConnectX-7 reaches 48-49 GB/s, i.e. 96% of its rate"
SMS_FOR_COMM = ("DeepSeek-V3 technical report (arXiv 2412.19437) §3.2.2, §3.5.1: 20 of an H800's 132 SMs drive IB "
                "and NVLink at full bandwidth; the compute they overlap loses those SMs")
A100_SOURCES = {
    "peak_flops": "NVIDIA A100 datasheet: 312 TFLOP/s dense BF16",
    "vector_flops": "NVIDIA A100 datasheet: 19.5 TFLOP/s FP32",
    "sm_count": "NVIDIA A100 Tensor Core GPU Architecture whitepaper: 108 SMs",
    "gemm_tile": TILE,
    "matmul_efficiency": MAMF + ": A100 SXM 271.2 of 312 TFLOP/s in bursts (86.9%), at the ~1200 MHz an A100 "
                         "sustains under load instead of 1410 (liangan1/GPU_travel performance/flash-attn/README.md: "
                         "'A100 frequency drop due to the power limit'): 0.869 x 1200 / 1410",
    "attention_efficiency": "liangan1/GPU_travel performance/flash-attn/README.md: FlashAttention-2 forward on A100, "
                            "177-187 TFLOP/s without a mask (57-60%), 37-60% causal; the backward is slower",
    "attention_speed": attention_speed.A100_SOURCE,
    "hbm_efficiency": ESTIMATE + " (a copy, read and written), beside what is measured: a read kernel on an A100 80GB "
                      "SXM reaches 1.80 of 2.04 TB/s, 88% by Nsight Compute too, about the 90% the best kernels of a "
                      "GTC talk it cites reach (NVIDIA developer forums, 'Trouble to Reach Peak Bandwidth of A100')",
    "intra_node_bw": "NVIDIA A100 datasheet: NVLink 600 GB/s (300 GB/s a direction)",
    "intra_node_efficiency": NCCL_A100,
    "inter_node_bw": "DGX A100: 8 x 200 Gb/s HDR InfiniBand a node, one adapter a GPU (Narayanan et al. 2021, §5)",
    "inter_node_efficiency": IB,
    "comm_contention": SMS_FOR_COMM + " (20 of the A100's 108)",
}
H100_SOURCES = {
    "peak_flops": "NVIDIA H100 datasheet: 989 TFLOP/s dense BF16 (SXM)",
    "vector_flops": "NVIDIA H100 datasheet: 67 TFLOP/s FP32 (SXM)",
    "sm_count": "NVIDIA H100 Tensor Core GPU Architecture whitepaper: 132 SMs (SXM5)",
    "gemm_tile": A100_SOURCES["gemm_tile"],
    "matmul_efficiency": MSMF + " (71.1% of 989; " + MAMF + ": the H100 SXM bursts as the H200)",
    "attention_efficiency": ESTIMATE + ", between FlashAttention-2's 35% and FlashAttention-3's 75% of an H100's "
                                       "peak (Shah et al. 2024, arXiv 2407.08608, abstract)",
    "attention_speed": attention_speed.H100_SOURCE,
    "hbm_bw": "NVIDIA H100 datasheet: 3.35 TB/s (SXM)",
    "hbm_efficiency": ESTIMATE,
    "intra_node_bw": "NVIDIA H100 datasheet: NVLink 900 GB/s (450 GB/s a direction)",
    "intra_node_efficiency": "nccl-tests issue #212 (NVIDIA): of NVLink's 450 GB/s line rate NCCL's protocol "
                             "overhead (~20%) leaves ~370 GB/s, the bus bandwidth of collectives other than "
                             "all-reduce and of all-reduce as a ring; NVLink SHARP all-reduce on 8 GPUs peaks near 480 "
                             "(not priced)",
    "inter_node_bw": "DGX H100: 8 x 400 Gb/s ConnectX-7 a node, one adapter a GPU",
    "inter_node_efficiency": IB,
    "comm_contention": SMS_FOR_COMM + " (20 of 132)",
}
LENT_H200 = "measured by bench/gpu.py on an H200 SXM, 2026-11-29 (bench/measured/H200-2026-11-29.json)"
H200_SOURCES = {
    **H100_SOURCES,
    "hbm_bw": "NVIDIA H200 datasheet: 4.8 TB/s",
    "hbm_efficiency": LENT_H200 + ": a 1 GiB copy moved 4232 GB/s read + written of 4800",
    "matmul_efficiency": MSMF + " (71.1% of 989); beside it, " + LENT_H200 + ": 8192^3 products held 663.9 "
                         "TFLOP/s over 5 s (67.1%) and 783.8 in bursts, the sustained-over-burst ratio (0.847) of the "
                         "figure cited (0.849)",
}
NVIDIA_DEFAULTS = dict(intra_node_efficiency=0.69, inter_node_efficiency=0.96, comm_contention=20 / 108)
HOPPER_ON = dict(attention_efficiency=0.5, intra_node_efficiency=0.8, inter_node_efficiency=0.96)  # H100 and after
DEEPSEEK_H800 = ("DeepSeek-V3 technical report (arXiv 2412.19437) §3.2.2: on H800 nodes NVLink reaches 160 GB/s, "
                 "IB 50 GB/s")
H800_SOURCES = {**H100_SOURCES,
                "intra_node_bw": "NVIDIA H800 SXM5 datasheet: NVLink 400 GB/s (200 GB/s a direction)",
                "intra_node_efficiency": DEEPSEEK_H800 + " (160 of 200)",
                "inter_node_bw": DEEPSEEK_H800 + " (one 400 Gb/s adapter a GPU)", "inter_node_efficiency": IB}
B200_SOURCES = {
    "peak_flops": "NVIDIA HGX B200 datasheet: 36 PFLOP/s FP16/BF16 with sparsity for 8 GPUs, 2.25 dense a GPU",
    "sm_count": "Chips and Cheese, 'Nvidia's B200: Keeping the CUDA Juggernaut Rolling' (2025): 74 SMs on each of its "
                "two dies, 148",
    "gemm_tile": TILE,
    "matmul_efficiency": MAMF + ": B200 SXM 1745.0 of 2250 TFLOP/s in bursts (77.6%), times the H200's sustained over "
                         "burst rate (" + MSMF + ", 702.9 / 828.0): 65.9%",
    "attention_efficiency": H100_SOURCES["attention_efficiency"] + " (no B200 figure)",
    "hbm_bw": "NVIDIA DGX B200 datasheet: 64 TB/s HBM3e for 8 GPUs (8 TB/s a GPU)",
    "hbm_efficiency": ESTIMATE,
    "intra_node_bw": "NVIDIA DGX B200 datasheet: fifth-generation NVLink, 1.8 TB/s a GPU (900 GB/s a direction)",
    "intra_node_efficiency": ESTIMATE + " (the H100's, nccl-tests issue #212)",
    "inter_node_bw": "NVIDIA DGX B200 datasheet: 8 single-port ConnectX-7 at 400 Gb/s a node, one adapter a GPU",
    "inter_node_efficiency": IB,
    "comm_contention": SMS_FOR_COMM + " (20 of 148)",
}
GB200_SOURCES = {
    **B200_SOURCES,
    "gpus_per_node": "NVIDIA GB200 NVL72 datasheet: 72 Blackwell GPUs in one NVLink domain (a 'node' here)",
    "peak_flops": "NVIDIA GB200 NVL72 datasheet: 360 PFLOP/s FP16/BF16 with sparsity for 72 GPUs, 2.5 dense a GPU",
    "sm_count": B200_SOURCES["sm_count"] + " (the same GPU, assumed)",
    "matmul_efficiency": MAMF + ": GB200 SXM 1822.0 of 2500 TFLOP/s in bursts (72.9%), times the H200's sustained over "
                         "burst rate (702.9 / 828.0): 61.9%",
    "hbm_bw": "NVIDIA GB200 NVL72 datasheet: 576 TB/s HBM3e for 72 GPUs (8 TB/s a GPU)",
    "intra_node_bw": "NVIDIA GB200 NVL72 datasheet: 130 TB/s NVLink for 72 GPUs (1.8 TB/s a GPU, 900 GB/s a direction)",
    "inter_node_bw": ESTIMATE + " (one 400 Gb/s ConnectX-7 a GPU between racks, as DGX B200)",
    "cpu_memory": "NVIDIA GB200 NVL72 datasheet: 17 TB LPDDR5X on 36 Grace CPUs (480 GB each) a rack",
    "pcie_bw": ESTIMATE + " (NVLink-C2C: 900 GB/s both ways for a Grace and its two GPUs, 225 GB/s a GPU a direction)",
}


_DATASHEETS = {
    "A100-40GB": _nvidia("A100-40GB", 40 * GiB, 312e12, 19.5e12, 1555 * GB, 108, 0.739, 300 * GB, 25 * GB,
                         {**A100_SOURCES, "hbm_bw": "NVIDIA A100 datasheet: 1,555 GB/s (40GB SXM)"},
                         attention_efficiency=0.5, attention_speed=attention_speed.A100, **NVIDIA_DEFAULTS),
    "A100-80GB": _nvidia("A100-80GB", 80 * GiB, 312e12, 19.5e12, 2039 * GB, 108, 0.739, 300 * GB, 25 * GB,
                         {**A100_SOURCES, "hbm_bw": "NVIDIA A100 datasheet: 2,039 GB/s (80GB SXM)"},
                         attention_efficiency=0.5, attention_speed=attention_speed.A100, **NVIDIA_DEFAULTS),
    "H100-80GB": _nvidia("H100-80GB", 80 * GiB, 989e12, 67e12, 3350 * GB, 132, 0.711, 450 * GB, 50 * GB, H100_SOURCES,
                         pcie_bw=55 * GB, attention_speed=attention_speed.H100, comm_contention=20 / 132, **HOPPER_ON),
    "H200": _nvidia("H200", 141 * GB, 989e12, 67e12, 4800 * GB, 132, 0.711, 450 * GB, 50 * GB, H200_SOURCES,
                    pcie_bw=55 * GB, hbm_efficiency=0.882,
                    attention_speed=attention_speed.H100, comm_contention=20 / 132, **HOPPER_ON),
    "H800": _nvidia("H800", 80 * GiB, 989e12, 67e12, 3350 * GB, 132, 0.711, 200 * GB, 50 * GB, H800_SOURCES,
                    pcie_bw=55 * GB, attention_speed=attention_speed.H100, comm_contention=20 / 132, **HOPPER_ON),
    "B200": _nvidia("B200", 180 * GB, 2250e12, 0.0, 8000 * GB, 148, 0.659, 900 * GB, 50 * GB, B200_SOURCES,
                    pcie_bw=55 * GB, comm_contention=20 / 148, **HOPPER_ON),
    "GB200-NVL72": _nvidia("GB200-NVL72", 186 * GB, 2500e12, 0.0, 8000 * GB, 148, 0.619, 900 * GB, 50 * GB,
                           GB200_SOURCES, gpus_per_node=72, cpu_memory=17000 * GB, pcie_bw=225 * GB,
                           comm_contention=20 / 148, **HOPPER_ON),
    "L40S": Hardware("L40S", 48 * GiB, 362e12, intra_node_bw=25 * GB, inter_node_bw=25 * GB, pcie_bw=25 * GB,
                     hbm_bw=864 * GB, cpu_memory=512 * GiB, sm_count=142,
                     sources={"peak_flops": "NVIDIA L40S datasheet: 362 TFLOP/s BF16", "hbm_bw": "datasheet: 864 GB/s",
                              "matmul_efficiency": ESTIMATE}),
    "V100-32GB": Hardware("V100-32GB", 32 * GiB, 125e12, intra_node_bw=150 * GB, inter_node_bw=12.5 * GB,
                          pcie_bw=12 * GB, hbm_bw=900 * GB, sm_count=80,
                          sources={"peak_flops": "NVIDIA V100 datasheet: 125 TFLOP/s FP16 tensor",
                                   "hbm_bw": "datasheet: 900 GB/s", "matmul_efficiency": ESTIMATE}),
    "RTX4090": Hardware("RTX4090", 24 * GiB, 165e12, gpus_per_node=4, intra_node_bw=25 * GB,
                        inter_node_bw=12.5 * GB, pcie_bw=25 * GB, hbm_bw=1008 * GB, cpu_memory=256 * GiB, sm_count=128,
                        sources={"peak_flops": "NVIDIA Ada whitepaper: 165 TFLOP/s FP16 tensor (FP32 accumulate)",
                                 "hbm_bw": "datasheet: 1,008 GB/s", "matmul_efficiency": ESTIMATE}),
}


def with_all_sources(hw: Hardware, extra: dict | None = None) -> Hardware:
    """`hw` whose fields left at Hardware's defaults name the defaults' sources (colozoo.cost.hardware_sources)."""
    defaults = {f.name: DEFAULT_SOURCES[f.name] for f in fields(Hardware)
                if f.name in DEFAULT_SOURCES and getattr(hw, f.name) == _default(f)}
    return replace(hw, sources={**defaults, **(extra or {}), **hw.sources})


def _default(f):
    return f.default_factory() if callable(f.default_factory) else f.default


def unsourced(hw: Hardware) -> list[str]:
    """The numbers of `hw` that name no source."""
    return [f.name for f in fields(Hardware) if f.name not in NOT_SOURCED and not hw.sources.get(f.name)]


def describe(hw: Hardware) -> str:
    """Every number of `hw` with where it comes from, one field a line."""
    rows = [(f.name, _shown(f.name, getattr(hw, f.name)), hw.sources.get(f.name, "(no source)"))
            for f in fields(Hardware) if f.name not in NOT_SOURCED]
    width = [max(len(r[i]) for r in rows) for i in (0, 1)]
    head = f"{hw.name}: {hw.gpus_per_node} GPUs a node x {hw.nodes} node(s)"
    return "\n".join([head] + [f"{n:<{width[0]}}  {v:>{width[1]}}  {src}" for n, v, src in rows])


def _shown(name: str, value) -> str:
    if name == "attention_speed":  # its series are many numbers each: `--json` prints them
        return f"{len(value)} measured series" if value else "none"
    if not isinstance(value, (int, float)) or isinstance(value, bool):
        return str(value)
    if name.endswith("_bw"):
        return f"{value / GB:,.1f} GB/s"
    if name in ("gpu_memory", "cpu_memory"):
        return f"{value / GB:,.1f} GB"
    if name.endswith("flops"):
        return f"{value / 1e12:,.4g} TFLOP/s"
    return f"{value:.3g}"


PRESETS = {name: with_all_sources(hw, PRESET_SOURCES.get(name)) for name, hw in _DATASHEETS.items()}


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


def _preset(name) -> Hardware:
    """A preset by name, or a JSON file of measured fields by its path (ending in .json)."""
    if str(name).lower().endswith(".json"):
        return load_measured(name)
    key = {k.lower(): k for k in PRESETS}.get(str(name or "H100-80GB").lower())
    if key is None:
        raise HardwareError(f"unknown hardware {name!r}; presets: {', '.join(PRESETS)}")
    return PRESETS[key]


METADATA = ("preset", "sources", "name", "evidence")  # a measured file's keys that are no field to set


def load_measured(path, base: Hardware | None = None) -> Hardware:
    """`base` (or the JSON's "preset") with the fields a JSON file measured: numbers by field name, "sources" saying
    where each comes from (a field without one is recorded as measured in this file); "evidence" (what
    colozoo.cost.measure saw: its shapes and rates) is for reading and not loaded."""
    try:
        data = json.loads(Path(path).read_text())
    except (OSError, ValueError) as e:
        raise HardwareError(f"cannot read measured hardware from {path}: {e}") from None
    if not isinstance(data, dict):
        raise HardwareError(f"{path}: expected a JSON object of hardware fields")
    hw = base if base is not None else _preset(data.get("preset"))
    known = {f.name: f for f in fields(Hardware)} | dict.fromkeys(METADATA)
    unknown = sorted(set(data) - set(known))
    if unknown:
        raise HardwareError(f"{path}: unknown hardware fields {unknown}; fields: {', '.join(f.name for f in fields(Hardware))}")
    changes = {}
    for key, value in data.items():
        if key in METADATA:
            continue
        optional = value is None and _default(known[key]) is None
        if isinstance(getattr(hw, key), (int, float)) and not isinstance(value, (int, float)) and not optional:
            raise HardwareError(f"{path}: {key} must be a number, got {value!r}")
        changes[key] = tuple(value) if isinstance(value, list) else value
    given = data.get("sources", {})
    sources = {**hw.sources, **{k: given.get(k, f"measured: {path}") for k in changes}}
    return replace(hw, **changes, sources=sources, name=data.get("name", hw.name))


def get_hardware(name_or_hw=None, *, gpus: int | None = None, gpu_memory=None, gpus_per_node: int | None = None,
                 measured=None, **overrides) -> Hardware:
    """A preset by name (case-insensitive), a measured JSON file by its path, or a Hardware, adjusted: `measured` a
    JSON file of measured fields over it (see load_measured), total `gpus` sets the node count."""
    if isinstance(name_or_hw, Hardware):
        hw = name_or_hw
    else:  # a measured file alone names its preset
        hw = _preset(name_or_hw) if name_or_hw is not None or measured is None else None
    if measured is not None:
        hw = load_measured(measured, hw)
    sizes = {"gpu_memory": None if gpu_memory is None else parse_bytes(gpu_memory), "gpus_per_node": gpus_per_node}
    hw = _given(hw, **{k: v for k, v in sizes.items() if v is not None})  # None: the parameter not given
    if gpus is not None:
        if gpus < 1:
            raise HardwareError(f"gpus must be >= 1, got {gpus}")
        per_node = min(hw.gpus_per_node, gpus)
        if gpus % per_node:
            raise HardwareError(f"{gpus} GPUs do not fill whole nodes of {per_node}")
        hw = hw.with_(gpus_per_node=per_node, nodes=gpus // per_node)
    return _given(hw, **overrides)


GIVEN = "given by the caller (get_hardware's arguments; colozoo plan --set, --gpu-memory, --gpus-per-node)"


def _given(hw: Hardware, **changes) -> Hardware:
    """`hw` with every field a caller set, whose source is then the caller. None is a value only where the field
    takes one (sm_count=None: no wave quantization); elsewhere it is refused, never read as "not given"."""
    known = {f.name: f for f in fields(Hardware)}
    for key, value in changes.items():
        if key not in known or key == "sources":
            raise HardwareError(f"get_hardware({key}=...): the hardware has no field {key!r} to set; fields: "
                                f"{', '.join(k for k in known if k != 'sources')}")
        if value is None and _default(known[key]) is not None:
            raise HardwareError(f"get_hardware({key}=None): {key} takes a number (the preset's is "
                                f"{getattr(hw, key)!r}); leave it out to keep the preset's")
    return replace(hw, **changes, sources={**hw.sources, **dict.fromkeys(changes, GIVEN)})
