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

import argparse
import contextlib
import json
import math
import time
import warnings
from collections import defaultdict
from dataclasses import asdict, dataclass, field

import torch
import torch.distributed as dist
from torch import nn

from colozoo.core.mesh import ParallelConfig
from colozoo.core.dtypes import NAMES as DTYPES
from colozoo.core.dtypes import human_bytes as human
from colozoo.cost.trace import TARGETS, Trace, trace_step
from colozoo.runtime.options import CHECKPOINTING, OFFLOAD

SCHEDULES = ("1f1b", "gpipe")  # what the cost model prices (of colozoo.runtime.options.SCHEDULES)
OPTIMIZER_BYTES = {"adamw": 8, "adam": 8, "sgd": 4, "none": 0}  # fp32 state bytes per parameter
DDP_BUCKET_BYTES = 25 * 2 ** 20  # DistributedDataParallel's default bucket_cap_mb


class ProfilerError(ValueError):
    pass


# Configs for names the registry does not carry (yet): real hyperparameters of the published models.
FALLBACK_CONFIGS = {
    "llama-2-70b": ("llama", dict(hidden_size=8192, intermediate_size=28672, num_hidden_layers=80,
                                  num_attention_heads=64, num_key_value_heads=8, vocab_size=32000,
                                  max_position_embeddings=4096, rms_norm_eps=1e-5, tie_word_embeddings=False)),
    "llama-3-70b": ("llama", dict(hidden_size=8192, intermediate_size=28672, num_hidden_layers=80,
                                  num_attention_heads=64, num_key_value_heads=8, vocab_size=128256,
                                  max_position_embeddings=8192, rope_theta=500000.0, tie_word_embeddings=False)),
    "llama-2-7b": ("llama", dict(hidden_size=4096, intermediate_size=11008, num_hidden_layers=32,
                                 num_attention_heads=32, num_key_value_heads=32, vocab_size=32000,
                                 max_position_embeddings=4096, tie_word_embeddings=False)),
}


def get_config(name: str):
    """A transformers config by registered name (colozoo.registry), falling back to FALLBACK_CONFIGS."""
    import transformers

    if name in FALLBACK_CONFIGS:
        model_type, kwargs = FALLBACK_CONFIGS[name]
        return transformers.AutoConfig.for_model(model_type, **kwargs)
    from colozoo import registry

    return registry.get_config(name)


def parse_mesh(mesh) -> ParallelConfig:
    """A ParallelConfig from a ParallelConfig, a dict, or 'tp=2,pp=2,dp=4,cp=1,ep=1,sp'."""
    if mesh is None:
        return ParallelConfig()
    if isinstance(mesh, ParallelConfig):
        return mesh
    if isinstance(mesh, dict):
        return ParallelConfig(**mesh)
    if isinstance(mesh, str):
        degrees = {}
        for part in filter(None, (p.strip() for p in mesh.split(","))):
            if part in ("sp", "sequence_parallel"):
                degrees["sequence_parallel"] = True
                continue
            key, sep, value = part.partition("=")
            if not sep or key not in ("tp", "pp", "dp", "cp", "ep") or not value.isdigit():
                raise ProfilerError(f"bad mesh entry {part!r} in {mesh!r}; write e.g. 'tp=2,pp=2,dp=4,sp'")
            degrees[key] = int(value)
        return ParallelConfig(**degrees)
    raise ProfilerError(f"mesh must be a ParallelConfig, a dict or a string like 'tp=2,pp=2', got {mesh!r}")


@dataclass
class Setup:
    """How the step is run: everything besides the mesh that changes its cost."""
    batch_size: int = 1                 # micro-batch size per data-parallel rank
    seq_len: int = 1024
    dtype: str = "bfloat16"              # parameter and activation dtype; 16-bit keeps fp32 master weights
    checkpointing: str = "none"          # none | selective (attention core) | full (whole layer)
    checkpoint_layers: int | None = None  # with full: how many layers of each stage recompute (None = all)
    optimizer: str = "adamw"
    zero: int = 0                        # 0 = DDP, 1 = optimizer states, 2 = + gradients, 3 = FSDP (+ weights)
    num_microbatches: int = 1
    schedule: str = "1f1b"
    offload: str = "none"                # none | optimizer (states + master on CPU) | params (FSDP2 CPU offload)
    target: str = "cuda"                 # whose attention kernels: cuda (flash), cpu or eager (unfused GPU)

    def check(self):
        if self.dtype not in DTYPES:
            raise ProfilerError(f"dtype {self.dtype!r} not one of {sorted(DTYPES)}")
        if self.checkpointing not in CHECKPOINTING:
            raise ProfilerError(f"checkpointing {self.checkpointing!r} not one of {CHECKPOINTING}")
        if self.optimizer not in OPTIMIZER_BYTES:
            raise ProfilerError(f"optimizer {self.optimizer!r} not one of {sorted(OPTIMIZER_BYTES)}")
        if self.zero not in (0, 1, 2, 3):
            raise ProfilerError(f"zero must be 0, 1, 2 or 3, got {self.zero!r}")
        if self.schedule not in SCHEDULES:
            raise ProfilerError(f"schedule {self.schedule!r} not one of {SCHEDULES}")
        if self.offload not in OFFLOAD:
            raise ProfilerError(f"offload {self.offload!r} not one of {OFFLOAD}")
        if self.target not in TARGETS:
            raise ProfilerError(f"target {self.target!r} not one of {TARGETS}")
        if self.batch_size < 1 or self.seq_len < 1 or self.num_microbatches < 1:
            raise ProfilerError("batch_size, seq_len and num_microbatches must be >= 1")

    @property
    def torch_dtype(self) -> torch.dtype:
        return DTYPES[self.dtype]


@dataclass
class UnitCost:
    """One traced piece of the model per micro-batch: a layer kind, or everything before / after the layers."""
    name: str
    count: int = 1
    layers: list = field(default_factory=list)
    param_bytes: int = 0
    expert_param_bytes: int = 0          # of param_bytes, the experts split over ep (sharded over dp*cp/ep)
    fwd_flops: int = 0
    bwd_flops: int = 0
    saved_bytes: int = 0
    attention_core_bytes: int = 0        # saved tensors of (..., s, s) shape: what selective recompute drops
    input_bytes: int = 0                 # what full recompute keeps
    transient_bytes: int = 0             # temporaries alive at the worst op (forward or backward)
    fwd_transient_bytes: int = 0
    bwd_transient_bytes: int = 0
    comm: dict = field(default_factory=dict)  # "group.collective" -> bytes per micro-batch (fwd + bwd)
    comm_calls: dict = field(default_factory=dict)  # "group.collective" -> calls per micro-batch (fwd + bwd)
    ops: dict = field(default_factory=dict)   # op -> {"calls", "fwd_flops", "bwd_flops", "saved_bytes"}


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


@dataclass
class ProfileReport:
    model: str
    mesh: dict
    setup: dict
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
        units = Table(title=f"{self.model}: per micro-batch of {self.setup['batch_size']} x {self.setup['seq_len']} "
                            f"({mesh}, {self.setup['dtype']}, checkpointing={self.setup['checkpointing']})")
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
        stages = Table(title="memory per rank, training step")
        for col in ("stage", "layers", "weights", "grads", "master", "optim", "fsdp buf", "activations", "transient",
                    "peak", "CPU"):
            stages.add_column(col, justify="right")
        for s in self.stages:
            ids = s["layers"]
            span = f"{ids[0]}-{ids[-1]}" if ids else "-"
            stages.add_row(str(s["stage"]), span, *(human(s[k]) for k in ("weights", "grads", "master", "optimizer",
                           "fsdp_buffers", "activations", "transient", "peak", "cpu_bytes")))
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


def _balanced_split(n: int, parts: int) -> list[int]:
    return [n // parts + (i < n % parts) for i in range(parts)]


@contextlib.contextmanager
def _balanced_routing():
    """MoE layers route by data (expert counts, then all-to-all splits), which meta tensors do not have:
    trace them with every expert receiving an equal share of the tokens (what the load-balancing loss aims
    for). The two all-to-alls of expert parallelism and the expert matmuls keep their real sizes."""
    from colozoo.layers import moe
    from colozoo.layers.comm import group_size

    def run_experts(self, rows, counts):
        ep, local = group_size(self.ep_group), self.experts.num_local
        if ep == 1:
            return self.experts(rows, _balanced_split(rows.shape[0], local))
        splits = _balanced_split(rows.shape[0], ep)  # rows to each rank; as many arrive from each
        received = moe.all_to_all_rows(rows, splits, splits, self.ep_group)
        out = self.experts(received, _balanced_split(received.shape[0], local))
        return moe.all_to_all_rows(out, splits, splits, self.ep_group)

    original = moe.MoE._run_experts
    moe.MoE._run_experts = run_experts
    try:
        yield
    finally:
        moe.MoE._run_experts = original


def _build_parallel_model(config, pc: ParallelConfig, dtype):
    """Our model of `config` on meta with fake tp/ep groups of the mesh's sizes (pp and cp are modelled)."""
    from colozoo.models import build_model
    from colozoo.core.mesh import ParallelContext

    trace_config = ParallelConfig(tp=pc.tp, dp=pc.ep, ep=pc.ep, sequence_parallel=pc.sequence_parallel)
    context = ParallelContext(trace_config, device=torch.device("cpu"))
    return build_model(config, pc=context, device="meta", dtype=dtype), context


def _meta_like(p: torch.Tensor, dtype) -> torch.Tensor:
    return torch.empty_like(p, device="meta", dtype=dtype if p.is_floating_point() else p.dtype)


def _meta_copy_run(model: nn.Module, inputs: dict, dtype):
    """Run `model` with meta stand-ins for its parameters and buffers (for models not built on meta)."""
    from torch.func import functional_call

    stand_ins = {name: nn.Parameter(_meta_like(p, dtype), requires_grad=p.requires_grad)
                 for name, p in model.named_parameters()}
    stand_ins.update({name: _meta_like(b, dtype) for name, b in model.named_buffers()})
    return lambda m: _loss_of(functional_call(m, stand_ins, (), inputs))


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
    setattr(parent, attr, subset)
    try:
        yield renamed
    finally:
        setattr(parent, attr, container)


def _rename_layers(trace: Trace, layer_prefix: str, renamed: dict):
    """Module names of a renumbered ModuleList back to the representative layer keys."""
    def fix(name):
        if name.startswith(layer_prefix):
            key, _, rest = name[len(layer_prefix):].partition(".")
            name = layer_prefix + renamed.get(key, key) + ("." + rest if rest else "")
        return name

    trace.steps = [(fix(m), *rest) for m, *rest in trace.steps]
    for saved in trace.saved.values():
        saved.module = fix(saved.module)
    for c in trace.collectives:
        c.module = fix(c.module)
    trace.params_saved_by = {k: {fix(m) for m in v} for k, v in trace.params_saved_by.items()}
    trace.module_inputs = {fix(k): v for k, v in trace.module_inputs.items()}


def _loss_of(out):
    loss = getattr(out, "loss", None)
    if loss is None and getattr(out, "hidden_states", None) is not None:  # encoders without a head (BertModel)
        return out.hidden_states.float().sum()
    if loss is None:
        if isinstance(out, torch.Tensor):
            return out.float().sum()
        if isinstance(out, dict) and "loss" in out:
            return out["loss"]
        raise ProfilerError("the model's output has no loss; pass inputs with labels or a model returning a tensor")
    return loss


def profile(model_or_name, batch_size: int = 1, seq_len: int | None = None, mesh=None, dtype: str = "bfloat16",
            checkpointing: str = "none", *, checkpoint_layers: int | None = None, optimizer: str = "adamw",
            zero: int = 0, num_microbatches: int = 1, schedule: str = "1f1b", offload: str = "none",
            target: str = "cuda", inputs: dict | None = None) -> ProfileReport:
    """Profile one training step per rank on meta tensors.

    model_or_name: a registered name, a transformers config, a colozoo model (rebuilt from its config on
    the mesh) or any nn.Module (traced whole as given; mesh then only shards data-parallel model states).
    `inputs` overrides the default batch (input_ids and labels of batch_size x seq_len).
    """
    start = time.perf_counter()
    pc = parse_mesh(mesh)
    setup = Setup(batch_size=batch_size, seq_len=seq_len or 0, dtype=dtype, checkpointing=checkpointing,
                  checkpoint_layers=checkpoint_layers, optimizer=optimizer, zero=zero,
                  num_microbatches=num_microbatches, schedule=schedule, offload=offload, target=target)
    config, _ = _resolve(model_or_name)
    if setup.seq_len == 0:
        setup.seq_len = default_seq_len(config)
    setup.check()
    mt = trace_model(config if isinstance(model_or_name, str) else model_or_name, setup.batch_size, setup.seq_len,
                     pc, setup.dtype, setup.target, inputs)
    if isinstance(model_or_name, str):
        mt.name = model_or_name
    report = assemble(mt, pc, setup)
    report.profile_seconds = time.perf_counter() - start
    return report


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

    next_batch: "ModelTrace | None" = None  # the same model traced at batch_size + 1, for `scaled`
    config: object = None  # the HF config of a colozoo model: pipeline stages are split as the model splits them

    def scaled(self, batch_size: int) -> "ModelTrace":
        """The same model at another micro-batch size. Activations, FLOPs and collectives are affine in the
        batch (weight-gradient temporaries and replicated-weight reductions are not proportional to it), so
        two traces at consecutive sizes give every other size exactly; with one trace, scale proportionally."""
        import copy

        nxt = self.next_batch
        f = batch_size - self.batch_size if nxt is not None else batch_size / self.batch_size

        def at(a, b):  # a at self.batch_size, b at batch_size + 1
            return a + (b - a) * f if nxt is not None else a * f

        units = {}
        for key, u in self.units.items():
            w = nxt.units[key] if nxt is not None else u
            v = copy.deepcopy(u)
            for attr in ("fwd_flops", "bwd_flops", "saved_bytes", "attention_core_bytes", "input_bytes",
                         "transient_bytes", "fwd_transient_bytes", "bwd_transient_bytes"):
                setattr(v, attr, int(round(at(getattr(u, attr), getattr(w, attr)))))
            v.comm = {k: at(n, w.comm.get(k, n)) for k, n in u.comm.items()}
            v.ops = {op: {k: (n if k == "calls" else int(round(at(n, w.ops.get(op, st)[k]))))
                          for k, n in st.items()} for op, st in u.ops.items()}
            units[key] = v
        return ModelTrace(self.name, units, self.layers, self.total_params, self.tied_bytes, batch_size,
                          self.local_seq, self.dtype, config=self.config)


def trace_model(model_or_name, batch_size, seq_len: int, mesh=None, dtype: str = "bfloat16",
                target: str = "cuda", inputs: dict | None = None):
    """Trace one micro-batch (one layer of each kind) at the mesh's tp, ep, sp and cp (as seq_len / cp).

    `batch_size` may be a list: the model is built once and traced at each size ({size: ModelTrace})."""
    pc = parse_mesh(mesh)
    config, generic = _resolve(model_or_name)
    torch_dtype = DTYPES[dtype]
    if seq_len % pc.cp:
        raise ProfilerError(f"seq_len={seq_len} must be divisible by cp={pc.cp}")
    local_seq = seq_len // pc.cp
    if generic is not None and (pc.tp > 1 or pc.ep > 1 or pc.pp > 1):
        raise ProfilerError(f"{type(generic).__name__} is not a colozoo model: only dp and cp apply to it "
                            f"(got tp={pc.tp}, pp={pc.pp}, ep={pc.ep})")
    sizes = list(batch_size) if isinstance(batch_size, (list, tuple)) else [batch_size]
    from colozoo.kernels.dispatch import use_kernels

    traces = {}
    with use_kernels("torch"), fake_world(max(pc.tp * pc.ep, 1)), _balanced_routing(), warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)  # c10d's deprecation notes on every traced collective
        if generic is not None:
            model, group_names = generic, {}
            params = {n: _meta_like(p, torch_dtype) for n, p in model.named_parameters()}
        else:
            model, context = _build_parallel_model(config, pc, torch_dtype)
            params = dict(model.named_parameters())
            group_names = {g: name for name, g in context.groups.items() if g is not None and name in ("tp", "ep")}
        prefix, container = _layer_container(model)
        kinds = _kinds(container) if container is not None else {}
        all_layers = [k for keys in kinds.values() for k in keys]
        with _representatives_only(model, prefix, container, kinds) as renamed:
            for size in sizes:
                batch = inputs
                if batch is None and hasattr(model, "example_inputs"):  # images, per-example labels (bert, vit)
                    batch = model.example_inputs(size, local_seq, device="meta")
                if batch is None:
                    ids = torch.zeros(size, local_seq, dtype=torch.long, device="meta")
                    batch = {"input_ids": ids, "labels": ids}
                if generic is not None:
                    run = _meta_copy_run(model, batch, torch_dtype)
                else:
                    run = lambda m, batch=batch: _loss_of(m(**batch))  # noqa: E731
                for p in params.values():
                    p.grad = None
                traces[size] = trace_step(model, run, target=target, group_names=group_names)
    root = type(model).__name__
    layer_prefix = f"{root}.{prefix}." if prefix else None
    if all(k.isdigit() for k in all_layers):
        all_layers = sorted(all_layers, key=int)
    name = model_or_name if isinstance(model_or_name, str) else type(model_or_name).__name__
    out = {}
    for size, trace in traces.items():
        if renamed:
            _rename_layers(trace, f"{root}.{prefix}.", renamed)
        step_unit = _unit_of_steps(trace, layer_prefix)
        module_unit = _module_units(trace, step_unit)
        units = _units(trace, step_unit, layer_prefix, kinds, local_seq)
        _assign_params(units, params, prefix, kinds, module_unit, root)
        tied = _tied_head_bytes(trace, params, prefix, module_unit, root)
        out[size] = ModelTrace(name, units, all_layers, _global_params(params, pc), tied, size, local_seq, dtype,
                               config=config if generic is None else None)
    return out if isinstance(batch_size, (list, tuple)) else out[batch_size]


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


def _unit_of_steps(trace: Trace, layer_prefix: str | None):
    """Unit name of every op: 'layer:<key>', or 'embed' / 'head' for ops before / after the layers."""
    names = []
    bounds = {}
    for i, (module, phase, _, _) in enumerate(trace.steps):
        if layer_prefix and module.startswith(layer_prefix):
            key = module[len(layer_prefix):].split(".")[0]
            names.append(f"layer:{key}")
            lo, hi = bounds.get(phase, (i, i))
            bounds[phase] = (min(lo, i), max(hi, i))
        else:
            names.append(None)
    for i, (module, phase, _, _) in enumerate(trace.steps):
        if names[i] is None:
            if phase not in bounds:
                names[i] = "model" if not layer_prefix else "embed"
            else:
                before = i < bounds[phase][0]
                names[i] = ("embed" if before else "head") if phase == "forward" else ("head" if before else "embed")
    return names


def _units(trace: Trace, step_unit, layer_prefix, kinds, local_seq: int) -> dict[str, UnitCost]:
    units: dict[str, UnitCost] = {}

    def unit(name) -> UnitCost | None:
        if name not in units:
            if name.startswith("layer:"):
                key = name.split(":", 1)[1]
                if key not in kinds:  # a generic model traced whole: its other layers repeat a representative
                    return None
                units[name] = UnitCost(name=f"layer {key}", count=len(kinds[key]), layers=kinds[key])
            else:
                units[name] = UnitCost(name=name)
        return units[name]

    temps = trace.temporaries()
    for i, (module, phase, op, fl) in enumerate(trace.steps):
        u = unit(step_unit[i])
        if u is None:
            continue
        stats = u.ops.setdefault(op, {"calls": 0, "fwd_flops": 0, "bwd_flops": 0, "saved_bytes": 0})
        if phase == "forward":
            stats["calls"] += 1
            stats["fwd_flops"] += fl
            u.fwd_flops += fl
        else:
            stats["bwd_flops"] += fl
            u.bwd_flops += fl
        u.transient_bytes = max(u.transient_bytes, temps[i])
        if phase == "forward":
            u.fwd_transient_bytes = max(u.fwd_transient_bytes, temps[i])
        else:
            u.bwd_transient_bytes = max(u.bwd_transient_bytes, temps[i])
    for saved in trace.saved.values():
        u = unit(_unit_of_saved(saved, trace, step_unit, layer_prefix))
        if u is None:
            continue
        u.saved_bytes += saved.nbytes
        u.ops.setdefault(saved.op, {"calls": 0, "fwd_flops": 0, "bwd_flops": 0, "saved_bytes": 0})
        u.ops[saved.op]["saved_bytes"] += saved.nbytes
        if len(saved.shape) >= 2 and saved.shape[-1] == saved.shape[-2] == local_seq:
            u.attention_core_bytes += saved.nbytes
    for c in trace.collectives:
        u = unit(step_unit[c.step])
        if u is None:
            continue
        key = f"{c.group}.{c.name}"
        u.comm[key] = u.comm.get(key, 0) + c.nbytes
        u.comm_calls[key] = u.comm_calls.get(key, 0) + 1
    if layer_prefix:
        for name, u in units.items():
            if name.startswith("layer:"):
                u.input_bytes = trace.module_inputs.get(layer_prefix + name.split(":", 1)[1], 0)
    return units


def _unit_of_saved(saved, trace: Trace, step_unit, layer_prefix) -> str:
    """A tensor is packed just before or just after its op is recorded: take the nearest op of its module."""
    i = min(saved.step, len(step_unit) - 1)
    if layer_prefix and saved.module.startswith(layer_prefix):
        return f"layer:{saved.module[len(layer_prefix):].split('.')[0]}"
    while i > 0 and layer_prefix and trace.steps[i][0].startswith(layer_prefix):
        i -= 1
    return step_unit[i]


def _module_units(trace: Trace, step_unit) -> dict[str, str]:
    """Module name -> the unit in whose forward it (or a submodule) first ran."""
    out = {}
    for (module, phase, _, _), unit in zip(trace.steps, step_unit):
        if phase != "forward":
            continue
        parts = module.split(".")
        for i in range(1, len(parts) + 1):
            out.setdefault(".".join(parts[:i]), unit)
    return out


def _assign_params(units, params, prefix, kinds, module_unit, root: str):
    """Parameter bytes per unit: one layer of each kind, and the rest by where their module ran."""
    from colozoo.layers.shard import spec_of

    layer_of_key = {k: rep for rep, keys in kinds.items() for k in keys}
    fallback = "embed" if "embed" in units else next(iter(units))
    for name, p in params.items():
        nbytes = p.numel() * p.element_size()
        if prefix and name.startswith(prefix + "."):
            key = name[len(prefix) + 1:].split(".")[0]
            if layer_of_key.get(key) != key or f"layer:{key}" not in units:
                continue
            unit = units[f"layer:{key}"]
        else:
            owner = module_unit.get(f"{root}.{name.rsplit('.', 1)[0]}", fallback)
            unit = units.get(owner, units[fallback])
        unit.param_bytes += nbytes
        if any(split.mesh_dim == "ep" for split in spec_of(p)):
            unit.expert_param_bytes += nbytes


def _tied_head_bytes(trace: Trace, params, prefix, module_unit, root) -> int:
    """Bytes of parameters owned before the layers but also used after them (tied embeddings): with
    pipeline parallelism the last stage holds its own copy."""
    total = 0
    for name, modules in trace.params_saved_by.items():
        if prefix and name.startswith(prefix + "."):
            continue
        owner = module_unit.get(f"{root}.{name.rsplit('.', 1)[0]}")
        if owner == "embed" and any(module_unit.get(m) == "head" for m in modules):
            total += params[name].numel() * params[name].element_size()
    return total


def assemble(mt: ModelTrace, mesh, setup: Setup) -> ProfileReport:
    """Per-rank memory, FLOPs and communication of a training step from a traced micro-batch."""
    from colozoo.core.partition import model_stage_layers, stage_layers

    pc = parse_mesh(mesh)
    setup.check()
    if mt.batch_size != setup.batch_size:
        mt = mt.scaled(setup.batch_size)
    units, all_layers = mt.units, mt.layers
    tied = mt.tied_bytes if pc.pp > 1 else 0
    itemsize = setup.torch_dtype.itemsize
    layer_unit = {k: u for u in units.values() for k in u.layers}
    n_layers = len(all_layers)
    if pc.pp > n_layers:
        raise ProfilerError(f"pp={pc.pp} exceeds the {n_layers} layers of the model")
    order = all_layers
    if mt.config is not None and n_layers:  # the split the model itself uses (balanced by parameters)
        stages = [[i for run in runs for i in run] for runs in model_stage_layers(mt.config, pc.pp)]
    else:
        stages = stage_layers(n_layers, pc.pp) if n_layers else [[]]
    shard = pc.dp * pc.cp  # FSDP / ZeRO shard over the data and context ranks
    m = setup.num_microbatches
    stage_costs = []
    comm_by_stage = []
    for s, idx in enumerate(stages):
        keys = [order[i] for i in idx]
        parts = [layer_unit[k] for k in keys]
        if s == 0:
            parts.append(units.get("embed") or units.get("model"))
        if s == len(stages) - 1 and "head" in units:
            parts.append(units["head"])
        parts = [p for p in parts if p is not None]
        param_bytes = sum(p.param_bytes for p in parts) + (tied if s == len(stages) - 1 else 0)
        n_params = param_bytes // itemsize
        weights = float(param_bytes)
        grads = float(param_bytes)
        master = 4.0 * n_params if setup.torch_dtype != torch.float32 else 0.0
        optim = float(OPTIMIZER_BYTES[setup.optimizer] * n_params)
        # experts are already split over ep: ZeRO/FSDP shards them only over the dp*cp/ep ranks holding the
        # same experts (the "edp" group), everything else over all dp*cp
        expert = sum(p.expert_param_bytes for p in parts)
        edp = max(1, shard // pc.ep)
        kept = ((param_bytes - expert) / shard + expert / edp) / param_bytes if param_bytes else 1.0
        if setup.zero >= 1:
            master, optim = master * kept, optim * kept
        if setup.zero >= 2:
            grads *= kept
        if setup.zero >= 3:
            weights *= kept
        cpu = 0.0
        if setup.offload in ("optimizer", "params"):
            cpu += master + optim
            master = optim = 0.0
        if setup.offload == "params":
            cpu += weights + grads
            weights = grads = 0.0
        layer_params = [layer_unit[k].param_bytes for k in keys] or [0]
        gathered = [(u.param_bytes - u.expert_param_bytes) * (1 - 1 / shard)
                    + u.expert_param_bytes * (1 - 1 / edp) for u in (layer_unit[k] for k in keys)] or [0]
        fsdp = 2.0 * max(gathered) if (setup.zero >= 3 and shard > 1) else 0.0
        if setup.offload == "params":
            fsdp = 2.0 * max(layer_params)  # the gathered working copies still live on the GPU
        recompute = _recompute_plan(setup, len(keys))
        saved, fwd, bwd, transient = 0.0, 0, 0, 0.0
        for j, p in enumerate(parts):
            is_layer = j < len(keys)
            policy = recompute[j] if is_layer else "none"
            saved += _saved_under(p, policy)
            # ring attention: this rank's queries meet the keys of all cp chunks, cp x the local core's FLOPs
            ring_fwd, ring_bwd = ((pc.cp - 1) * f for f in _core_flops(p))
            fwd += p.fwd_flops + ring_fwd
            bwd += p.bwd_flops + ring_bwd + _recompute_flops(p, policy) + (ring_fwd if policy != "none" else 0)
            extra = p.saved_bytes if policy == "full" else 0  # a recomputed layer is rebuilt whole in backward
            transient = max(transient, p.transient_bytes + extra)
        inflight = min(pc.pp - s, m) if setup.schedule == "1f1b" else m
        activations = saved * inflight
        extras = parts[len(keys):]  # embed on the first stage, head on the last, in that order
        head = [units["head"]] if s == len(stages) - 1 and "head" in units else []
        before = [p for p in extras if not any(p is h for h in head)]
        in_order = before + parts[:len(keys)] + head
        policies = ["none"] * len(before) + recompute + ["none"] * len(head)
        dynamic = _dynamic_peak(in_order, policies, saved, inflight, grads, param_bytes, m)
        peak = weights + master + optim + fsdp + dynamic
        stage_costs.append(StageCost(s, [int(k) if k.isdigit() else k for k in keys], int(n_params), weights, grads,
                                     master, optim, fsdp, activations, transient, peak, cpu, inflight, int(fwd),
                                     int(bwd), *_stage_comm(parts, keys, pc, setup, param_bytes, s, len(stages))))
        comm_by_stage.append(stage_costs[-1].comm)
    busiest = max(range(len(stage_costs)), key=lambda i: stage_costs[i].fwd_flops + stage_costs[i].bwd_flops)
    total, name = mt.total_params, mt.name
    mesh = {k: getattr(pc, k) for k in ("tp", "pp", "dp", "cp", "ep")}
    mesh["sp"] = pc.sequence_parallel
    return ProfileReport(
        model=name, mesh=mesh, setup=asdict(setup), num_layers=n_layers, total_params=total,
        units=[asdict(u) for u in units.values()], stages=[asdict(s) for s in stage_costs],
        comm=comm_by_stage[busiest], comm_calls=stage_costs[busiest].comm_calls,
        peak_memory=max(s.peak for s in stage_costs),
        step_flops=(stage_costs[busiest].fwd_flops + stage_costs[busiest].bwd_flops) * m, profile_seconds=0.0)


def _dynamic_peak(parts, policies, saved, inflight, grads, param_bytes, m) -> float:
    """Worst activations + temporaries + gradients over one micro-batch's forward and backward, walking the
    stage's units in order. Other micro-batches in flight keep their saved activations throughout; with
    more than one micro-batch the gradients exist from the first backward on, else they grow as it runs."""
    others = (inflight - 1) * saved
    grad_per_byte = grads / param_bytes if param_bytes else 0.0
    accumulated = grads if m > 1 else 0.0
    live, worst = 0.0, 0.0
    for p, policy in zip(parts, policies):
        kept = _saved_under(p, policy)
        worst = max(worst, others + live + kept + p.fwd_transient_bytes + accumulated)
        live += kept
    for p, policy in zip(reversed(parts), reversed(policies)):
        rebuilt = p.saved_bytes - _saved_under(p, policy)  # what recomputation brings back for this backward
        own_grads = p.param_bytes * grad_per_byte
        worst = max(worst, others + live + rebuilt + p.bwd_transient_bytes + accumulated + own_grads)
        live -= _saved_under(p, policy)
        if m == 1:
            accumulated += own_grads
    return worst


def _recompute_plan(setup: Setup, n: int) -> list[str]:
    if setup.checkpointing != "full":
        return [setup.checkpointing] * n
    k = n if setup.checkpoint_layers is None else min(setup.checkpoint_layers, n)
    return ["full"] * k + ["none"] * (n - k)


def _saved_under(u: UnitCost, policy: str) -> float:
    if policy == "full":
        return float(u.input_bytes)
    if policy == "selective":
        return float(u.saved_bytes - u.attention_core_bytes)
    return float(u.saved_bytes)


def _is_core(op: str) -> bool:
    """The attention core's ops (fused kernels, or the math path's batched matmuls): what makes (s, s)."""
    return "attention" in op or op in ("bmm", "softmax", "safe_softmax")


def _core_flops(u: UnitCost) -> tuple[int, int]:
    return (sum(s["fwd_flops"] for op, s in u.ops.items() if _is_core(op)),
            sum(s["bwd_flops"] for op, s in u.ops.items() if _is_core(op)))


def _recompute_flops(u: UnitCost, policy: str) -> int:
    if policy == "full":
        return u.fwd_flops
    if policy == "selective":  # the attention core's own forward, i.e. the ops that made the (s, s) tensors
        return _core_flops(u)[0]
    return 0


def _stage_comm(parts, keys, pc: ParallelConfig, setup: Setup, param_bytes, s, n_stages) -> tuple[dict, dict]:
    """Bytes each rank of stage `s` moves per step, and how many collective calls carry them, by group and
    collective (the calls are what latency costs: many small collectives are slow on any network)."""
    m = setup.num_microbatches
    out, calls = defaultdict(float), defaultdict(float)

    def add(key, nbytes, n):
        out[key] += nbytes
        calls[key] += n

    for p in parts:
        for key, nbytes in p.comm.items():
            add(key, nbytes * m, p.comm_calls.get(key, 0) * m)
    recompute = _recompute_plan(setup, len(keys))
    for j, k in enumerate(keys):  # a recomputed layer repeats its forward collectives
        if recompute[j] == "full":
            for key, nbytes in parts[j].comm.items():
                add(key, nbytes * m / 2, parts[j].comm_calls.get(key, 0) * m / 2)
    boundary = max((p.input_bytes for p in parts[:len(keys)]), default=0)
    if pc.pp > 1:
        sends = (s < n_stages - 1) + (s > 0)  # activations forward and gradients backward over each boundary
        add("pp.send_recv", 2 * sends * boundary * m / 2, sends * m)
    if pc.cp > 1:  # ring attention: K and V of every other cp rank pass by, forward and twice in backward
        add("cp.send_recv", 3 * 2 * boundary * (pc.cp - 1) * len(keys) * m, 3 * (pc.cp - 1) * len(keys) * m)
    shard = pc.dp * pc.cp
    if shard > 1:
        units = len(keys) + 1  # FSDP wraps every layer and the stage (embeddings, head) around them
        buckets = max(1, math.ceil(param_bytes / DDP_BUCKET_BYTES))
        if setup.zero >= 3:  # gathered for forward and again for backward; reduced after the last micro-batch
            add("dp_cp.all_gather", 2 * param_bytes * m, (2 * units - 1) * m)
            add("dp_cp.reduce_scatter", param_bytes, units)
        elif setup.zero >= 1:
            add("dp_cp.reduce_scatter", param_bytes, buckets)
            add("dp_cp.all_gather", param_bytes, buckets)
        else:
            add("dp_cp.all_reduce", param_bytes, buckets)
    return dict(out), dict(calls)


def _global_params(params, pc: ParallelConfig) -> int:
    """Global parameter count: local shards scaled back up along every split (vocab padding included)."""
    from colozoo.layers.shard import spec_of

    sizes = {"tp": pc.tp, "ep": pc.ep}
    total = 0
    for p in params.values():
        n = p.numel()
        for split in spec_of(p):
            n *= sizes.get(split.mesh_dim, 1)
        total += n
    return total


def add_setup_arguments(parser: argparse.ArgumentParser):
    parser.add_argument("--batch-size", type=int, default=1, help="micro-batch size per data-parallel rank")
    parser.add_argument("--seq-len", type=int, default=None, help="sequence length (default: min(2048, max positions))")
    parser.add_argument("--dtype", default="bfloat16", choices=sorted(DTYPES))
    parser.add_argument("--optimizer", default="adamw", choices=sorted(OPTIMIZER_BYTES))
    parser.add_argument("--json", action="store_true", help="print JSON instead of tables")


def add_parser(subparsers):
    p = subparsers.add_parser(
        "profile", help="FLOPs, memory and communication of a training step, on meta tensors",
        description="Profile one training step of a model on a mesh without running it: per layer and per op "
                    "FLOPs, parameter/gradient/optimizer bytes, activations saved for backward, peak memory per "
                    "rank and communication per collective.")
    p.add_argument("name", help="registered model name (see `colozoo models`)")
    p.add_argument("--mesh", default="", help="degrees, e.g. 'tp=8,pp=4,dp=2,cp=1,ep=1,sp'")
    add_setup_arguments(p)
    p.add_argument("--checkpointing", default="none", choices=CHECKPOINTING)
    p.add_argument("--zero", type=int, default=0, choices=(0, 1, 2, 3), help="0 DDP, 1/2 ZeRO, 3 FSDP")
    p.add_argument("--microbatches", type=int, default=1)
    p.add_argument("--schedule", default="1f1b", choices=SCHEDULES)
    p.add_argument("--offload", default="none", choices=OFFLOAD)
    p.set_defaults(func=_main)


def _main(args) -> int:
    warnings.filterwarnings("ignore", category=FutureWarning)
    report = profile(args.name, batch_size=args.batch_size, seq_len=args.seq_len, mesh=args.mesh or None,
                     dtype=args.dtype, checkpointing=args.checkpointing, optimizer=args.optimizer, zero=args.zero,
                     num_microbatches=args.microbatches, schedule=args.schedule, offload=args.offload)
    print(report.to_json(indent=1) if args.json else report.table())
    return 0
