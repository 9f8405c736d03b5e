"""`colozoo convert`: the parser needs no torch; the conversion (or with --merge-lora the model) is imported when the
command runs."""
from __future__ import annotations

import time
from pathlib import Path

from colozoo.core.names import FLOAT_CHOICES


def _check_options(args):
    for flag in ("tp", "pp", "ep"):
        if getattr(args, flag) < 1:
            raise ValueError(f"--{flag} must be >= 1, got {getattr(args, flag)}")
    if args.merge_lora and not args.to_hf:
        raise ValueError("--merge-lora goes with --to-hf (the merged weights as transformers loads them)")
    if args.adapter is not None and not args.merge_lora:
        raise ValueError("--adapter goes with --to-hf --merge-lora (the adapter merged into SRC's weights)")
    if not Path(args.src).exists():
        raise FileNotFoundError(f"no checkpoint at {args.src} (no such directory)")
    _check_writable(Path(args.dst))


def _check_writable(dst: Path):
    """The destination can be made: else one line, not an OSError naming the temp directory beside it."""
    import os

    existing = dst.absolute().parent
    while not existing.exists():
        existing = existing.parent
    if not existing.is_dir():
        raise ValueError(f"cannot write to the destination directory {dst}: {existing} is not a directory")
    if not os.access(existing, os.W_OK | os.X_OK):
        raise ValueError(f"cannot write to the destination directory {dst}: {existing} is not writable")


def _run_convert(args) -> int:
    from rich.console import Console

    from colozoo.checkpoint.atomic import check_destination
    from colozoo.checkpoint.convert import convert, open_checkpoint

    _check_options(args)
    check_destination(Path(args.dst))
    adapters = getattr(open_checkpoint(args.src, allow_bin=args.allow_bin, verify=False), "lora", None)
    if args.merge_lora:
        if adapters is None and args.adapter is None:
            raise ValueError(f"{args.src} holds no LoRA adapters to merge (pass --adapter DIR, or drop --merge-lora)")
        return _merge_lora(args)
    if adapters is not None and args.to_hf:
        raise ValueError(f"{args.src} holds LoRA adapters, which a transformers model lacks: pass --merge-lora to "
                         f"fold them into the weights")
    summary = convert(args.src, args.dst, tp=args.tp, pp=args.pp, ep=args.ep, dtype=args.dtype, to_hf=args.to_hf,
                      allow_bin=args.allow_bin, progress=not args.quiet)
    Console().print(f"[bold]converted[/bold] {args.src} -> {args.dst}: {summary['tensors']} tensors, "
                    f"{summary['bytes'] / 1e6:.1f} MB in {summary['files']} files, {summary['seconds']:.2f} s, "
                    f"peak RSS {summary['peak_rss_mb']:.0f} MB (largest tensor "
                    f"{summary['largest_tensor_bytes'] / 1e6:.1f} MB)", soft_wrap=True)
    return 0


def _merge_lora(args) -> int:
    """Load SRC (with --adapter on top) in this one process and export it with the adapters folded into the
    weights; the tokenizer and generation files come along."""
    import shutil

    from rich.console import Console

    from colozoo.api import from_pretrained
    from colozoo.checkpoint.convert import side_files

    start = time.perf_counter()
    model = from_pretrained(args.src, dtype=args.dtype, allow_bin=args.allow_bin, adapter=args.adapter)
    model.save_pretrained(args.dst, format="hf", merge_lora=True)
    for file in side_files(args.src) + (side_files(args.adapter) if args.adapter else []):
        if not (Path(args.dst) / file.name).exists():
            shutil.copy2(file, Path(args.dst) / file.name)
    Console().print(f"[bold]merged[/bold] the LoRA adapters of {args.adapter or args.src} into the weights: {args.src} "
                    f"-> {args.dst} (a transformers model), {time.perf_counter() - start:.2f} s", soft_wrap=True)
    return 0


def add_parser(subparsers):
    p = subparsers.add_parser("convert", help="convert / reshard a checkpoint (HF or colozoo) to colozoo or HF")
    p.add_argument("src", help="HF directory or colozoo checkpoint (a fine-tuning run's OUTPUT/checkpoints/step-N too)")
    p.add_argument("dst", help="destination directory (must not exist or be empty)")
    p.add_argument("--tp", type=int, default=1, help="tensor-parallel degree of the output (default: 1)")
    p.add_argument("--pp", type=int, default=1, help="pipeline-parallel degree of the output (default: 1)")
    p.add_argument("--ep", type=int, default=1, help="expert-parallel degree of the output (default: 1)")
    p.add_argument("--dtype", choices=FLOAT_CHOICES, default=None,
                   help="convert floating tensors (default: keep their dtype)")
    p.add_argument("--to-hf", action="store_true", help="write a Hugging Face directory instead")
    p.add_argument("--merge-lora", action="store_true",
                   help="with --to-hf: fold the LoRA adapters SRC holds (a LoRA run's checkpoint), or --adapter's, "
                        "into the weights (loads the model in this process)")
    p.add_argument("--adapter", help="with --merge-lora: a PEFT adapter directory (e.g. a LoRA run's OUTPUT/adapter) "
                                     "to merge into SRC")
    p.add_argument("--allow-bin", action="store_true", help="read PyTorch .bin weights (torch.load weights_only)")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    p.set_defaults(func=_run_convert)
