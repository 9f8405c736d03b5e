"""Triton kernels against the torch path and the hardware peak, one JSON line per kernel.

    python bench/kernels.py            # needs a CUDA GPU; on CPU it prints one skip line
    python bench/kernels.py --smoke    # CPU, triton interpreter, tiny shapes: checks this script, not speed

Each line: the kernel, the pass timed (forward, or forward+backward), milliseconds for both paths, the
throughput of each (GB/s for memory-bound kernels, TFLOP/s for attention and the fused LM-head loss), the
speedup over torch and the fraction of the device's peak (null for a device not in PEAKS).
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

SMOKE = "--smoke" in sys.argv
if SMOKE:
    os.environ["TRITON_INTERPRET"] = "1"  # before any kernel module is imported

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

# dense bf16/fp16 tensor-core TFLOP/s and HBM TB/s, from the vendors' data sheets (SXM parts)
PEAKS = {"H100": (989.0, 3.35), "H200": (989.0, 4.8), "A100": (312.0, 2.0), "L40S": (362.0, 0.864),
         "A10G": (125.0, 0.6), "B200": (2250.0, 8.0)}


def peak_for(name: str):
    for key, value in PEAKS.items():
        if key in name:
            return value
    return None, None


def timer(device):
    if device == "cuda":
        from triton.testing import do_bench

        return lambda fn, grads=(): do_bench(fn, warmup=25, rep=100, grad_to_none=list(grads))

    def wall(fn, grads=()):
        fn()  # warm
        start = time.perf_counter()
        fn()
        return (time.perf_counter() - start) * 1e3
    return wall


def fwd_bwd(fn, inputs):
    """A closure running fn(*inputs) and, when the inputs need grad, its backward."""
    def run():
        out = fn(*inputs)
        out = out[0] if isinstance(out, tuple) else out
        if any(t.requires_grad for t in inputs):
            out.backward(torch.ones_like(out))
    return run


def report(name, passes, metric, amount, ms_triton, ms_torch, peak, **shape):
    per_second = lambda ms: amount / (ms * 1e-3) / (1e12 if metric == "TFLOP/s" else 1e9)  # noqa: E731
    line = dict(kernel=name, passes=passes, metric=metric, **shape, triton_ms=round(ms_triton, 4),
                torch_ms=round(ms_torch, 4), triton=round(per_second(ms_triton), 2), torch=round(per_second(ms_torch), 2),
                speedup_vs_torch=round(ms_torch / ms_triton, 3),
                fraction_of_peak=None if peak is None else round(per_second(ms_triton) / peak, 3))
    print(json.dumps(line), flush=True)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--smoke", action="store_true", help="CPU, triton interpreter, tiny shapes")
    parser.parse_args()
    device = "cuda" if torch.cuda.is_available() and not SMOKE else "cpu"
    if device == "cpu" and not SMOKE:
        print(json.dumps({"benchmark": "kernels", "skipped": "no CUDA device (run with --smoke for a CPU check)"}))
        return
    from colozoo.kernels import (activations, activations_triton, cross_entropy_triton, moe, norms, norms_triton, rope,
                                 rope_triton, use_kernels)
    from colozoo.kernels.attention import local_attention
    from colozoo.kernels.cross_entropy import vocab_parallel_cross_entropy_reference as vocab_parallel_cross_entropy

    name = torch.cuda.get_device_name() if device == "cuda" else "cpu-interpreter"
    flops_peak, bw_peak = peak_for(name)
    bw_peak = bw_peak * 1e3 if bw_peak else None  # GB/s
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    elt = torch.tensor([], dtype=dtype).element_size()
    bench = timer(device)
    big = device == "cuda"
    print(json.dumps({"benchmark": "kernels", "device": name, "dtype": str(dtype).removeprefix("torch.")}), flush=True)

    def leaf(*shape, scale=1.0):
        return (torch.randn(*shape, device=device, dtype=dtype) * scale).requires_grad_()

    # norms: fwd reads x, writes y; bwd reads x, dy, writes dx (weight traffic is negligible)
    m, n = (16384, 4096) if big else (64, 96)
    x, w, b = leaf(m, n), leaf(n), leaf(n)
    for label, tri, ref in (("layer_norm", lambda x, w, b: norms_triton.layer_norm_triton(x, w, b),
                             lambda x, w, b: norms.layer_norm_reference(x, w, b)),
                            ("rms_norm", lambda x, w, b: norms_triton.rms_norm_triton(x, w),
                             lambda x, w, b: norms.rms_norm_reference(x, w))):
        report(label, "fwd+bwd", "GB/s", 5 * m * n * elt, bench(fwd_bwd(tri, (x, w, b)), (x, w, b)),
               bench(fwd_bwd(ref, (x, w, b)), (x, w, b)), bw_peak, rows=m, features=n)
    r = leaf(m, n)
    report("rms_norm_residual", "fwd+bwd", "GB/s", 8 * m * n * elt,
           bench(fwd_bwd(lambda x, r, w: norms_triton.rms_norm_triton(x, w, residual=r), (x, r, w)), (x, r, w)),
           bench(fwd_bwd(lambda x, r, w: norms.rms_norm_reference(x, w, residual=r), (x, r, w)), (x, r, w)),
           bw_peak, rows=m, features=n)

    # flash attention vs the torch path of kernels.attention (scaled_dot_product_attention)
    bsz, heads, kv_heads, seq = (4, 32, 8, 2048) if big else (1, 2, 1, 40)
    for d in (64, 128) if big else (16,):
        q, k, v = leaf(bsz, heads, seq, d), leaf(bsz, kv_heads, seq, d), leaf(bsz, kv_heads, seq, d)
        fwd_flops = 4 * bsz * heads * seq * seq * d / 2  # causal
        for passes, flops, inputs in (("fwd", fwd_flops, (q.detach(), k.detach(), v.detach())),
                                      ("fwd+bwd", 3.5 * fwd_flops, (q, k, v))):
            times = []
            for mode in ("triton", "torch"):
                with use_kernels(mode):
                    times.append(bench(fwd_bwd(lambda q, k, v: local_attention(q, k, v, causal=True), inputs),
                                       inputs))
            report("flash_attention", passes, "TFLOP/s", flops, *times, flops_peak, batch=bsz, heads=heads,
                   kv_heads=kv_heads, seq=seq, head_dim=d)

    # rotary: reads x, writes y; the models' cos/sin (fp32, two equal halves), of which the kernel reads one half
    x = leaf(bsz, heads, seq, 128 if big else 16)
    angles = torch.randn(bsz, seq, x.shape[-1] // 2, device=device)
    cos, sin = torch.cat((angles.cos(),) * 2, -1), torch.cat((angles.sin(),) * 2, -1)
    half = x.shape[-1] // 2
    report("rotary", "fwd+bwd", "GB/s", 4 * x.numel() * elt,
           bench(fwd_bwd(lambda x: rope_triton.apply_rotary_triton(x, cos[..., :half], sin[..., :half]), (x,)), (x,)),
           bench(fwd_bwd(lambda x: rope.apply_rotary_reference(x, cos, sin), (x,)), (x,)), bw_peak,
           shape=list(x.shape))

    # activations: swiglu fwd 3 tensors, bwd 5; bias-gelu fwd 2, bwd 3
    rows, width = (16384, 14336) if big else (32, 100)
    g, u, bias = leaf(rows, width), leaf(rows, width), leaf(width)
    report("swiglu", "fwd+bwd", "GB/s", 8 * rows * width * elt,
           bench(fwd_bwd(activations_triton.swiglu_triton, (g, u)), (g, u)),
           bench(fwd_bwd(activations.swiglu_reference, (g, u)), (g, u)), bw_peak, rows=rows, width=width)
    report("bias_gelu", "fwd+bwd", "GB/s", 5 * rows * width * elt,
           bench(fwd_bwd(lambda x, b: activations_triton.bias_gelu_triton(x, b, "tanh"), (g, bias)), (g, bias)),
           bench(fwd_bwd(lambda x, b: activations.bias_gelu_reference(x, b, "tanh"), (g, bias)), (g, bias)),
           bw_peak, rows=rows, width=width)

    # cross entropy on given logits (reads logits twice, writes their gradient once) ...
    tokens, hidden, vocab = (8192, 4096, 128256) if big else (24, 32, 300)
    target = torch.randint(0, vocab, (tokens,), device=device)
    logits = leaf(tokens, vocab, scale=2.0)
    report("cross_entropy", "fwd+bwd", "GB/s", 3 * tokens * vocab * elt,
           bench(fwd_bwd(lambda z: cross_entropy_triton.cross_entropy_triton(z, target, vocab), (logits,)), (logits,)),
           bench(fwd_bwd(lambda z: vocab_parallel_cross_entropy(z, target, vocab), (logits,)), (logits,)),
           bw_peak, tokens=tokens, vocab=vocab)
    del logits
    # ... the head then the Triton loss (the path when logits are asked for), and the two fused: 3 matmuls, all in
    # the forward (logits, d hidden, d weight), the backward only scaling what it kept
    h, weight = leaf(tokens, hidden), leaf(vocab, hidden, scale=0.02)
    report("linear_then_cross_entropy", "fwd+bwd", "TFLOP/s", 6 * tokens * hidden * vocab,
           bench(fwd_bwd(lambda h, w: cross_entropy_triton.cross_entropy_triton(F.linear(h, w), target, vocab),
                         (h, weight)), (h, weight)),
           bench(fwd_bwd(lambda h, w: vocab_parallel_cross_entropy(F.linear(h, w), target, vocab),
                         (h, weight)), (h, weight)),
           flops_peak, tokens=tokens, hidden=hidden, vocab=vocab)
    report("linear_cross_entropy", "fwd+bwd", "TFLOP/s", 6 * tokens * hidden * vocab,
           bench(fwd_bwd(lambda h, w: cross_entropy_triton.linear_cross_entropy_triton(h, w, target, vocab),
                         (h, weight)), (h, weight)),
           bench(fwd_bwd(lambda h, w: vocab_parallel_cross_entropy(F.linear(h, w), target, vocab),
                         (h, weight)), (h, weight)),
           flops_peak, tokens=tokens, hidden=hidden, vocab=vocab)

    # MoE: permute copies T*k rows, unpermute reads them back (each direction twice with the backward)
    tokens, hidden, experts, top_k = (16384, 4096, 64, 8) if big else (40, 32, 6, 2)
    x = leaf(tokens, hidden)
    ids = torch.rand(tokens, experts, device=device).topk(top_k, dim=-1).indices
    weights = torch.softmax(torch.randn(tokens, top_k, device=device), -1).to(dtype).requires_grad_()

    def moe_round_trip(mode):
        def run(x, weights):
            with use_kernels(mode):
                permuted, row_map, _ = moe.permute(x, ids, experts)
                return moe.unpermute(permuted, row_map, weights)
        return run
    report("moe_permute_unpermute", "fwd+bwd", "GB/s", 8 * tokens * top_k * hidden * elt,
           bench(fwd_bwd(moe_round_trip("triton"), (x, weights)), (x, weights)),
           bench(fwd_bwd(moe_round_trip("torch"), (x, weights)),
                 (x, weights)), bw_peak, tokens=tokens, hidden=hidden, experts=experts, top_k=top_k)


if __name__ == "__main__":
    main()
