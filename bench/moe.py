"""MoE training step time: colozoo Mixtral at ep=2 (and ep=1) against transformers' Mixtral, same config and weights.

Two gloo ranks (CPU, one thread each). Every rank runs each contender on its own batch of the same
shape at the same time, so all three see the same machine load: transformers' MixtralForCausalLM (sdpa), ours
with every expert local (ep=1, dp=2) and ours with the experts split over the two ranks (ep=2: all-to-all token
dispatch). Steps alternate between contenders. Prints one JSON line; "ratio_*" = transformers step time / ours
(> 1: colozoo is faster).

    python bench/moe.py [--hidden 256] [--inner 512] [--experts 8] [--layers 2] [--seq 256] [--batch 2]
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import tempfile
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.multiprocessing as mp  # noqa: E402

WORLD = 2


def run_rank(rank, init_file, args, results):
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(WORLD), LOCAL_RANK=str(rank))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=WORLD)
    import transformers

    from colozoo.checkpoint.load import load_hf_weights
    from colozoo.checkpoint.safetensors_io import SafetensorsReader
    from colozoo.api import build_model
    from colozoo.core.mesh import ParallelConfig, ParallelContext

    config = transformers.MixtralConfig(vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=args.inner,
                                        num_hidden_layers=args.layers, num_attention_heads=8, num_key_value_heads=4,
                                        num_local_experts=args.experts, num_experts_per_tok=2,
                                        max_position_embeddings=args.seq, output_router_logits=True)
    torch.manual_seed(0)
    hf = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="sdpa").train()
    directory = [tempfile.mkdtemp(prefix="colozoo-bench-moe-") if rank == 0 else None]
    dist.broadcast_object_list(directory)
    if rank == 0:
        hf.save_pretrained(directory[0])  # the per-expert checkpoint layout
    dist.barrier()
    contenders = {"hf": hf}
    for ep in (1, 2):
        model = build_model(config, parallel=ParallelContext(ParallelConfig(dp=WORLD, ep=ep)), device="meta")
        contenders[f"ep{ep}"] = load_hf_weights(model, SafetensorsReader(directory[0]), device="cpu").train()
    dist.barrier()
    if rank == 0:
        shutil.rmtree(directory[0])
    ids = torch.randint(0, args.vocab, (args.batch, args.seq), generator=torch.Generator().manual_seed(rank))

    def step(name):
        model = contenders[name]
        model.zero_grad(set_to_none=True)
        dist.barrier()
        start = time.perf_counter()
        if name == "hf":
            model(input_ids=ids, labels=ids).loss.backward()
        else:
            model(ids, labels=ids).loss.backward()
        return time.perf_counter() - start

    times = {name: [] for name in contenders}
    for repeat in range(args.repeats + 1):
        for name in contenders:
            elapsed = step(name)
            if repeat:
                times[name].append(elapsed)
    if rank == 0:
        results.put({name: statistics.median(t) for name, t in times.items()})
    dist.destroy_process_group()


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--inner", type=int, default=512)
    parser.add_argument("--experts", type=int, default=8)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--seq", type=int, default=256)
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--vocab", type=int, default=1000)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    fd, init_file = tempfile.mkstemp(prefix="colozoo-bench-")
    os.close(fd)
    os.unlink(init_file)
    procs = [ctx.Process(target=run_rank, args=(r, init_file, args, results)) for r in range(WORLD)]
    for p in procs:
        p.start()
    t = results.get(timeout=600)
    for p in procs:
        p.join()
    print(json.dumps({"bench": "moe_step", "device": "cpu", "ranks": WORLD, "experts": args.experts,
                      "tokens_per_rank": args.batch * args.seq, "hf_step_s": round(t["hf"], 4),
                      "ep1_step_s": round(t["ep1"], 4), "ep2_step_s": round(t["ep2"], 4),
                      "ratio_ep2": round(t["hf"] / t["ep2"], 3), "ratio_ep1": round(t["hf"] / t["ep1"], 3)}))


if __name__ == "__main__":
    main()
