"""The fine-tuning loop: check everything, load, train with periodic eval and checkpoints, export.

Every rank of a torchrun job runs `run(config)`. All input checks happen before the model is loaded, so bad
input costs seconds and leaves nothing behind.
"""
from __future__ import annotations

import json
import math
import os
import shutil
import signal
import time
from pathlib import Path

import torch
import torch.distributed as dist

from colozoo.runtime.amp import DynamicLossScaler
from colozoo.runtime.offload import OffloadedAdamW
from colozoo.finetune import data as D
from colozoo.finetune import runtime, samples, sft, state, token_cache
from colozoo.finetune.config import FinetuneConfig
from colozoo.finetune.metrics import (Reporter, device_notice, peak_flops, perplexity, plot_loss,
                                      tensorboard_writer_class, truncate_metrics)
from colozoo.finetune.saver import CheckpointSaver
from colozoo.finetune.schedule import build_scheduler
from colozoo.core.mesh import ParallelConfig
from colozoo.core.rng import model_parallel_seed
from colozoo.runtime.plan import DEGREES, Plan


def model_source(name_or_path: str):
    """(transformers config, directory holding the tokenizer or None), without loading any weights."""
    from colozoo.api import resolve

    source = resolve(name_or_path, verify=True)  # checksums are checked when weights are read
    return source.config, getattr(source, "path", None)


def _world_size() -> int:
    return int(os.environ.get("WORLD_SIZE", "1"))


def check_mesh(cfg: FinetuneConfig, plan: Plan | None = None) -> ParallelConfig:
    """The mesh of the config's degrees, or of the plan's under --plan auto."""
    degrees = plan.degrees() if plan is not None else {k: getattr(cfg, k) for k in DEGREES}
    return ParallelConfig.for_world(_world_size(), **degrees)


def plan_run(cfg: FinetuneConfig, config) -> tuple[Plan, ParallelConfig, int]:
    """--plan auto: (the plan, its mesh, the global batch it splits: --global-batch-size, else micro batch x world)."""
    global_batch = cfg.global_batch_size or cfg.micro_batch_size * _world_size()
    plan = runtime.plan_training(cfg, config, global_batch)
    mesh = check_mesh(cfg, plan)
    if plan.dp * plan.micro_batch_size * plan.num_microbatches != global_batch:
        raise ValueError(f"the plan {plan} does not split the global batch of {global_batch} into dp x micro batch "
                         f"x micro-batches")
    return plan, mesh, global_batch


def build_datasets(cfg: FinetuneConfig, config, directory) -> tuple[D.TensorData, D.TensorData, object]:
    """(train, eval, tokenizer or None), checked against the model's config."""
    tokenizer = None
    if cfg.task == "imgcls":
        read = lambda path, role: D.image_dataset(path, config, directory)  # noqa: E731
    else:
        D.check_seq_len(cfg.seq_len, getattr(config, "max_position_embeddings", None))
        tokenizer = D.load_tokenizer(directory, config.vocab_size, D.special_token_ids(config))
        if cfg.chat or cfg.task == "lm":
            read = lambda path, role: token_cache.lm_rows(cfg, tokenizer, path, role)  # noqa: E731
        else:
            read = lambda path, role: D.classification_dataset(path, tokenizer, cfg.seq_len, config,  # noqa: E731
                                                               cfg.text_field, cfg.label_field)
    train = read(cfg.data, "train")
    if cfg.eval_data:
        evaluation = read(cfg.eval_data, "eval")
    elif cfg.eval_fraction > 0:
        train, evaluation = train.split(cfg.eval_fraction)
    else:
        evaluation = None
    return train, evaluation, tokenizer


def _to(batch: dict, device) -> dict:
    return {k: v.to(device, non_blocking=True) for k, v in batch.items()}


@torch.no_grad()
def evaluate(model, data: D.TensorData, cfg: FinetuneConfig) -> dict:
    """Mean loss over up to `eval_batches` batches of the held-out set (perplexity for LM, accuracy otherwise)."""
    pc = model.pc
    dp, rank, micro = pc.size("dp"), pc.rank("dp"), cfg.micro_batch_size
    batches = min(cfg.eval_batches, len(data) // (micro * dp))
    if batches == 0:
        return {}
    model.eval()
    totals = torch.zeros(3, dtype=torch.float64, device=pc.device)  # loss sum, correct, samples
    for i in range(batches):
        start = (i * dp + rank) * micro
        batch = _to(data.take(range(start, start + micro)), pc.device)
        out = model(**batch, return_logits=cfg.task != "lm")
        totals[0] += out.loss.double()
        if cfg.task != "lm":
            totals[1] += (out.logits.argmax(-1) == batch["labels"]).sum()
            totals[2] += len(batch["labels"])
    if dp > 1:
        dist.all_reduce(totals, group=pc.group("dp"))
    model.train()
    loss = totals[0].item() / (batches * dp)
    if cfg.task == "lm":
        return {"eval_loss": loss, "eval_ppl": perplexity(loss)}
    return {"eval_loss": loss, "eval_acc": totals[1].item() / totals[2].item()}


class Interrupt:
    """Ctrl-C / SIGTERM ask for a clean stop: finish the step, save, exit. A second Ctrl-C stops at once."""

    def __init__(self):
        self.requested = False
        self.previous = {}

    def __enter__(self):
        for sig in (signal.SIGINT, signal.SIGTERM):
            self.previous[sig] = signal.signal(sig, self._handle)
        return self

    def _handle(self, signum, frame):
        # torchrun forwards the terminal's Ctrl-C to workers that already got it: only a later one means "now"
        if self.requested and time.monotonic() - self.requested_at > 2.0:
            raise KeyboardInterrupt
        if not self.requested:
            self.requested, self.requested_at = True, time.monotonic()

    def __exit__(self, *exc):
        for sig, handler in self.previous.items():
            signal.signal(sig, handler)

    def agreed(self, device) -> bool:
        """Whether any rank was interrupted (collective, so all ranks stop at the same step)."""
        flag = torch.tensor([float(self.requested)], device=device)
        if dist.is_available() and dist.is_initialized():
            dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        return bool(flag.item())


def check_writable(output: Path):
    """Before the model is loaded: the output directory can be created and written (every rank writes shards)."""
    probe = output / f".write-test-{os.getpid()}"
    try:
        output.mkdir(parents=True, exist_ok=True)
        probe.write_bytes(b"")
        probe.unlink()
    except OSError as e:
        raise ValueError(f"cannot write to the output directory {output}: {e.strerror or e}") from None


class NonFiniteError(ValueError):
    pass


def check_finite(step: int, loss: float, grad_norm: float, dtype: str):
    """Stop at the first non-finite loss or gradient norm (same values on every rank, so every rank stops)."""
    if not (math.isfinite(loss) and math.isfinite(grad_norm)):
        raise NonFiniteError(f"step {step}: loss {loss}, gradient norm {grad_norm} in {dtype}: not finite; stopped "
                             f"before the optimizer step, nothing saved or exported (lower --lr, check the data, or "
                             f"resume from the last checkpoint)")


def _is_rank0() -> bool:
    return not (dist.is_available() and dist.is_initialized()) or dist.get_rank() == 0


def run(cfg: FinetuneConfig) -> dict:
    plan = None
    if cfg.plan is None:  # bad degrees or batch sizes fail before anything is read
        mesh = check_mesh(cfg)
        cfg.num_microbatches(mesh.dp)
    config, directory = model_source(cfg.model)
    if cfg.num_labels is not None:
        config.num_labels = cfg.num_labels
    train, evaluation, tokenizer = build_datasets(cfg, config, directory)
    notes = D.tokenizer_warnings(tokenizer, config, train) if tokenizer is not None else []
    if cfg.plan is None:
        global_batch = cfg.global_batch_size or cfg.micro_batch_size * mesh.dp
    else:
        plan, mesh, global_batch = plan_run(cfg, config)
    D.BatchSampler(len(train), global_batch, 0, mesh.dp, cfg.seed)  # checks the data fills one global batch
    check_writable(Path(cfg.output))
    if cfg.tensorboard:
        tensorboard_writer_class()  # a missing tensorboard package fails before the model loads

    model, fresh = runtime.load_model(cfg, cfg.task, plan, labels=train.label_names)
    pc = model.pc
    sampler = D.BatchSampler(len(train), global_batch, pc.rank("dp"), mesh.dp, cfg.seed)
    total_steps = cfg.steps or sampler.total_steps(cfg.epochs)
    model_parallel_seed(cfg.seed, pc)
    plan_step = runtime.prepare_training(model, cfg)
    step_options = plan_step if plan else {"num_microbatches": cfg.num_microbatches(mesh.dp)}
    micro_batch_size = plan.micro_batch_size if plan else cfg.micro_batch_size
    model.train()
    optimizer = runtime.build_optimizer(model, cfg.lr, cfg.weight_decay)
    # with CPU offload the learning rate is the CPU AdamW's, inside the OffloadedAdamW
    scheduled = optimizer.optimizer if isinstance(optimizer, OffloadedAdamW) else optimizer
    scheduler = build_scheduler(scheduled, min(cfg.warmup_steps, total_steps - 1), total_steps, cfg.min_lr_ratio)
    scaler = DynamicLossScaler(enabled=cfg.dtype == "float16")  # fp16 gradients underflow without loss scaling

    output, rank0 = Path(cfg.output), _is_rank0()
    checkpoints = output / "checkpoints"
    mesh_json = {"tp": mesh.tp, "pp": mesh.pp, "dp": mesh.dp, "cp": mesh.cp, "ep": mesh.ep}
    start, resumed = 0, None
    data_position = {"global_batch": global_batch, "seed": cfg.seed, "samples": len(train)}
    latest = state.latest_checkpoint(checkpoints) if cfg.resume else None
    if latest is not None:
        resumed = state.load_training_state(latest, model, optimizer, scheduler, mesh_json, scaler, data_position)
        start = resumed["step"]
    if rank0:
        output.mkdir(parents=True, exist_ok=True)
        saved_config = {**cfg.to_json(), "planned": plan.to_dict()} if plan else cfg.to_json()
        (output / "config.json").write_text(json.dumps(saved_config, indent=1))
        if start:
            truncate_metrics(output / "metrics.jsonl", start)
        else:  # a fresh start in this directory: an earlier run's metrics and checkpoints would only mislead
            (output / "metrics.jsonl").unlink(missing_ok=True)
            shutil.rmtree(checkpoints, ignore_errors=True)
    if dist.is_available() and dist.is_initialized():
        dist.barrier()

    n_params = runtime.parameter_count(model)
    reporter = Reporter(output, total_steps, start, flops_per_token=6 * n_params,
                        peak=peak_flops(pc.device, cfg.dtype, cfg.peak_tflops), world_size=mesh.world_size,
                        enabled=rank0, progress=cfg.progress, tensorboard=cfg.tensorboard)
    reporter.print(f"{device_notice(pc.device)}; {n_params:,} parameters on mesh "
                   f"{' x '.join(f'{k}={v}' for k, v in mesh_json.items() if v > 1) or 'of one process'}; "
                   f"{len(train)} training samples, {total_steps} steps of {global_batch} "
                   f"({step_options['num_microbatches']} micro-batches of {micro_batch_size} per dp rank)")
    for note in notes:
        reporter.print(f"warning: {note}")
    if plan:
        reporter.print("plan auto: " + ", ".join(f"{k}={v}" for k, v in plan.to_dict().items()))
    if latest is not None:
        reporter.print(f"resumed from {latest} at step {start}")
        if not resumed["rng_restored"]:
            reporter.print(f"resharded from mesh {resumed['mesh']}: random states restart from --seed")
    if fresh:
        reporter.print(f"new task head, initialised fresh: {', '.join(fresh)}")

    saver = CheckpointSaver(asynchronous=cfg.async_save)

    def save(step, final):
        path = saver.save(checkpoints, step, model, optimizer, scheduler, mesh_json, final=final,
                          extra={"total_steps": total_steps, "data": data_position}, keep_last=cfg.keep_last,
                          scaler=scaler)
        if cfg.lora_r:  # the adapters of every checkpoint, as peft loads them (written once it is committed)
            saver.wait()
            runtime.export_adapter(model, path / "adapter")
        return path

    prompts = samples.held_out_prompts(evaluation, cfg.samples, cfg.seq_len // 2, until_answer=cfg.chat) \
        if cfg.task == "lm" else None
    if prompts is not None and samples.why_no_samples(model):
        reporter.print(f"no samples: {samples.why_no_samples(model)}")
        prompts = None

    def evaluation_at(step):
        results = evaluate(model, evaluation, cfg)
        reporter.evaluation(step, results)
        if prompts is not None:
            samples.write_samples(model, prompts, tokenizer, step, output, cfg.sample_tokens, reporter, rank0)
        return results

    step, saved_at, stopped, interrupted = start, None, False, False
    if start == 0 and evaluation is not None and cfg.eval_interval:
        evaluation_at(0)  # the baseline the fine-tuning improves on
    try:
        with Interrupt() as interrupt:
            while step < total_steps:
                tick = time.perf_counter()
                indices = sampler.global_indices(step)
                batch = _to(train.take(indices), pc.device)
                optimizer.zero_grad(set_to_none=True)
                loss_scale = scaler.scale
                loss = runtime.forward_backward(model, batch, grad_scale=loss_scale, **step_options)
                overflow = scaler.unscale_(model)  # every rank agrees; clipping then sees the true gradients
                grad_norm = None if overflow else runtime.clip_grad_norm(model, cfg.grad_clip)
                if not scaler.enabled:  # fp16 skips such steps; in fp32/bf16 they would poison the weights
                    check_finite(step + 1, float(loss.detach()), grad_norm, cfg.dtype)
                lr = optimizer.param_groups[0]["lr"]
                if not overflow:  # a skipped step leaves the learning-rate schedule where it is too
                    optimizer.step()
                    scheduler.step()
                scaler.update(overflow)
                step += 1
                tokens = int(train.tokens[indices].sum())
                if step % cfg.log_interval == 0 or step == total_steps:
                    amp = {"loss_scale": loss_scale, "skipped": overflow,
                           "skipped_steps": scaler.skipped_steps} if scaler.enabled else {}
                    reporter.step(step, float(loss.detach()), lr, tokens, time.perf_counter() - tick, grad_norm,
                                  global_batch, **amp)
                if evaluation is not None and cfg.eval_interval and step % cfg.eval_interval == 0 \
                        and step < total_steps:
                    evaluation_at(step)
                interrupted = interrupt.agreed(pc.device)
                stopped = interrupted or step == cfg.stop_after
                if stopped or (cfg.save_interval and step % cfg.save_interval == 0) or step == total_steps:
                    save(step, final=stopped or step == total_steps)
                    saved_at = step
                if stopped:
                    break
        saver.wait()
    finally:
        saver.wait(raise_error=False)  # a failed run still lets the save in flight finish (or fail) first
        reporter.close()

    summary = {"step": step, "total_steps": total_steps, "stopped": stopped,
               "checkpoint": str(checkpoints / f"{state.PREFIX}{step:08d}") if saved_at == step else None}
    if stopped:
        reporter.print(f"{'interrupted' if interrupted else 'stopped'} at step {step}/{total_steps}, saved to "
                       f"{summary['checkpoint']}; rerun the same command to resume")
    else:
        if evaluation is not None:
            summary.update(evaluation_at(step))
        if cfg.lora_r:
            summary["adapter"] = str(runtime.export_adapter(model, output / "adapter"))
            reporter.print(f"exported the LoRA adapters (PEFT format) to {summary['adapter']}")
        if cfg.export_hf and (cfg.merge or not cfg.lora_r):
            summary["export"] = str(export(model, cfg, output, evaluation or train, tokenizer))
            reporter.print(f"exported a transformers model{' (adapters merged)' if cfg.lora_r else ''} to "
                           f"{summary['export']}")
    if rank0:
        if cfg.plot and plot_loss(output / "metrics.jsonl", output / "loss.png"):
            summary["plot"] = str(output / "loss.png")
        (output / "summary.json").write_text(json.dumps(summary, indent=1))
    reporter.finish()
    return summary


def export(model, cfg: FinetuneConfig, output: Path, data: D.TensorData, tokenizer) -> Path:
    """HF export, plus the colozoo model's logits on one batch (probe.pt) so anyone can check the export."""
    path = output / "hf"
    if _is_rank0() and path.exists():  # a resumed run exports again
        shutil.rmtree(path)
    if dist.is_available() and dist.is_initialized():
        dist.barrier()
    runtime.export_hf(model, path, merge_lora=bool(cfg.lora_r))
    model.eval()
    with torch.no_grad():
        batch = data.take(range(min(cfg.micro_batch_size, len(data))))
        logits = model(**_to(runtime.model_inputs(batch), model.pc.device), return_logits=True).logits
    model.train()
    if _is_rank0():
        if tokenizer is not None:
            tokenizer.save_pretrained(str(path))
        torch.save({"inputs": runtime.model_inputs(batch), "logits": logits.float().cpu()}, output / "probe.pt")
    if dist.is_available() and dist.is_initialized():
        dist.barrier()
    return path
