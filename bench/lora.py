"""A LoRA fine-tuning step against full fine-tuning of the same model on the same mesh (one process).

Both: a LLaMA-style model (fp32) built by colozoo, one forward_backward + AdamW step per iteration, steps alternating
so neighbours on a shared machine affect both alike. Memory is counted exactly from the tensors that exist after a
step: gradients (every parameter's .grad) and optimizer states (AdamW's exp_avg / exp_avg_sq). "ratio" > 1: LoRA
is faster (tokens/s); "memory_ratio": LoRA's gradient + optimizer bytes over full fine-tuning's (goal: < 0.05 at r=16).

    python bench/lora.py [--hidden 512] [--layers 4] [--seq 256] [--batch 4] [--r 16] [--repeats 5]
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402
import transformers  # noqa: E402

from colozoo.api import build_model  # noqa: E402
from colozoo.layers.shard import materialize  # noqa: E402
from colozoo.runtime.lora import apply_lora  # noqa: E402
from colozoo.runtime.training import build_optimizer  # noqa: E402


def tensor_bytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors if isinstance(t, torch.Tensor))


def gradient_and_optimizer_bytes(model, optimizer) -> tuple[int, int]:
    grads = tensor_bytes(p.grad for p in model.parameters() if p.grad is not None)
    states = tensor_bytes(v for s in optimizer.state.values() for v in s.values() if torch.is_tensor(v) and v.dim())
    return grads, states


def build(config, lora_r):
    torch.manual_seed(0)
    model = build_model(config, device="meta")
    materialize(model, "cpu")
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.02)
    model.reset_buffers()
    if lora_r:
        apply_lora(model, r=lora_r, alpha=2 * lora_r, targets="all-linear")
    model.train()
    return model, build_optimizer(model, lr=1e-4)


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--seq", type=int, default=256)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--vocab", type=int, default=8192)
    parser.add_argument("--r", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    torch.set_num_threads(min(2, os.cpu_count() or 1))
    config = transformers.LlamaConfig(vocab_size=args.vocab, hidden_size=args.hidden, num_hidden_layers=args.layers,
                                      intermediate_size=int(args.hidden * 8 / 3) // 64 * 64,
                                      num_attention_heads=args.hidden // 64, num_key_value_heads=args.hidden // 128,
                                      max_position_embeddings=args.seq)
    ids = torch.randint(0, args.vocab, (args.batch, args.seq), generator=torch.Generator().manual_seed(1))
    runs = {"full": build(config, 0), "lora": build(config, args.r)}
    seconds = {name: [] for name in runs}
    for step in range(args.repeats + 1):  # the first step of each warms up
        for name, (model, optimizer) in runs.items():
            start = time.perf_counter()
            model.forward_backward(ids, ids)
            optimizer.step()
            elapsed = time.perf_counter() - start
            optimizer.zero_grad(set_to_none=False)
            if step:
                seconds[name].append(elapsed)
    tokens = args.batch * args.seq
    speed = {name: tokens / statistics.median(s) for name, s in seconds.items()}
    memory = {name: gradient_and_optimizer_bytes(*runs[name]) for name in runs}
    trainable = {name: sum(p.numel() for p in model.parameters() if p.requires_grad) for name, (model, _) in runs.items()}
    full_bytes, lora_bytes = sum(memory["full"]), sum(memory["lora"])
    print(json.dumps({
        "bench": f"lora/r{args.r}_all_linear_vs_full_finetune",
        "config": vars(args),
        "metrics": {"lora_tokens_per_s": round(speed["lora"]), "full_tokens_per_s": round(speed["full"]),
                    "lora_trainable_params": trainable["lora"], "full_trainable_params": trainable["full"],
                    "lora_grad_bytes": memory["lora"][0], "lora_optimizer_bytes": memory["lora"][1],
                    "full_grad_bytes": memory["full"][0], "full_optimizer_bytes": memory["full"][1],
                    "memory_ratio": round(lora_bytes / full_bytes, 4)},
        "peer": "full fine-tuning of the same model, same step, same process",
        "ratio": round(speed["lora"] / speed["full"], 3),
    }))


if __name__ == "__main__":
    main()
