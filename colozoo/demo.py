"""Parity demo (`make parity-demo`): a tiny GPT-2 saved by transformers, loaded by colozoo at tp=2 on two CPU ranks,
compared with transformers on logits and loss. Prints PASS/FAIL and exits non-zero on a mismatch.

    python -m colozoo.demo [--tp 2] [--tolerance 1e-5]
"""
from __future__ import annotations

import argparse
import os
import queue
import sys
import tempfile
from pathlib import Path

import torch
import torch.multiprocessing as mp

VOCAB, SEQ = 101, 12  # 101 is not divisible by 2: the vocab padding path runs too


def tiny_gpt2(path: Path):
    import transformers

    config = transformers.AutoConfig.for_model("gpt2", vocab_size=VOCAB, max_position_embeddings=32, hidden_size=64,
                                               num_hidden_layers=2, num_attention_heads=4)
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(config)
    with torch.no_grad():  # non-trivial norms and biases, so a misplaced one would show
        for p in model.parameters():
            if p.dim() == 1:
                p.add_(torch.randn_like(p) * 0.1)
    model.save_pretrained(path)  # config.json + model.safetensors


def demo_batch():
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, VOCAB, (2, SEQ), generator=g)
    mask = torch.ones(2, SEQ, dtype=torch.long)
    mask[0, :3] = 0  # left padding
    mask[1, -2:] = 0  # right padding
    return ids, mask, ids.masked_fill(mask == 0, -100)


def _rank(rank: int, world: int, init_file: str, path: str, results):
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), OMP_NUM_THREADS="1")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    torch.set_num_threads(1)
    import warnings

    import torch.distributed as dist

    warnings.filterwarnings("ignore", category=FutureWarning)

    try:
        import transformers

        from colozoo.checkpoint.load import load_hf_weights
        from colozoo.checkpoint.safetensors_io import SafetensorsReader
        from colozoo.api import build_model
        from colozoo.core.mesh import init_parallel

        dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
        parallel = init_parallel(tp=world)
        config = transformers.AutoConfig.from_pretrained(path)
        model = build_model(config, parallel=parallel, device="meta")
        load_hf_weights(model, SafetensorsReader(path), device="cpu")
        ids, mask, labels = demo_batch()
        with torch.no_grad():
            out = model.eval()(ids, attention_mask=mask, labels=labels, return_logits=True)
        local_params = sum(p.numel() for p in model.parameters())
        # numpy, not torch: a tensor would travel as shared memory that dies with this process
        results.put((rank, out.logits.numpy(), out.loss.item(), local_params, None))
        dist.destroy_process_group()
    except Exception as e:  # reported by the parent, which then fails
        import traceback

        results.put((rank, None, None, None, f"{type(e).__name__}: {e}\n{traceback.format_exc()}"))


def run_ranks(path: Path, world: int, timeout: float = 120):
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    init_file = str(path / "dist-init")
    procs = [ctx.Process(target=_rank, args=(r, world, init_file, str(path), results)) for r in range(world)]
    for p in procs:
        p.start()
    outcomes = {}
    try:
        while len(outcomes) < world:
            rank, *rest = results.get(timeout=timeout)
            outcomes[rank] = rest
            if rest[3]:  # one rank failed: the others may wait forever in a collective
                break
    except queue.Empty:
        pass
    for p in procs:
        p.join(5)
        if p.is_alive():
            p.kill()
    missing = sorted(set(range(world)) - set(outcomes))
    if missing:
        raise RuntimeError(f"ranks {missing} did not report within {timeout}s")
    errors = {r: o[3] for r, o in outcomes.items() if o[3]}
    if errors:
        raise RuntimeError("\n".join(f"rank {r}: {e}" for r, e in sorted(errors.items())))
    return [outcomes[r] for r in range(world)]


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tp", type=int, default=2)
    parser.add_argument("--tolerance", type=float, default=1e-5)
    args = parser.parse_args(argv)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    import transformers
    from rich.console import Console

    transformers.utils.logging.disable_progress_bar()
    from rich.table import Table

    console = Console()
    with tempfile.TemporaryDirectory(prefix="colozoo-demo-") as tmp:
        path = Path(tmp)
        tiny_gpt2(path)
        console.print(f"saved a tiny GPT-2 with transformers to {path}; loading it with colozoo at tp={args.tp} "
                      f"on {args.tp} CPU ranks (gloo) ...")
        reference = transformers.AutoModelForCausalLM.from_pretrained(path, attn_implementation="sdpa").eval()
        full_params = sum(p.numel() for p in reference.parameters())
        ids, mask, labels = demo_batch()
        with torch.no_grad():
            ref = reference(ids, attention_mask=mask, labels=labels)
        ranks = run_ranks(path, args.tp)

    keep = mask.bool()  # padded positions are garbage on both sides
    table = Table(title=f"colozoo GPT-2 at tp={args.tp} vs transformers")
    for column in ("rank", "check", "colozoo", "transformers", "|diff|", "status"):
        table.add_column(column, justify="right" if column != "check" else "left")
    passed = True
    for rank, (logits, loss, local_params, _) in enumerate(ranks):
        logits = torch.from_numpy(logits)
        logits_diff = (logits - ref.logits)[keep].abs().max().item() if logits.shape == ref.logits.shape else float("inf")
        loss_diff = abs(loss - ref.loss.item())
        for check, ours, theirs, diff in (
            ("logits (max over tokens)", f"shape {tuple(logits.shape)}", f"shape {tuple(ref.logits.shape)}",
             logits_diff),
            ("loss", f"{loss:.6f}", f"{ref.loss.item():.6f}", loss_diff),
        ):
            ok = diff < args.tolerance
            passed &= ok
            table.add_row(str(rank), check, ours, theirs, f"{diff:.2e}",
                          "[green]PASS[/green]" if ok else "[red]FAIL[/red]")
        table.add_row(str(rank), "parameters held", f"{local_params:,}", f"{full_params:,}", "", "")
    console.print(table)
    if passed:
        console.print(f"[bold green]PASS[/bold green]: colozoo matches transformers within {args.tolerance:g}")
        return 0
    console.print(f"[bold red]FAIL[/bold red]: colozoo differs from transformers by more than {args.tolerance:g}")
    return 1


if __name__ == "__main__":
    sys.exit(main())
