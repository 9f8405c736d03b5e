"""The validation as a picture: each published run's predicted step time over its measured one, against the measured
step time, inside the tolerance band or named outside it (`colozoo plan --validate --plot PNG`)."""
from __future__ import annotations

import math
from pathlib import Path

from colozoo.cost.validate import TOLERANCE, Validation


def points(results: list[Validation]) -> list[dict]:
    """One point a run: measured seconds a step, the prediction's error, its group, whether held out, and whether
    it misses the tolerance (the plot names those)."""
    return [{"id": r.run.id, "group": r.run.group, "measured_seconds": r.measured_seconds, "error": r.error,
             "held_out": r.run.held_out, "miss": not r.within} for r in results]


def plot_validation(results: list[Validation], png_path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    data = points(results)
    groups = sorted({p["group"] for p in data})
    colors = dict(zip(groups, plt.get_cmap("tab20").colors))
    fig, ax = plt.subplots(figsize=(10, 5.5))
    ax.axhspan(-100 * TOLERANCE, 100 * TOLERANCE, color="0.92", zorder=0, label=f"within {TOLERANCE:.0%}")
    ax.axhline(0, color="0.5", lw=0.8)
    for group in groups:
        for held_out, marker_face in ((False, None), (True, "none")):
            mine = [p for p in data if p["group"] == group and p["held_out"] == held_out]
            if mine:
                ax.scatter([p["measured_seconds"] for p in mine], [100 * p["error"] for p in mine], s=36,
                           color=colors[group], facecolors=marker_face, linewidths=1.2,
                           label=group + (" (held out)" if held_out else ""))
    misses = [p for p in data if p["miss"]]
    for p in misses:
        ax.annotate(p["id"], (p["measured_seconds"], 100 * p["error"]), fontsize=6,
                    xytext=(5, 3 if _above_neighbour(p, misses) else -8), textcoords="offset points")
    ax.set_xscale("log")
    ax.set_xlabel("measured seconds a step")
    ax.set_ylabel("predicted / measured - 1 (%)")
    ax.set_title(f"colozoo's planner on {len(data)} published training runs "
                 f"({sum(not p['miss'] for p in data)} within {TOLERANCE:.0%})")
    ax.grid(alpha=0.3, which="both")
    ax.legend(fontsize=7, loc="center left", bbox_to_anchor=(1.01, 0.5))
    fig.tight_layout()
    fig.savefig(png_path, dpi=110)
    plt.close(fig)
    return Path(png_path)


def _above_neighbour(p: dict, misses: list[dict]) -> bool:
    """Whether a miss lies above its nearest other miss: its name goes above its point, the neighbour's below, so that
    the two do not overlap. Nearness weighs a decade of measured seconds as 20 points of error, about as far apart
    as the plot draws them."""
    others = [q for q in misses if q is not p]
    if not others:
        return True
    nearest = min(others, key=lambda q: math.hypot(math.log10(q["measured_seconds"] / p["measured_seconds"]),
                                                   (q["error"] - p["error"]) * 5))
    return p["error"] >= nearest["error"]
