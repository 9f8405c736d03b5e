"""Model FLOPs utilisation of a tp=1 training step: colozoo and transformers (sdpa) side by side in one process.

A step is forward with labels -> loss -> backward (gradients set to None before it; no optimizer step, on both sides).
The FLOPs of one step are counted by torch.utils.flop_counter.FlopCounterMode on each side (they must agree); the
peak is the FLOP/s of a 2048^3 fp32 matmul timed in the same process between the steps (best of --peak-repeats at
each repeat, best over the repeats), so that a busy moment of a shared machine lowers both alike. MFU = FLOPs / step
time / peak, the step time being the best of --repeats wall-clock steps, the sides alternating. "ratio" = the
transformers step time / ours (> 1: colozoo is faster).

Where our step goes: one profiled step (torch.profiler) splits the operators' self CPU time into the counted matrix
products (mm, addmm, bmm, attention) and the rest; "colozoo_outside_matmul" = 1 - matmul time / the profiled step's
wall time (Python overhead included). `--profile` prints the top operators of both sides on stderr (and reports
"hf_outside_matmul"); `--ceiling` reports "matmul_ceiling_mfu", the MFU the step would have if everything outside
the matrix products were free: the step's own counted operators replayed alone at their shapes and strides (they run
below the 2048^3 peak when small or skinny); `--compile` adds the same model with compile=True (each layer compiled).

    python bench/mfu.py [--families gpt2,opt,llama] [--hidden 512] [--layers 4] [--batch 4] [--seq 256] [--threads 2]
"""
from __future__ import annotations

import argparse
import collections
import json
import os
import sys
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

import torch  # noqa: E402
import transformers  # noqa: E402
from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402
from torch.utils.flop_counter import FlopCounterMode, flop_registry  # noqa: E402

from colozoo.api import build_model  # noqa: E402
from colozoo.checkpoint.load import load_hf_weights  # noqa: E402
from colozoo.checkpoint.readers import StateDictReader  # noqa: E402

VOCAB = {"gpt2": 50257, "opt": 50272, "llama": 32000}  # the families' real vocabularies
MATMUL_OPS = ("mm", "bmm", "addmm", "baddbmm", "attention")  # operators whose self time counts as matrix products


def hf_config(family: str, args):
    h, vocab = args.hidden, args.vocab or VOCAB[family]
    if family == "gpt2":
        return transformers.GPT2Config(n_embd=h, n_head=args.heads, n_layer=args.layers, vocab_size=vocab,
                                       n_positions=max(args.seq, 1024), resid_pdrop=0.0, embd_pdrop=0.0,
                                       attn_pdrop=0.0)
    if family == "opt":
        return transformers.OPTConfig(hidden_size=h, ffn_dim=4 * h, num_attention_heads=args.heads,
                                      num_hidden_layers=args.layers, vocab_size=vocab, word_embed_proj_dim=h,
                                      max_position_embeddings=max(args.seq, 1024), dropout=0.0,
                                      attention_dropout=0.0)
    if family == "llama":
        return transformers.LlamaConfig(hidden_size=h, intermediate_size=args.intermediate or -(-8 * h // 3 // 32) * 32,
                                        num_attention_heads=args.heads, num_key_value_heads=args.heads,
                                        num_hidden_layers=args.layers, vocab_size=vocab,
                                        max_position_embeddings=max(args.seq, 1024))
    raise SystemExit(f"unknown family {family!r}; choose gpt2, opt or llama")


def build_pair(config, compile: bool):
    torch.manual_seed(0)
    hf = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="sdpa").train()
    state = {k: v.detach() for k, v in hf.state_dict().items()}
    models = {"colozoo": build_model(config, device="meta"), "hf": hf}
    load_hf_weights(models["colozoo"], StateDictReader(state), device="cpu")
    if compile:
        models["compiled"] = build_model(config, device="meta", compile=True)
        load_hf_weights(models["compiled"], StateDictReader(state), device="cpu")
    return {name: model.train() for name, model in models.items()}


def step_of(model, ids, hf: bool):
    def step():
        model.zero_grad(set_to_none=True)
        out = model(input_ids=ids, labels=ids) if hf else model(ids, labels=ids)
        out.loss.backward()
        return out.loss.detach()
    return step


def timed(step) -> float:
    start = time.perf_counter()
    step()
    return time.perf_counter() - start


def peak_step(repeats: int, n: int = 2048):
    """A step that times an n^3 fp32 matmul `repeats` times and returns its best FLOP/s."""
    a, b = torch.randn(n, n), torch.randn(n, n)
    torch.mm(a, b)
    return lambda: 2 * n ** 3 / min(timed(lambda: torch.mm(a, b)) for _ in range(repeats))


def counted_flops(step) -> tuple[int, object]:
    with FlopCounterMode(display=False) as counter:
        loss = step()
    return counter.get_total_flops(), loss


class MatmulRecorder(TorchDispatchMode):
    """Records the calls of the operators FlopCounterMode counts (their shapes and strides), to replay them alone."""

    def __init__(self):
        super().__init__()
        self.calls = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func.overloadpacket in flop_registry:
            self.calls[(func, _describe(args), _describe(kwargs))] += 1
        return func(*args, **kwargs)


def _describe(value):
    if isinstance(value, torch.Tensor):
        return ("tensor", tuple(value.shape), tuple(value.stride()), value.dtype, value.requires_grad)
    if isinstance(value, (list, tuple)):
        return tuple(_describe(v) for v in value)
    if isinstance(value, dict):
        return tuple((k, _describe(v)) for k, v in sorted(value.items()))
    return value


def _rebuild(value):
    if isinstance(value, tuple) and value[:1] == ("tensor",):
        _, shape, stride, dtype, _ = value
        if not dtype.is_floating_point:
            return torch.zeros(shape, dtype=dtype).as_strided(shape, stride)
        size = 1 + sum((s - 1) * st for s, st in zip(shape, stride)) if all(shape) else 0
        return torch.randn(size, dtype=dtype).as_strided(shape, stride)
    if isinstance(value, tuple) and value and all(isinstance(v, tuple) and len(v) == 2 and isinstance(v[0], str)
                                                  for v in value):
        return {k: _rebuild(v) for k, v in value}
    if isinstance(value, tuple):
        return tuple(_rebuild(v) for v in value)
    return value


def matmuls_alone(step):
    """A step that replays `step`'s counted operators alone, at their shapes and strides."""
    recorder = MatmulRecorder()
    with recorder:
        step()
    calls = [(func, _rebuild(args), dict(_rebuild(kwargs)) if kwargs else {}, count)
             for (func, args, kwargs), count in recorder.calls.items()]

    def replay():
        for func, args, kwargs, count in calls:
            for _ in range(count):
                func(*args, **kwargs)
    return replay


def profile_step(step, name: str, top: int | None) -> float:
    """Fraction of one profiled step's wall time outside the matrix products (self CPU time of the operators)."""
    from torch.profiler import ProfilerActivity, profile

    start = time.perf_counter()
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        step()
    wall = time.perf_counter() - start
    events = prof.key_averages()
    matmul = sum(e.self_cpu_time_total for e in events
                 if e.key.startswith("aten::") and any(op in e.key for op in MATMUL_OPS)) / 1e6
    if top:
        print(f"--- {name}: top {top} operators by self CPU time (profiled step {1000 * wall:.0f} ms) ---",
              file=sys.stderr)
        print(events.table(sort_by="self_cpu_time_total", row_limit=top), file=sys.stderr)
    return 1 - matmul / wall


def bench_family(family: str, args) -> dict:
    config = hf_config(family, args)
    models = build_pair(config, args.compile)
    ids = torch.randint(0, config.vocab_size, (args.batch, args.seq), generator=torch.Generator().manual_seed(1))
    steps = {name: step_of(model, ids, hf=name == "hf") for name, model in models.items()}
    flops, losses = {}, {}
    compile_s = None
    for name, step in steps.items():  # the counted step is the first warmup
        start = time.perf_counter()
        flops[name], losses[name] = counted_flops(step) if name != "compiled" else (None, step())
        if name == "compiled":
            compile_s = time.perf_counter() - start
    for _ in range(args.warmup - 1):
        for step in steps.values():
            step()
    if args.ceiling:
        steps["matmuls_alone"] = matmuls_alone(steps["hf"])
    peak = peak_step(args.peak_repeats)
    times, peaks = {name: [] for name in steps}, []
    for i in range(args.repeats):  # the peak is taken between the steps, so that it sees the machine they see
        peaks.append(peak())
        for name in (list(steps) if i % 2 == 0 else list(reversed(steps))):
            times[name].append(timed(steps[name]))
    best, peak = {name: min(t) for name, t in times.items()}, max(peaks)
    outside = profile_step(steps["colozoo"], f"{family} colozoo", args.profile)
    hf_outside = profile_step(steps["hf"], f"{family} transformers", args.profile) if args.profile else None
    alone = best.pop("matmuls_alone", None)
    mfu = {name: flops["hf"] / t / peak for name, t in best.items()}
    metrics = {"colozoo_mfu": round(mfu["colozoo"], 3), "hf_mfu": round(mfu["hf"], 3),
               "colozoo_step_ms": round(1000 * best["colozoo"], 1), "hf_step_ms": round(1000 * best["hf"], 1),
               "colozoo_step_ms_all": [round(1000 * t, 1) for t in times["colozoo"]],
               "hf_step_ms_all": [round(1000 * t, 1) for t in times["hf"]],
               "colozoo_gflop": round(flops["colozoo"] / 1e9, 3), "hf_gflop": round(flops["hf"] / 1e9, 3),
               "peak_gflop_per_s": round(peak / 1e9, 1), "peak_gflop_per_s_all": [round(p / 1e9, 1) for p in peaks],
               "colozoo_outside_matmul": round(outside, 3),
               "loss_diff": abs(losses["colozoo"].item() - losses["hf"].item())}
    if hf_outside is not None:
        metrics["hf_outside_matmul"] = round(hf_outside, 3)
    if alone is not None:
        metrics["matmuls_alone_ms"] = round(1000 * alone, 1)
        metrics["matmul_ceiling_mfu"] = round(flops["hf"] / alone / peak, 3)
    if args.compile:
        metrics.update(compiled_mfu=round(mfu["compiled"], 3), compiled_step_ms=round(1000 * best["compiled"], 1),
                       compiled_ratio=round(best["hf"] / best["compiled"], 3),
                       first_compiled_step_s=round(compile_s, 1))
    return {"bench": f"mfu/tp1/{family}",
            "config": {"family": family, "hidden": args.hidden, "layers": args.layers, "heads": args.heads,
                       "intermediate": getattr(config, "intermediate_size", None), "vocab": config.vocab_size,
                       "batch": args.batch, "seq": args.seq, "dtype": "float32", "tp": 1, "device": "cpu",
                       "threads": torch.get_num_threads(), "warmup": args.warmup, "repeats": args.repeats,
                       "clock": "wall, best of repeats", "step": "zero_grad + forward(labels) + backward",
                       "optimizer_step": False,
                       "peak": f"2048^3 fp32 mm, best of {args.peak_repeats} x {args.repeats} between the steps"},
            "metrics": metrics,
            "peer": "transformers AutoModelForCausalLM, attn_implementation=sdpa",
            "ratio": round(best["hf"] / best["colozoo"], 3)}


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--families", default="gpt2,opt,llama")
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--intermediate", type=int, default=None, help="LLaMA MLP width (default: 8/3 hidden)")
    parser.add_argument("--vocab", type=int, default=None, help="default: the family's real vocabulary")
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--seq", type=int, default=256)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--warmup", type=int, default=1, help="warmup steps per side (the first counts FLOPs)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--peak-repeats", type=int, default=3, help="matmuls timed for the peak at each repeat")
    parser.add_argument("--profile", type=int, nargs="?", const=15, default=0, metavar="TOP",
                        help="print the top operators of both sides by self CPU time (default 15)")
    parser.add_argument("--ceiling", action="store_true",
                        help="replay the step's matmuls alone at their shapes: the MFU with nothing else in the step")
    parser.add_argument("--compile", action="store_true", help="also time compile=True (each layer compiled)")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    for family in args.families.split(","):
        print(json.dumps(bench_family(family.strip(), args)), flush=True)


if __name__ == "__main__":
    main()
