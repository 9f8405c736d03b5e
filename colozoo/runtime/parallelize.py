"""parallelize(): a model's pipeline stages (built with its Run) wrapped for data parallelism (FSDP2 or DDP over
dp*cp), mixed precision, activation checkpointing and offload, recorded in its Run as a TrainingSetup."""
from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from colozoo.layers.shard import spec_of
from colozoo.layers.vocab import VocabParallelLMHead
from colozoo.runtime.checkpointing import apply_activation_checkpointing
from colozoo.runtime.compile import compile_layers
from colozoo.runtime.errors import TrainingError
from colozoo.runtime.offload import fsdp2_offload_policy
from colozoo.runtime.options import CHECKPOINTING, DATA_PARALLEL, MIXED_PRECISION, OFFLOAD

COMPUTE_DTYPES = {None: None, "bf16": torch.bfloat16, "fp16": torch.float16}


@dataclass
class TrainingSetup:
    """What parallelize() decided, read by the training step, clipping and the optimizer."""
    data_parallel: str | None = None     # "fsdp" | "ddp", None with one data rank
    sharded: bool = False                # FSDP2 shards parameters over dp*cp
    mixed_precision: str | None = None
    offload: str = "none"
    tied: tuple | None = None            # (name, group) of an embedding tied across the first and last stage
    specs: dict = field(default_factory=dict)     # parameter name -> shard spec (FSDP replaces the Parameters)
    experts: set = field(default_factory=set)     # names of the parameters split over ep


def tied_embedding(model):
    """(name, process group) of an embedding tied to an LM head on another pipeline stage, or None.
    Collective: every rank creates the first+last stage groups (one per dp/cp/tp coordinate)."""
    parallel = model.parallel
    if parallel.config.pp == 1 or not getattr(model.config, "tie_word_embeddings", False):
        return None
    name = getattr(model, "tied_embedding", None)
    if name is None and not any(getattr(m, "tied", False) for m in model.modules() if isinstance(m, VocabParallelLMHead)):
        return None  # no LM head shares the embedding (an encoder, a classifier), whatever the config says
    if name is None:
        raise TrainingError(f"{type(model).__name__} ties its LM head to the input embedding but does not declare "
                            f"`tied_embedding` (the parameter the first and last pipeline stages share)")
    mine = parallel.stage_ends_group()
    if (model.is_first or model.is_last) and name not in dict(model.named_parameters()):
        raise TrainingError(f"{type(model).__name__} on pipeline stage {parallel.rank('pp')} lacks the tied parameter "
                            f"{name!r}: the last stage must hold its own copy of the tied embedding")
    return name, mine


def parallelize(model, data_parallel: str = "fsdp", mixed_precision: str | None = None,
                activation_checkpointing: str | None = None, reshard_after_forward: bool = True,
                offload: str | None = None, checkpoint_layers: int | None = None, compile: bool = False):
    """Wrap the pipeline stages of `model` for data parallelism over the dp mesh dimension; returns the model's Run,
    which holds them and the TrainingSetup. The one call that changes a run: once, before training and before
    building the optimizer (FSDP replaces the parameters); a second call is refused. Collective over the whole job.
    `offload="optimizer"` keeps the fp32 master weights and AdamW states in CPU memory (build_optimizer then returns
    an OffloadedAdamW); `offload="params"` also keeps the sharded parameters and gradients there (FSDP2's
    CPUOffloadPolicy). `checkpoint_layers` with activation_checkpointing="full" recomputes only the first that many
    layers of each stage. `compile=True` compiles each layer with torch.compile (colozoo.runtime.compile; hooks of
    FSDP and checkpointing stay eager around the compiled body, so the order does not matter)."""
    run = model.run
    if run is None:
        raise TrainingError(f"{type(model).__name__} has no Run: build it with colozoo.build_model or "
                            f"colozoo.from_pretrained")
    if run.setup is not None:
        raise TrainingError("parallelize() was already called on this model")
    activation_checkpointing, offload = _checked(model, data_parallel, mixed_precision, activation_checkpointing,
                                                 offload, checkpoint_layers)
    experts = _expert_parameters(model)
    if activation_checkpointing:
        apply_activation_checkpointing(model, activation_checkpointing, checkpoint_layers)
    setup = decide_setup(model, data_parallel, mixed_precision, offload, experts)
    compute_dtype = COMPUTE_DTYPES[mixed_precision]
    stages = []
    for stage in run.stages:
        stage.activation_dtype, stage.autocast_dtype = compute_dtype, None if setup.sharded else compute_dtype
        stages.append(_wrapped(model, stage, setup.sharded, experts, compute_dtype, reshard_after_forward, offload))
    for name, p in model.named_parameters():  # FSDP replaces the Parameter objects that carried the specs
        if setup.specs[name]:
            p.shard_spec = setup.specs[name]
    run.stages = stages
    if compile:
        compile_layers(model)
    run.setup = setup
    return run


def _checked(model, data_parallel, mixed_precision, activation_checkpointing, offload, checkpoint_layers):
    """parallelize's options checked, one clear line for each mistake; (activation_checkpointing, offload) with
    their defaults ("none" checkpointing is None, no offload is "none")."""
    if data_parallel not in DATA_PARALLEL:
        raise TrainingError(f"data_parallel must be one of {DATA_PARALLEL}, got {data_parallel!r}")
    if mixed_precision not in (None, *MIXED_PRECISION):
        raise TrainingError(f"mixed_precision must be one of {[None, *MIXED_PRECISION]}, got {mixed_precision!r}")
    activation_checkpointing = None if activation_checkpointing == "none" else activation_checkpointing
    if activation_checkpointing not in (None, *CHECKPOINTING):
        raise TrainingError(f"activation_checkpointing must be one of {[None, *CHECKPOINTING]}, got "
                            f"{activation_checkpointing!r}")
    if checkpoint_layers is not None and not activation_checkpointing:
        raise TrainingError("checkpoint_layers needs activation_checkpointing='full'")
    offload = offload or "none"
    if offload not in OFFLOAD:
        raise TrainingError(f"offload must be one of {OFFLOAD}, got {offload!r}")
    replicas = model.parallel.size("dp_cp")
    if offload == "params" and (data_parallel != "fsdp" or replicas == 1):
        raise TrainingError(f"offload='params' needs FSDP2 (data_parallel='fsdp' over dp*cp > 1 ranks; here "
                            f"data_parallel={data_parallel!r}, dp*cp={replicas}): its CPUOffloadPolicy "
                            f"is what moves parameters to CPU memory; use offload='optimizer' instead")
    return activation_checkpointing, offload


def sync_tied_embedding(model):
    """The last stage's copy of a tied embedding takes the first stage's values, whatever the last stage was
    initialised with (collective over the whole job). Run calls it once, for a model built on a device; a model
    built on meta gets both copies from the same checkpoint tensor when it is loaded."""
    tied = tied_embedding(model)
    if tied is not None and (model.is_first or model.is_last):
        with torch.no_grad():
            src = dist.get_global_rank(model.parallel.group("pp"), 0)
            dist.broadcast(dict(model.named_parameters())[tied[0]], src=src, group=tied[1])


def decide_setup(model, data_parallel: str = "fsdp", mixed_precision: str | None = None, offload: str = "none",
                 experts: set[int] | None = None) -> TrainingSetup:
    """What parallelize decides for `model` with these options; nothing is wrapped or changed here."""
    experts = _expert_parameters(model) if experts is None else experts
    tied = tied_embedding(model)
    replicas = model.parallel.size("dp_cp")
    return TrainingSetup(data_parallel=data_parallel if replicas > 1 else None,
                         sharded=replicas > 1 and data_parallel == "fsdp", mixed_precision=mixed_precision, tied=tied,
                         specs={name: spec_of(p) for name, p in model.named_parameters()}, offload=offload,
                         experts={n for n, p in model.named_parameters() if id(p) in experts})


def _wrapped(model, stage, sharded: bool, experts: set[int], compute_dtype, reshard_after_forward: bool, offload: str):
    """The stage wrapped for data parallelism over dp*cp: FSDP2 (each layer, its expert modules over the edp group,
    then the stage), or DDP (experts left to the step, which reduces them over edp), or as it is on one data rank."""
    parallel, replicas = model.parallel, model.parallel.size("dp_cp")
    if sharded:
        from torch.distributed.device_mesh import DeviceMesh
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

        policy = MixedPrecisionPolicy(param_dtype=compute_dtype, reduce_dtype=torch.float32)
        kw = dict(mp_policy=policy, reshard_after_forward=reshard_after_forward,
                  offload_policy=fsdp2_offload_policy(offload))
        expert_mesh = DeviceMesh.from_group(parallel.group("edp"), parallel.device.type) if experts else None
        for layer in stage.layers.values():
            for module in _expert_modules(layer, experts):  # nested first: the layer's FSDP leaves them out
                fully_shard(module, mesh=expert_mesh, **kw)
                module.set_gradient_divide_factor(replicas)  # the divisor of every other gradient
                if parallel.size("edp") > 1:  # gloo lacks PREMUL_SUM; on one rank torch would divide twice
                    module.set_force_sum_reduction_for_comms(True)
            fully_shard(layer, mesh=parallel.dp_cp_mesh, **kw)
        fully_shard(stage, mesh=parallel.dp_cp_mesh, **kw)
        return stage
    if replicas > 1:
        DDP = torch.nn.parallel.DistributedDataParallel  # experts are reduced over edp by hand
        DDP._set_params_and_buffers_to_ignore_for_model(
            stage, [n for n, p in stage.named_parameters() if id(p) in experts])
        # the gradients are views of DDP's buckets, not a second copy beside them
        return DDP(stage, process_group=parallel.group("dp_cp"), broadcast_buffers=False, gradient_as_bucket_view=True)
    return stage


def _expert_parameters(model) -> set[int]:
    """ids of the parameters split over ep (each rank holds other experts), when ep > 1."""
    if model.parallel.size("ep") == 1:
        return set()
    return {id(p) for p in model.parameters() if any(s.mesh_dim == "ep" for s in spec_of(p))}


def _expert_modules(layer, experts: set[int]) -> list[torch.nn.Module]:
    """The modules of a layer that directly own expert parameters (FSDP shards them over the edp group)."""
    found = []
    for name, module in layer.named_modules():
        own = list(module.parameters(recurse=False))
        mine = [id(p) in experts for p in own]
        if any(mine):
            if not all(mine):
                raise TrainingError(f"{type(module).__name__} ({name}) holds expert and non-expert parameters; "
                                    f"FSDP reduces them over different groups, so they need separate modules")
            found.append(module)
    return found


def training_setup(model) -> TrainingSetup:
    """The model's TrainingSetup: parallelize()'s, else, with one data rank, what parallelize() would decide with its
    defaults (nothing wrapped, no parameter replaced, nothing kept: a call leaves the run as it found it). With more
    data ranks the user's optimizer would hold parameters FSDP or DDP is about to replace, so that is refused."""
    run = model.run
    if run.setup is not None:
        return run.setup
    if model.parallel.size("dp_cp") > 1:
        raise TrainingError(f"call colozoo.runtime.training.parallelize(model) before training on dp*cp = "
                            f"{model.parallel.size('dp_cp')} ranks, and build the optimizer after it: data parallelism "
                            f"replaces the parameters an optimizer built before would hold")
    return decide_setup(model)
