"""`colozoo finetune --nproc-per-node N`: torchrun's own launcher (`torch.distributed.run --standalone`) run in this
process, with Ctrl-C and SIGTERM handled so that an interrupted job ends as its workers do.

Plain torchrun turns SIGINT / SIGTERM into a `SignalException`: its agent sends the signal on to the workers,
SIGKILLs those still running after 30 s (a big model's save can take longer) and exits 1 with a long traceback,
although every rank saved. Here torchelastic is told to leave SIGINT and SIGTERM alone
(TORCHELASTIC_SIGNALS_TO_HANDLE); this process passes them on to its workers instead (they finish the step, save and
exit 0, and ignore the copy of a Ctrl-C the terminal sent them too) and the agent keeps waiting for them, so the
job exits 0 after a clean save, with rank 0's one line. A second Ctrl-C stops the workers at once (exit 130).
"""
from __future__ import annotations

import os
import signal
import sys
from pathlib import Path

PASSED_ON = (signal.SIGINT, signal.SIGTERM)
UNDER_TORCHRUN = "TORCHELASTIC_RUN_ID"  # set in every worker torchrun (or this launcher) starts


def under_torchrun() -> bool:
    return UNDER_TORCHRUN in os.environ


def _children(pid: int) -> list[int]:
    """The processes whose parent is `pid` (Linux /proc; elsewhere none)."""
    found = []
    for entry in Path("/proc").glob("[0-9]*"):
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        if int(stat.rsplit(")", 1)[1].split()[1]) == pid:  # "pid (comm) state ppid ...": comm may hold spaces
            found.append(int(entry.name))
    return found


class PassOn:
    """A SIGINT / SIGTERM handler: send the signal on to the workers and let the launcher wait for them."""

    def __init__(self):
        self.count = 0

    def __call__(self, signum, frame):
        self.count += 1
        workers = _children(os.getpid())
        if not workers:  # no worker started yet: nothing to save
            raise KeyboardInterrupt
        for pid in workers:
            try:
                os.kill(pid, signum)
            except ProcessLookupError:
                pass


def launch(nproc_per_node: int, worker_args: list[str], module: str = "colozoo.finetune",
           command: str = "finetune") -> int:
    """`python -m MODULE WORKER_ARGS` on `nproc_per_node` processes of this machine; the exit code. `command`: the
    colozoo command it runs, as messages name it."""
    from torch.distributed import run as torchrun
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError

    os.environ.setdefault("OMP_NUM_THREADS", "1")  # what torchrun sets, without its warning banner
    # torchelastic handles the rest (TORCHELASTIC_SIGNALS_TO_HANDLE); SIGINT and SIGTERM are PassOn's
    args = torchrun.parse_args(["--standalone", "--nproc-per-node", str(nproc_per_node), "--signals-to-handle",
                                "SIGHUP,SIGQUIT", "-m", module, *worker_args])
    handler = PassOn()
    previous = {sig: signal.signal(sig, handler) for sig in PASSED_ON}
    try:
        torchrun.run(args)
        return 0
    except ChildFailedError as e:
        if handler.count > 1:
            print("stopped at once (a second Ctrl-C); rerun the same command to resume from the last complete "
                  "checkpoint", file=sys.stderr)
            return 130
        _, first = e.get_first_failure()  # by the time each worker's error file gives (colozoo.runtime.failures)
        print(f"colozoo {command}: {len(e.failures)} of {nproc_per_node} processes failed (first exit code "
              f"{first.exitcode}); the first error is above", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("interrupted before training started; nothing was saved" if command == "finetune" else "interrupted",
              file=sys.stderr)
        return 130
    finally:
        for sig, old in previous.items():
            signal.signal(sig, old)


def command_line(parser, args, leave_out=("nproc_per_node",)) -> list[str]:
    """The arguments `parser` parsed into `args`, as a command line that parses back to them (what the workers of
    `--nproc-per-node` get), less the options named in `leave_out`."""
    import argparse

    argv = []
    for action in parser._actions:
        value = getattr(args, action.dest, None)
        if action.dest in leave_out or isinstance(action, argparse._HelpAction) or value is None:
            continue
        if not action.option_strings:
            argv.append(str(value))
        elif isinstance(action, argparse.BooleanOptionalAction):
            argv.append(action.option_strings[0] if value else action.option_strings[1])
        elif isinstance(action, argparse._StoreTrueAction):
            argv += [action.option_strings[0]] if value else []
        elif isinstance(action, argparse._AppendAction):
            argv += [f"{action.option_strings[0]}={item}" for item in value]  # '=': a value may start with '-'
        else:
            argv.append(f"{action.option_strings[0]}={value}")
    return argv
