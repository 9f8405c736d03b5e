"""Start-up stays light: `import colozoo`, `colozoo --help`, every subcommand's --help and `colozoo models` import
neither torch nor transformers (parsers live in light modules, parameter counts are stored in the registry), and
`colozoo --help` takes about as long as Python itself, not as `import torch`."""
from __future__ import annotations

import subprocess
import sys
import time

import pytest

from colozoo.cli import COMMANDS

HEAVY = ("torch", "transformers", "numpy", "safetensors")
SLACK_S = 0.5  # on top of the goal (within 0.5 s of import torch), for a busy shared machine


def imported_modules(*args: str) -> set[str]:
    """Top-level packages a fresh interpreter imports running `python -X importtime ARGS`."""
    proc = subprocess.run([sys.executable, "-X", "importtime", *args], capture_output=True, text=True, timeout=300)
    assert proc.returncode in (0, 2), proc.stderr[-2000:]
    return {line.rsplit("|", 1)[1].strip().split(".")[0] for line in proc.stderr.splitlines()
            if line.startswith("import time:") and "|" in line}


@pytest.mark.parametrize("args", [["-c", "import colozoo"], ["-m", "colozoo.cli", "--help"],
                                  ["-m", "colozoo.cli", "models"],
                                  *(["-m", "colozoo.cli", command, "--help"] for command in COMMANDS)],
                         ids=lambda args: " ".join(args[1:]))
def test_no_heavy_imports(args):
    found = imported_modules(*args)
    assert "colozoo" in found  # the check sees our imports at all
    heavy = sorted(set(HEAVY) & found)
    assert not heavy, f"python {' '.join(args)} imports {heavy}"


def test_a_heavy_import_is_seen():
    assert "torch" in imported_modules("-c", "import colozoo.core.mesh")


def wall(*args: str, repeats: int = 3) -> float:
    """The fastest of a few runs (the machine is shared: the minimum is the least noisy)."""
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        subprocess.run([sys.executable, *args], capture_output=True, check=True, timeout=300)
        best = min(best, time.perf_counter() - start)
    return best


def test_help_is_within_half_a_second_of_import_torch():
    torch_s = wall("-c", "import torch")
    help_s = wall("-m", "colozoo.cli", "--help")
    assert help_s < torch_s + 0.5 + SLACK_S, f"colozoo --help {help_s:.2f} s, import torch {torch_s:.2f} s"


def seconds_to_exit(through_console_script: bool, repeats: int = 3) -> float:
    """From a command's end, after `import torch`, to the process's end: through the console script's
    `main_and_exit` or a plain `sys.exit` (the fastest of a few runs)."""
    stamp = "sys.stderr.write(repr(time.time())), sys.stderr.flush()"
    end = f"cli.main = lambda: ({stamp}, 0)[-1]; cli.main_and_exit()" if through_console_script \
        else f"{stamp}; sys.exit(0)"
    code = f"import sys, time, torch; import colozoo.cli as cli; {end}"
    best = float("inf")
    for _ in range(repeats):
        proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=300)
        best = min(best, time.time() - float(proc.stderr.splitlines()[0]))
    return best


def test_the_console_script_exits_without_collecting_every_object_of_torch():
    plain, script = seconds_to_exit(through_console_script=False), seconds_to_exit(through_console_script=True)
    assert script < 0.6 * plain, f"the console script exits in {script:.2f} s, a plain exit in {plain:.2f} s"
