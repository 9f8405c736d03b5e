"""How a mutation switches a feature off in the running code (no file is edited), and what it names.

A target is "module:qualname" (an attribute of a module, or of a class in it: "colozoo.layers.moe:Router.forward").

    replace(target, make)          the target becomes make(original)
    Rewrite(target, (old, new))    the target function compiled again from its source with `old` (text found exactly
                                   once) replaced by `new`: a switch-off inside a function, without copying it

A replaced function or class, target in the module that defines it, is replaced too in every loaded module that
imported it by name (`from m import f` binds its own copy of the name); targeted where it was imported, it is replaced
there only. A target's source is part of the mutation's fingerprint, so a change to the code switched off makes CI
run the mutation whole (tests/helpers/mutations.py).
"""
from __future__ import annotations

import __future__
import importlib
import inspect
import sys
import textwrap
from dataclasses import dataclass


@dataclass(frozen=True)
class Mutation:
    what: str               # the feature switched off, in words
    patch: callable         # applies it
    tests: tuple            # pytest ids, every one of which must fail

    @property
    def targets(self) -> tuple:
        """The code switched off: a Rewrite's target, or what @switches names on a patch function."""
        return getattr(self.patch, "targets", ())

    def patch_text(self) -> str:
        """The patch as text, for the fingerprint."""
        return repr(self.patch) if isinstance(self.patch, Rewrite) else inspect.getsource(self.patch)


def switches(*targets: str):
    """Names the code a patch function switches off (its targets, for the fingerprint and the check that the patch
    changes them)."""
    def mark(patch):
        patch.targets = targets
        return patch
    return mark


def resolve(target: str):
    """(the object holding the attribute, the attribute's name) of "module:qualname"."""
    module_name, _, qualname = target.partition(":")
    owner = importlib.import_module(module_name)
    *path, name = qualname.split(".")
    for part in path:
        owner = getattr(owner, part)
    return owner, name


def current(target: str):
    """The target's object as the running code holds it now (the raw descriptor for a class attribute)."""
    owner, name = resolve(target)
    return inspect.getattr_static(owner, name)


def source(target: str) -> str:
    """The source of the target (its module's when it has none of its own: a constant)."""
    obj = current(target)
    obj = getattr(obj, "fget", None) or getattr(obj, "__func__", None) or obj
    try:
        return inspect.getsource(obj)
    except (OSError, TypeError):
        return inspect.getsource(sys.modules[target.partition(":")[0]])


def _set(target: str, new):
    owner, name = resolve(target)
    old = current(target)
    setattr(owner, name, new)
    if not isinstance(owner, type) and getattr(old, "__module__", None) == owner.__name__:
        # defined in that module: also where it was imported by name
        for module in list(sys.modules.values()):
            if module is not owner and getattr(module, name, None) is old:
                setattr(module, name, new)


def replace(target: str, make):
    """`target` becomes make(original)."""
    _set(target, make(current(target)))


class Rewrite:
    """Compile the target function again with each (old, new) pair's `old` replaced by `new` in its source (`old`
    must occur exactly once; the source is dedented: a method's body starts 4 spaces in)."""

    def __init__(self, target: str, *pairs: tuple[str, str]):
        self.target, self.pairs = target, pairs
        self.targets = (target,)

    def __repr__(self):
        return f"Rewrite({self.target!r}, {', '.join(map(repr, self.pairs))})"

    def __call__(self):
        original = current(self.target)
        function = original.fget if isinstance(original, property) else getattr(original, "__func__", original)
        lines, first = inspect.getsourcelines(function)
        text = textwrap.dedent("".join(lines))
        if "super()" in text:
            raise ValueError(f"{self.target}: a function calling super() cannot be compiled again outside its class")
        for old, new in self.pairs:
            if text.count(old) != 1:
                raise ValueError(f"{self.target}: {old!r} occurs {text.count(old)} times in its source, not once")
            text = text.replace(old, new)
        module = sys.modules[function.__module__]
        flags = __future__.annotations.compiler_flag  # annotations stay text, as under the modules' own future import
        # at its own lines of its file, so that tracebacks point at the source
        code = compile("\n" * (first - 1) + text, inspect.getsourcefile(function), "exec", flags=flags,
                       dont_inherit=True)
        scope: dict = {}
        exec(code, module.__dict__, scope)  # noqa: S102 (the project's own source, one snippet changed)
        new_function = scope[function.__name__]  # decorators in the source (property, no_grad...) applied again
        if isinstance(original, (classmethod, staticmethod)) and not isinstance(new_function, type(original)):
            new_function = type(original)(new_function)
        _set(self.target, new_function)
