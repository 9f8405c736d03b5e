"""Profiler and planner against real CPU/gloo training steps of a small GPT-2 on two ranks.

    .venv/bin/python bench/planner.py

    .venv/bin/python bench/planner.py --steps 1 --plans 2    # a quick sanity run

Prints two JSON lines:
  planner/memory   per mesh: the profiler's predicted peak memory per rank of a whole training step (weights,
                   gradients, optimizer states, activations and temporaries) against the bytes malloc reports
                   in use at the worst op of a real step (forward, backward and optimizer step; glibc mallinfo2
                   sampled after every op) minus what was in use before the model was built, worst rank; and
                   the same for the step's dynamic part alone (peak minus weights and optimizer states);
  planner/ranking  the planner's predicted step time of each candidate plan against the measured one, and the
                   rank correlation. The CPU "hardware" is calibrated in the same run: its FLOP rate from a
                   one-rank step of the same model, its link bandwidth from a gloo all-reduce.
"""
from __future__ import annotations

import argparse
import ctypes
import json
import os
import sys
import tempfile
import time
import warnings

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

warnings.filterwarnings("ignore")
sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

CONFIG = dict(vocab_size=1000, n_positions=256, n_embd=256, n_layer=4, n_head=8,
              activation_function="gelu_pytorch_tanh")
BATCH, SEQ = 8, 128
PLANS = [  # (name, mesh, micro-batches, data parallel wrapper)
    ("dp=2 fsdp", dict(dp=2), 1, "fsdp"),
    ("dp=2 fsdp m=2", dict(dp=2), 2, "fsdp"),
    ("tp=2", dict(tp=2), 1, None),
    ("tp=2 sp", dict(tp=2, sequence_parallel=True), 1, None),
    ("pp=2 m=2", dict(pp=2), 2, None),
    ("pp=2 m=4", dict(pp=2), 4, None),
]


class _MallInfo2(ctypes.Structure):
    _fields_ = [(n, ctypes.c_size_t) for n in ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks",
                                               "fsmblks", "uordblks", "fordblks", "keepcost")]


_libc = ctypes.CDLL("libc.so.6")
_libc.mallinfo2.restype = _MallInfo2


def malloc_in_use() -> int:
    info = _libc.mallinfo2()
    return info.uordblks + info.hblkhd


def peak_mode():
    from torch.utils._python_dispatch import TorchDispatchMode

    class Peak(TorchDispatchMode):
        peak = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            self.peak = max(self.peak, malloc_in_use())
            return out

    return Peak()


def config():
    import transformers

    return transformers.GPT2Config(**CONFIG)


def run_plan(mesh, m, data_parallel, steps):
    """Time a few real steps and measure one step's memory on this rank."""
    from colozoo.kernels.dispatch import use_kernels
    from colozoo.models import build_model
    from colozoo.parallel import init_parallel
    from colozoo.training import build_optimizer, parallelize

    torch.manual_seed(0)
    pc = init_parallel(**mesh)
    before_model = malloc_in_use()
    model = build_model(config(), pc=pc, device="cpu").train()
    parallelize(model, data_parallel=data_parallel or "ddp")
    optimizer = build_optimizer(model)
    ids = torch.randint(0, CONFIG["vocab_size"], (BATCH, SEQ), generator=torch.Generator().manual_seed(1))
    times = []
    with use_kernels("torch"):
        for step in range(steps + 2):
            optimizer.zero_grad(set_to_none=True)
            dist.barrier()
            start = time.perf_counter()
            model.forward_backward(ids, ids, num_microbatches=m)
            optimizer.step()
            dist.barrier()
            times.append(time.perf_counter() - start)
        optimizer.zero_grad(set_to_none=True)
        base = malloc_in_use()  # weights and optimizer states (allocated by the steps above)
        with peak_mode() as mode:
            model.forward_backward(ids, ids, num_microbatches=m)
            optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    return {"seconds": sorted(times[2:])[len(times[2:]) // 2], "total": mode.peak - before_model,
            "dynamic": mode.peak - base}


def allreduce_bandwidth() -> float:
    x = torch.zeros(2 ** 22 // 4)
    dist.all_reduce(x)
    start = time.perf_counter()
    for _ in range(5):
        dist.all_reduce(x)
    seconds = (time.perf_counter() - start) / 5
    return x.numel() * 4 * 2 * (2 - 1) / 2 / seconds  # bus bytes per second


def worker(rank, world, init_file, out, plans, steps):
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    results = {"bandwidth": allreduce_bandwidth()}
    for name, mesh, m, data_parallel in plans:
        results[name] = run_plan(mesh, m, data_parallel, steps)
        dist.barrier()
    out.put((rank, results))
    dist.destroy_process_group()


def single_rank_rate() -> float:
    """FLOP/s of a real one-rank step of the same model (fwd + bwd), with 1 thread like each worker."""
    from colozoo.kernels.dispatch import use_kernels
    from colozoo.models import build_model
    from colozoo.profiler import profile

    torch.set_num_threads(1)
    model = build_model(config(), device="cpu").train()
    ids = torch.randint(0, CONFIG["vocab_size"], (BATCH // 2, SEQ))
    with use_kernels("torch"):
        for _ in range(2):
            model(ids, labels=ids).loss.backward()
        start = time.perf_counter()
        for _ in range(3):
            model(ids, labels=ids).loss.backward()
    seconds = (time.perf_counter() - start) / 3
    flops = profile(config(), batch_size=BATCH // 2, seq_len=SEQ, dtype="float32", target="cpu").step_flops
    return flops / seconds


def predictions(flop_rate, bandwidth, plans):
    from colozoo.hardware import Hardware
    from colozoo.planner import estimate
    from colozoo.profiler import Setup, profile

    cpu = Hardware("cpu-gloo", gpu_memory=2 ** 40, peak_flops=flop_rate, gpus_per_node=2, intra_node_bw=bandwidth,
                   inter_node_bw=bandwidth, hbm_bw=10e9, mfu=1.0, layer_overhead_s=0.0)
    out = {}
    for name, mesh, m, data_parallel in plans:
        from colozoo.profiler import parse_mesh

        pc = parse_mesh(mesh)
        zero = 3 if data_parallel == "fsdp" and pc.dp > 1 else 0
        mbs = BATCH // (pc.dp * m)
        setup = Setup(batch_size=mbs, seq_len=SEQ, dtype="float32", zero=zero, num_microbatches=m, target="cpu")
        report = profile(config(), batch_size=mbs, seq_len=SEQ, mesh=pc, dtype="float32", zero=zero,
                         num_microbatches=m, target="cpu")
        step, _, _ = estimate(report, pc, setup, cpu)
        # what exists before the step: weights, master weights, optimizer states
        dynamic = max(s["peak"] - s["weights"] - s["master"] - s["optimizer"] for s in report.stages)
        out[name] = {"seconds": step, "total": report.peak_memory, "dynamic": dynamic}
    return out


def spearman(a, b) -> float:
    def ranks(x):
        order = sorted(range(len(x)), key=x.__getitem__)
        r = [0] * len(x)
        for i, j in enumerate(order):
            r[j] = i
        return r

    ra, rb = ranks(a), ranks(b)
    n = len(a)
    return 1 - 6 * sum((x - y) ** 2 for x, y in zip(ra, rb)) / (n * (n * n - 1))


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=3, help="timed steps per plan (after 2 warmup steps)")
    parser.add_argument("--plans", type=int, default=len(PLANS), help=f"run the first N of the {len(PLANS)} plans")
    args = parser.parse_args()
    if args.steps < 1 or not 2 <= args.plans <= len(PLANS):
        parser.error(f"--steps must be >= 1 and --plans between 2 and {len(PLANS)}")
    plans = PLANS[:args.plans]
    fd, init_file = tempfile.mkstemp(prefix="colozoo-bench-")
    os.close(fd)
    os.unlink(init_file)
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    flop_rate = single_rank_rate()  # before the workers start: they would share the cores
    procs = [ctx.Process(target=worker, args=(r, 2, init_file, out, plans, args.steps)) for r in range(2)]
    for p in procs:
        p.start()
    results = dict(out.get(timeout=600) for _ in procs)
    for p in procs:
        p.join()
    bandwidth = min(r["bandwidth"] for r in results.values())
    predicted = predictions(flop_rate, bandwidth, plans)
    config_out = {"model": "gpt2 h256 l4", "batch": BATCH, "seq": SEQ, "dtype": "float32", "ranks": 2,
                  "steps": args.steps, "plans": [name for name, *_ in plans]}
    memory = []
    for name, *_ in plans:
        row = {"plan": name}
        for part in ("total", "dynamic"):
            measured = max(results[r][name][part] for r in results)
            row.update({f"{part}_predicted_mib": round(predicted[name][part] / 2 ** 20, 2),
                        f"{part}_measured_mib": round(measured / 2 ** 20, 2),
                        f"{part}_ratio": round(predicted[name][part] / measured, 3)})
        memory.append(row)
    worst = min(min(r["total_ratio"], 1 / r["total_ratio"]) for r in memory)
    print(json.dumps({"bench": "planner/memory", "config": config_out, "metrics": {"plans": memory},
                      "peer": "malloc bytes in use during a real gloo training step (mallinfo2)",
                      "ratio": round(worst, 3)}))
    measured_t = [max(results[r][name]["seconds"] for r in results) for name, *_ in plans]
    predicted_t = [predicted[name]["seconds"] for name, *_ in plans]
    ranking = [{"plan": name, "predicted_s": round(p, 4), "measured_s": round(t, 4), "ratio": round(p / t, 3)}
               for (name, *_), p, t in zip(plans, predicted_t, measured_t)]
    rho = spearman(predicted_t, measured_t)
    print(json.dumps({"bench": "planner/ranking", "config": config_out,
                      "metrics": {"flop_rate_gflops": round(flop_rate / 1e9, 2),
                                  "bandwidth_gbs": round(bandwidth / 1e9, 3), "spearman": round(rho, 3),
                                  "predicted_best": plans[min(range(len(plans)), key=predicted_t.__getitem__)][0],
                                  "measured_best": plans[min(range(len(plans)), key=measured_t.__getitem__)][0],
                                  "plans": ranking},
                      "peer": "measured step times of the same plans", "ratio": round(rho, 3)}))


if __name__ == "__main__":
    main()
