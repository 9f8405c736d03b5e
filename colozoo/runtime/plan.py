"""The one plan type: how to run a model. The planner (colozoo.cost.planner) produces it,
`from_pretrained(plan="auto")` builds the model on its mesh and keeps it as `model.run.plan`, `apply_plan` applies
the rest (data parallelism, activation checkpointing, offload) and `colozoo finetune --plan auto` trains with it."""
from __future__ import annotations

from dataclasses import MISSING, asdict, dataclass, field, fields, replace

from colozoo.core.mesh import ParallelConfig
from colozoo.runtime.options import CHECKPOINTING, MULTI_STAGE_SCHEDULES, OFFLOAD, SCHEDULES, ZERO_LEVELS

DEGREES = tuple(f.name for f in fields(ParallelConfig))  # tp, pp, dp, cp, ep, sequence_parallel


@dataclass(init=False)
class Plan:
    """The mesh (`degrees`, a core.mesh.ParallelConfig: the degrees and their checks) and how a step runs on it.
    `Plan(tp=4, pp=2, micro_batch_size=2)` is short for `Plan(ParallelConfig(tp=4, pp=2), micro_batch_size=2)`, and
    `plan.tp` reads `plan.degrees.tp`."""
    degrees: ParallelConfig = field(default_factory=ParallelConfig)
    micro_batch_size: int = 1
    num_microbatches: int = 1
    schedule: str = "1f1b"
    zero: int = 0                        # 0: DDP, 3: FSDP2 (what colozoo.runtime runs); 1, 2: priced only
    checkpointing: str = "none"
    checkpoint_layers: int | None = None  # with "full": only the first k layers of each stage recompute
    offload: str = "none"
    virtual_stages: int = 1              # model chunks per pipeline rank (interleaved schedules: > 1)
    layers_per_stage: tuple | None = None  # layers of each (virtual) stage in order; None: balanced by parameters
    reshard_after_forward: bool = True   # ZeRO-3: free gathered weights after each layer's forward (FSDP2's option)

    def __init__(self, degrees: ParallelConfig | None = None, *, tp: int | None = None, pp: int | None = None,
                 dp: int | None = None, cp: int | None = None, ep: int | None = None,
                 sequence_parallel: bool | None = None, **choices):
        """The degrees given as keywords replace those of `degrees` (default: every degree 1); `choices`: the
        other fields."""
        known = fields(type(self))  # a subclass's fields too (the planner's RankedPlan)
        unknown = sorted(choices.keys() - {f.name for f in known})
        if unknown:
            raise TypeError(f"{type(self).__name__}() got unknown settings {unknown}; it takes "
                            f"{[f.name for f in known]} and the degrees {list(DEGREES)}")
        given = dict(tp=tp, pp=pp, dp=dp, cp=cp, ep=ep, sequence_parallel=sequence_parallel)
        self.degrees = degrees if degrees is not None else ParallelConfig()
        if isinstance(self.degrees, ParallelConfig):
            self.degrees = replace(self.degrees, **{k: v for k, v in given.items() if v is not None})
        for f in known:
            if f.name != "degrees":
                default = f.default_factory() if f.default is MISSING else f.default
                setattr(self, f.name, choices[f.name] if f.name in choices else default)
        self.__post_init__()

    def __post_init__(self):
        if not isinstance(self.degrees, ParallelConfig):
            raise TypeError(f"plan degrees must be a colozoo.core.mesh.ParallelConfig, got {self.degrees!r}")
        for name in ("micro_batch_size", "num_microbatches", "virtual_stages"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"plan {name} must be an integer >= 1, got {value!r}")
        for name, allowed in (("schedule", SCHEDULES), ("checkpointing", CHECKPOINTING), ("offload", OFFLOAD),
                              ("zero", ZERO_LEVELS)):
            if getattr(self, name) not in allowed:
                raise ValueError(f"plan {name} must be one of {allowed}, got {getattr(self, name)!r}")
        if self.virtual_stages > 1 and self.schedule not in MULTI_STAGE_SCHEDULES:
            raise ValueError(f"plan schedule {self.schedule!r} runs one stage per rank, but virtual_stages="
                             f"{self.virtual_stages}; use one of {MULTI_STAGE_SCHEDULES}")
        if self.layers_per_stage is not None:
            counts = tuple(self.layers_per_stage)
            if len(counts) != self.pp * self.virtual_stages or min(counts) < 1:
                raise ValueError(f"plan layers_per_stage {counts} must give pp * virtual_stages = "
                                 f"{self.pp * self.virtual_stages} counts >= 1")
            self.layers_per_stage = counts

    tp = property(lambda self: self.degrees.tp)
    pp = property(lambda self: self.degrees.pp)
    dp = property(lambda self: self.degrees.dp)
    cp = property(lambda self: self.degrees.cp)
    ep = property(lambda self: self.degrees.ep)
    sequence_parallel = property(lambda self: self.degrees.sequence_parallel)
    world_size = property(lambda self: self.degrees.world_size)

    def choices(self) -> "Plan":
        """Just the plan (a subclass adds the planner's predictions)."""
        return Plan(**{f.name: getattr(self, f.name) for f in fields(Plan)})

    def to_dict(self) -> dict:
        """One flat dict, the degrees first (what `Plan(**plan.to_dict())` and `Plan.from_dict` read back)."""
        settings = asdict(self)
        return {**settings.pop("degrees"), **settings}

    @classmethod
    def from_dict(cls, data: dict) -> "Plan":
        """The plan `to_dict` wrote (a subclass's extra entries, e.g. the planner's predictions, ignored)."""
        known = {f.name for f in fields(Plan) if f.name != "degrees"} | set(DEGREES)
        return Plan(**{k: v for k, v in data.items() if k in known})

    def mesh(self) -> str:
        text = f"tp={self.tp},pp={self.pp},dp={self.dp},cp={self.cp},ep={self.ep}"
        return text + (",sp" if self.sequence_parallel else "")
