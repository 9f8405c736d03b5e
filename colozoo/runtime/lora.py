"""LoRA on a sharded model: `apply_lora` attaches a `layers.lora.LoRA` to every targeted tensor-parallel linear and
freezes everything else.

    model = colozoo.from_pretrained("opt-1.3b", tp=2)
    apply_lora(model, r=16, alpha=32, targets=("q_proj", "v_proj"))   # or targets="all-linear"

Targets are HF module names, matched as PEFT matches them (the whole name, or its last dot-separated parts; a
single string other than "all-linear" is a regex the whole name must match). They are mapped onto our modules
through the family's converter map: the HF tensors of our fused `qkv` / `gate_up` weight name one HF module per
fused chunk, so `q_proj` adapts the q chunk of `qkv` only.
"""
from __future__ import annotations

import re
import warnings
import zlib
from contextlib import contextmanager
from dataclasses import asdict, dataclass

import torch

from colozoo.converters import family_module
from colozoo.converters.source import Source
from colozoo.layers.linear import ColumnParallelLinear, ReplicatedLinear, RowParallelLinear
from colozoo.layers.lora import LoRA
from colozoo.layers.shard import spec_of

ALL_LINEAR = "all-linear"
# trained whole by default, as PEFT's task_type SEQ_CLS does (its modules_to_save default)
TASK_MODULES_TO_SAVE = {"sequence_classification": ("classifier", "score")}


@dataclass(frozen=True)
class LoraSettings:
    """What builds (and rebuilds) a model's adapters: apply_lora's arguments, kept in colozoo checkpoints (PEFT's
    adapter_config says the same). The defaults are apply_lora's and PEFT's, so the cost model can say just r."""
    r: int
    alpha: float = 8
    dropout: float = 0.0
    targets: tuple[str, ...] | str = ("q_proj", "v_proj")
    use_rslora: bool = False
    modules_to_save: tuple[str, ...] | None = None  # HF modules trained whole beside the adapters (a classifier);
    #                                                 None: the task head's default (TASK_MODULES_TO_SAVE)

    def to_json(self) -> dict:
        out = asdict(self)
        out["targets"] = self.targets if isinstance(self.targets, str) else list(self.targets)
        out["modules_to_save"] = None if self.modules_to_save is None else list(self.modules_to_save)
        return out

    @classmethod
    def from_json(cls, d: dict) -> "LoraSettings":
        targets = d["targets"]
        saved = d.get("modules_to_save", ())
        return cls(d["r"], d["alpha"], d.get("dropout", 0.0), targets if isinstance(targets, str) else tuple(targets),
                   d.get("use_rslora", False), None if saved is None else tuple(saved))

    def apply(self, model, seed: int = 0):
        """apply_lora with these settings (`seed`: the adapters' initial values)."""
        return apply_lora(model, r=self.r, alpha=self.alpha, dropout=self.dropout, targets=self.targets,
                          use_rslora=self.use_rslora, seed=seed, modules_to_save=self.modules_to_save)


def hf_linear_modules(config) -> dict[str, tuple[str, ...]]:
    """{our module name: the HF module name of each of its fused chunks} for every weight in the family map."""
    return {name: tuple(n.removesuffix(".weight") for n in source.names)
            for name, source in hf_linear_sources(config).items()}


def hf_linear_sources(config) -> dict[str, Source]:
    """{our module name: the Source of its weight} for every unstacked weight in the family map, under the names
    transformers gives the modules in memory (what PEFT matches and saves: ViT's `q_proj`, not the saved `query`)."""
    conv = family_module(config.model_type)
    renames = getattr(conv, "NAME_ALIASES", ())
    return {name.removesuffix(".weight"): source.renamed(renames)
            for name, source in conv.hf_sources(config).items() if name.endswith(".weight") and not source.stack}


def hf_parameter_names(config) -> dict[str, str]:
    """{our parameter name: its HF name in memory} for every parameter the family maps one to one."""
    conv = family_module(config.model_type)
    renames = getattr(conv, "NAME_ALIASES", ())
    return {name: source.renamed(renames).names[0] for name, source in conv.hf_sources(config).items()
            if len(source.names) == 1 and not (source.stack or source.transpose or source.regroup)}


def _saved_parameters(model, modules_to_save) -> dict[str, str]:
    """{our parameter name: HF name} of this stage's parameters in the HF modules `modules_to_save` names (PEFT's
    matching: the whole module name or its last dot-separated parts)."""
    names = hf_parameter_names(model.config)
    unknown = [t for t in modules_to_save if not any(matches(n.rsplit(".", 1)[0], t) for n in names.values())]
    if unknown and modules_to_save != TASK_MODULES_TO_SAVE.get(getattr(model, "task", None)):
        raise ValueError(f"modules_to_save {unknown} name no module of this {model.config.model_type} model that "
                         f"colozoo maps one to one onto an HF module")
    mine = dict(model.named_parameters())
    saved = {name: hf for name, hf in names.items()
             if name in mine and any(matches(hf.rsplit(".", 1)[0], t) for t in modules_to_save)}
    sharded = [hf for name, hf in saved.items() if spec_of(mine[name])]
    if sharded:
        raise ValueError(f"modules_to_save {sharded[:2]} are sharded over the mesh; only replicated modules (a "
                         f"classifier head) can be trained whole beside LoRA adapters")
    return saved


def trained_modules(model) -> dict[str, str]:
    """{our parameter name: HF name} of this rank's parameters trained whole beside the adapters."""
    names = hf_parameter_names(model.config)
    return {name: names[name] for name, p in model.named_parameters()
            if p.requires_grad and ".lora." not in f".{name}" and name in names}


def expert_modules(config) -> list[str]:
    """The HF names of MoE experts, as saved (one linear per expert) and in memory (stacked parameters)."""
    conv = family_module(config.model_type)
    saved = [n for s in conv.hf_sources(config).values() if s.stack for n in s.names]
    in_memory = [n for ours, s in getattr(conv, "module_sources", lambda c: {})(config).items() if ".experts." in ours
                 for n in s.names]
    holders = {n.rsplit(".", 1)[0] for n in in_memory}  # the experts module PEFT would wrap
    return [n.removesuffix(".weight") for n in saved + in_memory] + sorted(holders)


def b_to_hf(lora, b: torch.Tensor) -> torch.Tensor:
    """A pair's global B (ours) in the HF module's row order (GPT-NeoX's per-head query_key_value)."""
    return b if lora.regroup is None else Source.of("B", regroup=lora.regroup).split(b)["B"]


def b_from_hf(lora, b: torch.Tensor) -> torch.Tensor:
    if lora.regroup is None:
        return b
    return b[Source.of("B", regroup=lora.regroup).hf_positions(b.shape[0])]


def matches(hf_name: str, target: str) -> bool:
    return hf_name == target or hf_name.endswith("." + target)


def _selector(targets):
    if targets == ALL_LINEAR:
        return lambda name: True
    if isinstance(targets, str):
        pattern = re.compile(targets)
        return lambda name: pattern.fullmatch(name) is not None
    return lambda name: any(matches(name, t) for t in targets)


def peft_expert_aliases(config, hf_names) -> list[str]:
    """The HF linear modules of `hf_names` that PEFT takes for the stacked experts: on transformers 5 it turns targets
    named as the family's converter lists in PEFT_EXPERT_NAMES (DeepSeek-V3: gate_proj, up_proj, down_proj) into
    targets on the routed experts, whatever module path precedes the name, so adapters on the dense MLPs or the shared
    expert would not load in peft."""
    names = getattr(family_module(config.model_type), "PEFT_EXPERT_NAMES", ())
    return [n for n in hf_names if n.rsplit(".", 1)[-1] in names]


def check_targets(targets, hf_names, experts=(), aliases=()) -> None:
    """Every target names some HF module of the model (on any stage) other than an MoE expert or a module PEFT takes
    for one (`aliases`, see peft_expert_aliases), or a clear error."""
    if targets == ALL_LINEAR and experts:
        raise ValueError("LoRA targets 'all-linear' on an MoE model are not supported: PEFT's all-linear adapts the "
                         "MoE expert linears and routers too, which colozoo does not; name the attention (and "
                         "shared-expert) linears instead")
    if targets == ALL_LINEAR:
        return
    select = _selector(targets)
    if any(select(n) for n in experts):
        raise ValueError(f"LoRA targets {targets!r} select MoE expert linears ({[n for n in experts if select(n)][:2]}"
                         f"...), which are not supported: transformers holds the experts as stacked parameters, not "
                         f"linear modules PEFT can target; adapt the attention (and shared-expert) linears")
    if any(select(n) for n in aliases):
        raise ValueError(f"LoRA targets {targets!r} select {[n for n in aliases if select(n)][:2]}...: PEFT (on "
                         f"transformers 5) takes modules named {sorted({n.rsplit('.', 1)[-1] for n in aliases})} in "
                         f"this model for its routed experts, so the adapter would not load in peft; adapt the "
                         f"attention projections")
    if isinstance(targets, str):
        if not any(_selector(targets)(n) for n in hf_names):
            raise ValueError(f"LoRA target pattern {targets!r} matches no module of the model")
        return
    if not targets:
        raise ValueError("LoRA needs at least one target module name (or targets='all-linear')")
    unknown = [t for t in targets if not any(matches(n, t) for n in hf_names)]
    if unknown:
        known = sorted({n.rsplit(".", 1)[-1] for n in hf_names if not n.rsplit(".", 1)[-1].isdigit()})
        raise ValueError(f"unknown LoRA target module(s) {unknown}: this model's modules are named {known}")


def _generator(seed: int, hf_module: str) -> torch.Generator:
    # one stream per HF module: the same adapter on every mesh, whatever stage or rank builds it
    return torch.Generator().manual_seed(seed * 1_000_003 + zlib.crc32(hf_module.encode()))


def apply_lora(model, r: int = 8, alpha: float = 8, dropout: float = 0.0, targets=("q_proj", "v_proj"),
               use_rslora: bool = False, seed: int = 0, dtype=torch.float32, modules_to_save=None):
    """Attach LoRA adapters (A kaiming-uniform, B zeros, as PEFT) to the targeted linears of this rank's shard,
    freeze every other parameter but those of `modules_to_save` (HF module names, trained whole as PEFT's
    modules_to_save; None: a sequence classifier's head, as PEFT's SEQ_CLS), and return the model."""
    if not isinstance(r, int) or isinstance(r, bool) or r <= 0:
        raise ValueError(f"LoRA rank r must be a positive integer, got {r!r}")
    if not 0.0 <= dropout < 1.0:
        raise ValueError(f"LoRA dropout must be in [0, 1), got {dropout!r}")
    if lora_modules(model):
        raise ValueError("the model already has LoRA adapters")
    if getattr(model.run, "setup", None) is not None:
        raise ValueError("apply_lora before parallelize(): FSDP/DDP wrap the parameters that exist when they are called")
    targets = targets if isinstance(targets, str) else tuple(targets)
    if modules_to_save is None:
        modules_to_save = TASK_MODULES_TO_SAVE.get(getattr(model, "task", None), ())
    saved = _saved_parameters(model, tuple(modules_to_save))
    sources = hf_linear_sources(model.config)
    linears = {name: tuple(n.removesuffix(".weight") for n in s.names) for name, s in sources.items()}
    hf_names = [n for names in linears.values() for n in names]
    check_targets(targets, hf_names, expert_modules(model.config), peft_expert_aliases(model.config, hf_names))
    select = _selector(targets)
    for name, module in model.named_modules():
        hf_names = linears.get(name)
        if hf_names is None:
            continue
        adapted = tuple(i for i, n in enumerate(hf_names) if select(n))
        if not adapted:
            continue
        if not isinstance(module, (ColumnParallelLinear, RowParallelLinear, ReplicatedLinear)):
            if targets != ALL_LINEAR:
                warnings.warn(f"LoRA target {hf_names[0]} ({type(module).__name__}) is not a tensor-parallel "
                              f"linear: left without an adapter", stacklevel=2)
            continue
        row = isinstance(module, RowParallelLinear)
        chunks = len(spec_of(module.weight)[0].chunks or (0,)) if spec_of(module.weight) else 1
        if len(hf_names) not in (1, chunks):
            raise ValueError(f"{name}: {len(hf_names)} HF modules cannot map onto {chunks} fused chunks")
        groups = tuple((c,) for c in range(chunks)) if len(hf_names) == chunks else (tuple(range(chunks)),)
        lora = LoRA(module, r, alpha, dropout, row=row, groups=groups, adapted=adapted,
                    hf_modules=tuple(hf_names[i] for i in adapted), use_rslora=use_rslora, dtype=dtype,
                    regroup=sources[name].regroup)
        lora.reset_parameters([_generator(seed, hf_names[i]) for i in adapted])
        module.lora = lora
    for name, p in model.named_parameters():
        p.requires_grad_(".lora." in f".{name}" or name in saved)
    return model


def lora_modules(model) -> dict[str, LoRA]:
    """{name of the adapted linear: its adapter} on this rank."""
    return {name.removesuffix(".lora"): m for name, m in model.named_modules() if isinstance(m, LoRA)}


def lora_settings(model) -> LoraSettings | None:
    """The settings of this rank's adapters (targets: the exact HF module names adapted here), or None."""
    adapters = list(lora_modules(model).values())
    if not adapters:
        return None
    first = adapters[0]
    names = sorted({n for a in adapters for n in a.hf_modules})
    saved = sorted({hf.rsplit(".", 1)[0] for hf in trained_modules(model).values()})
    return LoraSettings(first.r, first.alpha, first.p, tuple(names), first.use_rslora, tuple(saved))


@contextmanager
def merged_lora(model):
    """Inside: every adapter folded into its base weight and detached (the model is then a plain model, e.g. to
    export); on exit the original weights and adapters come back exactly."""
    adapters = lora_modules(model)
    saved = {}
    with torch.no_grad():
        for name, lora in adapters.items():
            base = model.get_submodule(name)
            saved[name] = base.weight.detach().clone()
            base.weight.add_(lora.delta_weight().to(base.weight.dtype))
            base.lora = None
    try:
        yield model
    finally:
        with torch.no_grad():
            for name, lora in adapters.items():
                base = model.get_submodule(name)
                base.weight.copy_(saved[name])
                base.lora = lora


@contextmanager
def adapters_disabled(model):
    """Inside: every LoRA adapter detached from its base layer, so the model computes as its base weights alone (the
    reference model of preference tuning under LoRA, as peft's `disable_adapter()`); on exit every adapter is
    attached again, whatever happened inside. Nothing else changes, and nothing stays changed."""
    adapters = lora_modules(model)
    for name in adapters:
        model.get_submodule(name).lora = None
    try:
        yield model
    finally:
        for name, lora in adapters.items():
            model.get_submodule(name).lora = lora
