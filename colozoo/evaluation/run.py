"""One evaluation with lm-evaluation-harness: the tasks found and loaded (bad names and data are one line, early), the
harness run on every rank, and its results with the time it took and the tokens per second the model went through.

    results = evaluate(lm, load_tasks(["colozoo_mc"], manager=task_manager()), limit=10)   # rank 0: the results
    print(table(results))
"""
from __future__ import annotations

import contextlib
import difflib
import functools
import json
import time
from pathlib import Path
from unittest import mock

SHIPPED_TASKS = Path(__file__).resolve().parent / "tasks"
INSTALL = "pip install 'colozoo[eval]' (lm-evaluation-harness)"


def require_lm_eval(what: str):
    """lm-eval, or one line saying what to install."""
    try:
        import lm_eval  # noqa: F401
        import lm_eval.models.huggingface  # noqa: F401  (the backend ColozooLM builds on: transformers, accelerate)
    except ImportError as e:
        raise ValueError(f"{what} needs lm-eval, which is not installed ({e.name} is missing): {INSTALL}") from None


def check_causal_lm(config, name):
    """One line for a checkpoint without a causal LM head (an encoder such as BERT): the harness scores and
    generates text with one."""
    from colozoo.models import model_class

    cls = model_class(config.model_type)
    cls = cls.for_task(config, None) if hasattr(cls, "for_task") else cls
    if cls.task != "causal_lm":
        raise ValueError(f"{name} is a {cls.__name__} ({cls.task} head), not a causal language model: lm-eval scores "
                         f"and generates text with a causal LM head")


def task_manager(include_path=None, names: list[str] | None = None):
    """lm-eval's TaskManager over the tasks shipped with colozoo, the folders of `include_path` (a path or a list;
    their tasks take precedence) and the harness's own tasks. Indexing the harness's thousands of tasks takes seconds:
    given the `names` to find, it is skipped when the shipped and included folders hold them all."""
    from lm_eval.tasks import TaskManager

    paths = [str(SHIPPED_TASKS), *map(str, _as_list(include_path))]
    for path in paths[1:]:
        if not Path(path).is_dir():
            raise ValueError(f"--include-path {path} is not a directory of lm-eval task YAML files")
    if names is not None:
        local = TaskManager(include_path=paths, include_defaults=False)
        if all(_resolve(local, name) for name in names):
            return local
    return _with_the_harness_tasks(tuple(paths))


@functools.lru_cache(maxsize=4)
def _with_the_harness_tasks(paths: tuple[str, ...]):
    """A TaskManager over `paths` and the harness's own tasks, indexed once per process (seconds: thousands of YAML
    files); it builds new task objects at every load."""
    from lm_eval.tasks import TaskManager

    return TaskManager(include_path=list(paths))


def load_tasks(names: list[str], manager) -> list:
    """The tasks (groups, tags) of `names` built, with their data, for lm_eval.simple_evaluate: an unknown name or data
    that does not load is one line naming the task."""
    from lm_eval.api.group import Group

    if not names:
        raise ValueError("give at least one task (--tasks NAME[,NAME...]; `lm_eval ls tasks` lists the harness's)")
    unknown = [name for name in names if not _resolve(manager, name)]
    if unknown:
        close = difflib.get_close_matches(unknown[0], manager.all_tasks, n=3)
        hint = f"; did you mean {', '.join(close)}?" if close else " (colozoo ships colozoo_mc, colozoo_ppl and " \
                                                                   "colozoo_gen; --include-path adds a folder of yours)"
        raise ValueError(f"unknown task {unknown[0]!r}{hint}")
    built = []
    for name in dict.fromkeys(found for name in names for found in _resolve(manager, name)):
        try:
            loaded = manager.load([name])
        except Exception as e:  # noqa: BLE001 - datasets' errors have no common type: the task's name and the cause
            raise ValueError(f"task {name}: its data did not load: {_first_line(e)}") from None
        group = loaded["groups"].get(name)
        built += [group] if isinstance(group, Group) else list(loaded["tasks"].values())
    return built


def evaluate(lm, tasks: list, manager, num_fewshot: int | None = None, limit: float | None = None,
             log_samples: bool = False, seed: int = 1234, environment: bool = True) -> dict | None:
    """lm_eval.simple_evaluate of `lm` on `tasks` (load_tasks' from `manager`), on every rank of the job; the harness's
    results on rank 0 with a "colozoo" entry (seconds, tokens the model read and wrote on every dp replica, tokens per
    second of rank 0's model time), None on the other ranks. `environment=False` leaves out the harness's description of
    the machine (torch's collect_env, which runs `pip list` and more: seconds at every call), for scores logged during
    training."""
    import lm_eval
    import lm_eval.evaluator

    started = time.perf_counter()
    counts = getattr(lm, "counts", {"tokens": 0, "model_s": 0.0})
    before = dict(counts)
    describe = contextlib.nullcontext() if environment else \
        mock.patch.object(lm_eval.evaluator, "add_env_info", lambda results: None)
    with describe:
        results = lm_eval.simple_evaluate(model=lm, tasks=tasks, num_fewshot=num_fewshot, limit=limit,
                                          batch_size=getattr(lm, "batch_size", None), log_samples=log_samples,
                                          task_manager=manager, random_seed=seed, numpy_random_seed=seed,
                                          torch_random_seed=seed, fewshot_random_seed=seed)
    if results is None:
        return None
    tokens, model_s = counts["tokens"] - before["tokens"], counts["model_s"] - before["model_s"]
    results["colozoo"] = {"seconds": time.perf_counter() - started, "model_seconds": model_s, "tokens": tokens,
                          "tokens_per_s": tokens / model_s if model_s > 0 else None}
    return results


def scores(results: dict) -> dict:
    """Every task's metrics as flat `task/metric` numbers (the filter named where it is not "none"; no stderr), as
    metrics.jsonl and TensorBoard take them."""
    flat = {}
    for task, metrics in (results or {}).get("results", {}).items():
        for key, value in metrics.items():
            metric, _, where = key.partition(",")
            if not where or "_stderr" in metric or isinstance(value, bool) or not isinstance(value, (int, float)):
                continue
            flat[f"{task}/{metric}" + (f"/{where}" if where != "none" else "")] = value
    return flat


def table(results: dict) -> str:
    """The harness's own tables (lm_eval.utils.make_table): the tasks, then the groups when there are any."""
    from lm_eval.utils import make_table

    out = make_table(results)
    if results.get("groups"):
        out += "\n" + make_table(results, "groups")
    return out


def write_results(results: dict, path) -> Path:
    """The results as the harness's CLI writes them (JSON, what is not JSON as text), whole or not at all."""
    from lm_eval.utils import handle_non_serializable

    from colozoo.core.files import fsync_write

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    text = json.dumps(results, indent=2, default=handle_non_serializable, ensure_ascii=False)
    fsync_write(path, lambda f: f.write(text.encode()))
    return path


def _resolve(manager, name: str) -> list[str]:
    """The task names `name` stands for: itself (a task, group or tag, or a task YAML file), or what it matches as a
    glob pattern ("colozoo_*"); none when it is unknown."""
    if name in manager.all_tasks or Path(name).suffix in (".yaml", ".yml") and Path(name).is_file():
        return [name]
    return manager.match_tasks([name]) if any(c in name for c in "*?[") else []


def _as_list(value) -> list:
    if value is None:
        return []
    return list(value) if isinstance(value, (list, tuple)) else [value]


def _first_line(error: BaseException) -> str:
    text = str(error).strip().splitlines()
    return f"{type(error).__name__}: {text[0] if text else ''}".rstrip(": ")
