"""Symbolic profiler: the cost of one training step of any model at any mesh, without running it.

    report = colozoo.profile("opt-30b", Plan(tp=8, pp=4, dp=2, sequence_parallel=True), Workload(seq_len=2048))
    report = colozoo.profile_for("opt-30b", batch_size=1, seq_len=2048, mesh="tp=8,pp=4,dp=2,sp")  # the same
    print(report.table()); report.to_json()
    colozoo profile opt-30b --batch-size 1 --seq-len 2048 --mesh tp=8,pp=4 --json

The model is built on the meta device with fake process groups of the right sizes (`torch.distributed`'s
"fake" backend), so tensor and expert parallel layers shard their parameters and issue their collectives
exactly as on a real mesh. Only one layer of each kind (same class and parameter shapes) is traced with the
embedding and the head; the others are multiplied in. Pipeline stages follow colozoo.core.partition, data
parallel shards model states (ZeRO 1/2/3 = FSDP; experts only over the dp*cp/ep ranks that hold them),
context parallel divides the sequence (its ring traffic and each rank's attention over every chunk's keys are
modelled, not traced), and checkpointing trades saved activations for recomputation. Mixture-of-experts
layers are traced with tokens spread evenly over the experts (their routing depends on data meta tensors
lack). `target` picks the attention kernels: "cuda" (flash), "cpu", or "eager" (unfused, as Megatron).
"""
from __future__ import annotations

import time
from dataclasses import fields, replace

from colozoo.cost.cost_model import assemble
from colozoo.cost.model_trace import _resolve, default_seq_len, trace_model
from colozoo.cost.report import ProfileReport
from colozoo.cost.setup import ProfilerError, Workload, check_priced, plan_of
from colozoo.runtime.plan import Plan

# the Plan's fields besides the mesh and the micro-batch size
STEP_CHOICES = tuple(f.name for f in fields(Plan) if f.name not in ("degrees", "micro_batch_size"))


def profile(model, plan: Plan, workload: Workload, inputs: dict | None = None) -> ProfileReport:
    """Profile one training step per rank on meta tensors: `model` run by `plan` (a colozoo.runtime.plan.Plan) on
    `workload` (seq_len None: the model's default; `lora`: LoRA fine-tuning, where only the adapters and the
    modules to save have gradients, master weights and optimizer states).

    model: a registered name, a transformers config, a colozoo model (rebuilt from its config on the mesh) or any
    nn.Module (traced whole as given; the plan's mesh then only shards data-parallel model states).
    `inputs` overrides the default batch (input_ids and labels of micro_batch_size x seq_len).
    """
    start = time.perf_counter()
    config, _ = _resolve(model)
    if workload.seq_len is None:
        workload = replace(workload, seq_len=default_seq_len(config))
    check_priced(plan)
    workload.check()
    traced = trace_model(config if isinstance(model, str) else model, plan.micro_batch_size, workload.seq_len,
                         plan.degrees, workload.dtype, workload.target, inputs)
    if isinstance(model, str):
        traced.name = model
    report = assemble(traced, plan, workload)
    report.profile_seconds = time.perf_counter() - start
    return report


def profile_for(model, batch_size: int = 1, seq_len: int | None = None, mesh=None, *, inputs: dict | None = None,
                **choices) -> ProfileReport:
    """profile() with the plan and the workload given field by field: `mesh` as colozoo.cost.setup.parse_mesh takes
    it ('tp=8,pp=4,dp=2,sp', a dict or a ParallelConfig), `batch_size` the micro-batch size, and `choices` any
    other field of the Plan (num_microbatches, schedule, zero, checkpointing, checkpoint_layers, offload) or of the
    Workload (dtype, optimizer, target, lora, task)."""
    plan_choices = {k: v for k, v in choices.items() if k in STEP_CHOICES}
    workload_fields = {k: v for k, v in choices.items() if k not in plan_choices}
    unknown = sorted(set(workload_fields) - {f.name for f in fields(Workload)})
    if unknown:
        raise ProfilerError(f"profile_for() got unknown settings {unknown}; it takes the Plan's {STEP_CHOICES} and "
                            f"the Workload's {tuple(f.name for f in fields(Workload) if f.name != 'seq_len')}")
    return profile(model, plan_of(mesh, micro_batch_size=batch_size, **plan_choices),
                   Workload(seq_len=seq_len, **workload_fields), inputs)
