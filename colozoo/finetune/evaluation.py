"""Evaluation during fine-tuning: the held-out loss (and perplexity or accuracy), for a causal LM greedy
continuations of a few held-out prompts, and with --eval-tasks the lm-evaluation-harness scores of the model as it is
(colozoo.evaluation), logged beside the loss as TASK/METRIC.

The loss is the mean over every held-out token that has a label (every sample, for classifiers), whichever mesh
evaluates it: each micro-batch's mean loss is weighted by the tokens it averages, and the rows evaluated are the first
`--eval-batches` x `--micro-batch-size` of the held-out set (all of them when it is smaller), whatever the dp degree.
"""
from __future__ import annotations

import math
from pathlib import Path

import torch
import torch.distributed as dist

from colozoo.finetune import data as D
from colozoo.finetune import samples
from colozoo.finetune.config import FinetuneConfig
from colozoo.finetune.metrics import Reporter, perplexity


class Evaluator:
    """`evaluator(step)`: the held-out loss (and perplexity or accuracy), logged, with a causal LM's greedy
    continuations of a few held-out prompts."""

    def __init__(self, cfg: FinetuneConfig, data, tokenizer, model, micro_batch_size: int, reporter: Reporter,
                 rank0: bool, preference=None):
        self.cfg, self.model, self.reporter, self.rank0 = cfg, model, reporter, rank0
        self.data, self.tokenizer, self.micro_batch_size = data, tokenizer, micro_batch_size
        self.preference = preference  # --method dpo / grpo: its evaluation (preference_train, grpo_train)
        self.manager = None
        if cfg.eval_tasks:  # checked with the inputs (harness_tasks); the tasks load at each evaluation
            from colozoo.evaluation.run import task_manager

            self.manager = task_manager(cfg.eval_include_path, names=cfg.eval_task_names())
        prompted = preference is not None  # the prompts of the held-out pairs' chosen rows
        if cfg.method == "grpo":  # its samples are the completions it evaluates
            self.prompts = None
            return
        rows = chosen_rows(data) if prompted and data is not None else data
        self.prompts = samples.held_out_prompts(rows, cfg.samples, cfg.sequence_length() // 2,
                                                until_answer=cfg.chat or prompted) if cfg.task == "lm" else None
        if self.prompts is not None and samples.why_no_samples(model):
            reporter.print(f"no samples: {samples.why_no_samples(model)}")
            self.prompts = None

    @property
    def enabled(self) -> bool:
        """Whether there is anything to evaluate: held-out data or --eval-tasks."""
        return self.data is not None or self.manager is not None

    def __call__(self, step: int) -> dict:
        if self.data is None:
            results = {}
        elif self.cfg.method == "grpo":
            prompts = min(len(self.data), max(1, self.cfg.eval_batches * self.micro_batch_size //
                                              self.cfg.num_generations))
            results = self.preference.evaluate(self.model, self.data, prompts, step, show=self.reporter.print)
        elif self.preference is not None:
            results = self.preference.evaluate(self.model, self.data, held_out_rows(self.data, self.cfg),
                                               self.micro_batch_size or self.cfg.micro_batch_size)
        else:
            results = evaluate(self.model, self.data, self.cfg, self.micro_batch_size)
        if self.manager is not None:
            results.update(task_scores(self.model, self.tokenizer, self.cfg, self.manager, self.micro_batch_size))
        self.reporter.evaluation(step, results)
        if self.prompts is not None:
            samples.write_samples(self.model, self.prompts, self.tokenizer, step, Path(self.cfg.output),
                                  self.cfg.sample_tokens, self.reporter, self.rank0)
        return results


def chosen_rows(data):
    """Preference pairs (pairs, 2, L) as the rows of their chosen sequences."""
    from colozoo.finetune.data import TensorData

    return TensorData({k: v[:, 0] for k, v in data.tensors.items()}, data.tokens)


def held_out_rows(data, cfg: FinetuneConfig) -> int:
    """How many held-out rows an evaluation reads: --eval-batches of --micro-batch-size, or all there are."""
    return min(len(data), cfg.eval_batches * cfg.micro_batch_size)


@torch.no_grad()
def evaluate(model, data, cfg: FinetuneConfig, micro_batch_size: int | None = None) -> dict:
    """The token-weighted mean loss over the first held_out_rows(data, cfg) rows (perplexity for a causal LM,
    accuracy for a classifier), the same on every rank and every mesh. Micro-batches of `micro_batch_size` (default:
    --micro-batch-size) go round the dp ranks; a rank left without one in the last round runs the first again
    without counting it, since a sharded (FSDP) forward is collective over the dp ranks."""
    parallel = model.parallel
    dp, rank = parallel.size("dp"), parallel.rank("dp")
    micro = micro_batch_size or cfg.micro_batch_size
    rows = held_out_rows(data, cfg)
    batches = [range(start, min(start + micro, rows)) for start in range(0, rows, micro)]
    lm = cfg.task == "lm"
    # weighted loss sum, weight, correct predictions
    totals = torch.zeros(3, dtype=torch.float64, device=parallel.device)
    was_training = model.training
    model.eval()
    for turn in range(math.ceil(len(batches) / dp)):
        index = turn * dp + rank
        counted = index < len(batches)
        rows_of = batches[index] if counted else batches[0]
        taken = data.take(list(rows_of))
        if lm and not cfg.pack:  # padded to the longest sample: every rank of a (tp, pp, cp) group cuts them alike
            taken = D.trim_padding(taken, D.padding_multiple(parallel))
        batch = {k: v.to(parallel.device, non_blocking=True) for k, v in taken.items()}
        out = model(**batch, return_logits=not lm)
        weight = int(data.tokens[list(rows_of)].sum()) if lm else len(rows_of)  # what the batch's mean loss averages
        if counted and weight:
            totals[0] += out.loss.double() * weight
            totals[1] += weight
            if not lm:
                totals[2] += (out.logits.argmax(-1) == batch["labels"]).sum()
    if dp > 1:
        dist.all_reduce(totals, group=parallel.group("dp"))
    model.train(was_training)
    if totals[1] == 0:
        return {}
    loss = totals[0].item() / totals[1].item()
    if lm:
        return {"eval_loss": loss, "eval_ppl": perplexity(loss)}
    return {"eval_loss": loss, "eval_acc": totals[2].item() / totals[1].item()}


def harness_tasks(cfg: FinetuneConfig) -> tuple:
    """(lm-eval's task manager, the --eval-tasks loaded): lm-eval installed, the names known, their data readable,
    and no generation task under sequence parallelism (generate runs one token at a time). Checked before the model
    loads; each evaluation loads the tasks afresh (the harness keeps its requests on them)."""
    from colozoo.evaluation import require_lm_eval
    from colozoo.evaluation.run import load_tasks, task_manager

    require_lm_eval("--eval-tasks")
    manager = task_manager(cfg.eval_include_path, names=cfg.eval_task_names())
    tasks = load_tasks(cfg.eval_task_names(), manager)
    generating = [t.config.task for t in leaf_tasks(tasks) if t.OUTPUT_TYPE == "generate_until"]
    if generating and cfg.sequence_parallel:
        raise ValueError(f"--eval-tasks {generating[0]} generates text, which runs without --sequence-parallel")
    return manager, tasks


def leaf_tasks(tasks: list) -> list:
    from lm_eval.api.group import Group

    return [leaf for t in tasks for leaf in (t.get_all_tasks() if isinstance(t, Group) else [t])]


def task_scores(model, tokenizer, cfg: FinetuneConfig, manager, batch_size: int) -> dict:
    """The harness's scores of the model as it is, flat (TASK/METRIC), on rank 0 ({} elsewhere), with the seconds
    they took (collective: every rank calls it; the dp replicas split the requests unless FSDP shards the model)."""
    from colozoo.evaluation import ColozooLM, evaluate
    from colozoo.evaluation.run import load_tasks, scores

    lm = ColozooLM(model, tokenizer=tokenizer, batch_size=batch_size, progress=False)
    results = evaluate(lm, load_tasks(cfg.eval_task_names(), manager), manager, limit=_limit(cfg.eval_tasks_limit),
                       environment=False)
    if results is None:
        return {}
    return {**scores(results), "eval_tasks_s": results["colozoo"]["seconds"]}


def _limit(limit: float | None):
    return int(limit) if limit is not None and limit >= 1 else limit
