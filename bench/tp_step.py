"""A whole tensor-parallel train step (forward with labels -> loss, backward) at tp=2: colozoo against transformers'
native tensor parallelism (a tp_plan="auto" DistributedConfig), same weights, two gloo processes of one thread each.

Both colozoo variants run (plain tp and tp with sequence parallelism); the faster one is the headline. Per rank:
MFU = (FLOPs of the whole model's step, counted by torch's FlopCounterMode on a one-process model, / tp) / step time /
peak, where peak = the FLOP/s of a one-thread fp32 matmul (--peak-size cubed) timed in the same run on that rank.
A step is timed from a barrier to the slowest rank's end; sides alternate, each the best (and median) of `repeats`.
Ratio = transformers' best step time / colozoo's. The losses of all three sides must agree.

`--profile` (on by default) adds where colozoo's step waits on communication: every collective is timed as it is
called (its exposed time: an async collective counts from its issue and its wait), grouped by kind (all-reduce,
all-gather, reduce-scatter, the loss's collectives, the small all-reduces of the norms' weight gradients under
sequence parallelism), torch.profiler's self CPU time per step by kind of op (matmuls, attention, collectives, other
ops), the MFU a step of only those matmuls and that attention would reach (the ceiling of the headline), and a bare
gloo collective of the activation's size is timed alone for comparison.

    python bench/tp_step.py [--hidden 512] [--layers 4] [--batch 4] [--seq 256] [--repeats 5] [--no-profile]
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

import torch  # noqa: E402
import transformers  # noqa: E402

from _comm_timer import CommTimer, op_breakdown  # noqa: E402
from _ranks import add_llama_arguments, hf_tensor_parallel, llama_config, run_ranks  # noqa: E402


def batch(args):
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(3, args.vocab, (args.batch, args.seq), generator=g)
    return ids, ids.clone()


def step_flops(model, ids, labels) -> int:
    """FLOPs of one forward + backward of the whole (one-process) model."""
    from torch.utils.flop_counter import FlopCounterMode

    with FlopCounterMode(display=False) as counter:
        model(input_ids=ids, labels=labels).loss.backward()
    model.zero_grad(set_to_none=True)
    return counter.get_total_flops()


def matmul_peak(n: int, repeats: int = 3) -> float:
    """FLOP/s of one n^3 fp32 matmul on this thread, best of `repeats`."""
    a, b = torch.randn(n, n), torch.randn(n, n)
    a @ b
    best = min(_timed(lambda: a @ b) for _ in range(repeats))
    return 2 * n ** 3 / best


def _timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def train_step(model, ids, labels):
    model.zero_grad(set_to_none=True)
    loss = model(input_ids=ids, labels=labels).loss
    loss.backward()
    return loss.detach()


def timed_step(model, ids, labels):
    """(seconds from a common start to the slowest rank's end, loss)."""
    import torch.distributed as dist

    model.zero_grad(set_to_none=True)
    dist.barrier()
    start = time.perf_counter()
    loss = model(input_ids=ids, labels=labels).loss
    loss.backward()
    elapsed = torch.tensor([time.perf_counter() - start], dtype=torch.float64)
    dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
    return float(elapsed), loss.detach()


def bare_collectives(numel: int, repeats: int = 20) -> dict:
    """Seconds of one bare gloo all-reduce / all-gather / reduce-scatter of `numel` fp32 (the activation), median."""
    import torch.distributed as dist

    from colozoo.layers.comm import all_gather, reduce_scatter

    x = torch.randn(numel)
    world = dist.get_world_size()
    ops = {"all_reduce": lambda: dist.all_reduce(x),
           "all_gather": lambda: all_gather(x[: numel // world], 0, None if world == 1 else dist.group.WORLD),
           "reduce_scatter": lambda: reduce_scatter(x, 0, dist.group.WORLD)}
    out = {}
    for name, op in ops.items():
        op()
        times = []
        for _ in range(repeats):
            dist.barrier()
            times.append(_timed(op))
        out[name] = statistics.median(times)
    return out


def _rank(rank, world, path, args):
    import colozoo

    sides = {"colozoo": colozoo.from_pretrained(path, tp=world),
             "colozoo_sp": colozoo.from_pretrained(path, tp=world, sequence_parallel=True),
             "hf": hf_tensor_parallel(path, world)}
    for model in sides.values():
        model.train()
    ids, labels = batch(args)
    peak = matmul_peak(args.peak_size)
    for model in sides.values():  # warm up
        train_step(model, ids, labels)
    times = {side: [] for side in sides}
    losses = {}
    for _ in range(args.repeats):  # alternate, so noise hits every side alike
        for side, model in sides.items():
            seconds, losses[side] = timed_step(model, ids, labels)
            times[side].append(seconds)
    peak = max(peak, matmul_peak(args.peak_size))  # the quieter of the two moments
    result = {"peak_flops_per_s": peak, "times": times, "losses": {k: float(v) for k, v in losses.items()}}
    if args.profile:
        result["profile"] = {}
        for side in ("colozoo", "colozoo_sp"):
            timer = CommTimer()
            with timer:
                for _ in range(args.profile_steps):
                    seconds, _ = timed_step(sides[side], ids, labels)
                    timer.steps.append(seconds)
            result["profile"][side] = timer.summary()
            result["profile"][side]["self_cpu_s_per_step"] = op_breakdown(lambda: train_step(sides[side], ids, labels))
        result["bare"] = bare_collectives(args.batch * args.seq * args.hidden)
    return result


def report(args, flops, results, world=2):
    peak = min(r["peak_flops_per_s"] for r in results.values())  # both ranks' timed steps are the same (max over ranks)
    times = results[0]["times"]
    best = {side: min(t) for side, t in times.items()}
    median = {side: statistics.median(t) for side, t in times.items()}
    mfu = {side: flops / world / best[side] / peak for side in times}
    ours = min(("colozoo", "colozoo_sp"), key=best.get)
    losses = results[0]["losses"]
    metrics = {"headline": ours, "step_flops": flops, "peak_flops_per_s": peak,
               **{f"{side}_step_s": best[side] for side in times},
               **{f"{side}_median_step_s": median[side] for side in times},
               **{f"{side}_mfu": mfu[side] for side in times},
               "ratio_sp": best["hf"] / best["colozoo_sp"], "ratio_no_sp": best["hf"] / best["colozoo"],
               "losses": losses, "max_loss_diff": max(abs(v - losses["hf"]) for v in losses.values()),
               "repeats": times}
    if args.profile:
        metrics["comm_profile"] = results[0]["profile"]
        for side, profile in metrics["comm_profile"].items():
            # the MFU of a step that ran nothing but its matmuls and attention, at their profiled speed: no
            # communication, no elementwise work. The headline MFU cannot pass it.
            compute_s = profile["self_cpu_s_per_step"]["matmul"] + profile["self_cpu_s_per_step"]["attention"]
            profile["matmul_and_attention_only_mfu"] = flops / world / compute_s / peak
        metrics["bare_collective_s"] = results[0]["bare"]
    config = dict(vars(args), tp=world, threads_per_rank=1, dtype="float32", device="cpu", backend="gloo")
    print(json.dumps({"bench": f"tp_step/tp{world}/llama", "config": config, "metrics": metrics,
                      "peer": "transformers' native tensor parallelism (a tp_plan='auto' DistributedConfig, gloo)",
                      "ratio": best["hf"] / best[ours]}), flush=True)


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_llama_arguments(parser)
    parser.add_argument("--seq", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--peak-size", type=int, default=2048, help="the peak matmul's n (n^3, fp32, one thread)")
    parser.add_argument("--profile", action=argparse.BooleanOptionalAction, default=True)
    parser.add_argument("--profile-steps", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(1)
    config = llama_config(args)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="sdpa")
    flops = step_flops(model, *batch(args))
    with tempfile.TemporaryDirectory() as path:
        model.save_pretrained(path)
        del model
        results = run_ranks(_rank, 2, path, args)
    report(args, flops, results)


if __name__ == "__main__":
    main()
