"""How long a collective takes on the hardware's links: its bus bytes over the bandwidth of the slowest hop, each
step of its algorithm taking at least its hop's latency.

Bus bytes are what each rank puts on the wire per payload byte (ring algorithms: 2(n-1)/n for an all-reduce,
(n-1)/n for an all-gather or a reduce-scatter). A group within one node rides NVLink; a group that leaves the node is
limited by each GPU's own network adapter (rail-optimised fabrics give every GPU one): Hardware.bandwidth. Latency:
a ring takes n-1 steps (all-reduce 2(n-1)), each at the latency of its hop: a ring over several nodes leaves a node
on one hop in n/nodes, and only those steps wait on the network (NCCL's own tuning model prices ring steps inside a
node and between nodes apart); across nodes NCCL all-reduces over a tree when that is shorter, 2 log2(nodes) steps
between nodes plus the ring inside each node. A step's latency and its transfer overlap: NCCL moves each step's chunk
in slices through a FIFO of NCCL_STEPS (8) buffers (ring collectives: two slices a chunk, ALLGATHER_SLICESTEPS =
NCCL_STEPS / 4 in src/include/collectives.h), so a slice goes out while the one before it is on the wire and a step
takes the longer of its hop's latency and its share of the transfer (`pipelined_seconds`): small calls pay the
latency, large ones the bandwidth, never both.
"""
from __future__ import annotations

import math

from colozoo.cost.hardware import Hardware

BUS_FACTOR = {  # bytes each rank puts on the wire per payload byte, ring algorithms
    "all_reduce": lambda n: 2 * (n - 1) / n,
    "all_gather": lambda n: (n - 1) / n,
    "reduce_scatter": lambda n: (n - 1) / n,
    "all_to_all": lambda n: (n - 1) / n,
    "send_recv": lambda n: 1.0,
    "broadcast": lambda n: 1.0,
}

RING_STEPS = {  # latency-bound steps of each collective, ring algorithms
    "all_reduce": lambda n: 2 * (n - 1),
    "all_gather": lambda n: n - 1,
    "reduce_scatter": lambda n: n - 1,
    "all_to_all": lambda n: n - 1,
    "send_recv": lambda n: 1,
}


def latency_steps(collective: str, n: int, per_node: int) -> tuple[float, float]:
    """(steps inside nodes, steps between nodes) of one call over a group of n ranks, `per_node` of them in each
    node: a ring crosses between nodes on `nodes` of its n hops, so that share of its steps waits on the network;
    an all-reduce across nodes runs NCCL's tree when shorter, 2 log2(nodes) steps between nodes plus the ring inside
    each node."""
    steps = RING_STEPS.get(collective, lambda n: 1)(n)
    nodes = math.ceil(n / max(1, per_node))
    if nodes <= 1:
        return float(steps), 0.0
    if collective == "all_reduce":
        tree = 2 * math.ceil(math.log2(nodes))
        if tree + 2 * (per_node - 1) < steps:
            return float(2 * (per_node - 1)), float(tree)
    between = steps * nodes / n
    return steps - between, between


def collective_seconds(hw: Hardware, collective: str, nbytes: float, n: int, span: int, calls: float = 0) -> float:
    """Seconds of `calls` calls of `collective` moving `nbytes` of payload in all, over a group of n ranks that lie
    within `span` consecutive ranks (a group spanning more than a node leaves it)."""
    if n <= 1 and collective != "send_recv":
        return 0.0
    n = max(n, 2)
    inside = span <= hw.gpus_per_node
    seconds = nbytes * BUS_FACTOR.get(collective, lambda n: 1.0)(n) / hw.bandwidth(collective, span)
    per_node = min(n, max(1, hw.gpus_per_node * n // max(span, 1)))
    if inside:
        per_node = n
    return pipelined_seconds(hw, collective, seconds, n, per_node, calls)


def pipelined_seconds(hw: Hardware, collective: str, transfer: float, n: int, per_node: int, calls: float) -> float:
    """Seconds of `calls` calls whose payload takes `transfer` seconds on the slowest link, over n ranks, `per_node`
    of them in each node: each step (latency_steps) takes the longer of its hop's latency and its even share of the
    transfer, since NCCL pipelines a step's slices behind the latency (module docstring). Without calls, the
    transfer alone."""
    within, between = latency_steps(collective, n, per_node)
    if calls <= 0 or within + between <= 0:
        return transfer
    step = transfer / (calls * (within + between))
    return calls * (within * max(hw.collective_latency_s, step) + between * max(hw.inter_node_latency_s, step))


def latency_seconds(hw: Hardware, collective: str, n: int, per_node: int, calls: float) -> float:
    """The latency of `calls` calls over n ranks, `per_node` of them in each node: every step at its hop's latency
    (latency_steps), what `pipelined_seconds` gives a payload too small to outlast it."""
    return pipelined_seconds(hw, collective, 0.0, n, per_node, calls)
