"""Fine-tuning step and checkpoint cost at tp=1 against a plain transformers training loop.

Ours: the colozoo.finetune step (colozoo.runtime.training forward/backward, global-norm clipping, AdamW, warmup+cosine
schedule) on a GPT-2 loaded from an HF directory. Peer: the textbook loop on the transformers model with the
same weights (loss.backward, torch.nn.utils.clip_grad_norm_, AdamW, the same LambdaLR). Steps alternate and
the clock is the process's CPU time (one thread) on CPU, so neighbours on a shared machine matter less.
Also compares a training-state save (colozoo: atomic per-rank checkpoint) with torch.save of the peer's
model + optimizer state. "ratio" > 1: colozoo is faster.

    python bench/finetune.py [--layers 2] [--hidden 256] [--seq 128] [--batch 4] [--repeats 5]
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

import torch  # noqa: E402
import transformers  # noqa: E402

from colozoo.finetune import runtime, state  # noqa: E402
from colozoo.finetune.config import FinetuneConfig  # noqa: E402
from colozoo.finetune.schedule import build_scheduler  # noqa: E402


def clock():
    return time.process_time() if not torch.cuda.is_available() else (torch.cuda.synchronize(), time.perf_counter())[1]


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--vocab", type=int, default=8192)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        torch.set_num_threads(1)
    work = Path(tempfile.mkdtemp(prefix="colozoo-bench-finetune-"))
    config = transformers.GPT2Config(vocab_size=args.vocab, n_embd=args.hidden, n_layer=args.layers,
                                     n_head=max(1, args.hidden // 64), n_positions=args.seq, resid_pdrop=0.0,
                                     embd_pdrop=0.0, attn_pdrop=0.0)
    torch.manual_seed(0)
    transformers.GPT2LMHeadModel(config).save_pretrained(str(work / "model"))
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")

    cfg = FinetuneConfig(model=str(work / "model"), data="-", seq_len=args.seq, lr=1e-4)
    ours, _ = runtime.load_model(cfg, "lm")
    runtime.prepare_training(ours, cfg)
    ours.train()
    our_opt = runtime.build_optimizer(ours, cfg.lr, 0.0)
    our_sched = build_scheduler(our_opt, 10, 1000)
    peer = transformers.GPT2LMHeadModel.from_pretrained(str(work / "model")).to(device).train()
    peer_opt = torch.optim.AdamW(peer.parameters(), lr=cfg.lr, betas=(0.9, 0.95), weight_decay=0.0)
    peer_sched = build_scheduler(peer_opt, 10, 1000)

    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, args.vocab, (args.batch, args.seq), generator=g).to(device)
    batch = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids}

    def our_step():
        our_opt.zero_grad(set_to_none=True)
        loss = runtime.forward_backward(ours, batch, 1)
        runtime.clip_grad_norm(ours, 1.0)
        our_opt.step()
        our_sched.step()
        return float(loss.detach())

    def peer_step():
        peer_opt.zero_grad(set_to_none=True)
        loss = peer(**batch).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(peer.parameters(), 1.0)
        peer_opt.step()
        peer_sched.step()
        return float(loss.detach())

    first = (our_step(), peer_step())  # warm-up, and the same starting loss on both sides
    times = {"ours": [], "peer": []}
    for _ in range(args.repeats):
        for name, step in (("ours", our_step), ("peer", peer_step)):
            start = clock()
            step()
            times[name].append(clock() - start)
    tokens = args.batch * args.seq
    ours_tps, peer_tps = tokens / statistics.median(times["ours"]), tokens / statistics.median(times["peer"])

    saves = {"ours": [], "peer": []}
    for i in range(3):
        start = time.perf_counter()
        state.save_training_state(work / "ckpt", i + 1, ours, our_opt, our_sched, {"tp": 1}, keep_last=1)
        saves["ours"].append(time.perf_counter() - start)
        start = time.perf_counter()
        torch.save({"model": peer.state_dict(), "optimizer": peer_opt.state_dict()}, work / "peer.pt")
        saves["peer"].append(time.perf_counter() - start)

    print(json.dumps({
        "bench": "finetune/gpt2_step",
        "config": {**vars(args), "device": device.type, "threads": torch.get_num_threads(), "dtype": "float32"},
        "metrics": {"colozoo_tokens_per_s": ours_tps, "hf_tokens_per_s": peer_tps,
                    "colozoo_step_s": times["ours"], "hf_step_s": times["peer"],
                    "first_loss_difference": abs(first[0] - first[1]),
                    "colozoo_save_s": statistics.median(saves["ours"]), "hf_torch_save_s": statistics.median(saves["peer"])},
        "peer": "transformers GPT2LMHeadModel + torch AdamW/clip_grad_norm_/LambdaLR loop; torch.save for checkpoints",
        "ratio": ours_tps / peer_tps,
    }))


if __name__ == "__main__":
    main()
