"""Convert a generated GPT-2-shaped HF checkpoint (--gb, default 1.0 as the issue asks) to colozoo, against peers
measured in the same run. Prints one JSON line per case (bench/README.md):

  convert/hf_to_tp4_pp2     `colozoo convert SRC DST --tp 4 --pp 2` end to end (a fresh process: start-up, imports,
                            layout, reads, writes, fsync, exit). Peer: `cp -r SRC DST && sync` of the same bytes,
                            alternated with ours over --repeats runs (the disk is shared), medians; ratio = cp + sync
                            seconds / ours (goal: >= 0.5, i.e. within 2x of copying). Also the converter's peak RSS
                            against the largest tensor (goal: largest + 300 MB over an interpreter that made the
                            same imports and read the config), and with --naive the obvious way (transformers from_pretrained, slice the state
                            dict, save_file) in seconds and RSS. `imports_s` times a process that only imports
                            and reads the config; `floor_vs_cp_sync` = (imports + cp + sync) / (cp + sync), the best
                            ratio any conversion after those imports could reach.
  convert/from_pretrained_tp2  per-rank peak RSS of colozoo.from_pretrained at tp=2 (goal: about half the model).
                            Peer: transformers from_pretrained of the whole model in one process; ratio = its RSS
                            over baseline / our worst rank's.
Every measurement runs in a fresh subprocess, so peak RSS is its own; "over_baseline" subtracts the RSS of the
same interpreter after its imports. Usage: python bench/convert.py [--gb 0.1] [--repeats 3] [--naive] [--keep DIR]
"""
from __future__ import annotations

import argparse
import json
import math
import os
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path


def rss_mb() -> float:
    """Peak resident memory since the last reset_peak() (VmHWM; ru_maxrss would carry the parent's over exec)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def reset_peak():
    Path("/proc/self/clear_refs").write_text("5")


def gpt2_config(gb: float):
    import transformers

    hidden, vocab = 1536, 50257
    per_layer = 12 * hidden * hidden * 4
    layers = max(2, round((gb * 1e9 - vocab * hidden * 4) / per_layer))
    layers += layers % 2  # two pipeline stages
    return transformers.GPT2Config(n_embd=hidden, n_layer=layers, n_head=16, vocab_size=vocab, n_positions=1024,
                                   architectures=["GPT2LMHeadModel"])


def generate(directory: Path, gb: float):
    """Random weights streamed tensor by tensor into model.safetensors (names and shapes from a meta HF model)."""
    import torch
    import transformers

    from colozoo.checkpoint.safetensors_io import SafetensorsWriter

    config = gpt2_config(gb)
    with torch.device("meta"):
        model = transformers.GPT2LMHeadModel(config)
    shapes = {n: tuple(p.shape) for n, p in model.named_parameters()}  # tied lm_head is not listed twice
    directory.mkdir(parents=True)
    writer = SafetensorsWriter(directory / "model.safetensors", [(n, torch.float32, s) for n, s in shapes.items()],
                               metadata={"format": "pt"})
    g = torch.Generator().manual_seed(0)
    for name, shape in shapes.items():
        writer.write(name, torch.randn(shape, generator=g) * 0.02)
    writer.close()
    config.save_pretrained(directory)
    return sum(math.prod(s) * 4 for s in shapes.values()), max(math.prod(s) * 4 for s in shapes.values())


# --- workers (each in its own process) -----------------------------------------------------------------------

# `colozoo convert` as the console script runs it, then its own peak RSS (VmHWM: ru_maxrss from wait4 would count
# this parent's memory, which Linux carries over fork and exec)
PEAK = "print([l for l in open('/proc/self/status') if l.startswith('VmHWM:')][0].split()[1])"
CLI_THEN_PEAK = (f"import atexit; atexit.register(lambda: {PEAK}); "
                 f"from colozoo.cli import main_and_exit; main_and_exit()")
# what the converter imports and reads before its first tensor: the baseline its peak is compared with (it exits
# as the console script does)
IMPORTS_THEN_PEAK = (f"import gc, sys, transformers, colozoo.checkpoint.convert; "
                     f"transformers.AutoConfig.from_pretrained(sys.argv[1]); {PEAK}; gc.freeze()")


def timed_child(argv: list[str]) -> tuple[float, str]:
    """(wall seconds from process start to exit, its stdout) of one child process."""
    start = time.perf_counter()
    proc = subprocess.run(argv, capture_output=True, text=True)
    seconds = time.perf_counter() - start
    if proc.returncode:
        raise RuntimeError(f"{' '.join(argv)} failed:\n{proc.stderr[-3000:]}")
    return seconds, proc.stdout


def end_to_end(work: Path, repeats: int) -> dict:
    """`colozoo convert` and `cp -r && sync`, alternated, each from a synced disk with the source in the page cache
    (both read the same warm source; both must flush what they wrote)."""
    colozoo = [sys.executable, "-c", CLI_THEN_PEAK, "convert", str(work / "hf"), str(work / "tp4pp2"), "--tp", "4",
               "--pp", "2", "--quiet"]
    imports = [sys.executable, "-c", IMPORTS_THEN_PEAK, str(work / "hf")]
    out = {"colozoo_s": [], "colozoo_peak_rss_mb": [], "cp_sync_s": [], "imports_s": [], "baseline_rss_mb": []}
    for i in range(repeats):
        for kind in ("cp", "colozoo") if i % 2 == 0 else ("colozoo", "cp"):
            shutil.rmtree(work / ("copy" if kind == "cp" else "tp4pp2"), ignore_errors=True)
            subprocess.run(["sync"], check=True)
            if kind == "cp":
                seconds, _ = timed_child(["sh", "-c", f"cp -r '{work / 'hf'}' '{work / 'copy'}' && sync"])
                out["cp_sync_s"].append(seconds)
            else:
                seconds, stdout = timed_child(colozoo)
                out["colozoo_s"].append(seconds)
                out["colozoo_peak_rss_mb"].append(int(stdout.split()[-1]) / 1024)
        seconds, stdout = timed_child(imports)
        out["imports_s"].append(seconds)
        out["baseline_rss_mb"].append(int(stdout) / 1024)
    shutil.rmtree(work / "copy", ignore_errors=True)
    return out


def work_naive(src: Path, dst: Path) -> dict:
    """The obvious way: load the whole model with transformers, slice every rank's state dict, save_file each."""
    import torch
    import transformers
    from safetensors.torch import save_file

    from colozoo.checkpoint.format import plan_mesh
    from colozoo.checkpoint.layout import ModelLayout
    from colozoo.checkpoint.readers import GlobalTensor, StateDictReader
    from colozoo.converters import family_module

    start = time.perf_counter()
    model = transformers.AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32)
    reader = StateDictReader(model.state_dict())
    layout = ModelLayout(model.config, pp=2)
    sources = family_module("gpt2").hf_sources(model.config)
    per_file: dict[str, dict] = {}
    for name, pieces in plan_mesh(layout, 4, 2, 1).items():
        full = GlobalTensor(reader, sources[name], name).read()
        for p in pieces:
            per_file.setdefault(p.file, {})[p.key] = full[p.index].contiguous()
    dst.mkdir()
    written = 0
    for file, tensors in per_file.items():
        save_file(tensors, dst / file)
        with open(dst / file, "rb") as f:  # the same durability as the others
            os.fsync(f.fileno())
        written += sum(t.numel() * t.element_size() for t in tensors.values())
    return {"seconds": time.perf_counter() - start, "bytes": written}


def work_hf_load(src: Path) -> dict:
    """transformers loading the whole model in one process (what every rank would hold without sharding)."""
    import torch
    import transformers

    start = time.perf_counter()
    model = transformers.AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32)
    with torch.no_grad():  # weights may still be unread pages of a memory map: touch them, as a first forward would
        checksum = sum(p.sum().item() for p in model.parameters())
    seconds = time.perf_counter() - start
    return {"seconds": seconds, "checksum": checksum}


def work_from_pretrained(ckpt: Path) -> dict:
    """Two gloo ranks, each loading its tp=2 shard of the colozoo checkpoint."""
    import torch.multiprocessing as mp

    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    init = tempfile.mktemp(prefix="colozoo-bench-")
    procs = [ctx.Process(target=_rank_main, args=(r, 2, init, str(ckpt), results)) for r in range(2)]
    for p in procs:
        p.start()
    out = sorted(results.get(timeout=600) for _ in procs)
    for p in procs:
        p.join()
    return {"ranks": [o[1] for o in out]}


def _rank_main(rank, world, init, ckpt, results):
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), OMP_NUM_THREADS="1")
    import torch
    import torch.distributed as dist

    import colozoo
    from colozoo.api import build_model  # noqa: F401 - imported before the baseline is taken

    dist.init_process_group("gloo", init_method=f"file://{init}", rank=rank, world_size=world)
    import torch._dynamo  # noqa: F401 - see worker()

    reset_peak()
    baseline = rss_mb()
    start = time.perf_counter()
    model = colozoo.from_pretrained(ckpt, tp=2)
    seconds = time.perf_counter() - start
    shard = sum(p.numel() * p.element_size() for p in model.parameters()) / 2**20
    results.put((rank, {"peak_rss_mb": round(rss_mb(), 1), "baseline_rss_mb": round(baseline, 1),
                        "over_baseline_mb": round(rss_mb() - baseline, 1), "shard_mb": round(shard, 1),
                        "seconds": round(seconds, 2)}))
    dist.barrier()
    dist.destroy_process_group()


def worker(kind: str, *paths: str) -> None:
    import torch  # noqa: F401 - the baseline includes the libraries every approach needs
    import transformers  # noqa: F401

    import torch._dynamo  # noqa: F401 - torch imports it on the first meta-device init (~2 s); not conversion work

    import colozoo.checkpoint.convert  # noqa: F401

    transformers.AutoConfig.for_model("gpt2")  # transformers' lazy module scan (~2 s), paid by every approach

    reset_peak()
    baseline = rss_mb()
    args = [Path(p) for p in paths]
    out = {"work_naive": work_naive, "work_hf_load": work_hf_load,
           "work_from_pretrained": work_from_pretrained}[kind](*args)
    out.update(peak_rss_mb=round(rss_mb(), 1), baseline_rss_mb=round(baseline, 1),
               over_baseline_mb=round(rss_mb() - baseline, 1))
    print(json.dumps(out))


def run(kind: str, *paths) -> dict:
    proc = subprocess.run([sys.executable, __file__, "--worker", kind, *map(str, paths)], capture_output=True, text=True)
    if proc.returncode:
        raise RuntimeError(f"{kind} failed:\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--gb", type=float, default=1.0, help="size of the generated checkpoint in GB")
    parser.add_argument("--repeats", type=int, default=3, help="end-to-end runs of ours and of cp + sync, alternated")
    parser.add_argument("--naive", action="store_true", help="also time the naive conversion (slow, ~2x the memory)")
    parser.add_argument("--keep", default=None, help="work directory to keep (default: a temp dir, removed)")
    parser.add_argument("--worker", nargs="+", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        return worker(*args.worker)
    work = Path(args.keep or tempfile.mkdtemp(prefix="colozoo-bench-"))
    mb = 2**20
    try:
        total, largest = generate(work / "hf", args.gb)
        gpt2 = gpt2_config(args.gb)
        config = {"gb": args.gb, "checkpoint_mb": round(total / mb, 1), "largest_tensor_mb": round(largest / mb, 1),
                  "model": "gpt2", "hidden": gpt2.n_embd, "layers": gpt2.n_layer, "vocab": gpt2.vocab_size,
                  "dtype": "float32", "device": "cpu", "cpus": os.cpu_count()}
        ends = end_to_end(work, args.repeats)
        naive = run("work_naive", work / "hf", work / "naive") if args.naive else None
        ours_s, cp_s = statistics.median(ends["colozoo_s"]), statistics.median(ends["cp_sync_s"])
        imports_s = statistics.median(ends["imports_s"])
        rss, baseline = statistics.median(ends["colozoo_peak_rss_mb"]), statistics.median(ends["baseline_rss_mb"])
        metrics = {
            "colozoo_s": round(ours_s, 2), "cp_sync_s": round(cp_s, 2),
            "colozoo_repeats_s": [round(x, 2) for x in ends["colozoo_s"]],
            "cp_sync_repeats_s": [round(x, 2) for x in ends["cp_sync_s"]],
            "colozoo_vs_cp_sync": round(ours_s / cp_s, 2),
            # a fresh process importing torch, transformers and the converter and reading the config: the part
            # no conversion speed can remove; the rest is reading, cutting, hashing, writing and flushing
            "imports_s": round(imports_s, 2), "after_imports_s": round(ours_s - imports_s, 2),
            "after_imports_vs_cp_sync": round((ours_s - imports_s) / cp_s, 2),
            "floor_vs_cp_sync": round((imports_s + cp_s) / cp_s, 2),
            "colozoo_peak_rss_mb": round(rss, 1), "baseline_rss_mb": round(baseline, 1),
            "colozoo_rss_over_baseline_minus_largest_mb": round(rss - baseline - largest / mb, 1),
        }
        if naive is not None:
            metrics.update(naive_s=round(naive["seconds"], 2), naive_peak_rss_mb=naive["peak_rss_mb"])
        print(json.dumps({
            "bench": "convert/hf_to_tp4_pp2",
            "config": {**config, "tp": 4, "pp": 2, "repeats": args.repeats},
            "metrics": metrics,
            "peer": "cp -r SRC DST && sync (the same bytes copied and flushed), end to end",
            "ratio": round(cp_s / ours_s, 2),
        }))
        hf_load = run("work_hf_load", work / "hf")
        ranks = run("work_from_pretrained", work / "tp4pp2")["ranks"]
        worst = max(max(r["over_baseline_mb"] for r in ranks), 1)
        print(json.dumps({
            "bench": "convert/from_pretrained_tp2",
            "config": {**config, "tp": 2, "source": "colozoo checkpoint saved at tp=4, pp=2", "ranks": 2},
            "metrics": {
                "rank_shard_mb": [r["shard_mb"] for r in ranks], "rank_peak_rss_mb": [r["peak_rss_mb"] for r in ranks],
                "rank_rss_over_baseline_mb": [r["over_baseline_mb"] for r in ranks],
                "rank_seconds": [r["seconds"] for r in ranks],
                "colozoo_worst_rank_over_baseline_vs_model": round(worst / (total / mb), 2),
                "hf_rss_over_baseline_mb": hf_load["over_baseline_mb"], "hf_peak_rss_mb": hf_load["peak_rss_mb"],
                "hf_seconds": round(hf_load["seconds"], 2),
            },
            "peer": "transformers AutoModelForCausalLM.from_pretrained of the whole model, one process",
            "ratio": round(hf_load["over_baseline_mb"] / worst, 2),
        }))
    finally:
        if not args.keep:
            shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
