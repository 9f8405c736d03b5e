"""Context parallelism: per-rank activation memory and step time versus sequence length at cp in {1, 2, 4}.

A GPT-2-shaped model (no padding, causal) runs forward + backward on cp gloo ranks (CPU, one thread each). Activation
memory is what autograd saves for backward on a rank (parameters excluded), counted by saved-tensor hooks, so
it is exact on any device. With a fixed budget (by default what cp=1 needs at the second sequence length) the
longest sequence that fits should grow about linearly with cp. Prints one JSON line per cp degree, then a
summary line with "max_seq_ratio" = longest fitting sequence at cp / at cp=1.

    python bench/long_context.py [--seqs 512,1024,2048,4096] [--cps 1,2,4] [--mode ring|all_to_all]
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
import torch.distributed as dist  # noqa: E402
import torch.multiprocessing as mp  # noqa: E402


class SavedBytes:
    """Bytes autograd keeps for backward (each storage once, parameters excluded)."""

    def __init__(self, params):
        self.skip = {p.untyped_storage().data_ptr() for p in params}
        self.seen, self.total = set(), 0

    def pack(self, t):
        storage = t.untyped_storage()
        key = storage.data_ptr()
        if key not in self.skip and key not in self.seen:
            self.seen.add(key)
            self.total += storage.nbytes()
        return t


def run_rank(rank, world, init_file, args, results):
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank))
    torch.set_num_threads(1)
    if world > 1:
        dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    import transformers

    from colozoo.api import build_model
    from colozoo.core.mesh import init_parallel

    parallel = init_parallel(cp=world)
    config = transformers.GPT2Config(vocab_size=args.vocab, n_embd=args.hidden, n_layer=args.layers, n_head=4,
                                     n_positions=max(args.seqs), resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    torch.manual_seed(0)
    model = build_model(config, parallel=parallel).train()
    rows = []
    for seq in args.seqs:
        ids = torch.randint(0, args.vocab, (1, seq), generator=torch.Generator().manual_seed(seq))
        times = []
        for repeat in range(args.repeats + 1):
            counter = SavedBytes(model.parameters())
            if world > 1:
                dist.barrier()
            start = time.perf_counter()
            with torch.autograd.graph.saved_tensors_hooks(counter.pack, lambda t: t):
                kwargs = {"cp_mode": args.mode} if world > 1 else {}
                loss = model(ids, labels=ids, **kwargs).loss
            loss.backward()
            model.zero_grad(set_to_none=True)
            if repeat:  # the first run warms up
                times.append(time.perf_counter() - start)
        rows.append((seq, counter.total, min(times)))
    if rank == 0:
        results.put(rows)
    if world > 1:
        dist.destroy_process_group()


def measure(cp, args):
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    fd, init_file = tempfile.mkstemp(prefix="colozoo-bench-")
    os.close(fd)
    os.unlink(init_file)
    procs = [ctx.Process(target=run_rank, args=(r, cp, init_file, args, results)) for r in range(cp)]
    for p in procs:
        p.start()
    rows = results.get(timeout=600)
    for p in procs:
        p.join()
    return rows


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--seqs", default="512,1024,2048,4096")
    parser.add_argument("--cps", default="1,2,4")
    parser.add_argument("--mode", default="ring", choices=["ring", "all_to_all"])
    parser.add_argument("--hidden", type=int, default=128)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--vocab", type=int, default=512)
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--budget-mib", type=float, default=None)
    args = parser.parse_args()
    args.seqs = [int(s) for s in args.seqs.split(",")]
    cps = [int(c) for c in args.cps.split(",")]
    measured = {cp: measure(cp, args) for cp in cps}
    mib = 2.0 ** 20
    budget = args.budget_mib or measured[cps[0]][min(1, len(args.seqs) - 1)][1] / mib
    longest = {}
    for cp, rows in measured.items():
        fits = [seq for seq, saved, _ in rows if saved / mib <= budget * 1.05]
        longest[cp] = max(fits) if fits else 0
        print(json.dumps({"bench": "long_context", "mode": args.mode, "cp": cp, "seq": [r[0] for r in rows],
                          "activation_mib_per_rank": [round(r[1] / mib, 2) for r in rows],
                          "step_s": [round(r[2], 4) for r in rows], "budget_mib": round(budget, 2),
                          "max_seq_in_budget": longest[cp]}))
    base = longest[cps[0]] or 1
    print(json.dumps({"bench": "long_context_summary", "mode": args.mode, "budget_mib": round(budget, 2),
                      "max_seq_ratio": {str(cp): longest[cp] / base for cp in cps}}))


if __name__ == "__main__":
    main()
