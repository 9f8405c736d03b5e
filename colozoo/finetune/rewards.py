"""Reward functions as TRL's GRPOTrainer takes them: Python callables, named on the command line as `module:function`
or `path/to/file.py:function`, called on a batch of completions as

    f(prompts=[...], completions=[...], completion_ids=[[...]], trainer_state=..., log_extra=..., log_metric=...,
      **other_columns_of_the_records) -> [float | None, ...]       # one per completion; None: does not apply

Conversational prompts come as message lists and completions as [{"role": "assistant", "content": text}], as in
TRL. A function that cannot be imported, raises, returns another number of rewards or something that is not a
number stops the run with one line naming it (RewardError).
"""
from __future__ import annotations

import importlib
import math
import numbers
import os
import sys
from pathlib import Path
import types
from contextlib import contextmanager
from types import SimpleNamespace

import torch


class RewardError(ValueError):
    """A reward function that failed on the completions of a step."""


def reward_name(spec) -> str:
    """How a reward function is named in messages: its module:function."""
    if isinstance(spec, str):
        return spec
    return f"{getattr(spec, '__module__', '?')}:{getattr(spec, '__qualname__', type(spec).__name__)}"


def metric_name(func) -> str:
    """TRL's name of a reward function in the metrics (rewards/<name>/mean): its __name__."""
    return getattr(func, "__name__", type(func).__name__)


def load_reward(spec):
    """The callable `spec` names (module:function, or path/to/file.py:function), or `spec` itself if callable."""
    if callable(spec):
        return spec
    module, sep, name = str(spec).rpartition(":")
    if not sep or not module or not name:
        raise ValueError(f"--reward-funcs {spec!r}: name each reward function as module:function or "
                         f"path/to/file.py:function")
    try:
        with searched_first(reward_directory(spec)):
            loaded = _import_file(module) if module.endswith(".py") else importlib.import_module(module)
    except Exception as e:  # noqa: BLE001 - whatever importing the user's module raises is reported as one line
        raise ValueError(f"--reward-funcs {spec}: cannot import {module}: {type(e).__name__}: {e}") from None
    func = getattr(loaded, name, None)
    if func is None:
        raise ValueError(f"--reward-funcs {spec}: {module} has no {name!r}")
    if not callable(func):
        raise ValueError(f"--reward-funcs {spec}: {module}.{name} is a {type(func).__name__}, not a function")
    return func


def reward_directory(spec) -> str | None:
    """Where the modules beside a reward function are found, as `python -m module` or `python file.py` finds them:
    the working directory for module:function, the file's directory for path/to/file.py:function (None: a callable
    given from Python, imported by its caller)."""
    if callable(spec):
        return None
    module = str(spec).rpartition(":")[0]
    return str(Path(module).resolve().parent) if module.endswith(".py") else os.getcwd()


@contextmanager
def searched_first(directory: str | None):
    """`directory` first on sys.path inside the block only (for a reward's imports, when it is imported and whenever
    it is called: a module it imports lazily is found too), so later imports of the process do not find the user's
    files first."""
    added = directory is not None and directory not in sys.path
    if added:
        sys.path.insert(0, directory)
    try:
        yield
    finally:
        if added:
            sys.path.remove(directory)


def _import_file(path: str):
    file = Path(path)
    if not file.is_file():
        raise FileNotFoundError(f"no file {file}")
    name = f"colozoo_rewards_{abs(hash(str(file.resolve())))}"
    if name in sys.modules:
        return sys.modules[name]
    module = types.ModuleType(name)
    module.__file__ = str(file)
    sys.modules[name] = module
    try:  # compiled here: no __pycache__ left beside the user's file
        exec(compile(file.read_text(), str(file), "exec"), module.__dict__)
    except BaseException:
        del sys.modules[name]
        raise
    return module


class RewardFunctions:
    """The run's reward functions and their weights (--reward-funcs, --reward-weights)."""

    def __init__(self, specs: list, weights: tuple[float, ...]):
        self.specs = [reward_name(s) for s in specs]
        self.funcs = [load_reward(s) for s in specs]
        self.directories = [reward_directory(s) for s in specs]
        self.names = [metric_name(f) for f in self.funcs]
        self.weights = torch.tensor(weights, dtype=torch.float32)

    def __call__(self, prompts: list, completions: list, completion_ids: list, columns: dict[str, list],
                 step: int, total_steps: int) -> tuple[torch.Tensor, dict, dict]:
        """(rewards (completions, functions) in float32, NaN where a function returned None; the metrics the
        functions logged through log_metric, averaged; the columns they added through log_extra)."""
        logged_metrics: dict[str, list] = {}
        logged_columns: dict[str, list] = {}
        state = SimpleNamespace(global_step=step - 1, max_steps=total_steps)
        out = torch.zeros(len(completions), len(self.funcs))
        for i, (func, spec, directory) in enumerate(zip(self.funcs, self.specs, self.directories)):
            try:
                with searched_first(directory):
                    values = func(prompts=prompts, completions=completions, completion_ids=completion_ids,
                                  trainer_state=state,
                                  log_extra=lambda c, v: logged_columns.setdefault(c, []).extend(v),
                                  log_metric=lambda n, v: logged_metrics.setdefault(n, []).append(float(v)),
                                  **columns)
            except Exception as e:  # noqa: BLE001 - the user's function: one line naming it
                hint = " (reward functions take **kwargs: every column of the records is passed)" \
                    if isinstance(e, TypeError) and "unexpected keyword" in str(e) else ""
                raise RewardError(f"reward function {spec} raised {type(e).__name__}: {e} at step {step}, on "
                                  f"{len(completions)} completions{hint}") from None
            out[:, i] = self._checked(values, spec, len(completions), step)
        return out, {k: sum(v) / len(v) for k, v in logged_metrics.items()}, logged_columns

    @staticmethod
    def _checked(values, spec: str, expected: int, step: int) -> torch.Tensor:
        try:
            values = list(values)
        except TypeError:
            raise RewardError(f"reward function {spec} returned a {type(values).__name__} at step {step}, not a list "
                              f"of {expected} rewards (one per completion, None where it does not apply)") from None
        if len(values) != expected:
            raise RewardError(f"reward function {spec} returned {len(values)} rewards for {expected} completions at "
                              f"step {step}: one per completion (None where it does not apply)")
        for j, value in enumerate(values):
            if value is not None and not isinstance(value, numbers.Real) and \
                    not (isinstance(value, torch.Tensor) and value.numel() == 1):
                raise RewardError(f"reward function {spec} returned {value!r} (a {type(value).__name__}) for "
                                  f"completion {j} at step {step}: rewards are numbers, or None")
        return torch.tensor([math.nan if v is None else float(v) for v in values], dtype=torch.float32)
