"""Shared by the tensor-parallel benchmarks: their LLaMA config, and N gloo ranks in spawned processes on this
machine, each of one thread, whose results come back by rank."""
from __future__ import annotations

import os
import socket

import torch
import torch.multiprocessing as mp
import transformers


def add_llama_arguments(parser):
    """The model and batch sizes llama_config reads."""
    for name, default in (("hidden", 512), ("layers", 4), ("heads", 8), ("vocab", 8192), ("batch", 4)):
        parser.add_argument(f"--{name}", type=int, default=default)


def llama_config(args):
    return transformers.LlamaConfig(vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=args.hidden * 3,
                                    num_hidden_layers=args.layers, num_attention_heads=args.heads,
                                    num_key_value_heads=args.heads // 2, max_position_embeddings=4096,
                                    pad_token_id=0)


def hf_tensor_parallel(path, world: int):
    """transformers' native tensor parallelism over the `world` ranks: `distributed_config` where this transformers
    has it (its `tp_plan=` argument is deprecated), `tp_plan="auto"` before."""
    try:
        from transformers import DistributedConfig
    except ImportError:
        return transformers.AutoModelForCausalLM.from_pretrained(path, tp_plan="auto")
    return transformers.AutoModelForCausalLM.from_pretrained(
        path, distributed_config=DistributedConfig(tp_size=world, tp_plan="auto"))


def _rank(target, rank, world, port, args, queue):
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    queue.put((rank, target(rank, world, *args)))


def run_ranks(target, world: int, *args) -> dict:
    """{rank: target(rank, world, *args)} from `world` spawned processes joined in one job (torchrun's variables)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    procs = [ctx.Process(target=_rank, args=(target, r, world, port, args, queue)) for r in range(world)]
    for p in procs:
        p.start()
    results = {}
    while len(results) < world:
        try:
            rank, result = queue.get(timeout=10)
            results[rank] = result
        except Exception:  # queue.Empty: is a rank dead?
            dead = [p.exitcode for p in procs if p.exitcode not in (None, 0)]
            if dead:
                raise SystemExit(f"a tensor-parallel rank failed (exit codes {dead}); see its traceback above")
    for p in procs:
        p.join()
    return results
