"""torch.compile of each layer (compile=True) against the same model run eagerly: the tp=1 training step (forward +
backward) of a small LLaMA in fp32, steps alternating between the two so machine noise hits both alike. Prints one
JSON line; "ratio" = eager step time / compiled step time (> 1: compile is faster), best of --repeats each.

The layers alone (forward + backward from the embeddings' output, what compile compiles; the embedding, LM head and
loss stay eager) are timed too ("layers_*"). Where their time goes: one eager pass is profiled and its operators split
into matrix products (mm, addmm, bmm, attention) and the rest (RoPE, RMSNorm, SiLU * up, residual adds, their
backward, copies), the work compile can fuse. "elementwise_removed" = (layers eager - layers compiled) / the eager
layers' time in that rest: how much of it compile saved.

    python bench/compile.py [--hidden 512] [--layers 4] [--batch 4] [--seq 256] [--repeats 7]
"""
from __future__ import annotations

import argparse
import json
import os
import tempfile
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", os.path.join(tempfile.gettempdir(), "colozoo-inductor"))

import torch  # noqa: E402
import transformers  # noqa: E402

from colozoo.api import build_model  # noqa: E402
from colozoo.checkpoint.load import load_hf_weights  # noqa: E402
from colozoo.checkpoint.readers import StateDictReader  # noqa: E402
from colozoo.runtime.compile import compile_layers  # noqa: E402
from throughput import timed  # noqa: E402

MATMUL_OPS = ("mm", "bmm", "addmm", "matmul", "linear", "attention", "sdpa", "baddbmm")


def build(config, state, device, compile):
    model = build_model(config, device="meta")
    load_hf_weights(model, StateDictReader(state), device=device)
    if compile:
        compile_layers(model)
    return model.train()


def step_of(model, ids):
    def step():
        model.zero_grad(set_to_none=True)
        model(ids, labels=ids).loss.backward()
    return step


def layers_step_of(model, ids):
    """Forward + backward of the transformer layers alone (what compile compiles), from the embeddings' output."""
    batch = model.batch_context(ids)
    hidden = model.embed(ids, batch).detach().requires_grad_()

    def step():
        model.zero_grad(set_to_none=True)
        model.forward_layers(hidden, batch).sum().backward()
    return step


def matmul_share(step) -> tuple[float, float]:
    """(seconds in matrix products and attention, seconds in everything else) of one profiled step, by the
    operators' self CPU time."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        step()
    matmul = other = 0.0
    for event in prof.key_averages():
        if event.key.startswith("aten::") or event.key.startswith("Optimizer"):
            name = event.key.removeprefix("aten::")
            seconds = event.self_cpu_time_total / 1e6
            if any(op in name for op in MATMUL_OPS):
                matmul += seconds
            else:
                other += seconds
    return matmul, other


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--intermediate", type=int, default=1376)
    parser.add_argument("--vocab", type=int, default=8192)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--seq", type=int, default=256)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: 1 on CPU)")
    parser.add_argument("--clock", choices=["cpu", "wall"], default=None)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    if args.threads or device.type == "cpu":
        torch.set_num_threads(args.threads or 1)
    config = transformers.LlamaConfig(hidden_size=args.hidden, num_hidden_layers=args.layers,
                                      num_attention_heads=args.heads, num_key_value_heads=args.heads,
                                      intermediate_size=args.intermediate, vocab_size=args.vocab,
                                      max_position_embeddings=max(args.seq, 512))
    torch.manual_seed(0)
    state = {k: v.detach() for k, v in transformers.LlamaForCausalLM(config).state_dict().items()}
    eager, compiled = build(config, state, device, False), build(config, state, device, True)
    ids = torch.randint(0, args.vocab, (args.batch, args.seq), generator=torch.Generator().manual_seed(1)).to(device)
    steps = {"eager": step_of(eager, ids), "compiled": step_of(compiled, ids),
             "layers_eager": layers_step_of(eager, ids), "layers_compiled": layers_step_of(compiled, ids)}
    start = time.perf_counter()
    steps["compiled"]()  # compiles
    compile_s = time.perf_counter() - start
    with torch.no_grad():
        diff = (eager(ids, return_logits=True).logits - compiled(ids, return_logits=True).logits).abs().max().item()
    for _ in range(args.warmup):
        for step in steps.values():
            step()
    clock = args.clock or ("cpu" if device.type == "cpu" else "wall")
    times = {name: [] for name in steps}
    for i in range(args.repeats):
        for name in (list(steps) if i % 2 == 0 else list(reversed(steps))):
            wall, cpu = timed(steps[name], device)
            times[name].append(cpu if clock == "cpu" else wall)
    best = {k: min(v) for k, v in times.items()}
    matmul, other = matmul_share(steps["layers_eager"])
    tokens = args.batch * args.seq
    saved = best["layers_eager"] - best["layers_compiled"]
    other_s = best["layers_eager"] * other / (matmul + other)  # the profiler slows the step; its shares still hold
    print(json.dumps({
        "bench": "compile/llama",
        "config": {"hidden": args.hidden, "layers": args.layers, "heads": args.heads,
                   "intermediate": args.intermediate, "vocab": args.vocab, "batch": args.batch, "seq": args.seq,
                   "dtype": "float32", "tp": 1, "device": str(device), "threads": torch.get_num_threads(),
                   "repeats": args.repeats, "clock": clock, "backend": "inductor"},
        "metrics": {"eager_step_ms": round(1000 * best["eager"], 1), "compiled_step_ms": round(1000 * best["compiled"], 1),
                    "eager_tokens_per_s": round(tokens / best["eager"], 1),
                    "compiled_tokens_per_s": round(tokens / best["compiled"], 1),
                    "eager_step_ms_all": [round(1000 * t, 1) for t in times["eager"]],
                    "compiled_step_ms_all": [round(1000 * t, 1) for t in times["compiled"]],
                    "first_compiled_step_s": round(compile_s, 1),
                    "layers_eager_ms": round(1000 * best["layers_eager"], 1),
                    "layers_compiled_ms": round(1000 * best["layers_compiled"], 1),
                    "layers_ratio": round(best["layers_eager"] / best["layers_compiled"], 3),
                    "layers_matmul_share": round(matmul / (matmul + other), 3),
                    "layers_elementwise_ms": round(1000 * other_s, 1),
                    "elementwise_removed": round(saved / other_s, 3) if other_s else None,
                    "max_abs_logits_diff": diff},
        "peer": "the same colozoo model without compile",
        "ratio": round(best["eager"] / best["compiled"], 3),
    }), flush=True)


if __name__ == "__main__":
    main()
