"""What the cost model has formulas for, without torch (the CLIs offer these before importing the profiler)."""
from __future__ import annotations

PRICED_SCHEDULES = ("1f1b", "gpipe", "interleaved_1f1b")  # of colozoo.runtime.options.SCHEDULES
OPTIMIZER_BYTES = {"adamw": 8, "adam": 8, "sgd": 4, "none": 0}  # fp32 state bytes per parameter
