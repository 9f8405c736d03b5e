"""The step time of a plan on hardware, from its profile (colozoo.cost.cost_model.assemble):

- each pipeline rank's micro-batch: its kernels (forward, backward, recomputation; colozoo.cost.compute_time), the
  tensor- and expert-parallel collectives between them, ring attention's key/value passes beyond what the attention
  core hides, the sends to its pipeline neighbours, and the ZeRO-3 gathers that prefetching (one layer ahead) does
  not hide: a layer's forward takes the longer of its kernels and its gather, its backward the longer of its kernels
  and its gathers (again after resharding, once more where the software frees a recomputed layer) plus its
  gradients' reduce-scatter; with a small per-GPU batch the network, not the GPU, sets the pace;
- the pipeline: m micro-batches at the pace of the slowest rank, plus the others' fill and drain, divided by the
  virtual stages of an interleaved schedule (each rank's chunk is 1/v of its layers): m t_max + (sum t - t_max) / v.
  Uneven first and last ranks (embedding, head and loss) are priced by their own kernels;
- the data-parallel gradient reduction that the last backward does not hide, the optimizer step, CPU offload.

Collectives are priced per group on their links (colozoo.cost.network; ring attention's steps in
colozoo.cost.context_parallel, expert dispatch and combine in colozoo.cost.experts); the software's habits
(colozoo.cost.software) say which overlap. Under the interleaved schedule the gradient reduction also runs behind
the deeper virtual stages' cool-down (reduce_window).
"""
from __future__ import annotations

from dataclasses import dataclass

from colozoo.cost.compute_time import unit_seconds
from colozoo.cost.context_parallel import ring_steps
from colozoo.cost.cost_model import _itemsize, _recompute_plan
from colozoo.cost.experts import dispatched_share, expert_exchange_seconds
from colozoo.cost.hardware import Hardware
from colozoo.cost.network import collective_seconds
from colozoo.cost.offload import MemoryNeed, decide_offload
from colozoo.cost.priced import OPTIMIZER_BYTES
from colozoo.cost.setup import Workload
from colozoo.cost.software import COLOZOO, OPTIMIZER_PASSES, Software
from colozoo.cost.zero3_submodules import submodule_ops, submodules
from colozoo.runtime.plan import Plan


def overlapped(compute: float, comm: float, overlap: float, contention: float = 0.0) -> float:
    """Seconds of work whose traffic can run behind it: the longer of the two when the links have engines of their
    own (overlap 1), their sum when they share the cores (overlap 0). While the collective runs, its kernels hold a
    `contention` share of the GPU, which the compute loses: a compute shorter than the traffic still ends behind it
    unless what it lost makes it the longer, a longer one ends `contention x comm` late."""
    together = max(comm, compute + contention * comm)
    return (1 - overlap) * (compute + comm) + overlap * together


def chain_exposure(ops: list[tuple[float, float]], overlap: float, contention: float = 0.0) -> float:
    """Seconds the traffic of a cyclic chain of (compute, comm) steps adds, when each step's traffic is prefetched
    during the step before it (one step ahead, on a stream of its own): what of it the previous compute does not
    hide, and what the compute loses to it while both run."""
    return sum(overlapped(ops[j - 1][0], comm, overlap, contention) - ops[j - 1][0]
               for j, (_, comm) in enumerate(ops))


def pipeline_seconds(stage_seconds: list[float], m: int, v: int = 1) -> float:
    """m micro-batches through ranks taking stage_seconds each (forward + backward of one micro-batch): the slowest
    sets the pace, the rest fill and drain the pipeline, v times less with v virtual stages per rank."""
    slowest = max(stage_seconds)
    return m * slowest + (sum(stage_seconds) - slowest) / v


def reduce_window(backward: float, plan: Plan) -> float:
    """Seconds of backward a rank's data-parallel gradient reduction runs behind at the end of a step
    (`backward`: one micro-batch's): the last micro-batch's backward; under the interleaved schedule a virtual
    stage's gradients are final after its last micro-batch's backward, while the rank still runs the deeper
    stages' last p micro-batches back, (v - 1)/v of p backwards, so all but the first stage's share hide there."""
    v = plan.virtual_stages
    return backward * (1 + min(plan.pp, plan.num_microbatches) * (v - 1) / v)


@dataclass
class StageTime:
    """One pipeline rank's share of one micro-batch, in seconds."""
    compute: float = 0.0
    tp: float = 0.0
    cp: float = 0.0
    ep: float = 0.0
    pp: float = 0.0
    zero: float = 0.0            # ZeRO-3 gathers and reduce-scatters not hidden (per micro-batch)
    zero_last: float = 0.0       # the last micro-batch's reduce-scatter (when reduced once a step) not hidden
    backward: float = 0.0        # what a gradient reduction can hide behind

    @property
    def total(self) -> float:
        return self.compute + self.tp + self.cp + self.ep + self.pp + self.zero


def _spans(plan: Plan) -> dict:
    return {"tp": plan.tp, "cp": plan.tp * plan.cp, "dp_cp": plan.tp * plan.cp * plan.dp,
            "pp": plan.tp * plan.cp * plan.dp + 1}


def _group_seconds(comm: dict, calls: dict, group: str, plan: Plan, hw: Hardware, scale: float = 1.0) -> float:
    sizes = {"tp": plan.tp, "cp": plan.cp, "dp_cp": plan.dp * plan.cp}
    out = 0.0
    for key, nbytes in comm.items():
        g, _, collective = key.partition(".")
        if g == group:
            out += collective_seconds(hw, collective, scale * nbytes, sizes[group], _spans(plan)[group],
                                      scale * calls.get(key, 0))
    return out


def _parts(report, st: dict, index: int) -> list[tuple[dict, bool]]:
    """(unit, is a layer) of every layer of a rank, with the embedding first on the first rank and the head last on
    the last."""
    units = {u["name"]: u for u in report.units}
    layer_unit = {str(k): u for u in report.units for k in u["layers"]}
    parts = [(layer_unit[str(k)], True) for k in st["layers"]]
    if index == 0 and (units.get("embed") or units.get("model")):
        parts.insert(0, (units.get("embed") or units.get("model"), False))
    if index == len(report.stages) - 1 and "head" in units:
        parts.append((units["head"], False))
    return parts


def _zero3(u: dict, policy: str, plan: Plan, hw: Hardware, software: Software, itemsize: int):
    """(gather, reduce-scatter, gathers in backward) of one ZeRO-3 unit per micro-batch: the first two as seconds
    of a share of the unit's weights (1: all of them, in one call)."""
    shard = plan.dp * plan.cp
    span = _spans(plan)["dp_cp"]
    weights = (software.gather_bytes or itemsize) / itemsize
    grads = (software.grad_reduce_bytes or itemsize) / itemsize
    expert = u["expert_param_bytes"]
    edp = max(1, shard // plan.ep)
    trained = u["param_bytes"] - u["frozen_param_bytes"]

    def gather(share: float = 1.0) -> float:
        return (collective_seconds(hw, "all_gather", share * weights * (u["param_bytes"] - expert), shard, span, 1)
                + collective_seconds(hw, "all_gather", share * weights * expert, edp, span, 1 if expert else 0))

    def reduce(share: float = 1.0) -> float:
        return collective_seconds(hw, "reduce_scatter", share * grads * trained, shard, span, 1)

    again = int(plan.reshard_after_forward) + int(policy == "full" and software.regather_for_recompute)
    return gather, reduce, again


def _zero3_chain(units: list, reduce: bool, overlap: float, contention: float, hw: Hardware,
                 software: Software) -> float:
    """Exposed ZeRO-3 traffic of one micro-batch, gathered by layer (FSDP's units) or by submodule (DeepSpeed's,
    colozoo.cost.zero3_submodules)."""
    if software.zero3_gather_unit == "submodule":
        steps = [(submodules(u["kernels"], hw, software.attention_kernel), f, b - f * (policy == "full"), gather,
                  reduce_scatter, _buffer_fill(u, hw, software), policy == "full", again)
                 for f, b, gather, reduce_scatter, again, (u, policy) in units]
        ops, fills = submodule_ops(steps, reduce)
        return fills + chain_exposure(ops, overlap, contention)
    return _layer_chain([(f, b, gather(), reduce_scatter(), again)
                         for f, b, gather, reduce_scatter, again, _ in units], reduce, overlap, contention)


def _buffer_fill(u: dict, hw: Hardware, software: Software):
    """Seconds the compute stream spends zeroing a gather's buffer, for a share of the unit's weights."""
    if not software.gather_buffer_zeroed:
        return lambda share: 0.0
    return lambda share: share * u["param_bytes"] / hw.memory_bandwidth


def _layer_chain(units: list, reduce: bool, overlap: float, contention: float) -> float:
    """Exposed ZeRO-3 traffic of one micro-batch: units' forwards in order, each prefetching its gather, then their
    backwards in reverse, each gathering again as needed and reduce-scattering the gradients of the unit before."""
    fwd = [(f, gather) for f, _, gather, _, _ in units]
    back = list(reversed(units))
    bwd = [(b, again * gather + (reduce and i > 0) * back[i - 1][3]) for i, (_, b, gather, _, again) in
           enumerate(back)]
    if reduce:  # the last reduce-scatter runs behind the next micro-batch's first forward
        fwd[0] = (fwd[0][0], fwd[0][1] + back[-1][3])
    return chain_exposure(fwd + bwd, overlap, contention)


def _unit_terms(u: dict, policy: str, is_layer: bool, plan: Plan, hw: Hardware, software: Software,
                itemsize: int) -> tuple:
    """(forward, backward with recomputation, tp, ep, exposed ring attention, ZeRO-3 terms or None) of one unit,
    seconds per micro-batch."""
    kernels, cp, o, kernel = u["kernels"], plan.cp, hw.comm_overlap, software.attention_kernel
    scale = cp  # ring attention: a rank's queries meet every chunk's keys, the causal pairs balanced zigzag
    fwd = unit_seconds(kernels, hw, "fwd", core_scale=scale, attention=kernel) + hw.layer_overhead_s * is_layer
    gradients = unit_seconds(kernels, hw, "bwd", core_scale=scale, attention=kernel)  # without recomputation
    bwd = gradients + (fwd if policy == "full" else (
        unit_seconds(kernels, hw, "fwd", core_only=True, core_scale=scale, attention=kernel) if policy == "selective"
        else 0.0))
    repeat = 1.5 if policy == "full" else 1.0  # a recomputed layer repeats its forward collectives
    tp = (1 - software.tp_comm_overlap) * _group_seconds(u["comm"], u["comm_calls"], "tp", plan, hw, repeat)
    if software.tp_wgrad_overlap and is_layer:  # the embedding and head keep their own collectives
        tp -= (1 - software.tp_comm_overlap) * _wgrad_hidden(u, plan, hw, gradients)
    ep = expert_exchange_seconds(u["comm"], u["comm_calls"], plan, hw, software.expert_tp_folded, repeat,
                                 dispatched_share(plan, software.expert_dispatch_sharded))
    ring = 0.0
    if cp > 1 and is_layer:  # keys and values pass the ring behind the attention core's blocks
        core = [unit_seconds(kernels, hw, phase, core_only=True, core_scale=scale, attention=kernel)
                for phase in ("fwd", "bwd")]
        kv = u.get("kv_bytes") or 2 * u["input_bytes"]  # without a config: as wide as the hidden state
        ring = sum(n * (overlapped(c, m, o, hw.comm_contention) - c)
                   for c, m, n in ring_steps(*core, kv, cp, hw, _spans(plan)["cp"], policy == "full"))
    zero = _zero3(u, policy, plan, hw, software, itemsize) if plan.zero >= 3 and plan.dp * plan.cp > 1 else None
    return fwd, bwd, tp, ep, ring, zero


def _wgrad_hidden(u: dict, plan: Plan, hw: Hardware, backward: float) -> float:
    """Seconds of a unit's tensor-parallel traffic hidden behind its column-parallel linears' weight gradients:
    their backward collective, half of the backward's (the other half: the row-parallel linears' gather of the
    output gradient under sequence parallelism; none without it), i.e. half the all-reduces without sequence
    parallelism (two in the forward, two in the backward) and half the reduce-scatters with it. The weight-gradient
    GEMMs it runs behind are taken as a quarter of the backward (half of it weight gradients, half of those the
    column-parallel linears'); this is what it takes when the collective is the longer."""
    key = "tp.reduce_scatter" if plan.sequence_parallel else "tp.all_reduce"
    if key not in u["comm"]:  # no tensor parallelism
        return 0.0
    traffic = _group_seconds({key: u["comm"][key] / 2}, {key: u["comm_calls"].get(key, 0) / 2}, "tp", plan, hw)
    window = backward / 4
    return traffic - (overlapped(window, traffic, hw.comm_overlap, hw.comm_contention) - window)


def stage_time(report, index: int, plan: Plan, hw: Hardware, software: Software = COLOZOO,
               cache: dict | None = None) -> StageTime:
    """One micro-batch on pipeline rank `index`; `cache` keeps each unit's terms across ranks of one estimate."""
    st, out, cache = report.stages[index], StageTime(), {} if cache is None else cache
    parts, itemsize = _parts(report, st, index), _itemsize(Workload.from_dict(report.workload))
    policies = iter(_recompute_plan(plan, sum(is_layer for _, is_layer in parts)))
    zero = []  # (forward, backward, gather, reduce-scatter, gathers in backward) of each ZeRO-3 unit
    for u, is_layer in parts:
        policy = next(policies) if is_layer else "none"
        key = (u["name"], policy, is_layer)
        if key not in cache:
            cache[key] = _unit_terms(u, policy, is_layer, plan, hw, software, itemsize)
        fwd, bwd, tp, ep, ring, zero3 = cache[key]
        out.compute += fwd + bwd
        out.backward += bwd
        out.tp, out.ep, out.cp = out.tp + tp, out.ep + ep, out.cp + ring
        if zero3 is not None:
            zero.append((fwd, bwd, *zero3, (u, policy)))
    if zero:
        o, c = hw.comm_overlap, hw.comm_contention
        every_microbatch = software.zero3_reduces_each_microbatch(plan)
        every = _zero3_chain(zero, every_microbatch, o, c, hw, software)
        out.zero = every
        if not every_microbatch:  # reduced once a step, in the last micro-batch's backward
            out.zero_last = _zero3_chain(zero, True, o, c, hw, software) - every
    if plan.pp > 1:
        sends = 2 * plan.virtual_stages - (index == 0) - (index == len(report.stages) - 1)
        boundary = max((u["input_bytes"] for u, is_layer in parts if is_layer), default=0)
        if software.pipeline_scatter_gather and not plan.sequence_parallel:
            boundary /= plan.tp
        out.pp = collective_seconds(hw, "send_recv", sends * boundary, 2, _spans(plan)["pp"], sends)
    return out


def _data_parallel(st: dict, plan: Plan, hw: Hardware, software: Software, backward: float, layers: int,
                   itemsize: int) -> float:
    """Exposed seconds of a step's gradient reduction without ZeRO-3: behind the last backward (reduce_window), all
    but the last layer's (or first virtual stage's) share when it overlaps, all of it when the software reduces
    after the backward."""
    if plan.zero >= 3 or plan.dp * plan.cp == 1:
        return 0.0
    scale = (software.grad_reduce_bytes or itemsize) / itemsize
    gathers = {k: v for k, v in st["comm"].items() if k.endswith("all_gather")}
    reduces = {k: v for k, v in st["comm"].items() if k not in gathers}
    reduce = _group_seconds(reduces, st["comm_calls"], "dp_cp", plan, hw, scale)
    gather = _group_seconds(gathers, st["comm_calls"], "dp_cp", plan, hw)  # ZeRO-1/2: updated weights, their dtype
    if software.grad_reduce_overlap:
        reduce = max(reduce / max(1, layers + 1), (reduce - backward) / plan.virtual_stages,
                     reduce - hw.comm_overlap * reduce_window(backward, plan))
    if software.param_gather_overlap:  # behind the next step's forward, as the backward hides the reduction
        gather = max(gather / max(1, layers + 1), gather - hw.comm_overlap * backward / 2)
    return reduce + gather


def estimate(report, plan: Plan, workload: Workload, hw: Hardware, base=None, software: Software = COLOZOO):
    """(step seconds, breakdown, offload decision or None) of a profile of `plan` on this hardware; `base` is the
    same plan's report without offload, to price what offload moves."""
    m = plan.num_microbatches
    cache, itemsize = {}, _itemsize(Workload.from_dict(report.workload))
    times = [stage_time(report, i, plan, hw, software, cache) for i in range(len(report.stages))]
    slowest = max(range(len(times)), key=lambda i: times[i].total)
    t = times[slowest]
    pipeline = pipeline_seconds([x.total for x in times], m, plan.virtual_stages)
    tails = [x.zero_last + _data_parallel(report.stages[i], plan, hw, software, x.backward,
                                          len(report.stages[i]["layers"]), itemsize)
             for i, x in enumerate(times)]
    dp = max(tails)
    st = report.stages[slowest]
    decision, offload, optimizer_step = None, 0.0, 0.0
    if plan.offload != "none" and base is not None:
        b = base.stages[slowest]
        need = MemoryNeed(weights=b["weights"], grads=b["grads"], master=b["master"], optimizer=b["optimizer"],
                          activations=b["activations"], transient=b["transient"], fsdp_buffers=b["fsdp_buffers"],
                          params=_optimizer_params(b, plan, workload, software), compute_seconds=t.compute * m,
                          num_microbatches=m)
        decision = decide_offload(need, hw, allowed=("none", plan.offload))
        offload = decision.exposed_seconds
    else:  # a fused optimizer reads and writes the weights it updates (its ZeRO shard), their gradients, master
        # weights and states once; the clipping passes over the same shard's gradients (under ZeRO-1 and 2,
        # Megatron-Core's distributed optimizer and DeepSpeed take the norm of the main gradients of their shard)
        updated = _optimizer_params(st, plan, workload, software)
        shard_grads = updated * software.grad_bytes(itemsize)
        fused_pass = updated * itemsize + shard_grads + 2 * (st["master"] + st["optimizer"])
        optimizer_step = (fused_pass * OPTIMIZER_PASSES[software.optimizer_kernels]
                          + shard_grads * software.grad_clip_passes) / hw.memory_bandwidth
    step = pipeline + dp + offload + optimizer_step
    breakdown = {"compute": t.compute * m, "bubble": pipeline - t.total * m, "tp": t.tp * m, "cp": t.cp * m,
                 "pp": t.pp * m, "ep": t.ep * m, "dp": t.zero * m + dp, "offload": offload,
                 "optimizer": optimizer_step}
    return step, breakdown, decision


def _optimizer_params(stage: dict, plan: Plan, workload: Workload, software: Software = COLOZOO) -> int:
    """Parameters this rank's optimizer updates: its ZeRO shard (experts shard over dp*cp/ep ranks only)."""
    per_param = OPTIMIZER_BYTES[workload.optimizer] * software.optimizer_state_bytes / 4
    if per_param:
        return int(stage["optimizer"] / per_param)
    return stage["params"] // max(1, plan.dp * plan.cp if plan.zero >= 1 else 1)
