"""The `colozoo` command. Each subcommand lives beside the code it drives and registers itself here.

Start-up stays light: every `add_parser` module imports no torch (its command's `func` imports the heavy
implementation when it runs), so `colozoo --help` and `colozoo models` never import torch
(tests/test_startup.py keeps it so)."""
from __future__ import annotations

import argparse
import atexit
import importlib
import os
import sys
import threading
import traceback

# subcommand -> module exposing `add_parser(subparsers)`; the parser's `func(args)` returns an exit code
COMMANDS = {
    "models": "colozoo.registry",
    "convert": "colozoo.convert_cli",
    "finetune": "colozoo.finetune",
    "generate": "colozoo.generate_cli",
    "eval": "colozoo.eval_cli",
    "profile": "colozoo.cost.profile_cli",
    "plan": "colozoo.cost.plan_cli",
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="colozoo", description="Pre-parallelized transformers: list models, convert and reshard checkpoints, "
                                    "fine-tune, generate, evaluate, profile and plan a device mesh.")
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
    except (ValueError, OSError, NotImplementedError) as e:  # OSError: a missing file, a full disk, no permission
        _report(e, f"colozoo {args.command}: ", expected=True)  # under torchrun: the first failing rank's line
        return 1
    except Exception as e:  # noqa: BLE001 - a peer's failure seen in a collective: one line; a bug: its traceback
        if _report(e, f"colozoo {args.command}: ", expected=False):
            return 1
        raise


def _report(error: Exception, prefix: str, expected: bool) -> bool:
    if "torch" not in sys.modules:  # failed before any process group could exist: no torch to import for it
        if expected:
            print(f"{prefix}error: {error}", file=sys.stderr)
        return expected
    from colozoo.runtime.failures import report_failure

    return report_failure(error, expected=expected, prefix=prefix)


def main_and_exit():
    """The console script: `main`, then an exit that skips the last garbage collections over every object torch
    and transformers created (0.5 s on a 2-core machine) and the teardown of extension modules (triton's nanobind
    bindings would report every object still alive as leaked). Exit handlers still run and output is flushed;
    commands close and fsync what they write themselves."""
    try:
        code = main()
    except SystemExit as e:  # argparse's usage errors and --help
        code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
        if not isinstance(e.code, (int, type(None))):
            print(e.code, file=sys.stderr)
    except KeyboardInterrupt:
        code = 130
    except Exception:  # noqa: BLE001 - a bug: its traceback, then the same quiet exit
        traceback.print_exc()
        code = 1
    for thread in threading.enumerate():  # what a plain exit waits for
        if thread is not threading.main_thread() and not thread.daemon:
            thread.join()
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):  # a closed pipe or stream: nothing more can reach it
            pass
    os._exit(code)


if __name__ == "__main__":
    main_and_exit()
