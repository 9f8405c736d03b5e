"""The one plan type: how to run a model. The planner (colozoo.cost.planner) produces it,
`from_pretrained(plan="auto")` builds the model on its mesh and keeps it as `model.run.plan`, `apply_plan` applies
the rest (data parallelism, activation checkpointing, offload) and `colozoo finetune --plan auto` trains with it."""
from __future__ import annotations

from dataclasses import asdict, dataclass, fields

from colozoo.runtime.options import CHECKPOINTING, MULTI_STAGE_SCHEDULES, OFFLOAD, SCHEDULES, ZERO_LEVELS

DEGREES = ("tp", "pp", "dp", "cp", "ep", "sequence_parallel")


@dataclass
class Plan:
    tp: int = 1
    pp: int = 1
    dp: int = 1
    cp: int = 1
    ep: int = 1
    sequence_parallel: bool = False
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

    def __post_init__(self):
        for name in ("tp", "pp", "dp", "cp", "ep", "micro_batch_size", "num_microbatches", "virtual_stages"):
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

    @property
    def world_size(self) -> int:
        return self.tp * self.pp * self.dp * self.cp

    def degrees(self) -> dict:
        """The mesh: keyword arguments of init_parallel / from_pretrained."""
        return {k: getattr(self, k) for k in DEGREES}

    def choices(self) -> "Plan":
        """Just the plan (a subclass adds the planner's predictions)."""
        return Plan(**{f.name: getattr(self, f.name) for f in fields(Plan)})

    def to_dict(self) -> dict:
        return asdict(self)

    def mesh(self) -> str:
        text = f"tp={self.tp},pp={self.pp},dp={self.dp},cp={self.cp},ep={self.ep}"
        return text + (",sp" if self.sequence_parallel else "")
