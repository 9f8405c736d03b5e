"""The fine-tuning loop: check everything, load, train with periodic evaluation and checkpoints, export.

Every rank of a torchrun job runs `finetune(config)`. All input checks happen before the model is loaded
(colozoo.finetune.inputs), so bad input costs seconds and leaves nothing behind.
"""
from __future__ import annotations

import json
import shutil
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist

from colozoo.checkpoint.convert import side_files
from colozoo.core.mesh import collective_timeout, init_distributed
from colozoo.core.rng import model_parallel_seed
from colozoo.finetune import data as D
from colozoo.finetune import runtime, state
from colozoo.finetune.config import FinetuneConfig
from colozoo.finetune.evaluation import Evaluator
from colozoo.finetune.fingerprint import data_fingerprint, weights_fingerprint
from colozoo.finetune.grpo_train import COMPLETIONS_FILE, GrpoTraining, grpo_training
from colozoo.finetune.inputs import (Inputs, check_inputs, check_model_and_mesh, nothing_left_if_refused,
                                     output_before)
from colozoo.finetune.metrics import (Reporter, device_notice, peak_flops, plot_loss, plot_reward,
                                      training_flops_per_token, truncate_metrics)
from colozoo.finetune.preference_data import pair_rows
from colozoo.finetune.preference_train import PreferenceTraining, prepare_reference, preference_training
from colozoo.finetune.run_lock import run_directory
from colozoo.finetune.saver import CheckpointSaver
from colozoo.finetune.schedule import build_scheduler
from colozoo.finetune.stopping import Interrupt, check_finite
from colozoo.finetune.watchdog import Watchdog, process_group_timeout
from colozoo.runtime.amp import DynamicLossScaler
from colozoo.runtime.lora import LoraSettings
from colozoo.runtime.offload import OffloadedAdamW


def finetune(cfg: FinetuneConfig) -> dict:
    """Fine-tune as `cfg` says (every rank of the job calls it); returns the summary, also OUTPUT/summary.json.
    The job owns OUTPUT while it runs (colozoo.finetune.run_lock), and a watchdog names a stuck rank."""
    timeout = collective_timeout(cfg.collective_timeout).total_seconds()
    before = output_before(cfg.output)
    checked = check_model_and_mesh(cfg)  # the degrees against the world size, before any process group
    init_distributed(process_group_timeout(timeout))  # the backstop where the watchdog cannot help
    with run_directory(cfg.output) as job, Watchdog(timeout, job) as watchdog:
        return _finetune(cfg, job, watchdog, before, checked)


def _finetune(cfg: FinetuneConfig, job: str, watchdog: Watchdog, before, checked) -> dict:
    with nothing_left_if_refused(cfg.output, before):
        watchdog.at(0, "checking the inputs")
        inputs = check_inputs(cfg, checked)
        watchdog.at(0, "loading the model")
        trainer = load(cfg, inputs)
        checkpoints = Checkpoints(cfg, inputs, trainer, job)
        watchdog.at(0, "resuming")
        resumed = checkpoints.resume()
        start = resumed.meta["step"] if resumed else 0
        if trainer.rl is not None:  # its first rollouts now: a reward function that fails leaves nothing behind
            trainer.rl.begin(trainer.model, start, resumed.path if resumed else None, trainer.step_options)
    prepare_output(cfg, inputs, start, checkpoints.root)
    reporter = open_reporter(cfg, inputs, trainer, checkpoints.mesh, start, resumed)
    if trainer.preference is not None and cfg.precompute_ref_logps:
        checkpoints.side_files.append(prepare_reference(cfg, inputs, trainer, resumed, reporter, _is_rank0()))
    evaluate_at = Evaluator(cfg, inputs.evaluation, inputs.tokenizer, trainer.model, trainer.micro_batch_size, reporter,
                            _is_rank0(), preference=trainer.preference or trainer.rl)
    if start == 0 and evaluate_at.enabled and cfg.eval_interval:
        watchdog.at(0, "evaluation")
        evaluate_at(0)  # the baseline the fine-tuning improves on
    try:
        outcome = train(cfg, inputs, trainer, checkpoints, evaluate_at, reporter, start, watchdog)
    finally:
        checkpoints.saver.wait(raise_error=False)  # a failed run still lets the save in flight finish (or fail) first
        reporter.close()
    watchdog.at(outcome.step, "exporting")
    return finish(cfg, inputs, trainer, checkpoints, evaluate_at, reporter, outcome)


# --- load -------------------------------------------------------------------------------------------------------

@dataclass
class Trainer:
    """The loaded model and what trains it: which samples each step takes, the optimizer, its learning-rate schedule
    and the fp16 loss scaler."""
    cfg: FinetuneConfig
    model: torch.nn.Module
    fresh: list[str]                     # parameters of a new task head, initialised fresh
    lora: LoraSettings | None
    sampler: D.BatchSampler
    total_steps: int
    step_options: dict                   # forward_backward's micro-batching (and schedule, under a plan)
    micro_batch_size: int
    optimizer: torch.optim.Optimizer
    scheduler: object
    scaler: DynamicLossScaler
    preference: PreferenceTraining | None = None  # --method dpo's step, reference and evaluation
    rl: GrpoTraining | None = None                # --method grpo's rollouts, step and evaluation
    masked_batches: int = 0              # global batches with no labelled token (every label -100): not trained on

    def step(self, batch: dict, number: int, indices=None) -> "StepResult":
        """One optimizer step on this rank's rows of the global batch (`number`: the step it completes; `indices`:
        the samples it takes). A global batch without a labelled token is counted and trains nothing (no update, the
        schedule waits): its loss, a mean over no token, would be NaN (transformers') and stop the run."""
        supervised = self.preference is None and self.rl is None
        if supervised and not int(self.model.loss_token_count(batch["labels"])):  # the same batch on every rank
            self.masked_batches += 1
            return StepResult(None, self.optimizer.param_groups[0]["lr"], None, False, self.scaler.scale, {})
        self.optimizer.zero_grad(set_to_none=True)
        loss_scale = self.scaler.scale
        if self.preference is not None:  # pairs are packed on the host, then their rows moved (PreferenceTraining.rows)
            loss, metrics = self.preference.step(self.model, batch, indices, loss_scale, self.step_options)
        elif self.rl is not None:
            loss, metrics = self.rl.step(self.model, number, loss_scale, self.step_options)
        else:
            batch = _to(batch, self.model.parallel.device)
            loss, metrics = runtime.forward_backward(self.model, batch, grad_scale=loss_scale, **self.step_options), {}
        overflow = self.scaler.unscale_(self.model)  # every rank agrees; clipping then sees the true gradients
        grad_norm = None if overflow else runtime.clip_grad_norm(self.model, self.cfg.grad_clip)
        if not self.scaler.enabled:  # fp16 skips such steps; in fp32/bf16 they would poison the weights
            check_finite(number, float(loss.detach()), grad_norm, self.cfg.dtype)
        lr = self.optimizer.param_groups[0]["lr"]
        if not overflow:  # a skipped step leaves the learning-rate schedule where it is too
            self.optimizer.step()
            self.scheduler.step()
        self.scaler.update(overflow)
        return StepResult(float(loss.detach()), lr, grad_norm, overflow, loss_scale, metrics)


@dataclass
class StepResult:
    loss: float | None                   # None: no labelled token in the batch, nothing trained
    lr: float
    grad_norm: float | None              # None: the step was skipped (fp16 overflow)
    overflow: bool
    loss_scale: float
    metrics: dict                        # further metrics of the step (--method dpo: TRL's)


def load(cfg: FinetuneConfig, inputs: Inputs) -> Trainer:
    """This rank's shard of the model, its config naming the data's classes, prepared for training on the mesh
    (data parallelism, mixed precision, checkpointing: collective), with its sampler, optimizer and schedule."""
    model, fresh = runtime.load_model(cfg, cfg.task, inputs.plan, labels=inputs.train.label_names)
    parallel, plan = model.parallel, inputs.plan
    sampler = D.BatchSampler(len(inputs.train), cfg.samples_per_step(inputs.global_batch), parallel.rank("dp"),
                             inputs.mesh.dp, cfg.seed)
    total_steps = cfg.steps or sampler.total_steps(cfg.epochs) * (cfg.num_iterations if cfg.method == "grpo" else 1)
    model_parallel_seed(cfg.seed, parallel)
    planned_step = runtime.prepare_training(model, cfg)
    step_options = planned_step if plan else {"num_microbatches": cfg.num_microbatches(inputs.mesh.dp)}
    model.train(cfg.method == "sft")  # preference tuning and RL train with dropout off (TRL's disable_dropout)
    preference = preference_training(cfg, model, plan) if cfg.method == "dpo" else None
    rl = grpo_training(cfg, model, inputs, sampler, total_steps) if cfg.method == "grpo" else None
    optimizer = runtime.build_optimizer(model, cfg.lr, cfg.weight_decay)
    # with CPU offload the learning rate is the CPU AdamW's, inside the OffloadedAdamW
    scheduled = optimizer.optimizer if isinstance(optimizer, OffloadedAdamW) else optimizer
    scheduler = build_scheduler(scheduled, min(cfg.warmup_steps, total_steps - 1), total_steps, cfg.min_lr_ratio)
    scaler = DynamicLossScaler(enabled=cfg.dtype == "float16")  # fp16 gradients underflow without loss scaling
    return Trainer(cfg, model, fresh, cfg.lora_settings(), sampler, total_steps, step_options,
                   plan.micro_batch_size if plan else cfg.micro_batch_size, optimizer, scheduler, scaler, preference,
                   rl)


# --- checkpoints and resuming -----------------------------------------------------------------------------------

@dataclass
class Resumed:
    path: Path                           # the checkpoint
    meta: dict                           # its meta: step, mesh, rng_restored (see state.load_training_state)


class Checkpoints:
    """OUTPUT/checkpoints: resumable saves of the whole training state (written in the background under
    --async-save), with the LoRA adapters in PEFT format beside each."""

    def __init__(self, cfg: FinetuneConfig, inputs: Inputs, trainer: Trainer, job: str = ""):
        self.cfg, self.trainer, self.job = cfg, trainer, job
        self.root = Path(cfg.output) / "checkpoints"
        self.mesh = {k: getattr(inputs.mesh, k) for k in ("tp", "pp", "dp", "cp", "ep")}
        self.data_position = {"global_batch": inputs.global_batch, "seed": cfg.seed, "samples": len(inputs.train),
                              "rows": data_fingerprint(inputs.train)}
        lora = cfg.lora_settings()
        self.started_from = {"model": cfg.model, "base": weights_fingerprint(cfg.model),
                             "adapters": json.loads(json.dumps(lora.to_json())) if lora else None}
        self.settings = {name: getattr(cfg, name) for name in state.RESTORED_SETTINGS}
        self.saver = CheckpointSaver(asynchronous=cfg.async_save)
        self.side_files = side_files(inputs.model_dir) if inputs.model_dir is not None else []

    def path(self, step: int) -> Path:
        return self.root / f"{state.PREFIX}{step:08d}"

    def resume(self) -> Resumed | None:
        """The newest complete checkpoint, loaded into the trainer; None under --no-resume or before the first."""
        if _is_rank0():
            for line in state.drop_partial_saves(self.root):
                print(line, file=sys.stderr, flush=True)
        latest = state.latest_checkpoint(self.root) if self.cfg.resume else None
        if latest is None:
            return None
        t = self.trainer
        resumed = Resumed(latest, state.load_training_state(latest, t.model, t.optimizer, t.scheduler, self.mesh,
                                                            t.scaler, self.data_position, self.started_from,
                                                            self.settings))
        t.masked_batches = resumed.meta.get("masked_batches", 0)
        return resumed

    def save(self, step: int, final: bool) -> Path:
        t = self.trainer
        carried = []
        if t.rl is not None:  # the rollouts later steps train on (after the save in flight copied the last ones)
            self.saver.wait()
            carried = t.rl.write_state(Path(self.cfg.output), _is_rank0())
        path = self.saver.save(self.root, step, t.model, t.optimizer, t.scheduler, self.mesh, final=final,
                               extra={"total_steps": t.total_steps, "data": self.data_position,
                                      "started_from": self.started_from, "masked_batches": t.masked_batches,
                                      "settings": self.settings},
                               keep_last=self.cfg.keep_last, scaler=t.scaler, side_files=[*self.side_files, *carried], job=self.job)
        if t.lora:  # the adapters of every checkpoint, as peft loads them (written once it is committed)
            self.saver.wait()
            runtime.export_adapter(t.model, path / "adapter")
        return path


def prepare_output(cfg: FinetuneConfig, inputs: Inputs, start: int, checkpoints: Path):
    """Rank 0 records the options (and the plan) in OUTPUT/config.json; a resumed run drops the metrics logged
    after its checkpoint, a fresh start an earlier run's metrics and checkpoints. Every rank waits for it."""
    output = Path(cfg.output)
    if _is_rank0():
        output.mkdir(parents=True, exist_ok=True)
        saved_config = {**cfg.to_json(), "planned": inputs.plan.to_dict()} if inputs.plan else cfg.to_json()
        (output / "config.json").write_text(json.dumps(saved_config, indent=1))
        logs = (output / "metrics.jsonl", output / COMPLETIONS_FILE)
        for log in logs:
            if start and log.exists():
                truncate_metrics(log, start)
            elif not start:  # a fresh start in this directory: an earlier run's logs and checkpoints would mislead
                log.unlink(missing_ok=True)
        if not start:
            shutil.rmtree(checkpoints, ignore_errors=True)
    if dist.is_available() and dist.is_initialized():
        dist.barrier()


# --- progress and evaluation ------------------------------------------------------------------------------------

def open_reporter(cfg: FinetuneConfig, inputs: Inputs, trainer: Trainer, mesh: dict, start: int,
                  resumed: Resumed | None) -> Reporter:
    """Rank 0's progress bar and metrics, opened with a word on what the run does (collective: it counts the
    parameters over every rank)."""
    model = trainer.model
    n_params, trainable = runtime.parameter_count(model), runtime.parameter_count(model, trainable=True)
    reporter = Reporter(Path(cfg.output), trainer.total_steps, start,
                        flops_per_token=training_flops_per_token(n_params, trainable),
                        peak=peak_flops(model.parallel.device, cfg.dtype, cfg.peak_tflops),
                        world_size=inputs.mesh.world_size, enabled=_is_rank0(), progress=cfg.progress,
                        tensorboard=cfg.tensorboard)
    reporter.print(f"{device_notice(model.parallel.device)}; {n_params:,} parameters ({trainable:,} trained) on mesh "
                   f"{' x '.join(f'{k}={v}' for k, v in mesh.items() if v > 1) or 'of one process'}; "
                   f"{len(inputs.train)} training samples, {trainer.total_steps} steps of {inputs.global_batch} "
                   f"({trainer.step_options['num_microbatches']} micro-batches of {trainer.micro_batch_size} per dp "
                   f"rank)")
    for note in inputs.notes:
        reporter.print(f"warning: {note}")
    if inputs.plan:
        reporter.print("plan auto: " + ", ".join(f"{k}={v}" for k, v in inputs.plan.to_dict().items()))
    if resumed is not None:
        reporter.print(f"resumed from {resumed.path} at step {start}")
        if start >= trainer.total_steps:
            reporter.print(f"{resumed.path.name} ends the run ({start} of {trainer.total_steps} steps): nothing left "
                           f"to train (--no-resume starts over, a larger --steps goes on)")
        if not resumed.meta["rng_restored"]:
            reporter.print(f"resharded from mesh {resumed.meta['mesh']}: random states restart from --seed")
    if trainer.fresh:
        reporter.print(f"new task head, initialised fresh: {', '.join(trainer.fresh)}")
    return reporter


# --- the step loop ----------------------------------------------------------------------------------------------

@dataclass
class Outcome:
    step: int                            # the last step trained
    stopped: bool                        # by Ctrl-C / SIGTERM or --stop-after, before the last step
    interrupted: bool                    # by Ctrl-C / SIGTERM
    saved_at: int | None                 # the step of the last checkpoint written


def train(cfg: FinetuneConfig, inputs: Inputs, trainer: Trainer, checkpoints: Checkpoints, evaluate_at: Evaluator,
          reporter: Reporter, start: int, watchdog: Watchdog) -> Outcome:
    """Steps from `start` to the last, logging every --log-interval steps, evaluating every --eval-interval and
    saving every --save-interval; Ctrl-C, SIGTERM and --stop-after save and stop at the end of a step. Each step and
    phase is reported to the `watchdog`."""
    step, saved_at, stopped, interrupted, total = start, None, False, False, trainer.total_steps
    with Interrupt() as interrupt:
        while step < total:
            watchdog.at(step + 1, "forward/backward and optimizer step")
            tick = time.perf_counter()
            batch, indices = next_batch(cfg, inputs, trainer, step)
            result = trainer.step(batch, step + 1, indices)
            step += 1
            if trainer.rl is not None:
                trainer.rl.log_completions(step, Path(cfg.output), _is_rank0())
            if step % cfg.log_interval == 0 or step == total:
                amp = {"loss_scale": result.loss_scale, "skipped": result.overflow,
                       "skipped_steps": trainer.scaler.skipped_steps} if trainer.scaler.enabled else {}
                computed, trained = step_tokens(inputs, trainer, batch, indices)
                reporter.step(step, result.loss, result.lr, computed, time.perf_counter() - tick, result.grad_norm,
                              inputs.global_batch, trained_tokens=trained, metrics=result.metrics,
                              masked_batches=trainer.masked_batches, **amp)
            if evaluate_at.enabled and cfg.eval_interval and step % cfg.eval_interval == 0 and step < total:
                watchdog.at(step, "evaluation")
                evaluate_at(step)
            watchdog.at(step, "agreeing whether to stop")
            interrupted = interrupt.agreed(trainer.model.parallel.device)
            stopped = interrupted or step == cfg.stop_after
            if stopped or (cfg.save_interval and step % cfg.save_interval == 0) or step == total:
                watchdog.at(step, "saving")
                checkpoints.save(step, final=stopped or step == total)
                saved_at = step
            if stopped:
                break
    checkpoints.saver.wait()
    return Outcome(step, stopped, interrupted, saved_at)


def next_batch(cfg: FinetuneConfig, inputs: Inputs, trainer: Trainer, step: int) -> tuple[dict | None, object]:
    """(the global batch, its sample indices) that step `step` + 1 trains on; (None, None) for --method grpo, whose
    steps draw their prompts themselves, once per --num-iterations cycle (GrpoTraining.make_rollout)."""
    if trainer.rl is not None:
        return None, None
    indices = trainer.sampler.global_indices(step)
    return unpacked_width(cfg, trainer.model, inputs.train.take(indices)), indices


def step_tokens(inputs: Inputs, trainer: Trainer, batch: dict | None, indices) -> tuple[int, int]:
    """(tokens computed, padding included; tokens trained on) of a step."""
    if trainer.rl is not None:  # the rows of the rollouts the step trained on
        return trainer.rl.tokens()
    return (batch["input_ids"].numel() if "input_ids" in batch else 0), int(inputs.train.tokens[indices].sum())


def unpacked_width(cfg: FinetuneConfig, model, batch: dict) -> dict:
    """--no-pack (a causal LM): the batch padded to its longest sample (rounded up), not to --seq-len."""
    unpacked = cfg.task == "lm" and cfg.method == "sft" and not cfg.pack  # dpo's pairs come trimmed already
    return D.trim_padding(batch, D.padding_multiple(model.parallel)) if unpacked else batch


# --- the end: final evaluation, exports, summary -----------------------------------------------------------------

def finish(cfg: FinetuneConfig, inputs: Inputs, trainer: Trainer, checkpoints: Checkpoints, evaluate_at: Evaluator,
           reporter: Reporter, outcome: Outcome) -> dict:
    """The run's summary (OUTPUT/summary.json, with the loss plot); after the last step, the final evaluation and
    the exports first."""
    step, output = outcome.step, Path(cfg.output)
    summary = {"step": step, "total_steps": trainer.total_steps, "stopped": outcome.stopped,
               "checkpoint": str(checkpoints.path(step)) if outcome.saved_at == step else None,
               "masked_batches": trainer.masked_batches}
    if trainer.masked_batches:
        reporter.print(f"warning: {trainer.masked_batches} of {step} steps had a batch with no labelled token (every "
                       f"label -100): nothing to learn from, so no update (masked_batches in metrics.jsonl)")
    if outcome.stopped:
        reporter.print(f"{'interrupted' if outcome.interrupted else 'stopped'} at step {step}/{trainer.total_steps}, "
                       f"saved to {summary['checkpoint']}; rerun the same command to resume")
    else:
        if evaluate_at.enabled:
            summary.update(evaluate_at(step))
        summary.update(export_results(cfg, inputs, trainer, reporter))
    if _is_rank0():
        if cfg.plot and plot_loss(output / "metrics.jsonl", output / "loss.png"):
            summary["plot"] = str(output / "loss.png")
        if cfg.plot and cfg.method == "grpo" and plot_reward(output / "metrics.jsonl", output / "reward.png"):
            summary["reward_plot"] = str(output / "reward.png")
        (output / "summary.json").write_text(json.dumps(summary, indent=1))
    reporter.finish()
    return summary


def export_results(cfg: FinetuneConfig, inputs: Inputs, trainer: Trainer, reporter: Reporter) -> dict:
    """The LoRA adapters (PEFT format) to OUTPUT/adapter, and a transformers model (merged under LoRA only with
    --merge) to OUTPUT/hf; returns where they went."""
    exported, output, model = {}, Path(cfg.output), trainer.model
    if trainer.lora:
        exported["adapter"] = str(runtime.export_adapter(model, output / "adapter"))
        reporter.print(f"exported the LoRA adapters (PEFT format) to {exported['adapter']}")
    if cfg.export_hf and (cfg.merge or not trainer.lora):
        exported["export"] = str(export(model, cfg, output, inputs.evaluation or inputs.train, inputs.tokenizer,
                                        merge_lora=trainer.lora is not None, model_dir=inputs.model_dir))
        reporter.print(f"exported a transformers model{' (adapters merged)' if trainer.lora else ''} to "
                       f"{exported['export']}")
    return exported


def export(model, cfg: FinetuneConfig, output: Path, data: D.TensorData, tokenizer, merge_lora: bool = False,
           model_dir: Path | None = None) -> Path:
    """HF export (LoRA adapters merged in) with the tokenizer and the model directory's other side files (chat
    template, generation config), plus the colozoo model's logits on one batch (probe.pt) so anyone can check the
    export."""
    path = output / "hf"
    if _is_rank0() and path.exists():  # a resumed run exports again
        shutil.rmtree(path)
    if dist.is_available() and dist.is_initialized():
        dist.barrier()
    runtime.export_hf(model, path, merge_lora=merge_lora)
    was_training = model.training
    model.eval()
    with torch.no_grad():
        batch = data.take(range(min(cfg.micro_batch_size, len(data))))
        batch = pair_rows(batch) if "input_ids" in batch and batch["input_ids"].dim() == 3 else batch  # pairs: rows
        logits = model(**_to(runtime.model_inputs(batch), model.parallel.device), return_logits=True).logits
    model.train(was_training)
    if _is_rank0():
        if tokenizer is not None:
            tokenizer.save_pretrained(str(path))
        for file in side_files(model_dir) if model_dir is not None else []:
            if not (path / file.name).exists():
                shutil.copy2(file, path / file.name)
        torch.save({"inputs": runtime.model_inputs(batch), "logits": logits.float().cpu()}, output / "probe.pt")
    if dist.is_available() and dist.is_initialized():
        dist.barrier()
    return path


def _to(batch: dict, device) -> dict:
    return {k: v.to(device, non_blocking=True) for k, v in batch.items()}


def _is_rank0() -> bool:
    return not (dist.is_available() and dist.is_initialized()) or dist.get_rank() == 0
