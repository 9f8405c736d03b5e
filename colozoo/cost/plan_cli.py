"""`colozoo plan`: the planner's ranked plans for a model on a number of GPUs, from the command line. The parser
needs no torch; the planner is imported when the command runs."""
from __future__ import annotations

import json
from dataclasses import fields

from colozoo.core.names import FLOAT_CHOICES, HelpFormatter
from colozoo.cost.hardware import PRESETS, Hardware, HardwareError
from colozoo.cost.priced import OPTIMIZER_BYTES
from colozoo.cost.profile_cli import check_seq_len, workload_from_args


def add_parser(subparsers):

    p = subparsers.add_parser(
        "plan", help="choose tp/pp/dp/cp/ep, micro-batching, checkpointing, ZeRO and offload for a cluster",
        description="Search parallel layouts jointly with activation checkpointing, ZeRO/FSDP and CPU offload "
                    "for the fastest predicted training step that fits in GPU memory, and print the ranked "
                    "plans with predicted memory per GPU, step time and why each was chosen.",
        formatter_class=HelpFormatter)
    p.add_argument("name", nargs="?", help="registered model name (see `colozoo models`) or a local HF or colozoo "
                                           "checkpoint directory")
    p.add_argument("--gpus", type=int, default=8, help="total GPUs")
    p.add_argument("--gpu-memory", default=None, help="memory per GPU, e.g. 80GB or 40GiB (default: the preset's)")
    p.add_argument("--hardware", default="H100-80GB",
                   help=f"preset ({', '.join(PRESETS)}) or a JSON file of measured fields over one (bench/gpu.py "
                        "--hardware-out writes one on a GPU)")
    p.add_argument("--hardware-file", default=None, metavar="JSON",
                   help="measured hardware fields over the preset (or the file's own \"preset\"), e.g. "
                        "{\"preset\": \"H100-80GB\", \"matmul_efficiency\": 0.7, ...}")
    p.add_argument("--show-hardware", action="store_true",
                   help="instead of planning: print every number of the hardware with where it comes from")
    p.add_argument("--gpus-per-node", type=int, default=None, help="GPUs a node holds (default: the preset's)")
    p.add_argument("--seq-len", type=int, default=None, help="tokens per sequence (default: min(2048, max positions))")
    p.add_argument("--global-batch", type=int, default=None, help="sequences per optimizer step "
                                                                  "(default: about 1M tokens)")
    p.add_argument("--dtype", default="bfloat16", choices=FLOAT_CHOICES, help="parameter and activation dtype")
    p.add_argument("--optimizer", default="adamw", choices=sorted(OPTIMIZER_BYTES), help="whose states are kept")
    p.add_argument("--no-offload", action="store_true", help="never offload to CPU memory")
    p.add_argument("--lora-r", type=int, default=0, help="plan LoRA fine-tuning with adapters of this rank (0: full)")
    p.add_argument("--lora-targets", default="all-linear", help="comma-separated HF module names, or all-linear")
    p.add_argument("--set", action="append", default=[], metavar="FIELD=VALUE",
                   help="override a field of the hardware preset, e.g. --set inter_node_bw=100e9 "
                        "--set collective_latency_s=2e-5 (fields: " + ", ".join(_numeric_fields()) + ")")
    p.add_argument("--top", type=int, default=10, help="plans to show")
    p.add_argument("--json", action="store_true", help="print JSON instead of a table")
    p.add_argument("--generate", action="store_true",
                   help="plan generation instead: the smallest tp x pp whose GPUs hold the weights and the KV cache "
                        "of --batch-size sequences of --seq-len tokens (then the fastest decode bound)")
    p.add_argument("--batch-size", type=int, default=1, help="with --generate: sequences decoded together")
    p.add_argument("--validate", action="store_true",
                   help="instead of planning: price the published training runs (colozoo/cost/published_runs.json: "
                        "Megatron-LM, Megatron-Core, DeepSpeed, MosaicML MPT, BLOOM, Llama 3, Nemotron-4, NeMo's "
                        "DGX Cloud benchmarks) as they ran and print predicted against measured")
    p.add_argument("--choose", action="store_true", help="with --validate: also the planner's own best plan for "
                                                         "each run's model, GPUs and batch (a search per run: slow)")
    p.add_argument("--runs", default=None, metavar="JSON",
                   help="with --validate: your own table of runs instead (the same JSON layout; its rows may name the "
                        "package's software presets and networks; keys: colozoo/cost/published_schema.py)")
    p.add_argument("--plot", default=None, metavar="PNG", help="with --validate: also draw each run's error against "
                                                              "its measured step time into this PNG")
    p.set_defaults(func=_main)


def _numeric_fields() -> list[str]:
    return [f.name for f in fields(Hardware) if f.type in ("float", "int") and f.name not in ("gpus_per_node", "nodes")]


def _overrides(items) -> dict:
    out = {}
    for item in items:
        name, _, value = item.partition("=")
        if name not in _numeric_fields():
            raise HardwareError(f"--set {item!r}: the hardware has no field {name!r}; fields: "
                                f"{', '.join(_numeric_fields())}")
        try:
            out[name] = float(value)
        except ValueError:
            raise HardwareError(f"--set {item!r}: {value!r} is not a number") from None
    return out


def _main(args) -> int:
    import warnings

    from colozoo.cost.inference import plan_generation
    from colozoo.cost.planner import SearchSpace, plan

    warnings.filterwarnings("ignore", category=FutureWarning)
    if args.validate:
        return _validate(args)
    if args.show_hardware:
        return _show_hardware(args)
    if args.name is None:
        raise ValueError("colozoo plan needs a model name (or --validate)")
    check_seq_len(args)
    if args.generate:
        found = plan_generation(args.name, gpus=args.gpus, batch_size=args.batch_size, seq_len=args.seq_len or 2048,
                                dtype=args.dtype, hardware=args.hardware)
        print(json.dumps(found.to_dict(), indent=1) if args.json else found.table())
        return 0
    try:
        hardware = _hardware(args)
        result = plan(args.name, hardware, workload_from_args(args), SearchSpace(allow_offload=not args.no_offload),
                      global_batch=args.global_batch)
    except HardwareError as e:
        raise ValueError(str(e)) from None
    if args.json:
        print(json.dumps({**result.to_dict(), "plans": result.to_dict()["plans"][:args.top]}, indent=1))
    else:
        print(result.table(args.top))
    if not result.plans:
        print(f"no plan fits: {result._rejections()}")
        return 1
    return 0


def _hardware(args) -> Hardware:
    from colozoo.cost.hardware import get_hardware

    return get_hardware(args.hardware, gpus=args.gpus, gpu_memory=args.gpu_memory, gpus_per_node=args.gpus_per_node,
                        measured=args.hardware_file, **_overrides(args.set))


def _show_hardware(args) -> int:
    from colozoo.cost.hardware import describe

    try:
        hardware = _hardware(args)
    except HardwareError as e:
        raise ValueError(str(e)) from None
    print(json.dumps(hardware.to_dict(), indent=1) if args.json else describe(hardware))
    return 0


def _validate(args) -> int:
    """Predicted against measured for every published run; 1 when a run not known to be missed is off by more than
    the tolerance."""
    import sys

    from colozoo.cost.published import published_runs
    from colozoo.cost.validate import table, validate

    runs = published_runs(args.runs)
    results = validate(runs, choose=args.choose, progress=lambda line: print(line, file=sys.stderr, flush=True))
    if args.json:
        print(json.dumps([r.row() for r in results], indent=1))
    else:
        print(table(results))
    if args.plot:
        from colozoo.cost.validate_plot import plot_validation

        print(f"plot: {plot_validation(results, args.plot)}", file=sys.stderr)
    return int(any(not r.within and not r.run.known_miss for r in results))
