"""Symbolic profiler: the cost of one training step of any model at any mesh, without running it.

    report = colozoo.profile("opt-30b", batch_size=1, seq_len=2048, mesh="tp=8,pp=4,dp=2,sp")
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
from dataclasses import replace

from colozoo.core.mesh import ParallelConfig
from colozoo.cost.cost_model import assemble
from colozoo.cost.model_trace import _resolve, default_seq_len, trace_model
from colozoo.cost.report import ProfileReport
from colozoo.cost.setup import Workload, check_priced, plan_of
from colozoo.runtime.plan import Plan


def profile(model_or_name, batch_size: int = 1, seq_len: int | None = None, mesh=None, dtype: str = "bfloat16",
            checkpointing: str = "none", *, checkpoint_layers: int | None = None, optimizer: str = "adamw",
            zero: int = 0, num_microbatches: int = 1, schedule: str = "1f1b", offload: str = "none",
            target: str = "cuda", inputs: dict | None = None, lora_r: int = 0,
            lora_targets="all-linear", lora_modules_to_save=None, task: str | None = None) -> ProfileReport:
    """Profile one training step per rank on meta tensors.

    model_or_name: a registered name, a transformers config, a colozoo model (rebuilt from its config on
    the mesh) or any nn.Module (traced whole as given; mesh then only shards data-parallel model states).
    `inputs` overrides the default batch (input_ids and labels of batch_size x seq_len).
    `lora_r` > 0: LoRA fine-tuning with adapters of that rank on `lora_targets` (HF module names or "all-linear"):
    gradients, master weights and optimizer states only for the adapters and the HF modules `lora_modules_to_save`
    (None: the default of the model's `task` head, as colozoo.runtime.lora.apply_lora: a classifier).
    """
    start = time.perf_counter()
    plan = plan_of(mesh, micro_batch_size=batch_size, num_microbatches=num_microbatches, schedule=schedule, zero=zero,
                   checkpointing=checkpointing, checkpoint_layers=checkpoint_layers, offload=offload)
    return profile_plan(model_or_name, plan, Workload(seq_len=seq_len or 0, dtype=dtype, optimizer=optimizer,
                                                      target=target, lora_r=lora_r, lora_targets=lora_targets,
                                                      lora_modules_to_save=lora_modules_to_save, task=task),
                        inputs, start)


def profile_plan(model_or_name, plan: Plan, workload: Workload, inputs: dict | None = None,
                 start: float | None = None) -> ProfileReport:
    """Profile one training step of `model_or_name` run by `plan` (a colozoo.runtime.plan.Plan) on `workload`
    (seq_len 0: the model's default)."""
    start = time.perf_counter() if start is None else start
    config, _ = _resolve(model_or_name)
    if workload.seq_len == 0:
        workload = replace(workload, seq_len=default_seq_len(config))
    check_priced(plan)
    workload.check()
    mesh = ParallelConfig(**plan.degrees())
    mt = trace_model(config if isinstance(model_or_name, str) else model_or_name, plan.micro_batch_size,
                     workload.seq_len, mesh, workload.dtype, workload.target, inputs)
    if isinstance(model_or_name, str):
        mt.name = model_or_name
    report = assemble(mt, plan, workload)
    report.profile_seconds = time.perf_counter() - start
    return report
