"""The fused LM head + loss (kernels.linear_cross_entropy: gradients taken chunk by chunk in the forward) against the
unfused path (the head's logits, then the vocab-parallel cross entropy), forward + backward, one JSON line.

    python bench/fused_head.py                        # 4096 tokens x 32k vocab, hidden 1024, fp32 on CPU
    python bench/fused_head.py --tokens 512 --vocab 4096 --hidden 256    # a quick run

Both sides take the path `auto` picks for the device (the torch path on CPU, the Triton kernels on CUDA). Metrics:
median milliseconds of each (alternated; on CPU the process's CPU time, and the wall clock beside it), the peak bytes
of the tensors each allocates during one forward + backward (a tracking dispatch mode on CPU,
torch.cuda.max_memory_allocated on CUDA; the inputs excluded), and the largest difference of loss and gradients.
ratio = unfused time / fused time.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from _peak import add_device_arguments, device_and_dtype, elapsed_ms, peak_bytes  # noqa: E402


def fused(hidden, weight, target, vocab):
    from colozoo.kernels.linear_cross_entropy import linear_cross_entropy

    return linear_cross_entropy(hidden, weight, target, vocab)


def unfused(hidden, weight, target, vocab):
    from colozoo.kernels.cross_entropy import vocab_parallel_cross_entropy

    return vocab_parallel_cross_entropy(F.linear(hidden, weight), target, vocab).sum()


def step(loss_fn, hidden, weight, target, vocab):
    """(loss, grad of hidden, grad of weight) of one forward + backward."""
    hidden.grad = weight.grad = None
    loss = loss_fn(hidden, weight, target, vocab)
    loss.backward()
    return loss.detach(), hidden.grad, weight.grad


def measured_step(loss_fn, inputs, device):
    """(peak bytes, (loss, grads)) of one forward + backward."""
    return peak_bytes(lambda: step(loss_fn, *inputs), device)


def timed(loss_fn, inputs, device) -> tuple[float, float]:
    """(wall, process CPU) milliseconds of one forward + backward."""
    return elapsed_ms(lambda: step(loss_fn, *inputs), device)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=4096)
    parser.add_argument("--vocab", type=int, default=32768)
    parser.add_argument("--hidden", type=int, default=1024)
    add_device_arguments(parser)
    args = parser.parse_args()
    device, dtype = device_and_dtype(args)
    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(args.tokens, args.hidden, generator=g).to(device, dtype).requires_grad_()
    weight = (torch.randn(args.vocab, args.hidden, generator=g) * 0.02).to(device, dtype).requires_grad_()
    target = torch.randint(0, args.vocab, (args.tokens,), generator=g)
    target[::16] = -100  # some ignored labels, as padding gives
    inputs = (hidden, weight, target.to(device), args.vocab)

    # the first run of each side is its warm-up, its memory measurement and the results compared
    peaks, results = {}, {}
    for name, fn in (("fused", fused), ("unfused", unfused)):
        peaks[name], measured = measured_step(fn, inputs, device)
        results[name] = [t.detach().clone() for t in measured]
    diffs = [(a.float() - b.float()).abs().max().item() for a, b in zip(results["fused"], results["unfused"])]
    del results, measured
    times = {"fused": [], "unfused": []}
    for _ in range(args.repeats):
        for name, fn in (("fused", fused), ("unfused", unfused)):
            times[name].append(timed(fn, inputs, device))
    # on CPU the process's CPU time (both threads), steadier than the wall clock on a shared machine
    clock = 1 if device == "cpu" else 0
    median = {name: statistics.median(t[clock] for t in runs) for name, runs in times.items()}
    wall = {name: statistics.median(t[0] for t in runs) for name, runs in times.items()}
    print(json.dumps({
        "bench": f"fused_head/{device}",
        "config": {"tokens": args.tokens, "vocab": args.vocab, "hidden": args.hidden,
                   "dtype": str(dtype).split(".")[-1],
                   "device": torch.cuda.get_device_name() if device == "cuda" else "cpu",
                   "threads": torch.get_num_threads(), "repeats": args.repeats,
                   "clock": "process CPU time" if clock else "wall"},
        "metrics": {"fused_ms": round(median["fused"], 1), "unfused_ms": round(median["unfused"], 1),
                    "fused_wall_ms": round(wall["fused"], 1), "unfused_wall_ms": round(wall["unfused"], 1),
                    "fused_ms_all": [round(t[clock], 1) for t in times["fused"]],
                    "unfused_ms_all": [round(t[clock], 1) for t in times["unfused"]],
                    "fused_peak_mib": round(peaks["fused"] / 2**20, 1),
                    "unfused_peak_mib": round(peaks["unfused"] / 2**20, 1),
                    "memory_ratio": round(peaks["unfused"] / max(peaks["fused"], 1), 2),
                    "max_diff_loss": diffs[0], "max_diff_grad_hidden": diffs[1], "max_diff_grad_weight": diffs[2]},
        "peer": "unfused: F.linear logits, then kernels.cross_entropy.vocab_parallel_cross_entropy",
        "ratio": round(median["unfused"] / median["fused"], 3)}))


if __name__ == "__main__":
    main()
