"""From a model trace to per-rank costs on a mesh: pipeline stages as the model splits them, FLOPs (with
recomputation), model-state and activation memory with the peak of the schedule, communication per collective."""
from __future__ import annotations

from collections import defaultdict
from dataclasses import asdict, dataclass, replace

import torch

from colozoo.cost.context_parallel import kv_bytes_per_token
from colozoo.cost.fsdp_memory import FsdpWalk, fsdp_walk
from colozoo.cost.model_trace import ModelTrace
from colozoo.cost.report import ProfileReport, StageCost, UnitCost
from colozoo.cost.priced import OPTIMIZER_BYTES
from colozoo.cost.setup import ProfilerError, Workload, check_priced
from colozoo.cost.software import COLOZOO, Software
from colozoo.cost.trace import is_core_op
from colozoo.runtime.plan import Plan


def _lora_states(traced, plan, workload, keys, weights, shard, ends=()):
    """(weights, grads, master, optimizer bytes, trainable count) of a stage under LoRA: the frozen base weights as
    before, plus fp32 adapters (no master copy) that, with the modules to save (trained whole in fp32, e.g. a
    classifier; `ends`: "embed" on the first stage, "head" on the last), alone have gradients and optimizer
    states; ZeRO shards them like any parameter."""
    from colozoo.cost.lora import adapter_params_per_layer, saved_params_per_unit

    counts = adapter_params_per_layer(traced.config, plan.tp, workload.lora)
    saved = saved_params_per_unit(traced.config, workload.task, workload.lora)
    n_adapters = sum(counts.get(str(k), 0) for k in keys)
    n = n_adapters + sum(saved.get(str(k), 0) for k in (*keys, *ends))
    adapters = 4.0 * n_adapters

    def sharded(level):
        return shard if plan.zero >= level and shard > 1 else 1

    return (weights + adapters / sharded(3), 4.0 * n / sharded(2), 0.0,
            float(OPTIMIZER_BYTES[workload.optimizer] * n) / sharded(1), n)


@dataclass
class _ModelStates:
    """One rank's model-state bytes on a stage, after ZeRO sharding, LoRA and offload."""
    param_bytes: int             # the stage's parameters as held unsharded (tied copy included)
    trained: float               # bytes of them that train (frozen: no gradient, master or optimizer state)
    weights: float
    grads: float
    master: float
    optimizer: float
    cpu: float = 0.0             # what offload keeps in host memory
    lora_params: int = 0         # trainable adapter (and saved-module) parameters under LoRA


def assemble(traced: ModelTrace, plan: Plan, workload: Workload, software=None) -> ProfileReport:
    """Per-rank memory, FLOPs and communication of a training step run by `plan`, from a traced micro-batch;
    `software` (colozoo.cost.software.Software): what its framework saves differently from colozoo's layers."""
    check_priced(plan)
    workload.check()
    if traced.batch_size != plan.micro_batch_size:
        traced = traced.scaled(plan.micro_batch_size)
    traced = _as_saved_by(traced, plan, software)
    n_layers = len(traced.layers)
    if plan.pp > n_layers:
        raise ProfilerError(f"pp={plan.pp} exceeds the {n_layers} layers of the model")
    stages = traced.memoized(("stages", plan.pp, plan.virtual_stages, plan.layers_per_stage),
                         lambda: _rank_layers(traced, plan, n_layers))
    stage_costs = [_stage_cost(traced, plan, workload, s, [traced.layers[i] for i in idx], len(stages), software)
                   for s, idx in enumerate(stages)]
    busiest = max(stage_costs, key=lambda c: c.fwd_flops + c.bwd_flops)
    mesh = {k: getattr(plan, k) for k in ("tp", "pp", "dp", "cp", "ep")}
    mesh["sp"] = plan.sequence_parallel
    return ProfileReport(
        model=traced.name, mesh=mesh, plan=plan.choices().to_dict(), workload=workload.to_dict(), num_layers=n_layers,
        total_params=traced.total_params,
        units=traced.memoized(("unit dicts", plan.tp, _itemsize(workload)),
                              lambda: _unit_dicts(traced, plan.tp, _itemsize(workload))),
        stages=[asdict(s) for s in stage_costs], comm=busiest.comm, comm_calls=busiest.comm_calls,
        peak_memory=max(s.peak for s in stage_costs),
        step_flops=(busiest.fwd_flops + busiest.bwd_flops) * plan.num_microbatches, profile_seconds=0.0)


def _as_saved_by(traced: ModelTrace, plan: Plan, software) -> ModelTrace:
    """The trace with each layer's saved bytes as `software` keeps them (colozoo.cost.saved_layout)."""
    from colozoo.cost import saved_layout as layout

    sp = plan.sequence_parallel and plan.tp > 1
    modules = tuple(getattr(software, "recompute_modules", ()))
    folded = bool(getattr(software, "expert_tp_folded", False))
    sharded = sp and (folded or getattr(software, "expert_dispatch_sharded", False))  # MoE kept on the sequence shard
    hidden = getattr(traced.config, "hidden_size", 0) if sharded else 0
    norm, swiglu = bool(getattr(software, "fused_norm", False)), bool(getattr(software, "fused_swiglu", False))
    fused = norm or swiglu  # fused kernels that save less than colozoo's
    shard = sp and getattr(software, "sequence_parallel_saves_shard", False)
    copies = bool(getattr(software, "attention_copies_views", False))
    if not (modules or hidden or fused or shard or copies):
        return traced

    def dropped(u):
        return (layout.dropped_bytes(u.module_saved, modules, hidden, plan.tp, experts_whole=folded)
                + (layout.fused_norm_bytes(u.module_saved, u.norm_inputs) if norm else 0)
                + (layout.sequence_shard_bytes(u.module_saved, plan.tp) if shard else 0)
                + (layout.fused_swiglu_bytes(u.module_saved) if swiglu else 0)
                + (u.attention_unviewed_bytes if copies else 0))

    def build():
        # what the software does not save may be what the unit had not saved yet, or had released, at its worst
        # op: taken off the peak once, not twice
        units = {k: replace(u, saved_bytes=int(u.saved_bytes - dropped(u)),
                            fwd_unsaved_bytes=int(max(0, u.fwd_unsaved_bytes - dropped(u))),
                            bwd_released_bytes=int(max(0, u.bwd_released_bytes - dropped(u))))
                 for k, u in traced.units.items()}
        return replace(traced, units=units, memo={})

    return traced.memoized(("saved by", modules, hidden, folded, norm, swiglu, shard, copies, plan.tp), build)


def _unit_dicts(traced: ModelTrace, tp: int, itemsize: int) -> list[dict]:
    """The traced units as dicts, with the bytes of a micro-batch's keys and values (what ring attention passes)."""
    per_token = kv_bytes_per_token(traced.config, tp, itemsize) or 0.0
    return [{**asdict(u), "kv_bytes": per_token * traced.batch_size * traced.local_seq} for u in traced.units.values()]


def _stage_cost(traced: ModelTrace, plan: Plan, workload: Workload, s: int, keys: list, n_stages: int,
                software=None) -> StageCost:
    """Memory, FLOPs and communication of one rank of pipeline stage `s`, which runs layers `keys`."""
    layers, ends = _stage_parts(traced, keys, s, n_stages)
    parts = layers + ends
    software = software or COLOZOO
    states = _model_states(traced, plan, workload, keys, parts, s, n_stages, software)
    recompute = _recompute_plan(plan, len(keys))
    saved, fwd, bwd, transient = _compute(traced, plan, parts, recompute)
    inflight = in_flight(plan, s)
    head = [traced.units["head"]] if s == n_stages - 1 and "head" in traced.units else []
    before = [p for p in ends if not any(p is h for h in head)]  # the embedding, on the first stage
    in_order = before + layers + head
    policies = ["none"] * len(before) + recompute + ["none"] * len(head)
    buckets = (software.torch_ddp_buckets and not software.grads_in_reduce_dtype and plan.zero == 0
               and plan.dp * plan.cp > 1)
    held_grads = states.grads * (2 if buckets and plan.num_microbatches > 1 else 1)  # no_sync's beside the buckets
    throughout, walk = fsdp_walk(plan, software, in_order, layers, _itemsize(workload))
    dynamic = _dynamic_peak(in_order, policies, saved, inflight, held_grads, plan.num_microbatches,
                            software.grads_in_reduce_dtype or buckets, software.wgrad_accumulation_fused, walk)
    peak = states.weights + states.master + states.optimizer + throughout + dynamic
    fsdp = throughout + (walk.most_gathered() if walk else 0.0)  # reported: the most at once
    grad_bytes = 4.0 * states.lora_params if workload.lora else states.trained
    cost = StageCost(s, [int(k) if k.isdigit() else k for k in keys], int(states.param_bytes // _itemsize(workload)),
                     states.weights, states.grads, states.master, states.optimizer, fsdp, saved * inflight, transient,
                     peak, states.cpu, inflight, int(fwd), int(bwd),
                     *_stage_comm(parts, keys, plan, states.param_bytes, s, n_stages, grad_bytes,
                                  software.grad_reduce_calls(grad_bytes, _itemsize(workload), plan.dp)))
    if workload.lora or states.trained < states.param_bytes:
        cost.trainable = states.lora_params if workload.lora else int(states.trained // _itemsize(workload))
    return cost


def _itemsize(workload: Workload) -> int:
    return workload.torch_dtype.itemsize


def _stage_parts(traced: ModelTrace, keys: list, s: int, n_stages: int) -> tuple[list, list]:
    """(the stage's layer units in order, the embedding on the first stage and the head on the last)."""
    layer_unit = traced.memoized("layer units", lambda: {k: u for u in traced.units.values() for k in u.layers})
    ends = []
    if s == 0:
        ends.append(traced.units.get("embed") or traced.units.get("model"))
    if s == n_stages - 1 and "head" in traced.units:
        ends.append(traced.units["head"])
    return [layer_unit[k] for k in keys], [p for p in ends if p is not None]


def _model_states(traced: ModelTrace, plan: Plan, workload: Workload, keys, parts, s: int,
                  n_stages: int, software: Software) -> _ModelStates:
    """Weights, gradients, master weights and optimizer states one rank of stage `s` keeps, each element as wide as
    the software keeps it (Software.grad_bytes, master_weight_bytes, optimizer_state_bytes)."""
    itemsize = _itemsize(workload)
    tied = traced.tied_bytes if plan.pp > 1 and s == n_stages - 1 else 0
    param_bytes = sum(p.param_bytes for p in parts) + tied
    trained = param_bytes - sum(p.frozen_param_bytes for p in parts)
    elements, state_bytes = trained // itemsize, software.optimizer_state_bytes
    master_bytes = state_bytes if software.master_weight_bytes is None else software.master_weight_bytes
    master = float(master_bytes * elements) if workload.torch_dtype != torch.float32 else 0.0
    states = _ModelStates(param_bytes, trained, float(param_bytes), float(software.grad_bytes(itemsize) * elements),
                          master, OPTIMIZER_BYTES[workload.optimizer] * state_bytes / 4 * elements)
    shard = plan.dp * plan.cp  # FSDP / ZeRO shard over the data and context ranks
    # experts are already split over ep: ZeRO/FSDP shards them only over the dp*cp/ep ranks holding the same
    # experts (the "edp" group), everything else (frozen parameters too) over all dp*cp
    expert = sum(p.expert_param_bytes for p in parts)
    edp = max(1, shard // plan.ep)

    def kept(nbytes):  # the share of nbytes (all experts among them) a rank keeps when ZeRO shards them
        return ((nbytes - expert) / shard + expert / edp) / nbytes if nbytes else 1.0

    if plan.zero >= 1:
        states.master, states.optimizer = states.master * kept(trained), states.optimizer * kept(trained)
    if plan.zero >= 2:
        states.grads *= kept(trained)
    if plan.zero >= 3:
        states.weights *= kept(param_bytes)
    if workload.lora:  # the base is frozen: gradients, master weights and optimizer states for adapters only
        ends = ("embed",) * (s == 0) + ("head",) * (s == n_stages - 1)
        (states.weights, states.grads, states.master, states.optimizer,
         states.lora_params) = _lora_states(traced, plan, workload, keys, states.weights, shard, ends)
    if plan.offload in ("optimizer", "params"):
        states.cpu += states.master + states.optimizer
        states.master = states.optimizer = 0.0
    if plan.offload == "params":
        states.cpu += states.weights + states.grads
        states.weights = states.grads = 0.0
    return states


def _compute(traced: ModelTrace, plan: Plan, parts: list, recompute: list) -> tuple[float, int, int, float]:
    """(activations saved per micro-batch, forward FLOPs, backward FLOPs with recomputation, worst temporaries) of
    a stage's units; `recompute` holds the policy of each of its layers, which come first in `parts`."""
    saved, fwd, bwd, transient = 0.0, 0, 0, 0.0
    for j, p in enumerate(parts):
        policy = recompute[j] if j < len(recompute) else "none"
        saved += _saved_under(p, policy)
        # ring attention: this rank's queries meet the keys of all cp chunks, cp x the local core's FLOPs
        ring_fwd, ring_bwd = ((plan.cp - 1) * f for f in traced.memoized(("core", p.name), lambda p=p: _core_flops(p)))
        fwd += p.fwd_flops + ring_fwd
        bwd += p.bwd_flops + ring_bwd + _recompute_flops(p, policy, traced) + (ring_fwd if policy != "none" else 0)
        extra = p.saved_bytes if policy == "full" else 0  # a recomputed layer is rebuilt whole in backward
        transient = max(transient, p.transient_bytes + extra)
    return saved, fwd, bwd, transient


def _rank_layers(traced: ModelTrace, plan: Plan, n_layers: int) -> list[list[int]]:
    """Layer indices of each pipeline rank (all its virtual stages): the split the model itself uses (balanced by
    parameters), or the plan's layers_per_stage."""
    from colozoo.core.partition import virtual_stage_layers
    from colozoo.models.partition import model_stage_layers

    if not n_layers:
        return [[]]
    if traced.config is not None and plan.layers_per_stage is None:
        runs = model_stage_layers(traced.config, plan.pp, plan.virtual_stages)
    else:
        runs = virtual_stage_layers(n_layers, plan.pp, plan.virtual_stages, layers_per_stage=plan.layers_per_stage)
    return [[i for run in rank_runs for i in run] for rank_runs in runs]


def in_flight(plan: Plan, stage: int) -> float:
    """Micro-batches whose activations pipeline rank `stage` holds at its fullest, in units of all its layers: all
    of them under GPipe, p - stage under 1F1B, and under the interleaved 1F1B (Megatron's, Narayanan et al. 2021)
    2(p - stage - 1) + (v - 1)p + 1 chunks of 1/v of the rank's layers each (p(1 + (p - 1)/(pv)) on the first)."""
    p, v, m = plan.pp, plan.virtual_stages, plan.num_microbatches
    if plan.schedule == "gpipe":
        return m
    if v == 1:
        return min(p - stage, m)
    return min(m, (2 * (p - stage - 1) + (v - 1) * p + 1) / v)


def _dynamic_peak(parts, policies, saved, inflight, grads, m, grad_buffer=False, wgrad_fused=False,
                  fsdp: FsdpWalk | None = None) -> float:
    """Worst activations + temporaries + gradients over one micro-batch's forward and backward, walking the
    stage's units in order. Other micro-batches in flight keep their saved activations throughout. A unit holds at
    its worst op only what it has saved so far (forward) or not yet released (backward) beside the temporaries, as
    traced (UnitCost.fwd_unsaved_bytes, bwd_released_bytes); a recomputed layer's forward saves nothing.
    With one micro-batch and no buffer allocated once (`grad_buffer`), the gradients stay as the backward makes them
    (UnitCost.bwd_kept_grad_bytes); else they exist from the first backward on, and a unit's backward computes each
    into a tensor of its own (of the parameters' dtype where a buffer takes them) until it is added
    (UnitCost.bwd_fresh_grad_bytes), unless its GEMMs accumulate them straight into the buffer (`wgrad_fused`).
    Under FSDP (colozoo.cost.fsdp_memory) `grads` are the shards, and the walk holds the gathered weights, each
    unit's unsharded gradients and the reduce-scatter's input beside them."""
    others = (inflight - 1) * saved
    traced_grads = sum(p.grad_bytes for p in parts)
    grad_per_byte = grads / traced_grads if traced_grads else 0.0  # as the stage keeps them (dtype, ZeRO shard)
    fresh_per_byte = 0.0 if wgrad_fused else 1.0 if grad_buffer else grad_per_byte
    growing = m == 1 and not grad_buffer
    deferred = bool(fsdp and fsdp.deferred)  # FSDP's gradients accumulate whole, reduce-scattered in the last backward
    accumulated = 0.0 if growing or deferred else grads
    unsharded = traced_grads * fsdp.reduce_ratio if deferred else 0.0

    def weights(j, phase):
        return fsdp.weights(j, phase) if fsdp else 0.0

    live, worst = 0.0, 0.0
    for j, (p, policy) in enumerate(zip(parts, policies)):
        kept = _saved_under(p, policy)
        unsaved = p.fwd_unsaved_bytes if policy == "none" else 0  # what it has not saved yet when its temporaries peak
        worst = max(worst, others + live + kept + p.fwd_transient_bytes - unsaved + accumulated + unsharded
                    + weights(j, "forward"))
        live += kept
        worst = max(worst, others + live + accumulated + unsharded + weights(j, "next"))
    reducing = 0.0  # FSDP: the previous unit's reduce-scatter input
    for j in reversed(range(len(parts))):
        p, policy = parts[j], policies[j]
        worst = max(worst, others + live + accumulated + unsharded + reducing + weights(j, "arrive"))
        rebuilt = p.saved_bytes - _saved_under(p, policy)  # what recomputation brings back for this backward
        held = rebuilt + p.bwd_transient_bytes - p.bwd_released_bytes  # its nodes free what they saved as they run
        if fsdp:  # its gradients made whole, or each added to those accumulated unsharded
            made = (p.bwd_fresh_grad_bytes if deferred else p.bwd_kept_grad_bytes) + reducing
        else:
            made = p.bwd_kept_grad_bytes * grad_per_byte if growing else p.bwd_fresh_grad_bytes * fresh_per_byte
        worst = max(worst, others + live + held + accumulated + unsharded + made + weights(j, "backward"))
        live -= max(0.0, _saved_under(p, policy) - p.bwd_outlived_bytes)
        if fsdp:
            reducing = p.grad_bytes * fsdp.reduce_ratio
            unsharded = max(0.0, unsharded - reducing)
        if growing or deferred:
            accumulated += p.grad_bytes * grad_per_byte
    return worst


def _recompute_plan(plan: Plan, n: int) -> list[str]:
    if plan.checkpointing != "full":
        return [plan.checkpointing] * n
    k = n if plan.checkpoint_layers is None else min(plan.checkpoint_layers, n)
    return ["full"] * k + ["none"] * (n - k)


def _saved_under(u: UnitCost, policy: str) -> float:
    if policy == "full":
        return float(u.input_bytes)
    if policy == "selective":
        return float(u.saved_bytes - u.attention_core_bytes)
    return float(u.saved_bytes)


def _core_flops(u: UnitCost) -> tuple[int, int]:
    return (sum(s["fwd_flops"] for op, s in u.ops.items() if is_core_op(op)),
            sum(s["bwd_flops"] for op, s in u.ops.items() if is_core_op(op)))


def _recompute_flops(u: UnitCost, policy: str, traced: ModelTrace) -> int:
    if policy == "full":
        return u.fwd_flops
    if policy == "selective":  # the attention core's own forward, i.e. the ops that made the (s, s) tensors
        return traced.memoized(("core", u.name), lambda: _core_flops(u))[0]
    return 0


def _stage_comm(parts, keys, plan: Plan, param_bytes, s, n_stages, grad_bytes, buckets: int) -> tuple[dict, dict]:
    """Bytes each rank of stage `s` moves per step, and how many collective calls carry them, by group and
    collective (the calls are what latency costs: many small collectives are slow on any network)."""
    m = plan.num_microbatches
    out, calls = defaultdict(float), defaultdict(float)

    def add(key, nbytes, n):
        out[key] += nbytes
        calls[key] += n

    for p in parts:
        for key, nbytes in p.comm.items():
            add(key, nbytes * m, p.comm_calls.get(key, 0) * m)
    recompute = _recompute_plan(plan, len(keys))
    for j, k in enumerate(keys):  # a recomputed layer repeats its forward collectives
        if recompute[j] == "full":
            for key, nbytes in parts[j].comm.items():
                add(key, nbytes * m / 2, parts[j].comm_calls.get(key, 0) * m / 2)
    boundary = max((p.input_bytes for p in parts[:len(keys)]), default=0)
    if plan.pp > 1:  # activations forward and gradients backward over each boundary of each virtual stage
        sends = 2 * plan.virtual_stages - (s == n_stages - 1) - (s == 0)
        add("pp.send_recv", 2 * sends * boundary * m / 2, sends * m)
    if plan.cp > 1:  # ring attention: K and V of every other cp rank pass by, forward and twice in backward
        add("cp.send_recv", 3 * 2 * boundary * (plan.cp - 1) * len(keys) * m, 3 * (plan.cp - 1) * len(keys) * m)
    shard = plan.dp * plan.cp
    if shard > 1:
        units = len(keys) + 1  # FSDP wraps every layer and the stage (embeddings, head) around them
        if plan.zero >= 3:  # gathered for forward and (resharded) again for backward; reduced after the last one
            gathers = 2 if plan.reshard_after_forward else 1
            add("dp_cp.all_gather", gathers * param_bytes * m, (gathers * units - 1) * m)
            add("dp_cp.reduce_scatter", grad_bytes, units)
        elif plan.zero >= 1:
            add("dp_cp.reduce_scatter", grad_bytes, buckets)
            add("dp_cp.all_gather", grad_bytes, buckets)
        else:
            add("dp_cp.all_reduce", grad_bytes, buckets)
    return dict(out), dict(calls)
