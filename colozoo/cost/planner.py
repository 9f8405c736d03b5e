"""Auto-parallel planner (the Colossal-Auto idea): layout and activation checkpointing chosen together.

    result = colozoo.plan("opt-30b", gpus=8, gpu_memory="80GB")
    print(result.table()); result.best.choices()   # a colozoo.runtime.plan.Plan
    colozoo plan opt-30b --gpus 8 --gpu-memory 80GB --hardware H100-80GB

For every tensor/context parallel degree the profiler traces one micro-batch once (colozoo.cost.profiler);
everything else is arithmetic on that trace: pipeline depth and schedule, data parallel and ZeRO/FSDP level,
micro-batch size and count, how many layers of each stage recompute (the fewest that fit, found per layout,
so checkpointing is decided with the layout rather than after it), and CPU offload when nothing else fits
(colozoo.runtime.offload). Step time = pipelined compute at a realistic fraction of peak + tensor/context/pipeline
collectives that sit on the critical path + the data-parallel traffic and offload transfers compute cannot
hide. Plans are ranked by step time among those under the memory limit.
"""
from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field, replace

from colozoo.cost.hardware import Hardware, get_hardware
from colozoo.cost.offload import MemoryNeed, decide_offload
from colozoo.core.mesh import ParallelConfig
from colozoo.core.dtypes import human_bytes as human
from colozoo.cost.cost_model import assemble
from colozoo.cost.model_trace import default_seq_len, trace_model
from colozoo.cost.priced import OPTIMIZER_BYTES, PRICED_SCHEDULES
from colozoo.cost.setup import Workload, get_config
from colozoo.runtime.options import ZERO
from colozoo.runtime.plan import Plan

BUS_FACTOR = {  # bytes each rank puts on the wire per payload byte, ring algorithms
    "all_reduce": lambda n: 2 * (n - 1) / n,
    "all_gather": lambda n: (n - 1) / n,
    "reduce_scatter": lambda n: (n - 1) / n,
    "all_to_all": lambda n: (n - 1) / n,
    "send_recv": lambda n: 1.0,
    "broadcast": lambda n: 1.0,
}


class PlanError(ValueError):
    pass


@dataclass
class RankedPlan(Plan):
    """A Plan with what the planner predicts for it."""
    memory: float = 0.0                  # predicted peak bytes on the fullest GPU
    step_seconds: float = 0.0
    breakdown: dict = field(default_factory=dict)  # seconds: compute, bubble, tp, cp, pp, dp, offload, optimizer
    tokens_per_second: float = 0.0
    mfu: float = 0.0
    why: list = field(default_factory=list)


@dataclass
class PlanResult:
    model: str
    hardware: dict
    seq_len: int
    global_batch: int
    plans: list                  # ranked, fastest first
    rejected: dict               # reason -> count
    searched: int
    seconds: float

    @property
    def best(self) -> RankedPlan:
        if not self.plans:
            raise PlanError(f"no plan fits {self.model} on {self.hardware['gpus_per_node'] * self.hardware['nodes']} "
                            f"x {self.hardware['name']}: {self._rejections()}")
        return self.plans[0]

    def _rejections(self) -> str:
        return "; ".join(f"{n} x {r}" for r, n in sorted(self.rejected.items(), key=lambda kv: -kv[1])[:4])

    def to_dict(self) -> dict:
        return {**{k: v for k, v in asdict(self).items() if k != "plans"}, "plans": [asdict(p) for p in self.plans]}

    def to_json(self, **kw) -> str:
        return json.dumps(self.to_dict(), **kw)

    def table(self, top: int = 10) -> str:
        from rich.console import Console
        from rich.table import Table

        hw = self.hardware
        console = Console(width=170, record=True, file=open("/dev/null", "w"))
        t = Table(title=f"{self.model} on {hw['nodes']}x{hw['gpus_per_node']} {hw['name']} "
                        f"({human(hw['gpu_memory'])} each), {self.global_batch} x {self.seq_len} tokens per step")
        for col in ("#", "mesh", "mbs x m", "sched", "ZeRO", "recompute", "offload", "mem/GPU", "step", "tok/s",
                    "MFU", "why"):
            t.add_column(col, justify="left" if col in ("mesh", "why", "recompute") else "right",
                         overflow="fold", max_width=60 if col == "why" else None)
        for i, p in enumerate(self.plans[:top], 1):
            recompute = p.checkpointing if p.checkpointing != "full" else \
                f"full x{p.checkpoint_layers if p.checkpoint_layers is not None else 'all'}"
            t.add_row(str(i), p.mesh(), f"{p.micro_batch_size}x{p.num_microbatches}", p.schedule, str(p.zero),
                      recompute, p.offload, human(p.memory), f"{p.step_seconds:.3g}s",
                      f"{p.tokens_per_second:,.0f}", f"{p.mfu:.0%}", "; ".join(p.why))
        console.print(t)
        console.print(f"searched {self.searched} plans in {self.seconds:.1f}s; rejected: {self._rejections() or '-'}")
        return console.export_text()


def divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


RING_STEPS = {  # latency-bound steps of each collective, ring algorithms
    "all_reduce": lambda n: 2 * (n - 1),
    "all_gather": lambda n: n - 1,
    "reduce_scatter": lambda n: n - 1,
    "all_to_all": lambda n: n - 1,
    "send_recv": lambda n: 1,
}


def _comm_seconds(comm: dict, calls: dict, pc: Plan, hw: Hardware) -> dict:
    """Seconds per step of each group's traffic on one rank: bytes over the bandwidth the collective reaches
    on its link, plus a latency for every step of every call."""
    sizes = {"tp": pc.tp, "cp": pc.cp, "dp_cp": pc.dp * pc.cp, "pp": pc.pp, "ep": pc.ep}
    spans = {"tp": pc.tp, "cp": pc.tp * pc.cp, "dp_cp": pc.tp * pc.cp * pc.dp, "ep": pc.tp * pc.cp * pc.dp,
             "pp": pc.tp * pc.cp * pc.dp + 1}  # pipeline neighbours are tp*cp*dp ranks apart
    out = {}
    for key, nbytes in comm.items():
        group, _, collective = key.partition(".")
        n = sizes.get(group, 1)
        if n <= 1 and group != "pp":
            continue
        n = max(n, 2)
        seconds = nbytes * BUS_FACTOR.get(collective, lambda n: 1.0)(n) / hw.bandwidth(collective, spans[group])
        seconds += calls.get(key, 0) * RING_STEPS.get(collective, lambda n: 1)(n) * hw.collective_latency_s
        out[group] = out.get(group, 0.0) + seconds
    return out


def estimate(report, plan: Plan, workload: Workload, hw: Hardware, base=None):
    """(step seconds, breakdown, offload decision or None) of a profile of `plan` on this hardware.
    `base` is the same plan's report without offload, to price what offload moves."""
    pc, m = plan, plan.num_microbatches
    flop_rate = hw.peak_flops * hw.mfu
    per_stage, parts = [], []
    for st in report.stages:
        comm = _comm_seconds(st["comm"], st["comm_calls"], pc, hw)
        compute = (st["fwd_flops"] + st["bwd_flops"]) / flop_rate
        # tp collectives sit between the matmuls; about half of the ring attention traffic can hide behind
        # attention compute; stage boundaries send one activation each way
        cp_exposed = (1 - 0.5 * hw.comm_overlap) * comm.get("cp", 0)
        critical = (comm.get("tp", 0) + cp_exposed + comm.get("pp", 0) + comm.get("ep", 0)) / m
        compute += hw.layer_overhead_s * max(1, len(st["layers"]))
        per_stage.append(compute + critical)
        parts.append((compute, comm))
    slowest = max(range(len(per_stage)), key=per_stage.__getitem__)
    t_mb = per_stage[slowest]
    compute, comm = parts[slowest]
    pipeline = (m + pc.pp - 1) * t_mb
    st = report.stages[slowest]
    # data parallel: gradient reduction overlaps the last backward; ZeRO-3 gathers prefetch behind compute
    dp = comm.get("dp_cp", 0.0)
    hideable = 0.8 * compute * m if plan.zero >= 3 else 0.66 * compute
    exposed_dp = max(0.0, dp - hw.comm_overlap * hideable)
    decision, offload, optimizer_step = None, 0.0, 0.0
    if plan.offload != "none" and base is not None:
        b = base.stages[slowest]
        need = MemoryNeed(weights=b["weights"], grads=b["grads"], master=b["master"], optimizer=b["optimizer"],
                          activations=b["activations"], transient=b["transient"], fsdp_buffers=b["fsdp_buffers"],
                          params=_optimizer_params(b, plan, workload),
                          compute_seconds=compute * m, num_microbatches=m)
        decision = decide_offload(need, hw, allowed=("none", plan.offload))
        offload = decision.exposed_seconds
    else:  # the optimizer reads and writes weights, gradients, master weights and states once
        optimizer_step = (st["weights"] + st["grads"] + 2 * (st["master"] + st["optimizer"])) / hw.hbm_bw
    step = pipeline + exposed_dp + offload + optimizer_step
    breakdown = {"compute": compute * m, "bubble": (pc.pp - 1) * t_mb,
                 "tp": comm.get("tp", 0.0), "cp": comm.get("cp", 0.0), "pp": comm.get("pp", 0.0),
                 "dp": exposed_dp, "offload": offload, "optimizer": optimizer_step}
    return step, breakdown, decision


def _optimizer_params(stage: dict, plan: Plan, workload: Workload) -> int:
    """Parameters this rank's optimizer updates: its ZeRO shard (experts shard over dp*cp/ep ranks only)."""
    per_param = OPTIMIZER_BYTES[workload.optimizer]
    if per_param:
        return int(stage["optimizer"] / per_param)
    return stage["params"] // max(1, plan.dp * plan.cp if plan.zero >= 1 else 1)


def _fits(report, hw: Hardware) -> bool:
    return report.peak_memory <= hw.memory_limit


def _traces(name, seq_len, dtype, target, tp, cp, ep, sp, cache, batch_sizes) -> dict | str:
    """{micro-batch size: ModelTrace} at this tp/ep/sp and local sequence (seq_len is already divided by cp;
    traced once per size: the worst op's temporaries are not linear in the batch), or why the degrees do not
    apply. Cached per (tp, cp, ep, sp)."""
    key = (tp, cp, ep, sp)
    if key not in cache:
        try:
            mesh = ParallelConfig(tp=tp, dp=ep, ep=ep, sequence_parallel=sp)
            cache[key] = trace_model(name, list(batch_sizes), seq_len, mesh, dtype, target)
        except (ValueError, RuntimeError) as e:
            cache[key] = f"tp={tp}: {str(e).splitlines()[0][:80]}"
    return cache[key]


def plan(name, gpus: int = 8, gpu_memory=None, hardware="H100-80GB", *, seq_len: int | None = None,
         global_batch: int | None = None, dtype: str = "bfloat16", optimizer: str = "adamw",
         micro_batch_sizes=(1, 2, 4, 8), schedules=PRICED_SCHEDULES, zero_levels=ZERO,
         context_parallel: bool | None = None, allow_offload: bool = True, partial_checkpointing: bool = True,
         target: str = "cuda", lora_r: int = 0, lora_targets="all-linear", lora_modules_to_save=None,
         task: str | None = None, gpus_per_node: int | None = None, top: int | None = None,
         **hardware_overrides) -> PlanResult:
    """Search layouts x micro-batching x checkpointing x ZeRO x offload for the fastest plan that fits (`lora_r` > 0:
    for LoRA fine-tuning, only the adapters and `lora_modules_to_save` training; None: the `task` head's default,
    as colozoo.runtime.lora.apply_lora)."""
    import time

    start = time.perf_counter()
    hw = get_hardware(hardware, gpus=gpus, gpu_memory=gpu_memory, gpus_per_node=gpus_per_node,
                      **hardware_overrides)
    config = get_config(name) if isinstance(name, str) else name
    seq_len = seq_len or default_seq_len(config)
    if global_batch is None:  # about a million tokens, at least one sequence per GPU
        global_batch = max(gpus, 2 ** 20 // seq_len)
    heads = getattr(config, "num_attention_heads", 1)
    experts = getattr(config, "num_local_experts", None) or getattr(config, "num_experts", None)
    use_cp = context_parallel if context_parallel is not None else seq_len >= 8192
    cache, plans, rejected, searched = {}, [], {}, 0

    def reject(reason):
        rejected[reason] = rejected.get(reason, 0) + 1

    for tp in divisors(gpus):
        if tp > hw.gpus_per_node:
            continue
        if heads % tp:
            reject(f"tp={tp} does not divide {heads} heads")
            continue
        for cp in (divisors(gpus // tp) if use_cp else [1]):
            if seq_len % (2 * cp if cp > 1 else 1):
                continue
            pp_dp = gpus // (tp * cp)
            for ep in (divisors(pp_dp) if experts else [1]):
                if experts and experts % ep:
                    continue
                traces = _traces(name, seq_len // cp, dtype, target, tp, cp, ep, tp > 1, cache,
                                 micro_batch_sizes)
                if isinstance(traces, str):
                    reject(traces)
                    continue
                mt = next(iter(traces.values()))
                for pp in divisors(pp_dp):
                    dp = pp_dp // pp
                    if pp > len(mt.layers) or (experts and (dp * cp) % ep):
                        continue
                    pc = ParallelConfig(tp=tp, pp=pp, dp=dp, cp=cp, ep=ep, sequence_parallel=tp > 1)
                    for mbs in micro_batch_sizes:
                        if global_batch % (dp * mbs):
                            continue
                        m = global_batch // (dp * mbs)
                        for schedule in (schedules if pp > 1 else ("1f1b",)):
                            for zero in (zero_levels if dp * cp > 1 else (0,)):
                                searched += 1
                                best = _best_recompute(traces[mbs], pc, mbs, m, schedule, zero, seq_len, dtype,
                                                       optimizer, target, hw, global_batch, allow_offload,
                                                       partial_checkpointing,
                                                       (lora_r, lora_targets, lora_modules_to_save, task))
                                if isinstance(best, str):
                                    reject(best)
                                else:
                                    plans.append(best)
    plans.sort(key=lambda p: (p.step_seconds, p.memory))
    hw_dict = hw.to_dict()
    result = PlanResult(name if isinstance(name, str) else type(name).__name__, hw_dict, seq_len, global_batch,
                        plans[:top] if top else plans, rejected, searched, time.perf_counter() - start)
    return result


def _best_recompute(mt, pc, mbs, m, schedule, zero, seq_len, dtype, optimizer, target, hw, global_batch,
                    allow_offload, partial_checkpointing=True, lora=(0, "all-linear", None, None)):
    """The fastest checkpointing choice that fits this layout, with CPU offload only when nothing else does."""
    workload = Workload(seq_len=seq_len, dtype=dtype, optimizer=optimizer, target=target, lora_r=lora[0],
                        lora_targets=lora[1], lora_modules_to_save=lora[2], task=lora[3])
    layout = Plan(**asdict(pc), micro_batch_size=mbs, num_microbatches=m, schedule=schedule, zero=zero)

    def evaluate(checkpointing, k=None, offload="none"):
        plan = replace(layout, checkpointing=checkpointing, checkpoint_layers=k, offload=offload)
        return assemble(mt, plan, workload), plan

    candidates = []
    for checkpointing in ("none", "selective"):
        report, plan = evaluate(checkpointing)
        if _fits(report, hw):
            candidates.append((report, plan))
    max_layers = max(len(s["layers"]) for s in assemble(mt, replace(layout, schedule="1f1b", zero=0),
                                                        workload).stages)
    # fewest recomputed layers per stage that fit: memory falls monotonically with k
    lo, hi = (1, max_layers) if partial_checkpointing else (max_layers, max_layers)
    report, plan = evaluate("full", hi)
    if _fits(report, hw):
        while lo < hi:
            mid = (lo + hi) // 2
            if _fits(evaluate("full", mid)[0], hw):
                hi = mid
            else:
                lo = mid + 1
        candidates.append(evaluate("full", hi if partial_checkpointing else None))
    elif allow_offload:
        base = report
        # parameters go to CPU memory through FSDP's offload policy: only when they are sharded
        for level in ("optimizer", "params") if zero >= 3 and pc.dp * pc.cp > 1 else ("optimizer",):
            report, plan = evaluate("full", max_layers, level)
            if _fits(report, hw):
                candidates.append((report, plan, base))
                break
    if not candidates:
        held = f" ({schedule} holds {m} micro-batches)" if schedule == "gpipe" else ""
        return (f"over {human(hw.memory_limit)} even with full recompute" + (" and offload" if allow_offload else "")
                + held)
    best = None
    for report, plan, *base in candidates:
        step, breakdown, decision = estimate(report, plan, workload, hw, base[0] if base else None)
        if best is None or step < best[1]:
            best = (report, step, breakdown, plan, decision)
    report, step, breakdown, plan, decision = best
    # model FLOPs utilisation counts forward + backward (~2x forward), not recomputation
    useful = 3 * sum(st["fwd_flops"] for st in report.stages) / len(report.stages) * m
    why = _why(report, plan, workload, breakdown, step, hw, decision, max_layers)
    return RankedPlan(**asdict(plan), memory=report.peak_memory, step_seconds=step, breakdown=breakdown,
                      tokens_per_second=global_batch * seq_len / step, mfu=useful / step / hw.peak_flops, why=why)


def _why(report, plan: Plan, workload: Workload, breakdown, step, hw, decision, max_layers) -> list[str]:
    why = []
    share = lambda s: f"{100 * s / step:.0f}%"  # noqa: E731
    if plan.tp > 1:
        why.append(f"tp={plan.tp} in NVLink, tp comm {share(breakdown['tp'])}")
    if plan.pp > 1:
        why.append(f"pp={plan.pp} bubble {share(breakdown['bubble'])}")
    if plan.cp > 1:
        why.append(f"cp={plan.cp} splits the {workload.seq_len}-token sequence")
    if plan.checkpointing == "none":
        why.append("no recompute needed")
    elif plan.checkpointing == "selective":
        why.append("selective recompute suffices")
    else:
        why.append(f"recompute {plan.checkpoint_layers}/{max_layers} layers per stage to fit")
    if plan.zero:
        why.append({1: "ZeRO-1 shards optimizer", 2: "ZeRO-2", 3: "FSDP shards weights"}[plan.zero])
    if decision is not None and plan.offload != "none":
        why.append(decision.reason)
    why.append(f"peak {human(report.peak_memory)} of {human(hw.memory_limit)}")
    return why


def best_plan_for_world(name, world_size: int, gpu_memory=None, hardware=None, **kwargs) -> Plan:
    """The best Plan for `world_size` GPUs (for from_pretrained(..., plan="auto")).

    GPU memory defaults to this machine's device. The search keeps to what colozoo.runtime.training.apply_plan runs:
    DDP or FSDP (ZeRO 0 or 3; ZeRO-1 and 2 are not in colozoo.runtime.training); keyword arguments go to plan().
    Inside a torch.distributed job rank 0 plans in a fresh process (the profiler builds fake process groups
    of its own) and broadcasts the result.
    """
    import torch
    import torch.distributed as dist

    if gpu_memory is None and torch.cuda.is_available():
        gpu_memory = torch.cuda.get_device_properties(torch.cuda.current_device()).total_memory
    if hardware is None and torch.cuda.is_available():
        device = torch.cuda.get_device_name().upper()
        hardware = next((k for k in ("H200", "H100-80GB", "A100-80GB", "A100-40GB", "L40S", "V100-32GB")
                         if k.split("-")[0] in device), "H100-80GB")
    gpus_per_node = min(world_size, torch.cuda.device_count()) if torch.cuda.is_available() else None
    args = (name, world_size, gpu_memory, hardware or "H100-80GB", gpus_per_node, kwargs)
    if not (dist.is_available() and dist.is_initialized()):
        return _best_degrees(*args)
    box = [None]
    if dist.get_rank() == 0:
        import multiprocessing as mp
        from concurrent.futures import ProcessPoolExecutor

        with ProcessPoolExecutor(1, mp_context=mp.get_context("spawn")) as pool:
            box[0] = pool.submit(_best_degrees, *args).result()
    dist.broadcast_object_list(box, src=0)
    return box[0]


def _best_degrees(name, world_size, gpu_memory, hardware, gpus_per_node, kwargs) -> Plan:
    kwargs = dict(kwargs)
    result = plan(name, gpus=world_size, gpu_memory=gpu_memory, hardware=hardware, gpus_per_node=gpus_per_node,
                  **kwargs)
    return result.best.choices()


__all__ = ["plan", "best_plan_for_world", "Plan", "RankedPlan", "PlanResult", "estimate", "PlanError"]
