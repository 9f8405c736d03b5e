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
                   rank correlation. The CPU "hardware" is calibrated in the same run, on both ranks at once
                   (they share the machine's cores and memory bandwidth as they do in the plans): FLOP rate and
                   fixed per-layer overhead from a fit of unsharded steps at three micro-batch sizes; latency
                   and bandwidth of each gloo collective from small and large calls. Nothing is fitted to the
                   plans' own step times.
"""
from __future__ import annotations

import argparse
import ctypes
import gc
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
    ("dp=2 ddp", dict(dp=2), 1, "ddp"),
    ("dp=2 fsdp", dict(dp=2), 1, "fsdp"),
    ("dp=2 fsdp m=2", dict(dp=2), 2, "fsdp"),
    ("tp=2", dict(tp=2), 1, None),
    ("tp=2 sp", dict(tp=2, sequence_parallel=True), 1, None),
    ("pp=2 m=1", dict(pp=2), 1, None),
    ("pp=2 m=2", dict(pp=2), 2, None),
    ("pp=2 m=4", dict(pp=2), 4, None),
]


def schedule_for(mesh: dict, m: int) -> str:
    return "1f1b" if m >= mesh.get("pp", 1) else "gpipe"  # 1F1B needs a micro-batch per stage


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
    from colozoo.api import build_model
    from colozoo.core.mesh import init_parallel
    from colozoo.runtime.training import build_optimizer, parallelize

    torch.manual_seed(0)
    parallel = init_parallel(**mesh)
    gc.collect()  # the last plan's model lives in reference cycles: freed now, not in the middle of this one
    before_model = malloc_in_use()
    model = build_model(config(), parallel=parallel, device="cpu").train()
    parallelize(model, data_parallel=data_parallel or "ddp")
    optimizer = build_optimizer(model)
    ids = torch.randint(0, CONFIG["vocab_size"], (BATCH, SEQ), generator=torch.Generator().manual_seed(1))
    times = []
    with use_kernels("torch"):
        for step in range(steps + 2):
            optimizer.zero_grad(set_to_none=True)
            dist.barrier()
            start = time.perf_counter()
            model.forward_backward(ids, ids, num_microbatches=m, schedule=schedule_for(mesh, m))
            optimizer.step()
            dist.barrier()
            times.append(time.perf_counter() - start)
        optimizer.zero_grad(set_to_none=True)
        base = malloc_in_use()  # weights and optimizer states (allocated by the steps above)
        with peak_mode() as mode:
            model.forward_backward(ids, ids, num_microbatches=m, schedule=schedule_for(mesh, m))
            optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    return {"seconds": sorted(times[2:])[len(times[2:]) // 2], "total": mode.peak - before_model,
            "dynamic": mode.peak - base}


COLLECTIVES = ("all_reduce", "all_gather", "reduce_scatter", "send_recv")


def _time_collective(name: str, numel: int, repeats: int) -> float:
    x = torch.zeros(numel)
    gathered, scattered = torch.zeros(2 * numel), torch.zeros(numel // 2)
    peer = 1 - dist.get_rank()

    def call():
        if name == "all_reduce":
            dist.all_reduce(x)
        elif name == "all_gather":
            dist.all_gather_into_tensor(gathered, x)
        elif name == "reduce_scatter":
            dist.reduce_scatter_tensor(scattered, x)
        else:  # one exchange between the two ranks, as a pipeline boundary does
            ops = [dist.P2POp(dist.isend, x, peer), dist.P2POp(dist.irecv, scattered.new_empty(numel), peer)]
            for work in dist.batch_isend_irecv(ops):
                work.wait()

    call()
    dist.barrier()
    start = time.perf_counter()
    for _ in range(repeats):
        call()
    return (time.perf_counter() - start) / repeats


def calibrate_links() -> dict:
    """{collective: (seconds per latency step, bus bytes per second)} of gloo between the two ranks: the
    latency from 1 KiB calls, the bandwidth from 16 MiB ones (payload as colozoo.cost.profiler counts it: the
    output of an all-gather, the input of the others)."""
    from colozoo.cost.network import BUS_FACTOR, RING_STEPS

    small, large = 256, 2 ** 22
    out = {}
    for name in COLLECTIVES:
        t_small = _time_collective(name, small, 20)
        t_large = _time_collective(name, large, 3)
        payload = large * 4 * (2 if name == "all_gather" else 1)
        bus = payload * BUS_FACTOR[name](2)
        out[name] = (t_small / RING_STEPS[name](2), bus / max(t_large - t_small, 1e-9))
    return out


CALIBRATION_SIZES = (1, 2, 4)


def step_flops() -> dict:
    """{micro-batch size: FLOPs of an unsharded fwd + bwd}, from the profiler (before the workers start:
    it cannot run inside a torch.distributed job)."""
    from colozoo.cost.profiler import profile_for

    return {mbs: profile_for(config(), batch_size=mbs, seq_len=SEQ, dtype="float32", target="cpu").step_flops
            for mbs in CALIBRATION_SIZES}


def calibrate_compute(flops: dict) -> tuple[float, float]:
    """(FLOP/s, seconds of fixed overhead per layer and micro-batch) of this rank, from unsharded fwd + bwd
    steps of the same model at a few micro-batch sizes, fitted as time = overhead + FLOPs / rate. Both ranks
    run it at once, so the rate is what each gets while the other computes too."""
    from colozoo.kernels.dispatch import use_kernels
    from colozoo.api import build_model
    from colozoo.core.mesh import init_parallel

    model = build_model(config(), parallel=init_parallel(dp=2), device="cpu").train()  # a whole replica per rank
    points = []
    with use_kernels("torch"):
        for mbs in CALIBRATION_SIZES:
            ids = torch.randint(0, CONFIG["vocab_size"], (mbs, SEQ))
            times = []
            for _ in range(4):
                dist.barrier()
                start = time.perf_counter()
                model(ids, labels=ids).loss.backward()
                times.append(time.perf_counter() - start)
            points.append((flops[mbs], sorted(times[1:])[1]))
    (f0, t0), (f1, t1) = points[0], points[-1]
    rate = (f1 - f0) / (t1 - t0)
    overhead = max(0.0, t0 - f0 / rate)
    return rate, overhead / CONFIG["n_layer"]


def worker(rank, world, init_file, out, plans, steps, flops):
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    results = {}
    for name, mesh, m, data_parallel in plans:
        results[name] = run_plan(mesh, m, data_parallel, steps)
        dist.barrier()
    # after the plans, so their memory readings start from the same allocator state as before
    results.update(links=calibrate_links(), compute=calibrate_compute(flops))
    out.put((rank, results))
    dist.destroy_process_group()


def cpu_hardware(links: dict, compute: tuple[float, float]):
    """The two-rank CPU as the planner's Hardware: what it measured, and no overlap (gloo's collectives
    need the cores the compute is using)."""
    from colozoo.cost.hardware import Hardware

    rate, layer_overhead = compute
    link = links["all_reduce"][1]
    latency = sorted(lat for lat, _ in links.values())[len(links) // 2]
    # every kernel at the fitted rate (no tensor-core tiles), memory-bound work inside the fitted rate and overhead
    return Hardware("cpu-gloo", gpu_memory=2 ** 40, peak_flops=rate, gpus_per_node=2, intra_node_bw=link,
                    inter_node_bw=link, hbm_bw=1e18, hbm_efficiency=1.0, matmul_efficiency=1.0,
                    attention_efficiency=1.0, kernel_floor_s=0.0, layer_overhead_s=layer_overhead,
                    collective_latency_s=latency, inter_node_latency_s=latency, comm_overlap=0.0,
                    collective_efficiency={name: bw / link for name, (_, bw) in links.items()})


def predictions(cpu, plans):
    from colozoo.cost.planner import estimate
    from colozoo.cost.profiler import profile
    from colozoo.cost.setup import Workload, parse_mesh, plan_of

    out = {}
    workload = Workload(seq_len=SEQ, dtype="float32", target="cpu")
    for name, mesh, m, data_parallel in plans:
        degrees = parse_mesh(mesh)
        zero = 3 if data_parallel == "fsdp" and degrees.dp > 1 else 0
        plan = plan_of(degrees, micro_batch_size=BATCH // (degrees.dp * m), num_microbatches=m,
                       schedule=schedule_for(mesh, m),
                       zero=zero)
        report = profile(config(), plan, workload)
        step, _, _ = estimate(report, plan, workload, cpu)
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


def _result(queue, procs, timeout=600):
    """One worker's result; fails at once when a worker died instead of waiting out the timeout."""
    import queue as queue_module

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            return queue.get(timeout=1)
        except queue_module.Empty:
            dead = [p.exitcode for p in procs if p.exitcode not in (None, 0)]
            if dead:
                raise SystemExit(f"a worker failed (exit code {dead[0]}); its traceback is above")
    raise SystemExit(f"no result within {timeout} s")


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=5, help="timed steps per plan (after 2 warmup steps; the median counts)")
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
    procs = [ctx.Process(target=worker, args=(r, 2, init_file, out, plans, args.steps, step_flops())) for r in range(2)]
    for p in procs:
        p.start()
    results = dict(_result(out, procs) for _ in procs)
    for p in procs:
        p.join()
    # the slower rank's view of each calibration: a step waits for the slowest
    links = {name: (max(r["links"][name][0] for r in results.values()),
                    min(r["links"][name][1] for r in results.values())) for name in COLLECTIVES}
    compute = (min(r["compute"][0] for r in results.values()), max(r["compute"][1] for r in results.values()))
    cpu = cpu_hardware(links, compute)
    predicted = predictions(cpu, plans)
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
                      "metrics": {"flop_rate_gflops": round(cpu.peak_flops / 1e9, 2),
                                  "layer_overhead_ms": round(cpu.layer_overhead_s * 1e3, 3),
                                  "latency_ms": round(cpu.collective_latency_s * 1e3, 3),
                                  "bandwidth_gbs": {name: round(bw / 1e9, 3) for name, (_, bw) in links.items()},
                                  "spearman": round(rho, 3),
                                  "predicted_best": plans[min(range(len(plans)), key=predicted_t.__getitem__)][0],
                                  "measured_best": plans[min(range(len(plans)), key=measured_t.__getitem__)][0],
                                  "plans": ranking},
                      "peer": "measured step times of the same plans", "ratio": round(rho, 3)}))


if __name__ == "__main__":
    main()
