"""Pipeline parallelism: the measured bubble against the textbook formula, and the train-step time of
tp=2 x pp=2 against one process on the same model.

bubble_<schedule>   p gloo ranks run colozoo's forward_backward (torch.distributed.pipelining underneath) on a
                    model whose layers *sleep* a fixed time in forward (t) and backward (2t), with negligible
                    arithmetic. Sleeping needs no CPU, so the schedule's bubble is measured exactly even on a
                    small, shared machine: bubble = 1 - (m * v * layers * 3t) / step time per rank, compared with
                    (p-1)/(m+p-1) for GPipe/1F1B and (p-1)/(v*m+p-1) for interleaved 1F1B with v virtual stages.
train_step_tp2_pp2  one training step (forward_backward + clip + AdamW) of a GPT-2-shaped model on 4 ranks
                    (tp=2, pp=2, 1F1B) versus one process, same global batch. On CPU with gloo, ranks share the
                    machine's cores, so the ratio says as much about the machine as about the parallelism.

Prints one JSON line per benchmark.   python bench/pipeline.py [--pp 4] [--microbatches 8] [--t-ms 10]
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from types import SimpleNamespace

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.multiprocessing as mp  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch import nn  # noqa: E402

from colozoo.models.base import ModelOutput, ParallelModel  # noqa: E402
from colozoo.runtime.run import Run  # noqa: E402


class _Sleep(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, t_forward):
        ctx.t_backward = 2 * t_forward
        time.sleep(t_forward)
        return x * weight

    @staticmethod
    def backward(ctx, grad):
        time.sleep(ctx.t_backward)
        return grad, grad.sum(dim=tuple(range(grad.dim() - 1))), None


class SleepLayer(nn.Module):
    def __init__(self, hidden, t_forward):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden))
        self.t_forward = t_forward

    def forward(self, x, batch):
        return _Sleep.apply(x, self.weight, self.t_forward)


class SleepModel(ParallelModel):
    """A ParallelModel whose cost is known exactly: each layer sleeps t in forward and 2t in backward."""
    family = "bench-sleep"

    def __init__(self, config, parallel, layer_ids):
        super().__init__(config, parallel, layer_ids)
        h = config.hidden_size
        if self.is_first:
            self.embedding = nn.Embedding(config.vocab_size, h)
        self.layers = nn.ModuleDict({str(i): SleepLayer(h, config.t_forward) for i in self.layer_ids})
        if self.is_last:
            self.out = nn.Linear(h, config.vocab_size)

    def embed(self, input_ids, batch):
        return self.embedding(input_ids)

    def head(self, hidden, batch, labels=None, logits=None):
        scores = self.out(hidden)
        loss = F.cross_entropy(scores[:, :-1].flatten(0, 1), labels[:, 1:].flatten()) if labels is not None else None
        return ModelOutput(loss=loss, logits=scores)


def _worker(rank, world, init_file, fn, args, results):
    os.environ.update(OMP_NUM_THREADS="1", RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    try:
        out = fn(*args)
        if rank == 0:
            results.put(out)
    finally:
        dist.destroy_process_group()


def spawn(fn, world, *args):
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    fd, init_file = tempfile.mkstemp(prefix="colozoo-bench-")
    os.close(fd)
    os.unlink(init_file)
    mp.start_processes(_worker, args=(world, init_file, fn, args, results), nprocs=world, start_method="spawn")
    return results.get(timeout=5)


def bubbles(pp, m, t_ms, steps, schedules=(("gpipe", 1), ("1f1b", 1), ("interleaved_1f1b", 2))):
    from colozoo.core.mesh import init_parallel

    parallel = init_parallel(pp=pp)
    return [bubble(parallel, m, virtual, schedule, t_ms, steps) for schedule, virtual in schedules]


def bubble(parallel, m, virtual, schedule, t_ms, steps):
    from colozoo.core.partition import rank_layers

    pp = parallel.config.pp
    n_layers = pp * virtual
    t_forward = t_ms / 1000 / virtual  # the same work per rank, whatever the number of virtual stages
    config = SimpleNamespace(num_hidden_layers=n_layers, hidden_size=8, vocab_size=16, t_forward=t_forward,
                             tie_word_embeddings=False)
    model = SleepModel(config, parallel, rank_layers(n_layers, pp, parallel.rank("pp"), virtual))
    Run(model)
    ids = torch.randint(0, 16, (m, 4))
    times = []
    for step in range(steps + 1):
        dist.barrier()
        start = time.perf_counter()
        model.forward_backward(ids, ids, num_microbatches=m, schedule=schedule)
        elapsed = torch.tensor(time.perf_counter() - start)
        dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
        if step:  # the first step builds the schedule
            times.append(elapsed.item())
    step_time = statistics.median(times)
    busy = m * virtual * 3 * t_forward  # per rank: v layers, forward t + backward 2t per micro-batch
    formula = (pp - 1) / (virtual * m + pp - 1)
    return dict(bench=f"bubble_{schedule}", pp=pp, microbatches=m, virtual_stages=virtual,
                measured_bubble=round(1 - busy / step_time, 4), formula_bubble=round(formula, 4),
                step_s=round(step_time, 4), formula_step_s=round(busy / (1 - formula), 4),
                busy_s=round(busy, 4), cpu_cores=os.cpu_count())


def train_step(tp, pp, m, steps, config_kwargs, batch_size, seq):
    import transformers

    from colozoo.checkpoint.load import load_hf_weights
    from colozoo.checkpoint.readers import StateDictReader
    from colozoo.api import build_model
    from colozoo.core.mesh import init_parallel
    from colozoo.runtime.training import build_optimizer, clip_grad_norm_

    parallel = init_parallel(tp=tp, pp=pp)
    config = transformers.GPT2Config(**config_kwargs)
    torch.manual_seed(0)
    hf = transformers.GPT2LMHeadModel(config)
    model = build_model(config, parallel=parallel, device="meta")
    load_hf_weights(model, StateDictReader(hf.state_dict()), device="cpu")
    del hf
    model.train()
    optimizer = build_optimizer(model, lr=1e-4)
    ids = torch.randint(0, config.vocab_size, (batch_size, seq), generator=torch.Generator().manual_seed(1))
    times = []
    for step in range(steps + 1):
        if dist.is_initialized():
            dist.barrier()
        start = time.perf_counter()
        loss = model.forward_backward(ids, ids, num_microbatches=m, schedule="1f1b")
        clip_grad_norm_(model, 1.0)
        optimizer.step()
        optimizer.zero_grad()
        if step:
            times.append(time.perf_counter() - start)
    return dict(step_s=statistics.median(times), loss=loss.item())


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--pp", type=int, default=4)
    parser.add_argument("--microbatches", type=int, default=8)
    parser.add_argument("--t-ms", type=float, default=20.0, help="forward sleep per rank and micro-batch")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--skip-train-step", action="store_true")
    args = parser.parse_args()

    p, m = args.pp, args.microbatches
    for line in spawn(bubbles, p, p, m, args.t_ms, args.steps):
        print(json.dumps(line), flush=True)

    if args.skip_train_step:
        return
    model = dict(vocab_size=1000, n_positions=256, n_embd=256, n_layer=8, n_head=8,
                 resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    shape = dict(config_kwargs=model, batch_size=8, seq=128)
    torch.set_num_threads(1)
    single = train_step(1, 1, 4, args.steps, **shape)
    parallel = spawn(train_step, 4, 2, 2, 4, args.steps, *shape.values())
    print(json.dumps(dict(bench="train_step_tp2_pp2", **{k: v for k, v in shape.items() if k != "config_kwargs"},
                          hidden=model["n_embd"], layers=model["n_layer"], microbatches=4,
                          single_process_s=round(single["step_s"], 4), tp2_pp2_s=round(parallel["step_s"], 4),
                          speedup=round(single["step_s"] / parallel["step_s"], 3),
                          loss_single=round(single["loss"], 5), loss_tp2_pp2=round(parallel["loss"], 5),
                          cpu_cores=os.cpu_count(), threads_per_rank=1)), flush=True)


if __name__ == "__main__":
    main()
