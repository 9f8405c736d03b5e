"""The `colozoo` command. Each subcommand lives beside the code it drives and registers itself here.

Start-up stays light: every `add_parser` module imports no torch (its command's `func` imports the heavy
implementation when it runs), so `colozoo --help` and `colozoo models` never import torch
(tests/test_startup.py keeps it so)."""
from __future__ import annotations

import argparse
import gc
import importlib
import sys

# subcommand -> module exposing `add_parser(subparsers)`; the parser's `func(args)` returns an exit code
COMMANDS = {
    "models": "colozoo.registry",
    "convert": "colozoo.checkpoint.convert_cli",
    "finetune": "colozoo.finetune",
    "generate": "colozoo.generate_cli",
    "profile": "colozoo.cost.profile_cli",
    "plan": "colozoo.cost.plan_cli",
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="colozoo", description="Pre-parallelized transformers: list models, convert and reshard checkpoints, "
                                    "fine-tune, generate, profile and plan a device mesh.")
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name, module in COMMANDS.items():
        try:
            importlib.import_module(module).add_parser(subparsers)
        except ModuleNotFoundError as e:
            if e.name != module:
                raise
    return parser


def main(argv=None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "func", None):
        parser.print_help()
        return 2
    try:
        return int(args.func(args) or 0)
    except (ValueError, FileNotFoundError, FileExistsError) as e:
        print(f"colozoo {args.command}: error: {e}", file=sys.stderr)
        return 1


def main_and_exit():
    """The console script: `main`, then an exit that skips the last garbage collections over every object torch
    and transformers created (0.5 s on a 2-core machine). Commands close and fsync what they write themselves."""
    code = main()
    gc.freeze()
    sys.exit(code)


if __name__ == "__main__":
    main_and_exit()
