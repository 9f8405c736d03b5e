"""colozoo: a model zoo of pre-parallelized transformers for PyTorch.

    model = colozoo.from_pretrained("opt-30b", tp=4, pp=2)
"""
from __future__ import annotations

import importlib

__version__ = "0.1.0"

# Public names resolved on first use, so `import colozoo` stays light (no torch until one is used).
_LAZY = {
    "ParallelConfig": "colozoo.core.mesh",
    "ParallelContext": "colozoo.core.mesh",
    "init_parallel": "colozoo.core.mesh",
    "from_pretrained": "colozoo.api",
    "convert": "colozoo.checkpoint.convert",
    "profile": "colozoo.cost.profiler",
    "profile_for": "colozoo.cost.profiler",
    "plan": "colozoo.cost.planner",
    "plan_for": "colozoo.cost.planner",
    "build_model": "colozoo.api",
}

__all__ = [*_LAZY]


def __getattr__(name):
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'colozoo' has no attribute {name!r}")
