"""Evaluation with lm-evaluation-harness on a model sharded over any tp x pp mesh (`colozoo eval`).

    from colozoo.evaluation import ColozooLM, task_manager     # needs lm-eval: pip install 'colozoo[eval]'

`ColozooLM` (colozoo.evaluation.harness) is the harness's model interface over a colozoo model; `task_manager()` finds
the small tasks shipped with colozoo (colozoo.evaluation.tasks) beside the harness's own; `evaluate`
(colozoo.evaluation.run) is what `colozoo eval` and `colozoo finetune --eval-tasks` run.
"""
from __future__ import annotations

from colozoo.evaluation.run import SHIPPED_TASKS, evaluate, require_lm_eval, task_manager


def __getattr__(name):
    if name == "ColozooLM":  # imports lm-eval (an optional dependency)
        from colozoo.evaluation.harness import ColozooLM

        return ColozooLM
    raise AttributeError(name)


__all__ = ["ColozooLM", "SHIPPED_TASKS", "evaluate", "require_lm_eval", "task_manager"]
