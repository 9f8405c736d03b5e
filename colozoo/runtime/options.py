"""Every list of allowed run options, defined once: the training runtime checks against these, the planner
searches only these, the CLI offers these."""
from __future__ import annotations

DATA_PARALLEL = ("fsdp", "ddp")
MIXED_PRECISION = ("bf16", "fp16")                     # None: the parameters' dtype
CHECKPOINTING = ("none", "selective", "full")          # activation checkpointing of each layer
OFFLOAD = ("none", "optimizer", "params")              # see colozoo.runtime.offload
SCHEDULES = ("gpipe", "1f1b", "interleaved_1f1b", "zero_bubble")
MULTI_STAGE_SCHEDULES = ("interleaved_1f1b", "zero_bubble")  # several (virtual) stages per pipeline rank
ZERO_LEVELS = (0, 1, 2, 3)                             # what a plan may say; the profiler prices each
ZERO = (0, 3)                                          # what runs: 0 DDP, 3 FSDP2 (ZeRO-1/2 are priced, not run)
