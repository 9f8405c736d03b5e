"""The planner against published training runs: each run's layout priced on its hardware (colozoo.cost.published)
and compared with what it measured; its memory against the GPU's; the planner's own choice for the same model, GPUs
and batch. `colozoo plan --validate` prints the table.

Traces are shared across runs: one per (model, tp, cp, ep, sequence parallelism, sequence, dtype, attention, the
software's head), every micro-batch size the runs need traced at once.
"""
from __future__ import annotations

import itertools
import json
from dataclasses import dataclass, replace

from colozoo.core.mesh import ParallelConfig
from colozoo.cost.cost_model import assemble
from colozoo.cost.model_trace import trace_model
from colozoo.cost.published import PublishedRun, published_runs
from colozoo.cost.step_time import estimate

TOLERANCE = 0.15  # the relative error every run's predicted step time must stay within


@dataclass
class Validation:
    run: PublishedRun
    predicted_seconds: float
    measured_seconds: float
    memory: float                # predicted peak bytes on the fullest GPU
    breakdown: dict
    chosen: object = None        # the planner's own best plan (RankedPlan) for the run's model, GPUs and batch

    @property
    def error(self) -> float:
        """Predicted over measured step time, minus one (positive: predicted slower)."""
        return self.predicted_seconds / self.measured_seconds - 1

    @property
    def within(self) -> bool:
        """The prediction is within the tolerance of the measurement."""
        return abs(self.error) <= TOLERANCE

    @property
    def fits(self) -> bool:
        return self.memory <= self.run.hardware.memory_limit

    def row(self) -> dict:
        r = self.run
        unit = {"narayanan2021": "TFLOP/s", "megatron_core": "TFLOP/s", "tokens_per_gpu": "tok/s/GPU",
                "step_seconds": "s/step"}[r.measured["unit"]]
        out = {"id": r.id, "gpus": r.gpus, "mesh": r.plan.mesh(), "measured": r.measured["value"],
               "predicted": round(r.in_source_units(self.predicted_seconds), 1), "unit": unit,
               "error": round(self.error, 3), "predicted_seconds": round(self.predicted_seconds, 3), "memory_gb": round(self.memory / 1e9, 1), "fits": self.fits,
               "held_out": r.held_out}
        if self.chosen is not None:
            out["chosen"] = f"{self.chosen.mesh()} mbs{self.chosen.micro_batch_size} {self.chosen.schedule}" \
                            f" v{self.chosen.virtual_stages} ZeRO-{self.chosen.zero}"
            out["chosen_seconds"] = round(self.chosen.step_seconds, 4)
        return out


class TraceCache:
    """Model traces shared by runs: traced once per key, at every micro-batch size asked for up front."""

    def __init__(self):
        self.traces, self.wanted = {}, {}

    @staticmethod
    def key(run: PublishedRun, plan=None):
        plan = plan or run.plan
        w = run.workload
        return (json.dumps(run.model, sort_keys=True), plan.tp, plan.cp, plan.ep, plan.sequence_parallel, w.seq_len,
                w.dtype, w.target, run.software.fused_head, run.software.triton_fusions)

    def want(self, run: PublishedRun):
        self.wanted.setdefault(self.key(run), set()).add(run.plan.micro_batch_size)

    def get(self, run: PublishedRun):
        key, mbs = self.key(run), run.plan.micro_batch_size
        if key not in self.traces or mbs not in self.traces[key]:
            sizes = sorted(self.wanted.get(key, set()) | {mbs})
            p = run.plan
            mesh = ParallelConfig(tp=p.tp, dp=p.ep, ep=p.ep, sequence_parallel=p.sequence_parallel)
            w = run.workload
            self.traces.setdefault(key, {}).update(
                trace_model(run.config(), sizes, w.seq_len // p.cp, mesh, w.dtype, w.target,
                            fused_head=run.software.fused_head, fusions=run.software.triton_fusions))
        return self.traces[key][mbs]


def validate_run(run: PublishedRun, cache: TraceCache) -> Validation:
    report = assemble(cache.get(run), run.plan, run.workload, run.software)
    seconds, breakdown, _ = estimate(report, run.plan, run.workload, run.hardware, software=run.software)
    return Validation(run, seconds, run.measured_seconds(), report.peak_memory, breakdown)


def validate(runs=None, choose: bool = False, progress=None) -> list[Validation]:
    """Every published run (or `runs`) priced as published; with `choose`, also the planner's own best plan for the
    run's model, GPUs and global batch (slow: a search per run)."""
    runs = list(published_runs() if runs is None else runs)
    cache = TraceCache()
    for run in runs:
        cache.want(run)
    out = []
    for i, run in enumerate(runs):
        if progress:
            progress(f"[{i + 1}/{len(runs)}] {run.id}")
        result = validate_run(run, cache)
        if choose:
            result.chosen = planner_choice(run)
        out.append(result)
    return out


def planner_choice(run: PublishedRun, search=None):
    """The planner's best plan for the run's model on its GPUs and global batch, priced as its software runs it."""
    from colozoo.cost.planner import SearchSpace, plan

    search = search or SearchSpace(micro_batch_sizes=tuple(sorted({1, 2, run.plan.micro_batch_size})),
                                   schedules=("1f1b", "interleaved_1f1b"), zero_levels=(0, 1, 3),
                                   virtual_stages=tuple(sorted({1, 2, 4, run.plan.virtual_stages})),
                                   allow_offload=False)
    workload = replace(run.workload)
    return plan(run.config(), run.hardware, workload, search, global_batch=run.global_batch,
                software=run.software).best


def comparisons(results: list[Validation]) -> list[dict]:
    """Every pair of runs of the same model on the same GPUs and batch (layouts a paper compared): which one was
    measured faster, which one is predicted faster, and the measured gap."""
    groups = {}
    for r in results:
        key = (json.dumps(r.run.model, sort_keys=True), r.run.hardware.name, r.run.gpus, r.run.global_batch)
        groups.setdefault(key, []).append(r)
    out = []
    for runs in groups.values():
        for a, b in itertools.combinations(runs, 2):
            measured = min((a, b), key=lambda r: r.measured_seconds)
            predicted = min((a, b), key=lambda r: r.predicted_seconds)
            gap = max(a.measured_seconds, b.measured_seconds) / min(a.measured_seconds, b.measured_seconds) - 1
            out.append({"runs": (a.run.id, b.run.id), "measured_faster": measured.run.id,
                        "predicted_faster": predicted.run.id, "measured_gap": round(gap, 3),
                        "agree": measured is predicted})
    return out


def table(results: list[Validation]) -> str:
    """The comparison as a markdown table (predicted against measured, the error, the memory, the planner's own
    choice when searched)."""
    rows = [r.row() for r in results]
    cols = ["id", "gpus", "mesh", "measured", "predicted", "unit", "error", "memory_gb", "fits", "held_out"]
    if any("chosen" in r for r in rows):
        cols += ["chosen", "chosen_seconds"]
    lines = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    for r in rows:
        lines.append("| " + " | ".join(f"{r[c]:+.1%}" if c == "error" else str(r.get(c, "")) for c in cols) + " |")
    lines.append("")
    for name, part in (("all", results), ("tuned against", [r for r in results if not r.run.held_out]),
                       ("held out", [r for r in results if r.run.held_out])):
        within = sum(r.within for r in part)
        mean = sum(abs(r.error) for r in part) / max(1, len(part))
        lines.append(f"{name}: {within}/{len(part)} runs within {TOLERANCE:.0%}, mean |error| {mean:.1%}")
    for r in results:
        if r.run.known_miss:
            lines.append(f"- {r.run.id}: {r.run.known_miss}")
        if r.run.memory_miss:
            lines.append(f"- {r.run.id} (memory {r.memory / 1e9:.0f} GB): {r.run.memory_miss}")
    for c in comparisons(results):
        lines.append(f"same GPUs and batch: {c['runs'][0]} vs {c['runs'][1]}: measured faster {c['measured_faster']}"
                     f" (by {c['measured_gap']:.0%}), predicted faster {c['predicted_faster']}")
    return "\n".join(lines)

