"""Names and numbers as users write and read them, without torch (the CLI parses and `colozoo models` prints
with these before anything heavy is imported)."""
from __future__ import annotations

import argparse

# the dtype names transformers accepts (torch's: `getattr(torch, name)`) for the floating dtypes colozoo computes in
DTYPE_NAMES = {"float32": "float32", "float": "float32", "bfloat16": "bfloat16", "float16": "float16",
               "half": "float16"}
FLOAT_CHOICES = ("float32", "bfloat16", "float16")   # what every command's --dtype offers
SHORT_DTYPE_NAMES = {"fp32": "float32", "fp16": "float16", "bf16": "bfloat16"}  # refused, with the name to write


def check_dtype_name(name: str, what: str = "dtype") -> str:
    """torch's name of a dtype name transformers accepts ('auto': returned as it is); anything else is refused in
    one line listing what is accepted."""
    if name == "auto" or name in DTYPE_NAMES:
        return DTYPE_NAMES.get(name, name)
    hint = f"; for {name!r} write {SHORT_DTYPE_NAMES[name]!r}" if name in SHORT_DTYPE_NAMES else ""
    raise ValueError(f"{what}={name!r} is not a dtype transformers accepts: give a torch.dtype, 'auto' (the "
                     f"checkpoint's) or one of {', '.join(repr(n) for n in DTYPE_NAMES)}{hint}")


def human_bytes(nbytes: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(nbytes) < 1024 or unit == "TiB":
            return f"{nbytes:.0f} {unit}" if unit == "B" else f"{nbytes:.2f} {unit}"
        nbytes /= 1024


def human_count(n: int | None) -> str:
    """A parameter count as 124.4M, 1.2B (? when unknown)."""
    if n is None:
        return "?"
    for unit, scale in (("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if n >= scale:
            return f"{n / scale:.1f}{unit}"
    return str(n)


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Every command's --help: each option's default, except where the help already says it, there is none, or the
    option is a plain flag."""

    def _get_help_string(self, action):
        if action.default is None or "default" in (action.help or "") or isinstance(action, argparse._StoreTrueAction):
            return action.help
        return super()._get_help_string(action)
