"""Where the hardware presets' numbers come from, beyond the sources written beside them in colozoo.cost.hardware:
the sources of the fields a preset leaves at Hardware's defaults (DEFAULT_SOURCES, attached only while the preset's
value is the default), and of the numbers a preset sets without a source beside it (PRESET_SOURCES). An estimate
says it is one; measure your own GPUs with colozoo.cost.measure (bench/gpu.py --hardware-out)."""
from __future__ import annotations

ESTIMATE = "estimate (not measured): give a measured value with --hardware my_gpu.json"
TILE = "NVIDIA Matrix Multiplication Background User's Guide (DU-09799-001): 256x128 tiles"
SMALL_TILE = ("fitted to the grid of bf16 products measured on a lent H200 (bench/measured/H200-2026-11-29.json, "
              "colozoo.cost.measure.fit_small_tile): beside 256x128 tiles, 128x64 at 0.92 of their rate explains "
              "every product within 14% (256x128 alone: the smallest ran 3.2x faster than it says)")
PCIE4 = "PCIe 4.0 x16: 32 GB/s a direction (PCI-SIG); 25 GB/s is an estimate of what pinned host copies reach"
PCIE5 = "PCIe 5.0 x16: 64 GB/s a direction (PCI-SIG); 55 GB/s is an estimate of what pinned host copies reach"
NO_NVLINK = "no NVLink: peers talk over PCIe 4.0 x16 (32 GB/s a direction); 25 GB/s is an estimate"

DEFAULT_SOURCES = {
    "gpus_per_node": "NVIDIA DGX A100 / DGX H100 / HGX datasheets: 8 GPUs a node",
    "intra_node_bw": "NVIDIA A100 datasheet: NVLink 600 GB/s (300 GB/s a direction)",
    "inter_node_bw": "DGX A100: 8 x 200 Gb/s HDR InfiniBand a node, one adapter a GPU (Narayanan et al. 2021, §5)",
    "cpu_memory": "NVIDIA DGX A100 datasheet: 1 TB system memory (2 TB option)",
    "pcie_bw": PCIE4,
    "hbm_bw": ESTIMATE,
    "sm_count": "None: no wave quantization modelled",
    "gemm_tile": TILE,
    "small_tile": SMALL_TILE,
    "small_tile_efficiency": SMALL_TILE,
    "vector_flops": "0: skinny products are priced on the tensor cores (no vector rate given)",
    "matmul_efficiency": ESTIMATE,
    "attention_efficiency": ESTIMATE,
    "attention_speed": "none: fused attention runs at attention_efficiency of the matmul rate (no measured speeds)",
    "hbm_efficiency": ESTIMATE,
    "kernel_floor_s": ESTIMATE + " (a few microseconds: a CUDA kernel's launch and tail)",
    "launch_s": "0 on a GPU: the host issues kernels ahead of the stream (the CPU bench, bench/planner.py, fits it)",
    "usable_memory": ESTIMATE + " (the CUDA context, allocator fragmentation and NCCL buffers take the rest), "
                     "in the range measured: NCCL's per-channel buffers, outside PyTorch's allocator (fairscale PR "
                     "#678), take 544 MB for a 2-rank and 688 MB for a larger communicator on 4 NVLinked A100s (NCCL "
                     "issue #964) and 1.06 GB, 4.34 GB after a first all-to-all, on 8 H100s (NCCL issue #1685); the "
                     "CUDA context about 0.1 GB (sglang PR #35538): a layout's 3-6 communicators (tensor, pipeline, "
                     "data, context, expert) take 2-6 GB of the 6.9 GB an 80 GB GPU keeps back",
    "cpu_adam_params_per_s": ESTIMATE,
    "layer_overhead_s": "0 on a GPU: the host runs ahead (the CPU bench, bench/planner.py, fits it)",
    "collective_latency_s": ESTIMATE + " (per ring step inside a node)",
    "inter_node_latency_s": ESTIMATE + " (per ring or tree step across nodes)",
    "intra_node_efficiency": "1: the link's rate (no measurement)",
    "inter_node_efficiency": "1: the adapter's rate (no measurement)",
    "comm_contention": "0: collectives take no SMs from compute (no measurement)",
    "comm_overlap": "1: NCCL's collectives run kernels of their own beside the compute they overlap",
    "collective_efficiency": "none: every collective at its link's rate",
}

PRESET_SOURCES = {
    "A100-40GB": {"gpu_memory": "NVIDIA A100 datasheet: 40 GB HBM2 (SXM)"},
    "A100-80GB": {"gpu_memory": "NVIDIA A100 datasheet: 80 GB HBM2e (SXM)"},
    "H100-80GB": {"gpu_memory": "NVIDIA H100 datasheet: 80 GB HBM3 (SXM)",
                  "pcie_bw": PCIE5,
                  "cpu_memory": "NVIDIA DGX H100 datasheet: 2 TB system memory (1 TB assumed a node)"},
    "H200": {"gpu_memory": "NVIDIA H200 datasheet: 141 GB HBM3e", "pcie_bw": PCIE5,
             "cpu_memory": "NVIDIA DGX H200 datasheet: 2 TB system memory (1 TB assumed a node)"},
    "H800": {"gpu_memory": "NVIDIA H800 SXM5 datasheet: 80 GB HBM3", "pcie_bw": PCIE5,
             "cpu_memory": "DGX H100's 2 TB system memory (1 TB assumed a node)"},
    "B200": {"gpu_memory": "NVIDIA DGX B200 datasheet: 1,440 GB HBM3e for 8 GPUs (180 GB a GPU)", "pcie_bw": PCIE5,
             "cpu_memory": "NVIDIA DGX B200 datasheet: 2 TB system memory (1 TB assumed a node)"},
    "GB200-NVL72": {"gpu_memory": "NVIDIA GB200 NVL72 datasheet: 13.4 TB HBM3e for 72 GPUs (186 GB a GPU)"},
    "L40S": {"gpu_memory": "NVIDIA L40S datasheet: 48 GB GDDR6", "intra_node_bw": NO_NVLINK,
             "inter_node_bw": ESTIMATE + " (one 200 Gb/s adapter a GPU)",
             "sm_count": "NVIDIA Ada Lovelace architecture whitepaper: L40S 142 SMs",
             "cpu_memory": ESTIMATE + " (512 GB a server)"},
    "V100-32GB": {"gpu_memory": "NVIDIA V100 datasheet: 32 GB HBM2",
                  "intra_node_bw": "NVIDIA V100 datasheet: NVLink 300 GB/s (150 GB/s a direction)",
                  "inter_node_bw": "DGX-1: 4 x 100 Gb/s EDR InfiniBand for 8 GPUs; one 100 Gb/s a GPU is an estimate",
                  "pcie_bw": "PCIe 3.0 x16: 16 GB/s a direction (PCI-SIG); 12 GB/s is an estimate of pinned copies",
                  "sm_count": "NVIDIA Tesla V100 (Volta) architecture whitepaper: 80 SMs"},
    "RTX4090": {"gpu_memory": "NVIDIA GeForce RTX 4090 specifications: 24 GB GDDR6X",
                "gpus_per_node": ESTIMATE + " (a workstation of 4)", "intra_node_bw": NO_NVLINK,
                "inter_node_bw": ESTIMATE + " (100 Gb/s Ethernet)", "sm_count": "NVIDIA Ada whitepaper: 128 SMs",
                "cpu_memory": ESTIMATE + " (256 GB a workstation)"},
}

# fields that are no number of the hardware: its name, the node count a plan's GPUs set, the sources themselves
NOT_SOURCED = ("name", "nodes", "sources")
