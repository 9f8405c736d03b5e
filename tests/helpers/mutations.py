"""Switch features off, one at a time, and check that the tests named for them fail.

A test named for a feature that still passes with the feature off proves nothing. Each mutation (mutations_*.py)
patches the running code (tests/helpers/mutation_tools.py: no file is edited) and names the tests that must then
fail:

    python tests/helpers/mutations.py                    # every mutation; exit 1 unless each named test fails
    python tests/helpers/mutations.py ring_window_off_by_one checkpoint_recomputes_nothing
    make mutations                                       # the whole audit, recorded in mutations_audit.json
    make mutations-ci                                    # what CI runs after `make test` (see ci_plan)

Before any test runs, every patch is applied in a fresh process and must change the code it names (a renamed
attribute would make its tests fail for the wrong reason). Then a control run: the named tests, in one pytest
without any mutation, must each be collected and pass. Each named test then runs in a pytest of its own under its
mutation; it is caught only if pytest reports that test itself failed (tests/helpers/mutation_report.py): a test
not collected, skipped, or failing in its setup is an error of the audit, not a catch.

`COLOZOO_MUTATION=<name>` applies a mutation in every python process of the run: the pytest process
(tests/conftest.py), the distributed workers (tests/helpers/distributed.py), and, through
tests/helpers/mutation_site/sitecustomize.py (first on PYTHONPATH), whatever else the tests start (launcher and
torchrun children, CLI subprocesses), right after it imports colozoo.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from mutation_tools import current, source
from mutations_faults import FAULTS
from mutations_finetune import FINETUNE
from mutations_generate import GENERATE
from mutations_kernels import KERNELS
from mutations_models import MODELS
from mutations_parallel import PARALLEL
from mutations_planner import PLANNER
from mutations_preference import PREFERENCE

ENV = "COLOZOO_MUTATION"
MUTATIONS = {**PARALLEL, **MODELS, **GENERATE, **FINETUNE, **KERNELS, **FAULTS, **PREFERENCE, **PLANNER}
HELPERS = Path(__file__).resolve().parent
ROOT = HELPERS.parents[1]
AUDIT = HELPERS / "mutations_audit.json"  # the last whole audit: fingerprints and seconds per test
TEST_TIMEOUT = 900  # seconds of one pytest under a mutation (pytest-timeout ends a hung test sooner)
_applied: list[str] = []


def apply_from_environment():
    """Apply the mutation named by COLOZOO_MUTATION, if any, once per process (conftest.py, the distributed workers
    and mutation_site/sitecustomize.py each call it)."""
    name = os.environ.get(ENV)
    if name and not _applied:
        if name not in MUTATIONS:
            raise SystemExit(f"{ENV}={name!r} is not a mutation; known: {sorted(MUTATIONS)}")
        import torch

        if not torch.cuda.is_available():  # as tests/conftest.py: a patch importing a kernel fixes triton's mode
            os.environ.setdefault("TRITON_INTERPRET", "1")
        _applied.append(name)  # first: the patch's own import of colozoo comes back here (sitecustomize)
        MUTATIONS[name].patch()


def fingerprint(name: str) -> str:
    """What a mutation's verdict depends on: its patch, the source of the code it switches off, and its named test
    files."""
    mutation = MUTATIONS[name]
    digest = hashlib.sha256(f"{name}\n{mutation.what}\n{mutation.tests}\n".encode())
    digest.update(mutation.patch_text().encode())
    for target in mutation.targets:
        digest.update(f"{target}\n{source(target)}".encode())
    for file in sorted({test.split("::")[0] for test in mutation.tests}):
        digest.update((ROOT / file).read_bytes())
    return digest.hexdigest()


def _check_patch(name: str) -> str | None:
    """Why mutation `name` does not apply (None: it does), in a process that has not applied any other."""
    mutation = MUTATIONS[name]
    if not mutation.targets:
        return "names no code it switches off (a Rewrite, or @switches on its patch function)"
    try:
        before = [current(t) for t in mutation.targets]
        mutation.patch()
        if all(current(t) is b for t, b in zip(mutation.targets, before)):
            return f"changes none of {list(mutation.targets)}"
    except Exception as error:  # noqa: BLE001 (reported, with its message)
        return f"{type(error).__name__}: {error}"
    return None


def patches_apply(names) -> list[str]:
    """Every mutation's patch applied in a process of its own (forked from one that imported colozoo), and
    COLOZOO_MUTATION applied by sitecustomize in a child process; the problems found, one line each."""
    script = ("import importlib, os, sys; sys.path.insert(0, 'tests/helpers'); import mutations\n"
              "for module in {t.partition(':')[0] for m in mutations.MUTATIONS.values() for t in m.targets}:\n"
              "    importlib.import_module(module)  # once, before the forks\n"
              "for name in sys.argv[1:]:\n"
              "    pid = os.fork()\n"
              "    if pid == 0:\n"
              "        problem = mutations._check_patch(name)\n"
              "        print(f'{name}: {problem}' if problem else '', flush=True)\n"
              "        os._exit(0)\n"
              "    if os.waitpid(pid, 0)[1]:\n"
              "        print(f'{name}: its check process died', flush=True)\n")
    result = subprocess.run([sys.executable, "-c", script, *names], cwd=ROOT, capture_output=True, text=True)
    if result.returncode:
        raise SystemExit(f"applying the patches failed:\n{result.stderr}")
    problems = [line for line in result.stdout.splitlines() if line]
    probe = subprocess.run([sys.executable, "-c", "import colozoo, mutations; print(mutations._applied)"], cwd=ROOT,
                           env=_environment(names[0]), capture_output=True, text=True)
    if probe.stdout.strip() != str([names[0]]):
        problems.append(f"{ENV} is not applied in a child process by sitecustomize: {probe.stderr[-500:]}")
    return problems


def uncollected(tests) -> list[str]:
    """The named tests pytest does not collect (a renamed test or parameter): one such id in the control run's
    command line stops pytest before it runs anything, so every mutation would be reported as not run."""
    files = sorted({test.split("::")[0] for test in tests})
    result = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider", *files],
                            cwd=ROOT, capture_output=True, text=True, env=_environment(None))
    collected = set(result.stdout.splitlines())
    return sorted(test for test in set(tests) if test not in collected)


def _environment(name: str | None) -> dict:
    env = {k: v for k, v in os.environ.items() if k != ENV}
    env["PYTHONPATH"] = os.pathsep.join([str(HELPERS / "mutation_site"), str(HELPERS), env.get("PYTHONPATH", "")])
    return {**env, ENV: name} if name else env


def run_pytest(tests, name: str | None) -> tuple[dict, float]:
    """Run `tests` in one pytest under mutation `name` (None: none); ({test: outcome}, seconds). An outcome is
    pytest's ("passed", "failed", "error", "skipped") with the test's own seconds, or "not collected"."""
    with tempfile.TemporaryDirectory() as tmp:
        report = Path(tmp) / "report.json"
        start = time.perf_counter()
        try:
            result = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p",
                                     "mutation_report", *tests], cwd=ROOT, capture_output=True, text=True,
                                    env={**_environment(name), "COLOZOO_MUTATION_REPORT": str(report)},
                                    timeout=TEST_TIMEOUT * len(tests))
            found = json.loads(report.read_text()) if report.exists() else {"collected": [], "outcomes": {}}
            tail = result.stdout[-2000:] + result.stderr[-2000:]
        except subprocess.TimeoutExpired:
            found, tail = {"collected": [], "outcomes": {}}, f"pytest ran past {TEST_TIMEOUT * len(tests)} s"
        seconds = time.perf_counter() - start
    outcomes = {}
    for test in tests:
        entry = found["outcomes"].get(test) if test in found["collected"] else None
        outcomes[test] = entry or {"outcome": "not collected", "seconds": 0.0, "output": tail}
    return outcomes, seconds


def control(tests) -> dict:
    """The named tests without any mutation, in one pytest: {test: its outcome}; each must pass."""
    start = time.perf_counter()
    outcomes, _ = run_pytest(sorted(set(tests)), None) if tests else ({}, 0)
    bad = {t: o["outcome"] for t, o in outcomes.items() if o["outcome"] != "passed"}
    print(f"control: {len(outcomes) - len(bad)}/{len(outcomes)} named tests pass without a mutation "
          f"({time.perf_counter() - start:.0f}s)" + "".join(f"\n  {o}: {t}" for t, o in bad.items()), flush=True)
    return outcomes


def run(plan: dict[str, tuple], controlled: dict) -> tuple[list[str], dict]:
    """Each mutation's tests in `plan` ({name: tests}), each in a pytest of its own; (the problems: tests that did not
    fail or were not run as named, {name: {test: seconds of its pytest}})."""
    problems, seconds = [], {}
    for name, tests in plan.items():
        mutation, start, caught = MUTATIONS[name], time.perf_counter(), 0
        for test in tests:
            if controlled.get(test, {}).get("outcome") != "passed":
                problems.append(f"{name}: {test}: not run, it does not pass without the mutation (control)")
                continue
            outcomes, wall = run_pytest([test], name)
            seconds.setdefault(name, {})[test] = round(wall, 1)
            outcome = outcomes[test]["outcome"]
            caught += outcome == "failed"
            if outcome != "failed":
                problems.append(f"{name}: {test}: {outcome} under the mutation"
                                + (f"\n{outcomes[test]['output']}" if outcome == "not collected" else ""))
        whole = "" if len(tests) == len(mutation.tests) else f" (fast: {len(tests)} of {len(mutation.tests)})"
        print(f"{'caught ' if caught == len(tests) else 'MISSED '} {name}: {mutation.what}: {caught}/{len(tests)} "
              f"named tests fail{whole} ({time.perf_counter() - start:.0f}s)", flush=True)
    return problems, seconds


def _fastest(entry: dict) -> tuple[str, float]:
    return min(entry["seconds"].items(), key=lambda item: item[1])


def rotation_slots(cost: dict[str, float], capacity: float) -> list[list[str]]:
    """The mutations split into slots of at most `capacity` seconds each (first fit, the costliest first; one that
    alone exceeds it has a slot of its own): the same slots for the same recorded audit."""
    slots: list[tuple[float, list[str]]] = []
    for name in sorted(cost, key=lambda n: (-cost[n], n)):
        for i, (used, members) in enumerate(slots):
            if used + cost[name] <= capacity:
                slots[i] = (used + cost[name], members + [name])
                break
        else:
            slots.append((cost[name], [name]))
    return [members for _, members in slots]


def rotation_index() -> int:
    """Which slot this CI run takes: $MUTATION_ROTATION (a CI's run counter) if set, else the number of commits on
    HEAD's first-parent line (one more at every commit of the main line)."""
    if os.environ.get("MUTATION_ROTATION"):
        return int(os.environ["MUTATION_ROTATION"])
    count = subprocess.run(["git", "rev-list", "--count", "--first-parent", "HEAD"], cwd=ROOT, capture_output=True,
                           text=True).stdout.strip()
    return int(count or 0)


def ci_plan(budget: float) -> dict[str, tuple]:
    """Mutations that changed since mutations_audit.json (their fingerprint: patch, code switched off, test files) or
    are not in it run whole. The recorded ones are split into slots that each fit `budget` seconds (a test's cost:
    its pytest under the mutation plus its share of the control run); this run takes slot rotation_index() % slots,
    each mutation by its fastest test, then packs what else fits, so every mutation runs within len(slots) runs."""
    audit = json.loads(AUDIT.read_text()) if AUDIT.exists() else {"mutations": {}}
    recorded = {n: e for n, e in audit["mutations"].items() if n in MUTATIONS}
    changed = [n for n in MUTATIONS if recorded.get(n, {}).get("fingerprint") != fingerprint(n)]
    plan = {n: MUTATIONS[n].tests for n in changed}
    control_seconds = audit.get("control_seconds", {})
    fastest = {n: _fastest(e)[0] for n, e in recorded.items()}
    cost = {n: recorded[n]["seconds"][t] + control_seconds.get(t, 0.0) for n, t in fastest.items()}
    capacity = budget - audit.get("control_startup", 0.0)
    slots = rotation_slots(cost, capacity) or [[]]
    index = rotation_index() % len(slots)
    left, packed = capacity, 0
    for slot in slots[index:] + slots[:index]:
        for name in slot:
            if name not in plan and (slot is slots[index] or cost[name] <= left):
                plan[name], left, packed = (fastest[name],), left - cost[name], packed + (slot is not slots[index])
    print(f"mutations: {len(changed)} changed since the last whole audit run whole; slot {index + 1} of "
          f"{len(slots)} (rotation {rotation_index()}) by their fastest test, {packed} more packed into the "
          f"{budget:.0f} s budget; every mutation runs within {len(slots)} CI runs", flush=True)
    return plan


def record(seconds: dict, controlled: dict, control_wall: float, wall: float):
    """After a whole audit that caught everything: fingerprints and timings, for ci_plan and the README."""
    mutations = {n: {"fingerprint": fingerprint(n), "seconds": seconds[n], "total": round(sum(seconds[n].values()))}
                 for n in MUTATIONS}
    control_seconds = {t: o["seconds"] for t, o in sorted(controlled.items())}
    AUDIT.write_text(json.dumps({
        "total_seconds": round(wall), "control_seconds_total": round(control_wall),
        "control_startup": round(max(control_wall - sum(control_seconds.values()), 0.0), 1),
        "control_seconds": control_seconds, "mutations": mutations}, indent=1) + "\n")


def readme_table() -> str:
    """The README's table of the recorded audit: each mutation, what it switches off, its tests and seconds."""
    audit = json.loads(AUDIT.read_text())
    rows = ["| mutation | switched off | named tests | whole (s) | fastest test (s) |", "|---|---|---|---|---|"]
    for name, entry in audit["mutations"].items():
        rows.append(f"| `{name}` | {MUTATIONS[name].what} | {len(entry['seconds'])} | {entry['total']} | "
                    f"{_fastest(entry)[1]:.0f} |")
    return "\n".join(rows)


def main(argv) -> int:
    parser = argparse.ArgumentParser(description="Switch features off one at a time; the tests named for each "
                                                 "must fail.")
    parser.add_argument("names", nargs="*", help="mutations to run (default: all, recorded in mutations_audit.json)")
    parser.add_argument("--ci", type=float, metavar="SECONDS", help="the CI form: mutations changed since the last "
                        "whole audit run whole, a rotating slot of the others by their fastest test within SECONDS")
    parser.add_argument("--table", action="store_true", help="print the README's table of the recorded audit")
    args = parser.parse_args(argv)
    if args.table:
        print(readme_table())
        return 0
    unknown = [n for n in args.names if n not in MUTATIONS]
    if unknown:
        raise SystemExit(f"unknown mutation(s) {unknown}; known: {sorted(MUTATIONS)}")
    start = time.perf_counter()
    broken = patches_apply(args.names or list(MUTATIONS))
    if broken:
        print("patches that do not apply:\n  " + "\n  ".join(broken))
        return 1
    plan = ci_plan(args.ci) if args.ci is not None else {n: MUTATIONS[n].tests for n in args.names or MUTATIONS}
    missing = uncollected([t for tests in plan.values() for t in tests])
    if missing:
        print("named tests pytest does not collect:\n  " + "\n  ".join(missing))
        return 1
    control_start = time.perf_counter()
    controlled = control([t for tests in plan.values() for t in tests])
    control_wall = time.perf_counter() - control_start
    problems, seconds = run(plan, controlled)
    print(f"{len(plan)} mutations in {time.perf_counter() - start:.0f} s", flush=True)
    if problems:
        print("not caught as named:\n  " + "\n  ".join(problems))
        return 1
    if args.ci is None and not args.names:
        record(seconds, controlled, control_wall, time.perf_counter() - start)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
