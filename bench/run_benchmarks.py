"""Run the benchmarks and collect their JSON lines.

    python bench/run_benchmarks.py           # every bench/*.py except this runner
    python bench/run_benchmarks.py throughput -- --layers 1 --repeats 3   # named ones; args after -- go to each
    python bench/run_benchmarks.py --out results.jsonl

Each bench is run as its own process (so one cannot skew another's threads or memory). Lines a bench prints
that parse as a JSON object with a "bench" key are its results; everything else is passed through to stderr.
Exits non-zero if a bench fails or prints no result.
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent


def discover() -> list[str]:
    return sorted(p.stem for p in HERE.glob("*.py") if p.name != Path(__file__).name and not p.name.startswith("_"))


def parse_results(stdout: str) -> tuple[list[dict], list[str]]:
    results, other = [], []
    for line in stdout.splitlines():
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            record = None
        if isinstance(record, dict) and "bench" in record:
            results.append(record)
        elif line.strip():
            other.append(line)
    return results, other


def run_bench(name: str, extra: list[str]) -> tuple[list[dict], str | None]:
    path = HERE / f"{name}.py"
    if not path.exists():
        return [], f"no benchmark {name!r} (known: {', '.join(discover())})"
    proc = subprocess.run([sys.executable, str(path), *extra], cwd=ROOT, capture_output=True, text=True)
    results, other = parse_results(proc.stdout)
    for line in other:
        print(f"[{name}] {line}", file=sys.stderr)
    if proc.returncode:
        return results, f"{name} exited with {proc.returncode}:\n{proc.stderr[-4000:]}"
    if not results:
        return results, f"{name} printed no JSON result line"
    return results, None


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    extra = []
    if "--" in argv:
        cut = argv.index("--")
        argv, extra = argv[:cut], argv[cut + 1:]
    parser = argparse.ArgumentParser(description="Run colozoo benchmarks and collect their JSON lines.")
    parser.add_argument("names", nargs="*", help="benchmarks to run (file stems in bench/); default: all")
    parser.add_argument("--out", help="also write the JSON lines to this file")
    args = parser.parse_args(argv)
    collected, failures = [], []
    for name in args.names or discover():
        start = time.perf_counter()
        results, error = run_bench(name, extra)
        print(f"[{name}] {len(results)} result(s) in {time.perf_counter() - start:.1f}s", file=sys.stderr)
        for record in results:
            print(json.dumps(record), flush=True)
        collected += results
        if error:
            failures.append(error)
    if args.out:
        Path(args.out).write_text("".join(json.dumps(r) + "\n" for r in collected))
    for error in failures:
        print(f"FAILED: {error}", file=sys.stderr)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
