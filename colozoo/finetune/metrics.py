"""What the user sees: a progress bar on rank 0, metrics appended to a JSONL file, and a loss-curve PNG."""
from __future__ import annotations

import json
import math
import time
from pathlib import Path

import torch
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

# Dense bf16 peak TFLOP/s per device (fp32 runs count half: TF32 tensor cores); the first match wins.
PEAK_TFLOPS = {"H200": 989.0, "H100": 989.0, "A100": 312.0, "L40": 181.0, "A10": 125.0, "L4": 121.0,
               "V100": 125.0, "T4": 65.0}
SHOWN = ("rewards/accuracies", "rewards/margins", "reward")  # a method's metrics on the progress line
CPU_TFLOPS_PER_THREAD = 0.05  # a nominal fp32 figure: CPU MFU is a rough guide only


def peak_flops(device: torch.device, dtype: str, override_tflops: float | None = None) -> float:
    if override_tflops:
        return override_tflops * 1e12
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
        tflops = next((v for k, v in PEAK_TFLOPS.items() if k in name), 100.0)
        return tflops * 1e12 * (0.5 if dtype == "float32" else 1.0)
    return CPU_TFLOPS_PER_THREAD * 1e12 * torch.get_num_threads()


def training_flops_per_token(parameters: int, trainable: int) -> int:
    """The matmul FLOPs a training step spends per token: the forward's 2 per parameter, the backward's 2 for the
    activation gradients through every layer, and 2 more for weight gradients only where weights train (6N in full
    fine-tuning, about 4N under LoRA, whose frozen base gets no weight gradients). Attention's score matmuls are left
    out, as in the usual 6N."""
    return 4 * parameters + 2 * trainable


def device_notice(device: torch.device) -> str:
    if device.type == "cpu":
        return "running on CPU (no GPU found): fine for tiny models and demos, slow for anything else"
    return f"running on {torch.cuda.get_device_name(device)}"


def read_metrics(path) -> list[dict]:
    path = Path(path)
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def truncate_metrics(path, step: int):
    """Drop lines logged after `step` (a resumed run logs them again); keep the file otherwise."""
    path = Path(path)
    kept = [r for r in read_metrics(path) if r.get("step", 0) <= step]
    path.write_text("".join(json.dumps(r) + "\n" for r in kept))


class Reporter:
    """Rank 0's view of the run. On other ranks every method is a no-op."""

    def __init__(self, output, total_steps: int, start_step: int, flops_per_token: float, peak: float,
                 world_size: int, enabled: bool, progress: bool = True, tensorboard: str | None = None):
        self.enabled = enabled
        # a resumed run logs the steps after its checkpoint again: TensorBoard drops what it had from there on
        self.tensorboard = tensorboard_writer_class()(log_dir=str(tensorboard), purge_step=start_step or None) \
            if enabled and tensorboard else None
        self.metrics_path = Path(output) / "metrics.jsonl"
        self.flops_per_token, self.peak, self.world_size = flops_per_token, peak, world_size
        self.total_steps, self.start_step = total_steps, start_step
        self.console = Console(stderr=True)
        self.progress = None
        self.plain_lines = enabled and progress and not self.console.is_terminal  # logs, pipes: no live bar
        self.started = time.time()
        if enabled and progress and not self.plain_lines:
            self.progress = Progress(
                TextColumn("[bold]fine-tune"), BarColumn(), MofNCompleteColumn(),
                TextColumn("loss {task.fields[loss]}  {task.fields[speed]}  MFU {task.fields[mfu]}"),
                TextColumn("ETA"), TimeRemainingColumn(), console=self.console, transient=False)
            self.task = self.progress.add_task("train", total=total_steps, completed=start_step,
                                               loss="-", speed="-", mfu="-")
            self.progress.start()

    def print(self, *args, **kwargs):
        if self.enabled:  # soft wrap: a log line stays one line, however narrow the console
            self.console.print(*args, soft_wrap=True, **kwargs)

    def log(self, record: dict):
        if not self.enabled:
            return
        with open(self.metrics_path, "a") as f:
            f.write(json.dumps(record) + "\n")
        if self.tensorboard is not None:
            for key, value in record.items():
                if key not in ("step", "time") and isinstance(value, (int, float)) and not isinstance(value, bool):
                    self.tensorboard.add_scalar(key, value, record["step"])
            self.tensorboard.flush()

    def step(self, step: int, loss: float | None, lr: float, tokens: int, seconds: float, grad_norm: float | None,
             samples: int, trained_tokens: int = 0, metrics: dict | None = None, **extra):
        """`tokens`: the positions the step computed (padding included), `trained_tokens`: those with a label (no
        loss when there is none); `metrics`: the method's further metrics (--method dpo: TRL's), logged and shown on
        the progress line; `extra`: further fields of the step's record (masked_batches: the batches without a
        labelled token so far; fp16: loss_scale, skipped, skipped_steps)."""
        metrics = metrics or {}
        per_s = (lambda n: n / seconds) if seconds > 0 else (lambda n: 0.0)
        mfu = self.flops_per_token * per_s(tokens) / (self.peak * self.world_size) if tokens else None
        self.log({"step": step, "loss": loss, "lr": lr, "grad_norm": grad_norm, "tokens": tokens,
                  "trained_tokens": trained_tokens, "samples": samples, "tokens_per_s": per_s(tokens),
                  "trained_tokens_per_s": per_s(trained_tokens), "mfu": mfu, **metrics, **extra, "time": time.time()})
        speed = f"{per_s(tokens):,.0f} tok/s ({per_s(trained_tokens):,.0f} trained)" if tokens else \
            f"{per_s(samples):,.1f} samples/s"
        mfu_text = f"{100 * mfu:.1f}%" if mfu is not None else "-"
        shown = "".join(f"  {k} {metrics[k]:.4f}" for k in SHOWN if k in metrics)
        loss_text = f"{loss:.4f}{shown}" if loss is not None else "- (no labelled token)"
        if self.progress is not None:
            self.progress.update(self.task, completed=step, loss=loss_text, speed=speed, mfu=mfu_text)
        elif self.plain_lines:
            skipped = f"  skipped: fp16 gradients overflowed at loss scale {extra['loss_scale']:g}" \
                if extra.get("skipped") else ""
            self.console.print(f"step {step}/{self.total_steps}  loss {loss_text}  lr {lr:.2e}  {speed}  MFU {mfu_text}"
                               f"  ETA {self.eta(step)}{skipped}", highlight=False, soft_wrap=True)

    def eta(self, step: int) -> str:
        """Time left at this run's mean pace so far, as h:mm:ss."""
        done = step - self.start_step
        if done <= 0:
            return "-"
        seconds = round((time.time() - self.started) / done * (self.total_steps - step))
        return f"{seconds // 3600}:{seconds // 60 % 60:02d}:{seconds % 60:02d}"

    def evaluation(self, step: int, results: dict):
        if not results:  # no held-out token has a label
            return
        self.log({"step": step, **results})
        if self.enabled:
            shown = "  ".join(f"{k} {v:.4f}" for k, v in results.items())
            self.print(f"step {step}: {shown}")

    def close(self):
        """The progress bar ends; metrics may still be logged (the final evaluation)."""
        if self.progress is not None:
            self.progress.stop()
            self.progress = None

    def finish(self):
        self.close()
        if self.tensorboard is not None:
            self.tensorboard.close()
            self.tensorboard = None


def tensorboard_writer_class():
    """torch.utils.tensorboard.SummaryWriter, or one clear error when the tensorboard package is missing."""
    try:
        from torch.utils.tensorboard import SummaryWriter
    except ImportError:
        raise ValueError("--tensorboard needs the tensorboard package: pip install tensorboard") from None
    return SummaryWriter


def plot_loss(metrics_path, png_path) -> Path | None:
    """The training (and eval) loss against the step, as a PNG; None when there is nothing to plot."""
    records = read_metrics(metrics_path)
    train = [(r["step"], r["loss"]) for r in records if r.get("loss") is not None]
    evals = [(r["step"], r["eval_loss"]) for r in records if "eval_loss" in r]
    if not train:
        return None

    def draw(ax):
        ax.plot(*zip(*train), label="train loss")
        if evals:
            ax.plot(*zip(*evals), "o-", label="eval loss")
    return _figure(png_path, "loss", draw)


def plot_reward(metrics_path, png_path) -> Path | None:
    """--method grpo: the mean reward of each step's completions (with its standard deviation as a band, and the
    held-out reward where evaluated) against the step, as a PNG; None when there is nothing to plot."""
    records = read_metrics(metrics_path)
    train = [(r["step"], r["reward"], r.get("reward_std") or 0.0) for r in records if "reward" in r]
    evals = [(r["step"], r["eval_reward"]) for r in records if "eval_reward" in r]
    if not train:
        return None

    def draw(ax):
        steps, mean, std = (list(column) for column in zip(*train))
        ax.fill_between(steps, [m - s for m, s in zip(mean, std)], [m + s for m, s in zip(mean, std)], alpha=0.2)
        ax.plot(steps, mean, label="reward (mean of the step's completions)")
        if evals:
            ax.plot(*zip(*evals), "o-", label="held-out reward")
    return _figure(png_path, "reward", draw)


def _figure(png_path, ylabel: str, draw) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    draw(ax)
    ax.set_xlabel("step")
    ax.set_ylabel(ylabel)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(png_path, dpi=100)
    plt.close(fig)
    return Path(png_path)


def perplexity(loss: float) -> float:
    return math.exp(min(loss, 50.0))
