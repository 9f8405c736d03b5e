"""Names and numbers as users write and read them, without torch (the CLI parses and `colozoo models` prints
with these before anything heavy is imported)."""
from __future__ import annotations

import argparse

DTYPE_NAMES = {"fp32": "float32", "float32": "float32", "fp16": "float16", "float16": "float16",
               "half": "float16", "bf16": "bfloat16", "bfloat16": "bfloat16"}  # what users write -> torch's name
FLOAT_CHOICES = ("float32", "bfloat16", "float16")   # what CLIs offer


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
