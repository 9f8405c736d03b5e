"""The per-token log-probs and entropy metric of a GRPO step (the logits over the temperature, the labels' log-probs
with their backward, the entropy of each position's softmax) from one pass over the vocab slice of the logits,
against the two passes the step made before (label_log_probs, then label_entropy) and against TRL's
selective_log_softmax_and_entropy, forward + backward, one JSON line.

    python bench/grpo_entropy.py                               # 2 x 256 tokens x Qwen2.5's 151936 vocab, fp32 on CPU
    python bench/grpo_entropy.py --tokens 64 --vocab 32000     # a quick run

Every side takes the path `auto` picks for the device (the torch paths on CPU; on CUDA our Triton kernel and TRL's).
Metrics: the peak bytes of the tensors each side allocates during one forward + backward (a tracking dispatch mode on
CPU, torch.cuda.max_memory_allocated on CUDA; the logits excluded), in vocab slices of fp32 too; median milliseconds
(alternated; process CPU time on CPU); the largest differences of log-probs, entropy and gradient against TRL.
ratio = TRL's peak / ours; memory_ratio_two_passes = the two passes' peak / ours (the step before and after).
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

TEMPERATURE = 0.7


def one_pass(head, logits, labels):
    return head.label_log_probs_and_entropy(logits / TEMPERATURE, labels)


def two_passes(head, logits, labels):
    scaled = logits / TEMPERATURE
    return head.label_log_probs(scaled, labels), head.label_entropy(scaled.detach(), labels)


def trl(head, logits, labels):
    """TRL's GRPOTrainer computes both on the completion's logits, aligned with the tokens they predict."""
    from trl.trainer.utils import selective_log_softmax_and_entropy

    logps, entropy = selective_log_softmax_and_entropy(logits[:, :-1], labels[:, 1:].clamp(min=0),
                                                       entropy_requires_grad=False, temperature=TEMPERATURE)
    mask = labels[:, 1:] != -100
    return F.pad(logps * mask, (1, 0)), F.pad(entropy * mask, (1, 0))


def step(side, head, logits, labels):
    """(log-probs, entropy, the logits' gradient) of one forward + backward of a weighted sum of the log-probs."""
    logits.grad = None
    logps, entropy = side(head, logits, labels)
    (logps * torch.linspace(0.5, 1.5, logps.numel(), device=logps.device).view_as(logps)).sum().backward()
    return logps.detach(), entropy, logits.grad


def measured_step(side, inputs, device):
    """(peak bytes, results) of one forward + backward."""
    return peak_bytes(lambda: step(side, *inputs), device)


def timed(side, inputs, device) -> float:
    """Milliseconds of one forward + backward: wall on CUDA, process CPU time on CPU."""
    wall, cpu = elapsed_ms(lambda: step(side, *inputs), device)
    return wall if device == "cuda" else cpu


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=2, help="completions")
    parser.add_argument("--tokens", type=int, default=256, help="tokens of each")
    parser.add_argument("--vocab", type=int, default=151936)
    add_device_arguments(parser)
    args = parser.parse_args()
    from colozoo.layers.vocab import VocabParallelLMHead

    device, dtype = device_and_dtype(args)
    g = torch.Generator().manual_seed(0)
    logits = (torch.randn(args.rows, args.tokens, args.vocab, generator=g) * 3).to(device, dtype).requires_grad_()
    labels = torch.randint(0, args.vocab, (args.rows, args.tokens), generator=g)
    labels[:, : args.tokens // 4] = -100  # the prompt
    inputs = (VocabParallelLMHead(8, args.vocab, device="meta"), logits, labels.to(device))
    sides = {"one_pass": one_pass, "two_passes": two_passes, "trl": trl}

    # each side's first run is its warm-up, its memory measurement and the results compared
    peaks, results = {}, {}
    for name, side in sides.items():
        peaks[name], measured = measured_step(side, inputs, device)
        results[name] = [t.detach().float().clone() for t in measured]
    diffs = {f"max_diff_{what}_vs_trl": (a - b).abs().max().item()
             for what, a, b in zip(("logps", "entropy", "grad"), results["one_pass"], results["trl"])}
    del results, measured
    times = {name: [] for name in sides}
    for _ in range(args.repeats):
        for name, side in sides.items():
            times[name].append(timed(side, inputs, device))
    slice_bytes = logits.numel() * 4
    print(json.dumps({
        "bench": f"grpo_entropy/{device}",
        "config": {"rows": args.rows, "tokens": args.tokens, "vocab": args.vocab, "temperature": TEMPERATURE,
                   "dtype": str(dtype).split(".")[-1], "threads": torch.get_num_threads(), "repeats": args.repeats,
                   "device": torch.cuda.get_device_name() if device == "cuda" else "cpu",
                   "clock": "wall" if device == "cuda" else "process CPU time"},
        "metrics": {**{f"{name}_peak_mib": round(peak / 2**20, 1) for name, peak in peaks.items()},
                    **{f"{name}_peak_fp32_slices": round(peak / slice_bytes, 2) for name, peak in peaks.items()},
                    **{f"{name}_ms": round(statistics.median(t), 1) for name, t in times.items()},
                    "memory_ratio_two_passes": round(peaks["two_passes"] / peaks["one_pass"], 2), **diffs},
        "peer": "TRL selective_log_softmax_and_entropy (entropy_requires_grad=False); and the two passes "
                "label_log_probs + label_entropy",
        "ratio": round(peaks["trl"] / peaks["one_pass"], 2)}))


if __name__ == "__main__":
    main()
