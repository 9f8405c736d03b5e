"""Training throughput at tp=1: forward + backward tokens/s of colozoo GPT-2 and OPT against transformers (sdpa).

Both models hold the same weights (colozoo loads the HF state dict), run the same batch in fp32 with the same
thread count and dropout off; steps alternate between the two so machine noise hits both alike. Prints one JSON
line per family; "ratio" = colozoo tokens/s / transformers tokens/s (> 1: colozoo is faster).

On CPU the default is one thread and the process's CPU time as the clock: on a shared machine wall time mostly
measures the neighbours, CPU time the work done. Wall-clock numbers are reported alongside; on CUDA the clock is
wall time around synchronisations.

    python bench/throughput.py [--layers 2] [--seq 128] [--batch 2] [--repeats 5] [--families gpt2,opt]
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

import torch  # noqa: E402
import transformers  # noqa: E402

from colozoo.checkpoint.load import load_hf_weights  # noqa: E402
from colozoo.checkpoint.readers import StateDictReader
from colozoo.api import build_model  # noqa: E402


def hf_config(family: str, layers: int, seq: int, vocab: int):
    common = dict(vocab_size=vocab, num_hidden_layers=layers, max_position_embeddings=max(seq, 1024))
    if family == "gpt2":  # gpt2-small widths
        return transformers.GPT2Config(n_embd=768, n_head=12, n_positions=common.pop("max_position_embeddings"),
                                       n_layer=common.pop("num_hidden_layers"), resid_pdrop=0.0, embd_pdrop=0.0,
                                       attn_pdrop=0.0, **common)
    if family == "opt":  # opt-125m widths
        return transformers.OPTConfig(hidden_size=768, ffn_dim=3072, num_attention_heads=12, dropout=0.0,
                                      attention_dropout=0.0, **common)
    raise SystemExit(f"unknown family {family!r}; choose gpt2 or opt")


def build_pair(config, device):
    torch.manual_seed(0)
    hf = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="sdpa").to(device).train()
    ours = build_model(config, device="meta")
    load_hf_weights(ours, StateDictReader({k: v.detach() for k, v in hf.state_dict().items()}), device=device)
    return ours.train(), hf


def make_steps(ours, hf, ids):
    def step_ours():
        ours.zero_grad(set_to_none=True)
        ours(ids, labels=ids).loss.backward()

    def step_hf():
        hf.zero_grad(set_to_none=True)
        hf(input_ids=ids, labels=ids).loss.backward()

    return step_ours, step_hf


def timed(step, device) -> tuple[float, float]:
    """(wall seconds, CPU seconds of this process) of one step."""
    if device.type == "cuda":
        torch.cuda.synchronize()
    wall, cpu = time.perf_counter(), time.process_time()
    step()
    if device.type == "cuda":
        torch.cuda.synchronize()
    return time.perf_counter() - wall, time.process_time() - cpu


def bench_family(family, args, device):
    config = hf_config(family, args.layers, args.seq, args.vocab)
    ours, hf = build_pair(config, device)
    ids = torch.randint(0, config.vocab_size, (args.batch, args.seq), generator=torch.Generator().manual_seed(1))
    ids = ids.to(device)
    with torch.no_grad():  # same weights, same numbers: a bench of two different computations would mean nothing
        diff = (ours(ids, return_logits=True).logits - hf(input_ids=ids).logits).abs().max().item()
    step_ours, step_hf = make_steps(ours, hf, ids)
    for _ in range(args.warmup):
        step_ours()
        step_hf()
    wall, cpu = {"colozoo": [], "hf": []}, {"colozoo": [], "hf": []}
    for i in range(args.repeats):
        order = [("colozoo", step_ours), ("hf", step_hf)]
        for name, step in order if i % 2 == 0 else reversed(order):
            w, c = timed(step, device)
            wall[name].append(w)
            cpu[name].append(c)
    clock = args.clock or ("cpu" if device.type == "cpu" else "wall")
    times = cpu if clock == "cpu" else wall
    tokens = args.batch * args.seq
    median = {k: statistics.median(v) for k, v in times.items()}
    wall_median = {k: statistics.median(v) for k, v in wall.items()}
    return {
        "bench": f"throughput/{family}",
        "config": {"family": family, "hidden": config.hidden_size, "layers": args.layers, "vocab": args.vocab,
                   "batch": args.batch, "seq": args.seq, "dtype": "float32", "tp": 1, "device": str(device),
                   "threads": torch.get_num_threads(), "warmup": args.warmup, "repeats": args.repeats,
                   "clock": clock},
        "metrics": {"colozoo_tokens_per_s": round(tokens / median["colozoo"], 1),
                    "hf_tokens_per_s": round(tokens / median["hf"], 1),
                    "colozoo_step_ms": round(1000 * median["colozoo"], 2),
                    "hf_step_ms": round(1000 * median["hf"], 2),
                    "colozoo_step_ms_all": [round(1000 * t, 1) for t in times["colozoo"]],
                    "hf_step_ms_all": [round(1000 * t, 1) for t in times["hf"]],
                    "colozoo_wall_step_ms": round(1000 * wall_median["colozoo"], 2),
                    "hf_wall_step_ms": round(1000 * wall_median["hf"], 2),
                    "wall_ratio": round(wall_median["hf"] / wall_median["colozoo"], 3),
                    "max_abs_logits_diff": diff},
        "peer": "transformers AutoModelForCausalLM, attn_implementation=sdpa",
        "ratio": round(median["hf"] / median["colozoo"], 3),
    }


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--families", default="gpt2,opt")
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--vocab", type=int, default=50272)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: 1 on CPU)")
    parser.add_argument("--clock", choices=["cpu", "wall"], default=None,
                        help="what the ratio is taken on (default: cpu time on CPU, wall time on CUDA)")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    if args.threads or device.type == "cpu":
        torch.set_num_threads(args.threads or 1)
    for family in args.families.split(","):
        print(json.dumps(bench_family(family.strip(), args, device)), flush=True)


if __name__ == "__main__":
    main()
