"""Tracing a model on meta tensors in a fake world of the mesh's tensor/expert sizes: one layer of each kind with
the embedding and the head, every collective the layers issue, every tensor saved for backward; then the trace
attributed to units (embedding, each kind of layer, head) with their parameters (colozoo.cost.attribution)."""
from __future__ import annotations

import contextlib
import warnings
from collections import defaultdict
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import nn

from colozoo.core.mesh import ParallelConfig
from colozoo.core.dtypes import NAMES as DTYPES
from colozoo.cost.attribution import (assign_params, global_params, module_units, rename_layers,
                                      tied_head_bytes, unit_of_steps, units_of)
from colozoo.cost.trace import Trace, trace_step
from colozoo.kernels.attention import priced_as
from colozoo.kernels.priced import pricing_fusions
from colozoo.cost.setup import ProfilerError, get_config, parse_mesh


@contextlib.contextmanager
def fake_world(world_size: int):
    """A process-local "fake" default group: collectives succeed instantly and move no data."""
    if dist.is_available() and dist.is_initialized():
        raise ProfilerError("profile() builds fake process groups and cannot run inside an initialised "
                            "torch.distributed job; profile before init_process_group or in a separate process")
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world_size)
    try:
        yield
    finally:
        dist.destroy_process_group()


def _layer_signature(layer: nn.Module):
    return (type(layer).__name__, tuple((n, tuple(p.shape), p.dtype) for n, p in layer.named_parameters()))


def _layer_container(model: nn.Module):
    """(prefix, container) of the repeated blocks: `model.layers` for colozoo models, else the largest list."""
    if isinstance(getattr(model, "layers", None), (nn.ModuleDict, nn.ModuleList)):
        return "layers", model.layers
    best = (None, None)
    for name, mod in model.named_modules():
        if isinstance(mod, (nn.ModuleList, nn.ModuleDict)) and len(mod) > 1:
            if best[1] is None or len(mod) > len(best[1]):
                best = (name, mod)
    return best


def _kinds(container) -> dict:
    """Layer kind (first key of a signature) -> global layer keys of that kind, in order."""
    groups = defaultdict(list)
    first = {}
    for key, layer in container.items() if isinstance(container, nn.ModuleDict) else enumerate(container):
        sig = _layer_signature(layer)
        first.setdefault(sig, str(key))
        groups[first[sig]].append(str(key))
    return dict(groups)


def _build_parallel_model(config, degrees: ParallelConfig, dtype):
    """Our model of `config` on meta with fake tp/ep groups of the mesh's sizes (pp and cp are modelled), with the
    run that drives its forward."""
    from colozoo.core.mesh import ParallelContext
    from colozoo.models import build_shard
    from colozoo.runtime.run import Run

    trace_config = ParallelConfig(tp=degrees.tp, dp=degrees.ep, ep=degrees.ep,
                                  sequence_parallel=degrees.sequence_parallel)
    context = ParallelContext(trace_config, device=torch.device("cpu"))
    model = build_shard(config, parallel=context, device="meta", dtype=dtype)
    Run(model)
    return model, context


@contextlib.contextmanager
def balanced_routing(model: nn.Module):
    """Meta tensors have no routing counts: trace every MoE layer with its "balanced" routing option (each expert
    gets an equal share of the tokens), then give the layers back their own routing."""
    from colozoo.layers.moe import MoE

    layers = [m for m in model.modules() if isinstance(m, MoE)]
    before = [m.routing for m in layers]
    for m in layers:
        m.routing = "balanced"
    try:
        yield
    finally:
        for m, routing in zip(layers, before):
            m.routing = routing


def _meta_like(p: torch.Tensor, dtype) -> torch.Tensor:
    return torch.empty_like(p, device="meta", dtype=dtype if p.is_floating_point() else p.dtype)


def _meta_copy_run(model: nn.Module, inputs: dict, dtype):
    """Run `model` with meta stand-ins for its parameters and buffers (for models not built on meta): (the run, the
    stand-ins by name)."""
    from torch.func import functional_call

    stand_ins = {name: nn.Parameter(_meta_like(p, dtype), requires_grad=p.requires_grad)
                 for name, p in model.named_parameters()}
    stand_ins.update({name: _meta_like(b, dtype) for name, b in model.named_buffers()})
    return (lambda m: _loss_of(functional_call(m, stand_ins, (), inputs))), stand_ins


@contextlib.contextmanager
def _representatives_only(model: nn.Module, prefix, container, kinds):
    """Temporarily keep one layer of each kind in the model's layer container (the model's own loop then runs
    just those). Yields {traced key: representative key} where a ModuleList renumbers them."""
    if container is None or len(kinds) == len(container):
        yield {}
        return
    reps = sorted(kinds, key=lambda k: int(k) if k.isdigit() else k)
    if isinstance(container, nn.ModuleDict):
        subset, renamed = nn.ModuleDict({k: container[k] for k in reps}), {}
    else:
        subset = nn.ModuleList([container[int(k)] for k in reps])
        renamed = {str(i): k for i, k in enumerate(reps)}
    parent_name, _, attr = prefix.rpartition(".")
    parent = model.get_submodule(parent_name) if parent_name else model
    stages = model.run.stages if getattr(model, "run", None) is not None else []  # a colozoo model's one stage
    setattr(parent, attr, subset)
    for stage in stages:
        stage.layers = subset
    try:
        yield renamed
    finally:
        setattr(parent, attr, container)
        for stage in stages:
            stage.layers = container


def _loss_of(out):
    loss = getattr(out, "loss", None)
    if loss is None and getattr(out, "last_hidden_state", None) is not None:  # encoders without a head (BertModel)
        return out.last_hidden_state.float().sum()
    if loss is None:
        if isinstance(out, torch.Tensor):
            return out.float().sum()
        if isinstance(out, dict) and "loss" in out:
            return out["loss"]
        raise ProfilerError("the model's output has no loss; pass inputs with labels or a model returning a tensor")
    return loss


def default_seq_len(config) -> int:
    return min(getattr(config, "max_position_embeddings", 1024) or 1024, 2048) if config is not None else 1024


@dataclass
class ModelTrace:
    """What tracing one micro-batch teaches about a model at given tp/ep/sp and local sequence length; the
    pipeline, data parallel and training options are applied afterwards by `assemble`."""
    name: str
    units: dict                  # unit key -> UnitCost
    layers: list                 # global layer keys in order
    total_params: int
    tied_bytes: int              # owned by the embedding, used by the head: duplicated on the last pp stage
    batch_size: int
    local_seq: int
    dtype: str

    config: object = None  # the HF config of a colozoo model: pipeline stages are split as the model splits them
    # what assemble derives from this trace alone (unit dicts, core FLOPs, stage splits), kept with it
    memo: dict = field(default_factory=dict, repr=False, compare=False)

    def memoized(self, key, compute):
        if key not in self.memo:
            self.memo[key] = compute()
        return self.memo[key]

    def scaled(self, batch_size: int) -> "ModelTrace":
        """The same model at another micro-batch size, scaled proportionally (the planner traces every size it
        searches, so this serves only sizes it did not trace)."""
        import copy

        f = batch_size / self.batch_size
        units = {}
        for key, u in self.units.items():
            v = copy.deepcopy(u)
            for attr in ("fwd_flops", "bwd_flops", "saved_bytes", "attention_core_bytes", "attention_unviewed_bytes",
                         "input_bytes", "transient_bytes", "fwd_transient_bytes", "bwd_transient_bytes",
                         "fwd_unsaved_bytes", "bwd_released_bytes"):
                setattr(v, attr, int(round(getattr(u, attr) * f)))
            v.comm = {k: n * f for k, n in u.comm.items()}
            v.module_saved = {k: int(round(n * f)) for k, n in u.module_saved.items()}
            v.norm_inputs = {k: int(round(n * f)) for k, n in u.norm_inputs.items()}
            v.ops = {op: {k: (n if k == "calls" else int(round(n * f))) for k, n in st.items()}
                     for op, st in u.ops.items()}
            v.kernels = {key: [count * f, flops * f, nbytes * f] for key, (count, flops, nbytes) in u.kernels.items()}
            units[key] = v
        return ModelTrace(self.name, units, self.layers, self.total_params, self.tied_bytes, batch_size,
                          self.local_seq, self.dtype, config=self.config)


def trace_model(model_or_name, batch_size, seq_len: int, mesh=None, dtype: str = "bfloat16",
                target: str = "cuda", inputs: dict | None = None, fused_head: bool = True, fusions: bool = True):
    """Trace one micro-batch (one layer of each kind) at the mesh's tp, ep, sp and cp (as seq_len / cp).
    `fused_head=False` runs a causal LM's head as the logits projected and then the loss (Software.fused_head).
    `fusions` (Software.triton_fusions): on "cuda" the norms, the in-place rotary and the fused SwiGLU keep what
    colozoo's Triton functions keep (colozoo.kernels.priced); without, what their torch composition keeps.

    `batch_size` may be a list: the model is built once and traced at each size ({size: ModelTrace})."""
    degrees = parse_mesh(mesh)
    config, generic = _resolve(model_or_name)
    torch_dtype = DTYPES[dtype]
    if seq_len % degrees.cp:
        raise ProfilerError(f"seq_len={seq_len} must be divisible by cp={degrees.cp}")
    if generic is not None and (degrees.tp > 1 or degrees.ep > 1 or degrees.pp > 1):
        raise ProfilerError(f"{type(generic).__name__} is not a colozoo model: only dp and cp apply to it "
                            f"(got tp={degrees.tp}, pp={degrees.pp}, ep={degrees.ep})")
    sizes = list(batch_size) if isinstance(batch_size, (list, tuple)) else [batch_size]
    local_seq = seq_len // degrees.cp
    traced = _trace_sizes(config, generic, degrees, torch_dtype, sizes, local_seq, target, inputs, fused_head,
                          fusions and target == "cuda")
    name = model_or_name if isinstance(model_or_name, str) else type(model_or_name).__name__
    out = {size: _model_trace(traced, trace, name, size, local_seq, dtype, degrees,
                              config if generic is None else None) for size, trace in traced.traces.items()}
    return out if isinstance(batch_size, (list, tuple)) else out[batch_size]


@dataclass
class _Traced:
    """The traces of one model at several micro-batch sizes, with what attributing them to units needs."""
    traces: dict                 # micro-batch size -> Trace
    params: dict                 # parameter name -> parameter (meta)
    root: str                    # the model's class name, the prefix of its module names
    prefix: str | None           # the layer container's path in the model
    kinds: dict                  # layer kind (representative key) -> the layer keys of that kind
    renamed: dict                # traced key -> representative key, where the container was renumbered


def _trace_sizes(config, generic, degrees: ParallelConfig, torch_dtype, sizes, local_seq: int, target: str,
                 inputs: dict | None, fused_head: bool = True, fusions: bool = False) -> _Traced:
    """Build the model once on meta in a fake world of the mesh's tp x ep ranks and trace a training step at each
    micro-batch size, one layer of each kind standing in for the others."""
    from colozoo.kernels import use_kernels

    traces = {}
    with use_kernels("torch"), fake_world(max(degrees.tp * degrees.ep, 1)), warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)  # c10d's deprecation notes on every traced collective
        if generic is not None:
            model, group_names = generic, {}
            params = {n: _meta_like(p, torch_dtype).requires_grad_(p.requires_grad and p.is_floating_point())
                      for n, p in model.named_parameters()}
        else:
            model, context = _build_parallel_model(config, degrees, torch_dtype)
            params = dict(model.named_parameters())
            # tp sub-groups ("tp/2": replicated kv heads summing their gradients) are priced as tp traffic
            group_names = {g: name.split("/")[0] for name, g in context.groups.items()
                           if g is not None and name.split("/")[0] in ("tp", "ep")}
        prefix, container = _layer_container(model)
        kinds = _kinds(container) if container is not None else {}
        with _representatives_only(model, prefix, container, kinds) as renamed:
            for size in sizes:
                run, stand_ins = _step_of(model, generic, size, local_seq, torch_dtype, inputs, fused_head)
                for p in params.values():
                    p.grad = None
                with balanced_routing(model), priced_as(target), pricing_fusions(fusions):
                    stages = model.run.stages if getattr(model, "run", None) is not None else ()
                    traces[size] = trace_step(model, run, target=target, group_names=group_names, wrappers=stages,
                                               stand_ins=stand_ins)
    return _Traced(traces, params, type(model).__name__, prefix, kinds, renamed)


def _step_of(model, generic, size: int, local_seq: int, torch_dtype, inputs: dict | None, fused_head: bool = True):
    """The training step traced at one micro-batch size: model -> loss on its inputs (token ids by default). Without
    `fused_head` a causal LM's head projects this rank's vocabulary slice of the logits and takes the loss from them,
    as frameworks without a fused head do. Returns (the step, the meta stand-ins it runs a generic model with, else
    None)."""
    batch = inputs
    if batch is None and hasattr(model, "example_inputs"):  # images, per-example labels (bert, vit)
        batch = model.example_inputs(size, local_seq, device="meta")
    if batch is None:
        ids = torch.zeros(size, local_seq, dtype=torch.long, device="meta")
        batch = {"input_ids": ids, "labels": ids}
    if generic is not None:
        return _meta_copy_run(model, batch, torch_dtype)
    if not fused_head and set(batch) == {"input_ids", "labels"}:
        from colozoo.layers.vocab import LogitsRequest
        from colozoo.runtime.pipeline import pipeline_forward

        return (lambda m: _loss_of(pipeline_forward(m, batch["input_ids"], labels=batch["labels"],
                                                    logits=LogitsRequest("vocab_slice")))), None
    return (lambda m: _loss_of(m(**batch))), None


def _model_trace(traced: _Traced, trace: Trace, name: str, size: int, local_seq: int, dtype: str,
                 degrees: ParallelConfig, config) -> ModelTrace:
    """One size's trace attributed to units (embedding, each kind of layer, head) with their parameters."""
    root, prefix, kinds = traced.root, traced.prefix, traced.kinds
    layer_prefix = f"{root}.{prefix}." if prefix else None
    if traced.renamed:
        rename_layers(trace, layer_prefix, traced.renamed)
    all_layers = [k for keys in kinds.values() for k in keys]
    if all(k.isdigit() for k in all_layers):
        all_layers = sorted(all_layers, key=int)
    step_unit = unit_of_steps(trace, layer_prefix)
    module_unit = module_units(trace, step_unit)
    units = units_of(trace, step_unit, layer_prefix, kinds, local_seq)
    assign_params(units, traced.params, prefix, kinds, module_unit, root)
    tied = tied_head_bytes(trace, traced.params, prefix, module_unit, root)
    return ModelTrace(name, units, all_layers, global_params(traced.params, degrees), tied, size, local_seq, dtype,
                      config=config)


def _resolve(model_or_name):
    """(config, generic module or None)."""
    from colozoo.models.base import ParallelModel

    if isinstance(model_or_name, str):
        return get_config(model_or_name), None
    if isinstance(model_or_name, ParallelModel):
        return model_or_name.config, None
    if isinstance(model_or_name, nn.Module):
        return getattr(model_or_name, "config", None), model_or_name
    if hasattr(model_or_name, "model_type"):
        return model_or_name, None
    raise ProfilerError(f"profile() takes a model name, a transformers config or an nn.Module, got "
                        f"{type(model_or_name).__name__}")


