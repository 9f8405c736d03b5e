"""`colozoo profile`: the symbolic profiler from the command line, for a training step or (--generate) for
generation. The parser needs no torch; the profiler is imported when the command runs."""
from __future__ import annotations

import argparse
import json
import warnings

from colozoo.core.names import FLOAT_CHOICES, HelpFormatter
from colozoo.cost.priced import OPTIMIZER_BYTES, PRICED_SCHEDULES
from colozoo.runtime.options import CHECKPOINTING, OFFLOAD, ZERO_LEVELS


def add_setup_arguments(parser: argparse.ArgumentParser):
    parser.add_argument("--batch-size", type=int, default=1, help="micro-batch size per data-parallel rank")
    parser.add_argument("--seq-len", type=int, default=None, help="sequence length (default: min(2048, max positions))")
    parser.add_argument("--dtype", default="bfloat16", choices=FLOAT_CHOICES, help="parameter and activation dtype")
    parser.add_argument("--optimizer", default="adamw", choices=sorted(OPTIMIZER_BYTES), help="whose states are kept")
    parser.add_argument("--lora-r", type=int, default=0, help="LoRA fine-tuning with adapters of this rank (base "
                                                                 "frozen; 0: full fine-tuning)")
    parser.add_argument("--lora-targets", default="all-linear", help="comma-separated HF module names the adapters "
                                                                     "go on, or all-linear")
    parser.add_argument("--json", action="store_true", help="print JSON instead of tables")


def lora_targets(text: str):
    return text if text == "all-linear" else tuple(t.strip() for t in text.split(",") if t.strip())


def workload_from_args(args):
    """The Workload of the shared options (add_setup_arguments): --seq-len (None: the model's default), --dtype,
    --optimizer, and --lora-r / --lora-targets as one LoraSettings (--lora-r 0: none)."""
    from colozoo.cost.setup import Workload
    from colozoo.runtime.lora import LoraSettings

    lora = LoraSettings(r=args.lora_r, targets=lora_targets(args.lora_targets)) if args.lora_r else None
    return Workload(seq_len=args.seq_len, dtype=args.dtype, optimizer=args.optimizer, lora=lora)


def add_parser(subparsers):
    p = subparsers.add_parser(
        "profile", help="FLOPs, memory and communication of a training step, on meta tensors",
        description="Profile one training step of a model on a mesh without running it: per layer and per op "
                    "FLOPs, parameter/gradient/optimizer bytes, activations saved for backward, peak memory per "
                    "rank and communication per collective.", formatter_class=HelpFormatter)
    p.add_argument("name", help="registered model name (see `colozoo models`) or a local HF or colozoo "
                                "checkpoint directory")
    p.add_argument("--mesh", default="", help="degrees, e.g. 'tp=8,pp=4,dp=2,cp=1,ep=1,sp' (default: every degree 1)")
    add_setup_arguments(p)
    p.add_argument("--checkpointing", default="none", choices=CHECKPOINTING, help="activation checkpointing")
    p.add_argument("--zero", type=int, default=0, choices=ZERO_LEVELS, help="0 DDP, 1/2 ZeRO (priced, not run), 3 FSDP")
    p.add_argument("--microbatches", type=int, default=1, help="micro-batches per step")
    p.add_argument("--schedule", default="1f1b", choices=PRICED_SCHEDULES, help="pipeline schedule")
    p.add_argument("--offload", default="none", choices=OFFLOAD, help="what lives in CPU memory")
    p.add_argument("--generate", action="store_true",
                   help="profile generation instead: weights and KV cache per rank, bytes read per decode step and "
                        "the memory-bandwidth bound on tokens/s (--batch-size sequences of --seq-len tokens)")
    p.add_argument("--hardware", default="H100-80GB", help="with --generate: the preset whose HBM bandwidth bounds "
                                                           "decoding (see colozoo plan --help)")
    p.set_defaults(func=_main)


def check_seq_len(args):
    """A --seq-len past the model's position table is refused in the words every command uses."""
    if args.seq_len is not None:
        from colozoo.registry import check_positions, get_config

        check_positions(get_config(args.name), args.seq_len, f"--seq-len {args.seq_len}")


def _main(args) -> int:
    from colozoo.cost.inference import profile_generation
    from colozoo.cost.profiler import profile
    from colozoo.cost.setup import plan_of

    warnings.filterwarnings("ignore", category=FutureWarning)
    check_seq_len(args)
    if args.generate:
        found = profile_generation(args.name, batch_size=args.batch_size, seq_len=args.seq_len or 2048,
                                   mesh=args.mesh or None, dtype=args.dtype, hardware=args.hardware)
        print(json.dumps(found.to_dict(), indent=1) if args.json else found.table())
        return 0
    plan = plan_of(args.mesh or None, micro_batch_size=args.batch_size, num_microbatches=args.microbatches,
                   schedule=args.schedule, zero=args.zero, checkpointing=args.checkpointing, offload=args.offload)
    report = profile(args.name, plan, workload_from_args(args))
    print(report.to_json(indent=1) if args.json else report.table())
    return 0
