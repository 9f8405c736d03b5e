"""The profile of one training step: per-unit costs, per-stage costs, and the report with its tables and JSON."""
from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field

from colozoo.core.dtypes import human_bytes as human
from colozoo.cost.setup import Workload


@dataclass
class UnitCost:
    """One traced piece of the model per micro-batch: a layer kind, or everything before / after the layers."""
    name: str
    count: int = 1
    layers: list = field(default_factory=list)
    param_bytes: int = 0
    expert_param_bytes: int = 0          # of param_bytes, the experts split over ep (sharded over dp*cp/ep)
    frozen_param_bytes: int = 0          # of param_bytes, without gradients (DeepSeek-V3's routing bias)
    fwd_flops: int = 0
    bwd_flops: int = 0
    saved_bytes: int = 0
    attention_core_bytes: int = 0        # saved tensors of (..., s, s) shape: what selective recompute drops
    attention_unviewed_bytes: int = 0    # of the storages the attention kernel saves views of, the bytes no view covers
    input_bytes: int = 0                 # what full recompute keeps
    module_saved: dict = field(default_factory=dict)  # "module path|op|(width,)" inside a layer -> saved bytes
    norm_inputs: dict = field(default_factory=dict)   # a layer's norm modules -> bytes of their input
    transient_bytes: int = 0             # temporaries alive at the worst op (forward or backward)
    fwd_transient_bytes: int = 0
    bwd_transient_bytes: int = 0
    fwd_unsaved_bytes: int = 0           # of saved + fwd_transient, what the forward never holds at once: the
    #                                      tensors it saves only after its temporaries peak
    bwd_released_bytes: int = 0          # of saved + bwd_transient, what the backward never holds at once: the saved
    #                                      tensors its nodes have released before its temporaries peak
    bwd_fresh_grad_bytes: int = 0        # what the backward's peak rises by when each gradient it makes is held until
    #                                      added to one kept from before (a later micro-batch's, a buffer's)
    bwd_kept_grad_bytes: int = 0         # what it rises by when the gradients it makes stay as made (a first
    #                                      backward with nothing to add them to)
    bwd_outlived_bytes: int = 0          # of saved, what is still held when its backward ends: the gradient of a tied
    #                                      weight computed in the forward (the fused head), held until the other use's
    #                                      gradient is added to it
    grad_bytes: int = 0                  # the gradients its backward makes (a tied weight's where it is used last)
    comm: dict = field(default_factory=dict)  # "group.collective" -> bytes per micro-batch (fwd + bwd)
    comm_calls: dict = field(default_factory=dict)  # "group.collective" -> calls per micro-batch (fwd + bwd)
    ops: dict = field(default_factory=dict)   # op -> {"calls", "fwd_flops", "bwd_flops", "saved_bytes"}
    kernels: dict = field(default_factory=dict)  # colozoo.cost.trace.kernel_key -> [count, flops, bytes]


@dataclass
class StageCost:
    stage: int
    layers: list
    params: int                  # local parameter count on one rank of this stage
    weights: float               # bytes per rank, after sharding and offload
    grads: float
    master: float
    optimizer: float
    fsdp_buffers: float          # unsharded layers gathered around the one computing (ZeRO-3)
    activations: float           # saved for backward, all micro-batches in flight
    transient: float             # the worst op's temporaries (+ a recomputed layer)
    peak: float
    cpu_bytes: float             # what offload keeps in CPU memory
    inflight: int
    fwd_flops: int               # per micro-batch on one rank
    bwd_flops: int               # including recomputation
    comm: dict = field(default_factory=dict)  # "group.collective" -> bytes per step
    comm_calls: dict = field(default_factory=dict)  # "group.collective" -> calls per step (what latency costs)
    trainable: int = -1          # local trainable parameter count (-1: all of `params`; with LoRA: the adapters;
                                 # fewer when some are frozen, e.g. DeepSeek-V3's routing bias)


@dataclass
class ProfileReport:
    model: str
    mesh: dict
    plan: dict                   # the colozoo.runtime.plan.Plan priced, as a dict
    workload: dict               # seq_len, dtype, optimizer, target, LoRA (colozoo.cost.setup.Workload.to_dict)
    num_layers: int
    total_params: int            # global, tied weights once, vocab padding included
    units: list                  # UnitCost as dicts
    stages: list                 # StageCost as dicts
    comm: dict                   # "group.collective" -> bytes per step per rank (busiest stage)
    comm_calls: dict             # "group.collective" -> calls per step per rank (busiest stage)
    peak_memory: float           # bytes, worst rank
    step_flops: int              # per rank, busiest stage, whole step (all micro-batches)
    profile_seconds: float

    def to_dict(self) -> dict:
        return asdict(self)

    def to_json(self, **kw) -> str:
        return json.dumps(self.to_dict(), **kw)

    def table(self) -> str:
        from rich.console import Console
        from rich.table import Table

        console = Console(width=140, record=True, file=open("/dev/null", "w"))
        mesh = ", ".join(f"{k}={v}" for k, v in self.mesh.items())
        units = Table(title=f"{self.model}: per micro-batch of {self.plan['micro_batch_size']} x "
                            f"{self.workload['seq_len']} ({mesh}, {self.workload['dtype']}, "
                            f"checkpointing={self.plan['checkpointing']})")
        for col in ("unit", "x", "params/rank", "fwd FLOPs", "bwd FLOPs", "saved act.", "transient", "comm"):
            units.add_column(col, justify="left" if col == "unit" else "right")
        for u in self.units:
            units.add_row(u["name"], str(u["count"]), human(u["param_bytes"]), flops(u["fwd_flops"]),
                          flops(u["bwd_flops"]), human(u["saved_bytes"]), human(u["transient_bytes"]),
                          human(sum(u["comm"].values())))
        ops = Table(title="per op (one of each unit)")
        for col in ("unit", "op", "calls", "fwd FLOPs", "bwd FLOPs", "saved act."):
            ops.add_column(col, justify="left" if col in ("unit", "op") else "right")
        for u in self.units:
            for op, s in sorted(u["ops"].items(), key=lambda kv: -(kv[1]["fwd_flops"] + kv[1]["saved_bytes"])):
                if s["fwd_flops"] or s["bwd_flops"] or s["saved_bytes"]:
                    ops.add_row(u["name"], op, str(s["calls"]), flops(s["fwd_flops"]), flops(s["bwd_flops"]),
                                human(s["saved_bytes"]))
        lora = Workload.from_dict(self.workload).lora
        stages = Table(title="memory per rank, training step" +
                       (f" (LoRA r={lora.r}: trainable = adapters)" if lora else ""))
        for col in ("stage", "layers", "trainable", "weights", "grads", "master", "optim", "fsdp buf", "activations",
                    "transient", "peak", "CPU"):
            stages.add_column(col, justify="right")
        for s in self.stages:
            ids = s["layers"]
            span = f"{ids[0]}-{ids[-1]}" if ids else "-"
            trainable = s["params"] if s.get("trainable", -1) < 0 else s["trainable"]
            stages.add_row(str(s["stage"]), span, f"{trainable:,}", *(human(s[k]) for k in (
                "weights", "grads", "master", "optimizer", "fsdp_buffers", "activations", "transient", "peak",
                "cpu_bytes")))
        comm = Table(title="communication per step per rank")
        comm.add_column("collective")
        comm.add_column("bytes", justify="right")
        comm.add_column("calls", justify="right")
        for name, nbytes in sorted(self.comm.items()):
            comm.add_row(name, human(nbytes), f"{self.comm_calls.get(name, 0):,.0f}")
        for t in (units, ops, stages, comm):
            console.print(t)
        console.print(f"peak memory per rank {human(self.peak_memory)}; {flops(self.step_flops)} per rank per step; "
                      f"{self.total_params / 1e9:.2f}B parameters; profiled in {self.profile_seconds:.2f}s")
        return console.export_text()


def flops(n: float) -> str:
    for unit in ("", "K", "M", "G", "T", "P", "E"):
        if abs(n) < 1000 or unit == "E":
            return f"{n:.3g} {unit}FLOP"
        n /= 1000
