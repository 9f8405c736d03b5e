"""A tp=1 training step and greedy decoding on one CUDA GPU in bf16: colozoo (kernels "auto") against transformers
(sdpa), same weights, one process. Needs a GPU; on CPU it prints one skip line.

step/<family>: zero_grad + forward with labels + backward, bf16 weights on both sides. MFU = FLOPs of one step
(torch's FlopCounterMode, both sides must agree) / median step time / the bf16 FLOP/s of an 8192^3 matmul timed in the
same run. Also the peak memory of a step above the weights (torch.cuda.max_memory_allocated). "ratio" = transformers'
step time / ours.

generate/llama: greedy decoding of --new tokens after a --prompt-token prompt, batch --decode-batch, KV cache on both
sides; tokens must be identical; "ratio" = our decode tokens/s / transformers'.

    python bench/gpu.py [--families llama,gpt2] [--hidden 2048] [--layers 8] [--batch 4] [--seq 2048]
"""
from __future__ import annotations

import argparse
import json
import os
import statistics

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

import torch  # noqa: E402
import transformers  # noqa: E402
from torch.utils.flop_counter import FlopCounterMode  # noqa: E402

from colozoo.api import build_model  # noqa: E402
from colozoo.checkpoint.load import load_hf_weights  # noqa: E402
from colozoo.checkpoint.readers import StateDictReader  # noqa: E402


def hf_config(family: str, args):
    h, heads = args.hidden, args.hidden // 128
    if family == "llama":  # as many kv heads as heads: torch's FLOP counter refuses grouped-query SDPA
        return transformers.LlamaConfig(hidden_size=h, intermediate_size=-(-8 * h // 3 // 256) * 256,
                                        num_attention_heads=heads, num_key_value_heads=heads,
                                        num_hidden_layers=args.layers, vocab_size=args.vocab,
                                        max_position_embeddings=max(args.seq, 4096))
    if family == "gpt2":
        return transformers.GPT2Config(n_embd=h, n_head=heads, n_layer=args.layers, vocab_size=50257,
                                       n_positions=max(args.seq, 1024), resid_pdrop=0.0, embd_pdrop=0.0,
                                       attn_pdrop=0.0)
    raise SystemExit(f"unknown family {family!r}; choose llama or gpt2")


def build_pair(config):
    torch.manual_seed(0)
    hf = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="sdpa",
                                                       dtype=torch.bfloat16).cuda()
    ours = build_model(config, device="meta", dtype=torch.bfloat16)
    load_hf_weights(ours, StateDictReader({k: v.detach() for k, v in hf.state_dict().items()}), device="cuda")
    return {"colozoo": ours, "hf": hf}


def cuda_ms(fn) -> float:
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end)


def matmul_peak(n: int = 8192) -> float:
    a, b = torch.randn(n, n, device="cuda", dtype=torch.bfloat16), torch.randn(n, n, device="cuda",
                                                                                dtype=torch.bfloat16)
    for _ in range(3):
        a @ b
    return 2 * n ** 3 / (statistics.median(cuda_ms(lambda: a @ b) for _ in range(10)) * 1e-3)


def bench_step(family, args, peak):
    models = build_pair(hf_config(family, args))
    ids = torch.randint(0, models["hf"].config.vocab_size, (args.batch, args.seq), device="cuda")

    def step(name):
        model = models[name]

        def run():
            model.zero_grad(set_to_none=True)
            loss = model(input_ids=ids, labels=ids).loss
            loss.backward()
            return loss.detach()
        return run

    flops, losses, memory, times = {}, {}, {}, {name: [] for name in models}
    for name in models:
        with FlopCounterMode(display=False) as counter:
            losses[name] = step(name)().item()
        flops[name] = counter.get_total_flops()
        step(name)()
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        step(name)()
        memory[name] = torch.cuda.max_memory_allocated() - base
    for _ in range(args.repeats):
        for name in models:
            times[name].append(cuda_ms(step(name)))
    ms = {name: statistics.median(t) for name, t in times.items()}
    mfu = {name: flops[name] / (ms[name] * 1e-3) / peak for name in models}
    print(json.dumps({
        "bench": f"gpu/step/{family}",
        "config": {"hidden": args.hidden, "layers": args.layers, "batch": args.batch, "seq": args.seq,
                   "vocab": models["hf"].config.vocab_size, "dtype": "bfloat16", "device": torch.cuda.get_device_name(),
                   "repeats": args.repeats},
        "metrics": {"colozoo_ms": round(ms["colozoo"], 2), "hf_ms": round(ms["hf"], 2),
                    "colozoo_mfu": round(mfu["colozoo"], 3), "hf_mfu": round(mfu["hf"], 3),
                    "colozoo_step_memory_gb": round(memory["colozoo"] / 2**30, 2),
                    "hf_step_memory_gb": round(memory["hf"] / 2**30, 2),
                    "colozoo_gflop": round(flops["colozoo"] / 1e9), "hf_gflop": round(flops["hf"] / 1e9),
                    "peak_tflops": round(peak / 1e12), "loss_diff": abs(losses["colozoo"] - losses["hf"])},
        "peer": "transformers AutoModelForCausalLM, attn_implementation=sdpa, bf16",
        "ratio": round(ms["hf"] / ms["colozoo"], 3)}), flush=True)
    models.clear()
    torch.cuda.empty_cache()


def bench_generate(args):
    models = build_pair(hf_config("llama", args))
    ids = torch.randint(3, args.vocab, (args.decode_batch, args.prompt), device="cuda")
    mask = torch.ones_like(ids)
    options = dict(max_new_tokens=args.new, do_sample=False, pad_token_id=0, eos_token_id=None)
    out, prefill, total = {}, {name: [] for name in models}, {name: [] for name in models}
    with torch.no_grad():
        for name, model in models.items():
            model.eval()
            out[name] = model.generate(ids, attention_mask=mask, **options)  # warm
        for _ in range(args.repeats):
            for name, model in models.items():
                prefill[name].append(cuda_ms(lambda: model.generate(ids, attention_mask=mask,
                                                                    **{**options, "max_new_tokens": 1})))
                total[name].append(cuda_ms(lambda: model.generate(ids, attention_mask=mask, **options)))
    decode = {name: args.decode_batch * (args.new - 1) / ((statistics.median(total[name])
                                                           - statistics.median(prefill[name])) * 1e-3)
              for name in models}
    print(json.dumps({
        "bench": "gpu/generate/llama",
        "config": {"hidden": args.hidden, "layers": args.layers, "batch": args.decode_batch, "prompt": args.prompt,
                   "new": args.new, "dtype": "bfloat16", "device": torch.cuda.get_device_name()},
        "metrics": {"colozoo_decode_tokens_per_s": round(decode["colozoo"]), "hf_decode_tokens_per_s":
                    round(decode["hf"]), "colozoo_prefill_ms": round(statistics.median(prefill["colozoo"]), 2),
                    "hf_prefill_ms": round(statistics.median(prefill["hf"]), 2),
                    "same_tokens": bool(torch.equal(out["colozoo"], out["hf"]))},
        "peer": "transformers generate (DynamicCache, sdpa), bf16",
        "ratio": round(decode["colozoo"] / decode["hf"], 3)}), flush=True)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--families", default="llama,gpt2")
    parser.add_argument("--hidden", type=int, default=2048)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--vocab", type=int, default=32000, help="LLaMA's vocabulary (GPT-2 keeps its own)")
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--seq", type=int, default=2048)
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--decode-batch", type=int, default=8)
    parser.add_argument("--prompt", type=int, default=512)
    parser.add_argument("--new", type=int, default=64)
    parser.add_argument("--skip-generate", action="store_true")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print(json.dumps({"bench": "gpu", "skipped": "no CUDA device"}))
        return
    peak = matmul_peak()
    for family in filter(None, args.families.split(",")):
        bench_step(family, args, peak)
    if not args.skip_generate:
        bench_generate(args)


if __name__ == "__main__":
    main()
