"""Auto-parallel planner (the Colossal-Auto idea): layout and activation checkpointing chosen together.

    result = colozoo.plan("opt-30b", get_hardware("H100-80GB", gpus=8), Workload(seq_len=2048))
    result = colozoo.plan_for("opt-30b", gpus=8, gpu_memory="80GB", seq_len=2048)   # the same
    print(result.table()); result.best.choices()   # a colozoo.runtime.plan.Plan
    colozoo plan opt-30b --gpus 8 --gpu-memory 80GB --hardware H100-80GB

For every tensor/context parallel degree the profiler traces one micro-batch once (colozoo.cost.profiler);
everything else is arithmetic on that trace: pipeline depth and schedule, data parallel and ZeRO/FSDP level,
micro-batch size and count, how many layers of each stage recompute (the fewest that fit, found per layout,
so checkpointing is decided with the layout rather than after it), and CPU offload when nothing else fits
(colozoo.runtime.offload). Step time (colozoo.cost.step_time): every traced kernel priced by its shape on the
hardware, the collectives on the critical path, the ZeRO-3 gathers and data-parallel traffic that compute cannot
hide, the pipeline's bubble, offload transfers. Plans are ranked by step time among those under the memory limit.
`colozoo plan --validate` checks the predictions against published training runs (colozoo.cost.validate).
"""
from __future__ import annotations

import json
import time
from dataclasses import asdict, dataclass, field, fields, replace

from colozoo.cost.hardware import Hardware, get_hardware
from colozoo.core.mesh import ParallelConfig
from colozoo.core.sequence import sequence_multiple
from colozoo.core.dtypes import human_bytes as human
from colozoo.cost.cost_model import assemble
from colozoo.cost.model_trace import default_seq_len, trace_model
from colozoo.cost.priced import PRICED_SCHEDULES
from colozoo.cost.software import COLOZOO, Software
from colozoo.cost.step_time import estimate
from colozoo.cost.setup import Workload, get_config
from colozoo.runtime.options import MULTI_STAGE_SCHEDULES, ZERO
from colozoo.runtime.plan import Plan

class PlanError(ValueError):
    pass


@dataclass(init=False)  # Plan's __init__: degrees as keywords, for replace(ranked, tp=...) too
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
        return {**{k: v for k, v in asdict(self).items() if k != "plans"}, "plans": [p.to_dict() for p in self.plans]}

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
            schedule = p.schedule + (f" v{p.virtual_stages}" if p.virtual_stages > 1 else "")
            t.add_row(str(i), p.mesh(), f"{p.micro_batch_size}x{p.num_microbatches}", schedule, str(p.zero),
                      recompute, p.offload, human(p.memory), f"{p.step_seconds:.3g}s",
                      f"{p.tokens_per_second:,.0f}", f"{p.mfu:.0%}", "; ".join(p.why))
        console.print(t)
        console.print(f"searched {self.searched} plans in {self.seconds:.1f}s; rejected: {self._rejections() or '-'}")
        return console.export_text()


def divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def _fits(report, hw: Hardware) -> bool:
    return report.peak_memory <= hw.memory_limit


@dataclass(frozen=True)
class SearchSpace:
    """What the planner chooses among besides the mesh (every tp x cp x ep x pp x dp that fills the GPUs)."""
    micro_batch_sizes: tuple[int, ...] = (1, 2, 4, 8)
    schedules: tuple[str, ...] = PRICED_SCHEDULES
    zero_levels: tuple[int, ...] = ZERO
    context_parallel: bool | None = None  # None: for sequences of 8192 tokens and more
    allow_offload: bool = True
    partial_checkpointing: bool = True   # recompute the fewest layers per stage that fit (False: all of them)
    degrees: dict | None = None          # mesh degrees held fixed, e.g. {"tp": 1, "ep": 8}; the others are searched
    virtual_stages: tuple[int, ...] = (1,)  # model chunks per pipeline rank tried with interleaved schedules
    reshard_after_forward: tuple[bool, ...] = (True,)  # ZeRO-3: free gathered weights after each forward, or keep

    def allows(self, **degrees) -> bool:
        return all((self.degrees or {}).get(k, v) == v for k, v in degrees.items())

    def pipelines(self, pp: int, layers: int) -> list[tuple[str, int]]:
        """(schedule, virtual stages) to try at this pipeline depth."""
        if pp == 1:
            return [("1f1b", 1)]
        return [(schedule, v) for schedule in self.schedules
                for v in ((v for v in self.virtual_stages if v > 1 and pp * v <= layers)
                          if schedule in MULTI_STAGE_SCHEDULES else (1,))]


def _traces(model, workload: Workload, tp, cp, ep, batch_sizes, cache, fused_head: bool = True,
            fusions: bool = True) -> dict | str:
    """{micro-batch size: ModelTrace} at this tp/ep (sequence parallel under tp) and cp's local sequence (traced
    once per size: the worst op's temporaries are not linear in the batch), or why the degrees do not apply.
    Cached per (tp, cp, ep), the sizes, the workload's sequence, dtype and target, and the software's head and
    fusions."""
    key = (tp, cp, ep, tuple(batch_sizes), workload.seq_len, workload.dtype, workload.target, fused_head, fusions)
    if key not in cache:
        try:
            mesh = ParallelConfig(tp=tp, dp=ep, ep=ep, sequence_parallel=tp > 1)
            cache[key] = trace_model(model, list(batch_sizes), workload.seq_len // cp, mesh, workload.dtype,
                                     workload.target, fused_head=fused_head, fusions=fusions)
        except (ValueError, RuntimeError) as e:
            cache[key] = f"tp={tp}: {str(e).splitlines()[0][:80]}"
    return cache[key]


def num_experts(config) -> int | None:
    """The routed experts of a mixture-of-experts model, as its family declares them (None: a dense model)."""
    from colozoo.models import model_class

    try:
        family = model_class(config.model_type)
    except ValueError:  # not a colozoo family: the profiler traces it whole, without expert parallelism
        return None
    return family.experts(config) or None


def _meshes(gpus: int, hw: Hardware, heads: int, experts, seq_len: int, use_cp: bool, search: SearchSpace, reject):
    """(tp, cp, ep) of every mesh worth tracing."""
    for tp in divisors(gpus):
        if tp > hw.gpus_per_node or not search.allows(tp=tp):
            continue
        if heads % tp:
            reject(f"tp={tp} does not divide {heads} heads")
            continue
        for cp in (divisors(gpus // tp) if use_cp else [1]):
            if not search.allows(cp=cp):
                continue
            multiple = sequence_multiple(cp, tp)  # the planner runs sequence parallelism wherever tp > 1
            if seq_len % multiple:
                reject(f"seq_len={seq_len} is not a multiple of {multiple} (tp={tp}, cp={cp})")
                continue
            for ep in (divisors(gpus // (tp * cp)) if experts else [1]):
                if not (experts and experts % ep) and search.allows(ep=ep):
                    yield tp, cp, ep


def _layouts(tp, cp, ep, gpus, layers, experts, global_batch, search: SearchSpace):
    """Every Plan (before checkpointing and offload) at this tp x cp x ep."""
    pp_dp = gpus // (tp * cp)
    for pp in divisors(pp_dp):
        dp = pp_dp // pp
        if pp > layers or (experts and (dp * cp) % ep) or not search.allows(pp=pp, dp=dp):
            continue
        for mbs in search.micro_batch_sizes:
            if global_batch % (dp * mbs):
                continue
            for schedule, v in search.pipelines(pp, layers):
                for zero in (search.zero_levels if dp * cp > 1 else (0,)):
                    for reshard in (search.reshard_after_forward if zero >= 3 else (True,)):
                        yield Plan(tp=tp, pp=pp, dp=dp, cp=cp, ep=ep, sequence_parallel=tp > 1, micro_batch_size=mbs,
                                   num_microbatches=global_batch // (dp * mbs), schedule=schedule, zero=zero,
                                   virtual_stages=v, reshard_after_forward=reshard)


def plan(model, hardware: Hardware, workload: Workload, search: SearchSpace = SearchSpace(), *,
         global_batch: int | None = None, top: int | None = None, software: Software = COLOZOO,
         traces: dict | None = None) -> PlanResult:
    """The plans that train `model` (a registered name or a config) on all of `hardware`'s GPUs, `global_batch`
    sequences of `workload` per step (None: about a million tokens, at least one sequence per GPU), searched over
    layouts x `search` (micro-batching, schedules, ZeRO, checkpointing, offload): those that fit, fastest first
    (the `top` first), their step times as `software` runs them. With `workload.lora`, only the adapters and the
    modules to save train. `traces`: a dict the caller keeps to reuse this model's traces across calls."""
    start = time.perf_counter()
    config = get_config(model) if isinstance(model, str) else model
    if workload.seq_len is None:
        workload = replace(workload, seq_len=default_seq_len(config))
    seq_len, gpus, hw = workload.seq_len, hardware.gpus, hardware
    if global_batch is None:
        global_batch = max(gpus, 2 ** 20 // seq_len)
    heads = getattr(config, "num_attention_heads", 1)
    experts = num_experts(config)
    use_cp = search.context_parallel if search.context_parallel is not None else \
        seq_len >= 8192 or (search.degrees or {}).get("cp", 1) > 1
    cache = {} if traces is None else traces
    plans, rejected, searched = [], {}, 0

    def reject(reason):
        rejected[reason] = rejected.get(reason, 0) + 1

    for tp, cp, ep in _meshes(gpus, hw, heads, experts, seq_len, use_cp, search, reject):
        found = _traces(model, workload, tp, cp, ep, search.micro_batch_sizes, cache, software.fused_head,
                        software.triton_fusions)
        if isinstance(found, str):
            reject(found)
            continue
        layers = len(next(iter(found.values())).layers)
        for layout in _layouts(tp, cp, ep, gpus, layers, experts, global_batch, search):
            searched += 1
            best = _best_recompute(found[layout.micro_batch_size], layout, workload, hw, search, global_batch,
                                   software)
            if isinstance(best, str):
                reject(best)
            else:
                plans.append(best)
    plans.sort(key=lambda p: (p.step_seconds, p.memory))
    return PlanResult(model if isinstance(model, str) else type(model).__name__, hw.to_dict(), seq_len, global_batch,
                      plans[:top] if top else plans, rejected, searched, time.perf_counter() - start)


def plan_for(model, gpus: int = 8, gpu_memory=None, hardware="H100-80GB", *, gpus_per_node: int | None = None,
             global_batch: int | None = None, top: int | None = None, **settings) -> PlanResult:
    """plan() with the hardware, the workload and the search space given field by field: `hardware` a preset name
    (or a Hardware) with `gpus` in all, `gpu_memory` ('80GB') and `gpus_per_node`, and `settings` any field of the
    Workload (seq_len, dtype, optimizer, target, lora, task), of the SearchSpace (micro_batch_sizes, schedules,
    zero_levels, context_parallel, allow_offload, partial_checkpointing, degrees) or of the Hardware (overrides)."""
    workload_fields, search_fields = _fields_of(Workload, settings), _fields_of(SearchSpace, settings)
    overrides = {k: v for k, v in settings.items() if k not in workload_fields and k not in search_fields}
    hw = get_hardware(hardware, gpus=gpus, gpu_memory=gpu_memory, gpus_per_node=gpus_per_node, **overrides)
    return plan(model, hw, Workload(**workload_fields), SearchSpace(**search_fields), global_batch=global_batch,
                top=top)


def _fields_of(cls, settings: dict) -> dict:
    return {f.name: settings[f.name] for f in fields(cls) if f.name in settings}


def _best_recompute(traced, layout: Plan, workload: Workload, hw: Hardware, search: SearchSpace, global_batch: int,
                    software: Software = COLOZOO):
    """The fastest checkpointing choice that fits this layout, with CPU offload only when nothing else does."""
    def evaluate(checkpointing, k=None, offload="none"):
        candidate = replace(layout, checkpointing=checkpointing, checkpoint_layers=k, offload=offload)
        return assemble(traced, candidate, workload, software), candidate

    candidates = []
    for checkpointing in ("none", "selective"):
        report, candidate = evaluate(checkpointing)
        if _fits(report, hw):
            candidates.append((report, candidate))
    max_layers = max(len(s["layers"]) for s in assemble(traced, replace(layout, zero=0),
                                                        workload).stages)
    # fewest recomputed layers per stage that fit: memory falls monotonically with k
    lo, hi = (1, max_layers) if search.partial_checkpointing else (max_layers, max_layers)
    report, candidate = evaluate("full", hi)
    if _fits(report, hw):
        while lo < hi:
            mid = (lo + hi) // 2
            if _fits(evaluate("full", mid)[0], hw):
                hi = mid
            else:
                lo = mid + 1
        candidates.append(evaluate("full", hi if search.partial_checkpointing else None))
    elif search.allow_offload:
        base = report
        # parameters go to CPU memory through FSDP's offload policy: only when they are sharded
        for level in ("optimizer", "params") if layout.zero >= 3 and layout.dp * layout.cp > 1 else ("optimizer",):
            report, candidate = evaluate("full", max_layers, level)
            if _fits(report, hw):
                candidates.append((report, candidate, base))
                break
    if not candidates:
        held = f" ({layout.schedule} holds {layout.num_microbatches} micro-batches)" \
            if layout.schedule == "gpipe" else ""
        return (f"over {human(hw.memory_limit)} even with full recompute"
                + (" and offload" if search.allow_offload else "") + held)
    best = None
    for report, candidate, *base in candidates:
        step, breakdown, decision = estimate(report, candidate, workload, hw, base[0] if base else None, software)
        if best is None or step < best[1]:
            best = (report, step, breakdown, candidate, decision)
    report, step, breakdown, chosen, decision = best
    # model FLOPs utilisation counts forward + backward (~2x forward), not recomputation
    useful = 3 * sum(st["fwd_flops"] for st in report.stages) / len(report.stages) * layout.num_microbatches
    why = _why(report, chosen, workload, breakdown, step, hw, decision, max_layers)
    return RankedPlan(**vars(chosen), memory=report.peak_memory, step_seconds=step, breakdown=breakdown,
                      tokens_per_second=global_batch * workload.seq_len / step, mfu=useful / step / hw.peak_flops,
                      why=why)


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


def best_plan_for_world(model, world_size: int, workload: Workload = Workload(), search: SearchSpace = SearchSpace(),
                        *, global_batch: int | None = None, gpu_memory=None, hardware=None) -> Plan:
    """The best Plan for `world_size` GPUs (for from_pretrained(..., plan="auto") and colozoo finetune --plan auto).

    GPU memory defaults to this machine's device, `hardware` (a preset name) to the preset of its name. The search
    keeps to what colozoo.runtime.training.apply_plan runs: DDP or FSDP (ZeRO 0 or 3; ZeRO-1 and 2 are not in
    colozoo.runtime.training). Inside a torch.distributed job rank 0 plans in a fresh process (the profiler builds
    fake process groups of its own) and broadcasts the result.
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
    hw = get_hardware(hardware or "H100-80GB", gpus=world_size, gpu_memory=gpu_memory, gpus_per_node=gpus_per_node)
    args = (model, hw, workload, search, global_batch)
    if not (dist.is_available() and dist.is_initialized()):
        return _best_plan(*args)
    box = [None]
    if dist.get_rank() == 0:
        import multiprocessing as mp
        from concurrent.futures import ProcessPoolExecutor

        with ProcessPoolExecutor(1, mp_context=mp.get_context("spawn")) as pool:
            box[0] = pool.submit(_best_plan, *args).result()
    dist.broadcast_object_list(box, src=0)
    return box[0]


def _best_plan(model, hw: Hardware, workload: Workload, search: SearchSpace, global_batch: int | None) -> Plan:
    return plan(model, hw, workload, search, global_batch=global_batch).best.choices()


__all__ = ["plan", "plan_for", "SearchSpace", "best_plan_for_world", "Plan", "RankedPlan", "PlanResult", "estimate",
           "PlanError"]
