"""Fine-tuning: `colozoo finetune` / scripts/finetune_*.py, run by every rank of a torchrun job, or launching
the ranks on this machine itself (`--nproc-per-node`, see `launch`).

    colozoo finetune --nproc-per-node 4 --model MODEL_DIR --data data/lm.jsonl --tp 2 --pp 2
    torchrun --nproc-per-node 4 -m colozoo.cli finetune --model MODEL_DIR --data data/lm.jsonl --tp 2 --pp 2
"""
from __future__ import annotations

import argparse
import sys

from dataclasses import fields

from colozoo.core.names import HelpFormatter
from colozoo.finetune.config import FinetuneConfig, add_arguments, config_from_args

__all__ = ["FinetuneConfig", "finetune", "add_parser", "main"]


def finetune(config: FinetuneConfig) -> dict:
    """Fine-tune as `config` says, on every rank of the job (colozoo.finetune.loop); returns the summary."""
    from colozoo.finetune.loop import finetune as loop_finetune

    return loop_finetune(config)


def _command(args) -> int:
    from colozoo.finetune import launch
    from colozoo.finetune.config import check_at_least

    config = config_from_args(args)
    config.check_paths()  # in the first second: before torch is imported, any process started or the model read
    if args.nproc_per_node is not None and not launch.under_torchrun():
        check_at_least("nproc_per_node", args.nproc_per_node)
        from colozoo.finetune.inputs import check_model_and_mesh

        check_model_and_mesh(config, world=args.nproc_per_node)  # before any process starts
        return launch.launch(args.nproc_per_node, worker_arguments(args))
    from colozoo.runtime.failures import terminated_raises

    with terminated_raises():  # torchrun stopping this rank because another failed: it says so (the loop saves)
        summary = finetune(config)
    return 0 if summary.get("step") else 1


def add_launch_argument(parser):
    parser.add_argument("--nproc-per-node", type=int, default=None, metavar="N",
                        help="start N processes on this machine (torchrun --standalone, in this process); Ctrl-C "
                             "then saves and exits 0 (plain torchrun exits 1 with a traceback)")


def worker_arguments(args) -> list[str]:
    """The options of `args` as the command line every worker parses (`python -m colozoo.finetune ...`)."""
    argv = []
    for f in fields(FinetuneConfig):
        value, flag = getattr(args, f.name), "--" + f.name.replace("_", "-")
        if isinstance(value, bool):
            argv.append(flag if value else "--no-" + flag[2:])
        elif value is not None:
            argv += [flag, str(value)]
    return argv


def add_parser(subparsers):
    parser = subparsers.add_parser(
        "finetune", help="fine-tune a model (launch with torchrun for more than one process)",
        description="Fine-tune a causal LM (GPT-2, OPT, LLaMA; on text, or on chat and prompt/completion records "
                    "with --chat; on preference pairs with --method dpo; from the rewards of its own completions "
                    "with --method grpo), a sequence classifier (BERT) or an "
                    "image classifier (ViT) on any mesh, all weights or LoRA adapters (--lora-r). Every rank of a "
                    "torchrun job runs this command.",
        formatter_class=HelpFormatter)
    add_arguments(parser)
    add_launch_argument(parser)
    parser.set_defaults(func=_command)
    return parser


def main(argv=None, task: str | None = None) -> int:
    """Entry point of the scripts: parse, train, and report bad input as one line (the first failing rank's)."""
    parser = argparse.ArgumentParser(description=f"colozoo fine-tuning ({task or 'any task'}); launch with torchrun",
                                     formatter_class=HelpFormatter)
    add_arguments(parser, task=task)
    add_launch_argument(parser)
    args = parser.parse_args(argv)
    from colozoo.runtime.failures import report_failure

    try:
        return _command(args)
    except (ValueError, FileNotFoundError, FileExistsError, NotImplementedError) as e:
        report_failure(e, expected=True)  # one line, from the first rank that failed
        return 1
    except Exception as e:  # noqa: BLE001 - a peer's failure seen in a collective: one line; a bug: its traceback
        if report_failure(e, expected=False):
            return 1
        raise
    finally:
        _shutdown_distributed()


def _shutdown_distributed():
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
