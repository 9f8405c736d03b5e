"""Generation speed: prefill and decode tokens/s of colozoo's generate against transformers' generate.

tp=1: the same LLaMA-shaped model (same weights, batch, prompts, threads) in one process, greedy, both sides
timed the same way: prefill = the time of generate(max_new_tokens=1), decode tokens/s = (new - 1) x batch over
generate(new) minus that, each the best of `repeats` runs that alternate between the two sides (the machines this
runs on are shared: the best run is the one least disturbed). tp=2: two gloo processes of one thread each,
colozoo's tensor parallelism against transformers' native one (a tp_plan="auto" DistributedConfig). The generated
tokens must agree. One JSON line per figure: generate/tp1/prefill, generate/tp1/decode, generate/tp2/prefill,
generate/tp2/decode (ratio = colozoo tokens/s over transformers'), generate/tp<N>/kv_cache (bytes per rank against
2 x layers x kv heads/tp x head_dim x (prompt + new) x batch x 4), and generate/tp1/compiled: colozoo's static decode
step torch.compile'd by inductor (generate(cache_implementation="static", compile_config=...), fullgraph, static
shapes; the compile timed apart) against colozoo's eager loop, with the static step run eagerly beside them (ratio =
compiled decode tokens/s over the eager loop's; the tokens must agree).

    python bench/generate.py [--hidden 512] [--layers 4] [--batch 4] [--prompt 64] [--new 32] [--repeats 7]
    python bench/generate.py --tp 1            # only the one-process cases
    python bench/generate.py --skip-compiled   # without the compiled step (its compile takes a minute or two)
"""
from __future__ import annotations

import argparse
import json
import os
import tempfile
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

import torch  # noqa: E402
import transformers  # noqa: E402

from _ranks import add_llama_arguments, hf_tensor_parallel, llama_config, run_ranks  # noqa: E402


def prompts(args):
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(3, args.vocab, (args.batch, args.prompt), generator=g)
    mask = torch.ones_like(ids)
    for row in range(args.batch):  # left padding of different lengths
        mask[row, : row * args.prompt // (2 * args.batch)] = 0
    return ids.masked_fill(mask == 0, 0), mask


def timed(generate, new: int):
    """(prefill seconds, seconds of the whole generate(new), the tokens)."""
    start = time.perf_counter()
    generate(1)
    first = time.perf_counter() - start
    start = time.perf_counter()
    tokens = generate(new)
    return first, time.perf_counter() - start, tokens


def rates(prefill_s, whole_s, args, prompt_tokens):
    return {"prefill_tokens_per_s": prompt_tokens / prefill_s,
            "decode_tokens_per_s": (args.new - 1) * args.batch / max(whole_s - prefill_s, 1e-9),
            "prefill_s": prefill_s, "generate_s": whole_s}


def measure(ours, hf, ids, mask, args, parallel=None):
    options = dict(do_sample=False, pad_token_id=0, eos_token_id=None)
    ours_gen = lambda n: ours.generate(ids, attention_mask=mask, max_new_tokens=n, **options)  # noqa: E731
    hf_gen = lambda n: hf.generate(input_ids=ids, attention_mask=mask, max_new_tokens=n, **options)  # noqa: E731
    for warm in (ours_gen, hf_gen):
        warm(2)
    results = {"ours": [], "hf": []}
    tokens = {}
    for _ in range(args.repeats):  # alternate, so noise hits both sides alike
        for side, fn in (("ours", ours_gen), ("hf", hf_gen)):
            p, w, tokens[side] = timed(fn, args.new)
            results[side].append((p, w))
    prompt_tokens = int(mask.sum())
    out = {}
    for side, runs in results.items():  # best of the repeats, prefill and the whole generate each
        out[side] = rates(min(r[0] for r in runs), min(r[1] for r in runs), args, prompt_tokens)
    out["same_tokens"] = bool(torch.equal(tokens["ours"], tokens["hf"]))
    return out


def compiled_against_eager(ours, ids, mask, args):
    """The static step compiled, and run eagerly, against the eager loop: one JSON line."""
    options = dict(do_sample=False, pad_token_id=0, eos_token_id=None)
    compile_config = transformers.CompileConfig(fullgraph=True, dynamic=False, backend="inductor", mode=None)
    sides = {"compiled": dict(cache_implementation="static", compile_config=compile_config),
             "static": dict(cache_implementation="static"), "eager": {}}
    generate = {side: (lambda n, kw=kw: ours.generate(ids, attention_mask=mask, max_new_tokens=n, **options, **kw))
                for side, kw in sides.items()}
    start = time.perf_counter()
    generate["compiled"](args.new)
    compile_s = time.perf_counter() - start
    runs, tokens = {side: [] for side in sides}, {}
    for _ in range(args.repeats):
        for side, fn in generate.items():
            p, w, tokens[side] = timed(fn, args.new)
            runs[side].append((p, w))
    decode = {side: rates(min(r[0] for r in runs[side]), min(r[1] for r in runs[side]), args, int(mask.sum()))[
        "decode_tokens_per_s"] for side in sides}
    print(json.dumps({"bench": "generate/tp1/compiled", "config": dict(vars(args), tp=1, backend="inductor"),
                      "metrics": {f"{side}_decode_tokens_per_s": rate for side, rate in decode.items()}
                      | {"compile_s": compile_s,
                         "same_tokens": all(torch.equal(t, tokens["eager"]) for t in tokens.values())},
                      "peer": "colozoo's eager generate (the growing cache)",
                      "ratio": decode["compiled"] / decode["eager"]}), flush=True)


def cache_bytes(model, config, args, tp):
    head_dim = config.hidden_size // config.num_attention_heads
    formula = (2 * config.num_hidden_layers * (config.num_key_value_heads // tp) * head_dim
               * (args.prompt + args.new) * args.batch * 4)
    return model.generate(torch.zeros(args.batch, args.prompt, dtype=torch.long, device=model.parallel.device),
                          max_new_tokens=args.new, eos_token_id=None, pad_token_id=0,
                          return_dict_in_generate=True).cache_elements * 4, formula


def report(case, config_fields, metrics, peer):
    """One JSON line per figure: prefill and decode (ratio = colozoo tokens/s over the peer's), the KV cache."""
    ours, hf = metrics["ours"], metrics["hf"]
    for phase in ("prefill", "decode"):
        key = f"{phase}_tokens_per_s"
        print(json.dumps({"bench": f"generate/{case}/{phase}", "config": config_fields,
                          "metrics": {f"colozoo_{key}": ours[key], f"hf_{key}": hf[key],
                                      "same_tokens": metrics["same_tokens"]},
                          "peer": peer, "ratio": ours[key] / hf[key]}), flush=True)
    print(json.dumps({"bench": f"generate/{case}/kv_cache", "config": config_fields,
                      "metrics": {"bytes_per_rank": metrics["kv_cache_bytes"],
                                  "formula_bytes": metrics["kv_cache_bytes_formula"]},
                      "ratio": metrics["kv_cache_bytes"] / metrics["kv_cache_bytes_formula"]}), flush=True)


def one_process(args):
    from colozoo.api import build_model
    from colozoo.checkpoint.load import load_hf_weights
    from colozoo.checkpoint.readers import StateDictReader

    torch.set_num_threads(args.threads)
    config = llama_config(args)
    torch.manual_seed(0)
    hf = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="sdpa").eval()
    ours = build_model(config, device="meta")
    load_hf_weights(ours, StateDictReader(hf.state_dict()), device="cpu")
    ids, mask = prompts(args)
    with torch.no_grad():
        metrics = measure(ours.eval(), hf, ids, mask, args)
    metrics["kv_cache_bytes"], metrics["kv_cache_bytes_formula"] = cache_bytes(ours, config, args, 1)
    report("tp1", dict(vars(args), tp=1), metrics, "transformers generate (LlamaForCausalLM, sdpa, DynamicCache)")
    if not args.skip_compiled:
        with torch.no_grad():
            compiled_against_eager(ours, ids, mask, args)


def _tp_rank(rank, world, path, args):
    import colozoo

    ours = colozoo.from_pretrained(path, tp=world).eval()
    hf = hf_tensor_parallel(path, world).eval()
    ids, mask = prompts(args)
    with torch.no_grad():
        metrics = measure(ours, hf, ids, mask, args)
    metrics["kv_cache_bytes"], metrics["kv_cache_bytes_formula"] = cache_bytes(ours, ours.config, args, world)
    return metrics


def tensor_parallel(args, world=2):
    config = llama_config(args)
    torch.manual_seed(0)
    with tempfile.TemporaryDirectory() as path:
        transformers.AutoModelForCausalLM.from_config(config).save_pretrained(path)
        results = run_ranks(_tp_rank, world, path, args)
    report("tp2", dict(vars(args), tp=world, threads_per_rank=1), results[0],
           "transformers generate with its native tensor parallelism (a tp_plan='auto' DistributedConfig, gloo)")


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_llama_arguments(parser)
    parser.add_argument("--prompt", type=int, default=64)
    parser.add_argument("--new", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--tp", type=int, choices=(1, 2), default=None, help="only this case (default: both)")
    parser.add_argument("--skip-compiled", action="store_true", help="no generate/tp1/compiled line")
    args = parser.parse_args()
    if args.tp in (None, 1):
        one_process(args)
    if args.tp in (None, 2):
        tensor_parallel(args)


if __name__ == "__main__":
    main()
