"""`colozoo convert`: the parser needs no torch; the conversion is imported when the command runs."""
from __future__ import annotations


def _run_convert(args) -> int:
    from rich.console import Console

    from colozoo.checkpoint.convert import convert

    summary = convert(args.src, args.dst, tp=args.tp, pp=args.pp, ep=args.ep, dtype=args.dtype, to_hf=args.to_hf,
                      allow_bin=args.allow_bin, progress=not args.quiet)
    Console().print(f"[bold]converted[/bold] {args.src} -> {args.dst}: {summary['tensors']} tensors, "
                    f"{summary['bytes'] / 1e6:.1f} MB in {summary['files']} files, {summary['seconds']:.2f} s, "
                    f"peak RSS {summary['peak_rss_mb']:.0f} MB (largest tensor "
                    f"{summary['largest_tensor_bytes'] / 1e6:.1f} MB)")
    return 0


def add_parser(subparsers):
    p = subparsers.add_parser("convert", help="convert / reshard a checkpoint (HF or colozoo) to colozoo or HF")
    p.add_argument("src", help="HF directory or colozoo checkpoint")
    p.add_argument("dst", help="destination directory (must not exist or be empty)")
    p.add_argument("--tp", type=int, default=1, help="tensor-parallel degree of the output")
    p.add_argument("--pp", type=int, default=1, help="pipeline-parallel degree of the output")
    p.add_argument("--ep", type=int, default=1, help="expert-parallel degree of the output")
    p.add_argument("--dtype", choices=["fp32", "fp16", "bf16"], default=None, help="convert floating tensors")
    p.add_argument("--to-hf", action="store_true", help="write a Hugging Face directory instead")
    p.add_argument("--allow-bin", action="store_true", help="read PyTorch .bin weights (torch.load weights_only)")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    p.set_defaults(func=_run_convert)
