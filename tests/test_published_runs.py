"""The planner against published training runs (colozoo/cost/published_runs.json: Megatron-LM's Tables 1 and 2 of
Narayanan et al. 2021, MosaicML's MPT benchmarks under FSDP, BLOOM-176B, Llama 3 405B with context parallelism,
Mixtral and gpt-oss with expert parallelism on H100, Megatron-Core's weak scaling, Nemotron-4 340B and MT-NLG 530B on
long pipelines, sequence parallelism and selective recomputation up to 1T, NVIDIA's DGX Cloud benchmark recipes of
NeMo on H100s): each run's layout priced on its hardware
within 15% of its measured step time, fitting in its GPUs' memory at its micro-batch and recompute; runs compared
on the same GPUs ranked as measured; and the planner, free to choose, no longer prefers ZeRO-3 where the paper
measured it falling behind pipelines."""
import json
import warnings

import pytest

from colozoo.cost.published import published_runs
from colozoo.cost.validate import TOLERANCE, comparisons, validate

warnings.filterwarnings("ignore", category=FutureWarning)


@pytest.fixture(scope="module")
def results():
    return validate()


def test_every_run_is_predicted_within_tolerance(results):
    off = {r.run.id: f"{r.error:+.1%}" for r in results if abs(r.error) > TOLERANCE and not r.run.known_miss}
    assert not off, off
    # a run marked as a known miss still is one: its reason must not outlive the miss
    fixed = [r.run.id for r in results if r.run.known_miss and abs(r.error) <= TOLERANCE]
    assert not fixed, f"no longer missed, drop known_miss: {fixed}"
    held_out = [r for r in results if r.run.held_out and not r.run.known_miss]
    assert len(held_out) >= 10 and all(abs(r.error) <= TOLERANCE for r in held_out)
    # the issue's own rows: PTD-P 153 / 149 / 141 and ZeRO-3 at 768 and 1536 GPUs 88 / 44 TFLOP/s
    by_id = {r.run.id: r for r in results}
    for gpus, tflops in ((384, 153), (768, 149), (1536, 141)):
        r = by_id[f"narayanan2021-table2-ptdp-175b-{gpus}"]
        assert r.run.in_source_units(r.predicted_seconds) == pytest.approx(tflops, rel=TOLERANCE)
    for gpus, tflops in ((768, 88), (1536, 44)):
        r = by_id[f"narayanan2021-table2-zero3-175b-{gpus}"]
        assert r.run.in_source_units(r.predicted_seconds) == pytest.approx(tflops, rel=TOLERANCE)


def test_every_run_fits_its_gpus(results):
    """Each published layout fits at its micro-batch and recompute; over are only the runs whose table says why
    (memory_miss, with the breakdown: the 530B under ZeRO-3 at micro-batch 4, which the paper reports at the edge,
    and the runs whose recomputation the source does not publish or the memory model cannot express)."""
    over = {r.run.id for r in results if not r.fits}
    explained = {r.run.id for r in results if r.run.memory_miss}
    assert over == explained, over ^ explained
    # a reason must not excuse more than it explains: the fullest, Llama 3 405B on 8192 GPUs, is 1.28x the GPU's
    assert all(r.memory <= 1.3 * r.run.hardware.memory_limit for r in results if r.run.memory_miss)


def test_what_the_long_pipelines_notes_claim():
    """The rows' own notes, kept true: Nemotron-4 340B lands 4-6% fast with its tensor-parallel collectives left
    exposed (the report does not say they were overlapped; the Megatron-Core preset hides them), and MT-NLG at
    micro-batches of 2 sequences lands at -10 to -11% (the paper does not give the micro-batch)."""
    from dataclasses import replace

    runs = {r.id: r for r in published_runs()}
    exposed = [replace(r, software=replace(r.software, tp_comm_overlap=0.0))
               for i, r in runs.items() if i.startswith("nemotron4-340b-")]
    pairs = [replace(r, plan=replace(r.plan, micro_batch_size=2, num_microbatches=r.plan.num_microbatches // 2))
             for i, r in runs.items() if i.startswith("mt-nlg-530b-")]
    assert len(exposed) == len(pairs) == 3
    assert all(-0.065 <= v.error <= -0.035 for v in validate(exposed)), [f"{v.error:+.1%}" for v in validate(exposed)]
    assert all(-0.115 <= v.error <= -0.095 for v in validate(pairs)), [f"{v.error:+.1%}" for v in validate(pairs)]


def test_layouts_compared_on_the_same_gpus_rank_as_measured(results):
    """Every pair of layouts a paper ran on the same GPUs and batch is ranked as measured: PTD-P ahead of ZeRO-3 by
    69-231%, and at 384 GPUs by 6%, where DeepSpeed's per-submodule gathers (one ahead) leave the MLP's weights
    exposed behind the attention's; sequence parallelism with selective recomputation ahead of full recomputation
    by 29-32% (Korthikanti et al. 2022)."""
    pairs = comparisons(results)
    assert len(pairs) == 9
    assert all(p["agree"] for p in pairs), [p for p in pairs if not p["agree"]]


def test_free_planner_leaves_zero3_for_pipelines_on_3072_gpus():
    """The 1T model of Table 1 on 3072 A100s, batch 3072, tp held at 8 as Megatron's: the planner used to prefer
    ZeRO-3 over dp 384 (106 s predicted); the 384-way gathers of a 1T model over 25 GB/s a GPU cannot hide behind a
    micro-batch of one sequence, so it now chooses a pipeline, predicted no slower than the published one."""
    from colozoo.cost.planner import SearchSpace, plan
    from colozoo.cost.validate import TraceCache, validate_run

    run = next(r for r in published_runs() if r.id == "narayanan2021-table1-1008b")
    search = SearchSpace(degrees={"tp": 8}, micro_batch_sizes=(1,), schedules=("1f1b",), zero_levels=(0, 3),
                         allow_offload=False)
    result = plan(run.config(), run.hardware, run.workload, search, global_batch=run.global_batch,
                  software=run.software)
    best = result.best
    assert best.pp > 1 and best.zero == 0, best.mesh()
    assert best.step_seconds <= validate_run(run, TraceCache()).predicted_seconds
    zero3 = next(p for p in result.plans if p.pp == 1 and p.zero == 3)
    assert zero3.step_seconds > 2 * best.step_seconds


def test_validate_cli(tmp_path, capsys):
    """`colozoo plan --validate --runs FILE`: the table of a small run, exit 0 within the tolerance; a run 3x off
    (a measured step a third of the truth) exits 1 and says so."""
    from colozoo.cli import main

    row = {"id": "small", "source": "a test", "hardware": "A100-80GB", "gpus": 8, "dtype": "bfloat16",
           "model": {"family": "gpt2", "hidden": 1024, "layers": 4, "heads": 8, "vocab": 4096, "seq": 1024},
           "layout": {"dp": 8, "micro_batch": 4, "global_batch": 32}, "measured": {"unit": "step_seconds"}}
    from colozoo.cost.published import _run

    seconds = None
    for measured in ("truth", "off"):
        if measured == "truth":
            row["measured"]["value"] = 1.0
            seconds = validate([_run(row, {}, {})])[0].predicted_seconds
        row["measured"]["value"] = seconds if measured == "truth" else seconds / 3
        path = tmp_path / f"{measured}.json"
        path.write_text(json.dumps({"software": {}, "runs": [row]}))
        assert main(["plan", "--validate", "--runs", str(path)]) == (0 if measured == "truth" else 1)
        out = capsys.readouterr().out
        assert "| small | 8 |" in out and ("+0.0%" in out if measured == "truth" else "+200.0%" in out)
