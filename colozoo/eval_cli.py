"""`colozoo eval`: lm-evaluation-harness scores of a model on any tp x pp x dp mesh, as `lm_eval --model hf` gives them.

    colozoo eval ./my-model --tasks colozoo_mc,colozoo_ppl,colozoo_gen
    colozoo eval ./ckpt --tasks hellaswag --num-fewshot 10 --nproc-per-node 4 --tp 2 --pp 2 --output results.json
    colozoo eval ./ckpt --tasks hellaswag --nproc-per-node 8 --tp 2      # 4 dp replicas, each scoring a quarter

Every rank runs it; rank 0 prints the harness's table, the time and tokens per second, and writes the results JSON.
Everything that needs no model (lm-eval installed, the model's causal LM head against its config, the mesh, the
tokenizer, the tasks and their data) is checked before any rank starts.
"""
from __future__ import annotations

import sys
from pathlib import Path

from colozoo.core.names import HelpFormatter
from colozoo.finetune.config import check_at_least
from colozoo.generate_cli import add_mesh_arguments, on_ranks


def add_parser(subparsers):
    p = subparsers.add_parser(
        "eval", help="score a model on lm-evaluation-harness tasks, on any mesh (needs lm-eval: colozoo[eval])",
        description="Run lm-evaluation-harness tasks on a model sharded over tp x pp ranks (ranks beyond tp x pp are "
                    "dp replicas, each scoring a share of the requests): the same requests, batches "
                    "and metrics as `lm_eval --model hf`. Ships colozoo_mc (multiple choice), colozoo_ppl (perplexity) "
                    "and colozoo_gen (generation, exact match), which need no download; the harness's own tasks need "
                    "their datasets in the local Hugging Face cache (HF_DATASETS_OFFLINE=1 to never download), or a "
                    "task YAML of yours pointing at local files (--include-path).",
        formatter_class=HelpFormatter)
    p.add_argument("model", help="a registry name (see `colozoo models`), a local HF / colozoo directory, or a "
                                 "checkpoint of a fine-tuning run (OUTPUT/checkpoints/step-N)")
    p.add_argument("--tasks", required=True, help="comma-separated task, group or tag names (glob patterns too, "
                                                  "e.g. colozoo_*), or task YAML files")
    p.add_argument("--include-path", action="append", metavar="DIR", help="a folder of task YAML files of yours "
                                                                         "(its tasks take precedence); repeat for more")
    p.add_argument("--num-fewshot", type=int, help="examples before each request (default: each task's own)")
    p.add_argument("--limit", type=float, help="requests per task at most (below 1: that fraction of them)")
    p.add_argument("--batch-size", type=int, default=1, help="requests per forward (and per generate call)")
    p.add_argument("--output", type=Path, help="write the harness's results JSON here (with the time and tokens/s)")
    p.add_argument("--log-samples", action="store_true", help="with --output: every request, response and score")
    p.add_argument("--adapter", help="a PEFT LoRA adapter directory to attach")
    p.add_argument("--seed", type=int, default=1234, help="the harness's seeds (few-shot choice, sampling)")
    add_mesh_arguments(p, nproc="N = tp x pp x dp: the dp replicas share the requests")
    p.set_defaults(func=run, command_parser=p)
    return p


def check_options(args):
    for flag in ("tp", "pp", "nproc_per_node", "batch_size"):
        check_at_least(flag, getattr(args, flag))
    check_at_least("num_fewshot", args.num_fewshot, 0)
    if args.limit is not None and (args.limit <= 0 or args.limit >= 1 and args.limit != int(args.limit)):
        raise ValueError(f"--limit must be a whole number of requests or a fraction in (0, 1), got {args.limit:g}")
    if args.log_samples and args.output is None:
        raise ValueError("--log-samples goes with --output (the samples are written into the results JSON)")
    if args.output is not None and args.output.is_dir():
        raise ValueError(f"--output {args.output} is a directory; give the JSON file to write")
    if args.adapter is not None and not (Path(args.adapter) / "adapter_config.json").is_file():
        raise ValueError(f"--adapter {args.adapter} is not a PEFT adapter directory (no adapter_config.json)")


class Prepared:
    """What the evaluation needs before the model loads: lm-eval, the checkpoint's config (a causal LM on this mesh),
    the tokenizer's directory and the tasks, loaded with their data."""

    def __init__(self, args):
        from colozoo.api import resolve
        from colozoo.checkpoint.layout import check_mesh
        from colozoo.evaluation import require_lm_eval
        from colozoo.evaluation.run import check_causal_lm, load_tasks, task_manager
        from colozoo.generate_cli import load_tokenizer

        require_lm_eval("colozoo eval")
        self.names = [name.strip() for name in args.tasks.split(",") if name.strip()]
        source = resolve(args.model, verify=False)  # its directory and config: from_pretrained verifies weights
        check_causal_lm(source.config, args.model)
        check_mesh(source.config, tp=args.tp, pp=args.pp)
        self.tokenizer = load_tokenizer([getattr(source, "path", None), args.adapter], args.model).name_or_path
        self.manager = task_manager(args.include_path, names=self.names)
        self.tasks = load_tasks(self.names, self.manager)


def run(args) -> int:
    check_options(args)
    return on_ranks(args, Prepared, evaluate, dp=None)  # ranks beyond tp x pp: dp replicas sharing the requests


def evaluate(args, prepared: Prepared) -> int:
    import logging

    from colozoo.api import from_pretrained
    from colozoo.evaluation import ColozooLM, evaluate
    from colozoo.evaluation.harness import global_rank
    from colozoo.evaluation.run import table, write_results

    rank0 = global_rank() == 0
    logging.getLogger("lm_eval").setLevel(logging.WARNING if rank0 else logging.ERROR)
    model = from_pretrained(args.model, tp=args.tp, pp=args.pp, dtype=args.dtype, adapter=args.adapter)
    lm = ColozooLM(model, tokenizer=prepared.tokenizer, batch_size=args.batch_size)
    limit = int(args.limit) if args.limit is not None and args.limit >= 1 else args.limit
    results = evaluate(lm, prepared.tasks, prepared.manager, num_fewshot=args.num_fewshot, limit=limit,
                       log_samples=args.log_samples, seed=args.seed)
    if rank0 and results is not None:
        print(table(results))
        stats = results["colozoo"]
        rate = f"{stats['tokens_per_s']:,.0f} tokens/s" if stats["tokens_per_s"] else "no tokens"
        print(f"evaluated in {stats['seconds']:.1f} s: the model read and wrote {stats['tokens']:,} tokens in "
              f"{stats['model_seconds']:.1f} s ({rate}) on mesh tp={args.tp} x pp={args.pp} x "
              f"dp={model.parallel.config.dp}")
        if args.output is not None:
            print(f"results written to {write_results(results, args.output)}", file=sys.stderr)
    return 0
