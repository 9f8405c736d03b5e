"""Fine-tuning options: one dataclass, filled from the command line (`colozoo finetune` and scripts/) or from code."""
from __future__ import annotations

import argparse
from dataclasses import dataclass, fields

from colozoo.finetune.grpo_options import GRPO_HELP, GrpoOptions
from colozoo.finetune.preference_options import PREFERENCE_CHOICES, PREFERENCE_HELP, PreferenceOptions

TASKS = ("lm", "seqcls", "imgcls")
DTYPES = ("float32", "bfloat16", "float16")
DATA_PARALLEL = ("fsdp", "ddp")
OFFLOAD = ("none", "optimizer", "params")
PLANS = ("auto",)
TRUNCATION = ("turns", "tokens")
PLANNED = ("tp", "pp", "dp", "cp", "ep", "sequence_parallel", "data_parallel", "activation_checkpointing", "offload")


def check_at_least(name: str, value, minimum: int = 1):
    """One wording for every command: `--flag must be >= minimum, got value` (None: not given, nothing to check)."""
    if value is not None and value < minimum:
        raise ValueError(f"--{name.replace('_', '-')} must be >= {minimum}, got {value}")


@dataclass
class FinetuneConfig(PreferenceOptions, GrpoOptions):  # --method dpo's and grpo's options are declared with them
    model: str                          # registry name, HF directory or colozoo checkpoint
    data: str                           # jsonl / txt (language), npz / folder of images (ViT)
    output: str = "runs/finetune"
    task: str = "lm"                    # lm (causal LM), seqcls (BERT), imgcls (ViT)
    plan: str | None = None             # "auto": the planner picks mesh, micro-batching, FSDP/DDP, checkpointing
    eval_data: str | None = None        # default: the last `eval_fraction` of `data`
    eval_fraction: float = 0.1
    tp: int = 1
    pp: int = 1
    dp: int | None = None               # None: what the world size leaves after tp*pp*cp
    cp: int = 1
    ep: int = 1
    sequence_parallel: bool = False
    data_parallel: str | None = None    # fsdp (sharded, the default) or ddp (replicated) over the dp ranks
    micro_batch_size: int = 2
    global_batch_size: int | None = None  # default: micro_batch_size * dp (one micro-batch per step)
    lr: float = 1e-4
    min_lr_ratio: float = 0.1
    warmup_steps: int = 10
    weight_decay: float = 0.0
    grad_clip: float = 1.0
    steps: int | None = None            # optimizer steps; default: `epochs` passes over the data
    epochs: float = 1.0
    seq_len: int = 128
    pack: bool = True                   # concatenate documents into full sequences (LM)
    chat: bool = False                  # messages / prompt-completion records, loss on the answers only
    truncate: str = "turns"             # --chat, past --seq-len: keep whole turns ("turns") or cut ("tokens")
    lora_r: int | None = None           # LoRA rank; None: full fine-tuning
    lora_alpha: float | None = None     # default: lora_r
    lora_dropout: float = 0.0
    lora_targets: str = "all-linear"    # comma-separated HF module names, or all-linear
    lora_rslora: bool = False
    merge: bool = False                 # LoRA: also export the adapters merged into the weights (OUTPUT/hf)
    num_labels: int | None = None      # classification: classes of a new head (default: the model config's)
    text_field: str = "text"
    label_field: str = "label"
    dtype: str = "float32"
    activation_checkpointing: bool = False
    compile: bool = False               # torch.compile each transformer layer
    offload: str = "none"               # CPU memory for optimizer states ("optimizer"), or FSDP shards too ("params")
    seed: int = 1234
    log_interval: int = 1
    eval_interval: int = 200            # 0: evaluate only at the end
    eval_batches: int = 8
    eval_tasks: str | None = None       # lm-eval tasks scored at every evaluation, comma-separated
    eval_tasks_limit: float | None = None  # requests per task at most (below 1: that fraction)
    eval_include_path: str | None = None   # a folder of lm-eval task YAML files for --eval-tasks
    samples: int = 3                    # causal LM: greedy continuations of this many held-out prompts per eval
    sample_tokens: int = 24             # new tokens per sample
    save_interval: int = 200            # 0: only the final checkpoint
    keep_last: int = 2
    async_save: bool = False            # write interval checkpoints in the background while training goes on
    resume: bool = True                 # pick up the newest complete checkpoint in output/checkpoints
    collective_timeout: float | None = None  # seconds until a stuck rank is named (COLOZOO_COLLECTIVE_TIMEOUT, 600)
    export_hf: bool = True
    peak_tflops: float | None = None    # per device, for the MFU estimate; default from a table of known devices
    stop_after: int | None = None       # stop (after saving) at this step, as if interrupted: for tests and demos
    progress: bool = True
    plot: bool = True
    tensorboard: str | None = None      # also log the metrics as TensorBoard scalars to this directory

    def __post_init__(self):
        if self.task not in TASKS:
            raise ValueError(f"task must be one of {TASKS}, got {self.task!r}")
        if self.data_parallel not in (None, *DATA_PARALLEL):
            raise ValueError(f"data_parallel must be one of {DATA_PARALLEL}, got {self.data_parallel!r}")
        if self.plan not in (None, *PLANS):
            raise ValueError(f"plan must be one of {PLANS}, got {self.plan!r}")
        if self.plan is not None:
            defaults = {f.name: f.default for f in fields(self)}
            chosen = [name for name in PLANNED if getattr(self, name) != defaults[name]]
            if chosen:
                flags = ", ".join("--" + name.replace("_", "-") for name in chosen)
                raise ValueError(f"--plan {self.plan} chooses the mesh, data parallelism and checkpointing itself; "
                                 f"drop {flags} (or drop --plan)")
        if self.offload not in OFFLOAD:
            raise ValueError(f"offload must be one of {OFFLOAD}, got {self.offload!r}")
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {DTYPES}, got {self.dtype!r}")
        for name in ("micro_batch_size", "seq_len", "log_interval", "eval_batches", "keep_last", "tp", "pp", "dp", "cp",
                     "ep"):
            check_at_least(name, getattr(self, name))
        if self.steps is not None and self.steps < 1:
            raise ValueError(f"--steps must be >= 1, got {self.steps}")
        self.check_numbers()
        if self.steps is None and self.epochs <= 0:
            raise ValueError(f"--epochs must be > 0, got {self.epochs}")
        if self.lora_r is not None and self.lora_r < 1:
            raise ValueError(f"--lora-r must be >= 1, got {self.lora_r}")
        if self.lora_r is None:
            lora = [f for f in ("lora_alpha", "lora_rslora", "merge") if getattr(self, f)]
            if lora or self.lora_dropout:
                flag = "--" + (lora or ["lora_dropout"])[0].replace("_", "-")
                raise ValueError(f"{flag} needs LoRA: pass --lora-r (the adapters' rank)")
        if self.truncate not in TRUNCATION:
            raise ValueError(f"truncate must be one of {TRUNCATION}, got {self.truncate!r}")
        if self.truncate != "turns" and not self.chat:
            raise ValueError(f"--truncate {self.truncate} goes with --chat (plain text is packed, never truncated)")
        if self.chat and self.task != "lm":
            raise ValueError(f"--chat trains causal LMs (--task lm), not --task {self.task}")
        if self.collective_timeout is not None and not self.collective_timeout > 0:
            raise ValueError(f"--collective-timeout must be > 0 seconds, got {self.collective_timeout}")
        if not 0.0 <= self.eval_fraction < 1.0:
            raise ValueError(f"--eval-fraction must be in [0, 1), got {self.eval_fraction}")
        self.check_preference_options()
        self.check_grpo_options()
        self._check_eval_tasks()

    def _check_eval_tasks(self):
        if self.eval_tasks is None:
            for flag in ("eval_tasks_limit", "eval_include_path"):
                if getattr(self, flag) is not None:
                    raise ValueError(f"--{flag.replace('_', '-')} goes with --eval-tasks")
            return
        if self.task != "lm":
            raise ValueError(f"--eval-tasks scores causal LMs (--task lm), not --task {self.task}")
        if self.cp > 1:
            raise ValueError(f"--eval-tasks needs cp=1 (the harness's requests are scored whole), got --cp {self.cp}")
        limit = self.eval_tasks_limit
        if limit is not None and (limit <= 0 or limit >= 1 and limit != int(limit)):
            raise ValueError(f"--eval-tasks-limit must be a whole number of requests or a fraction in (0, 1), got "
                             f"{limit:g}")

    def eval_task_names(self) -> list[str]:
        return [name.strip() for name in (self.eval_tasks or "").split(",") if name.strip()]

    def check_numbers(self):
        """The learning rate, schedule and other numbers within their range (NaN is never within it)."""
        for name in ("lr", "peak_tflops", "lora_alpha"):
            value = getattr(self, name)
            if value is not None and not value > 0:
                raise ValueError(f"--{name.replace('_', '-')} must be > 0, got {value}")
        if not self.grad_clip > 0:
            raise ValueError(f"--grad-clip must be > 0 (the gradient norm is clipped to it; inf: no clipping), "
                             f"got {self.grad_clip}")
        ranges = {"min_lr_ratio": (0.0 <= self.min_lr_ratio <= 1.0, "in [0, 1]"),
                  "lora_dropout": (0.0 <= self.lora_dropout < 1.0, "in [0, 1)"),
                  "weight_decay": (self.weight_decay >= 0.0, ">= 0")}
        for name, (within, bound) in ranges.items():
            if not within:
                raise ValueError(f"--{name.replace('_', '-')} must be {bound}, got {getattr(self, name)}")
        for name in ("warmup_steps", "eval_interval", "save_interval", "samples"):
            check_at_least(name, getattr(self, name), 0)
        for name in ("sample_tokens", "num_labels", "global_batch_size", "stop_after"):
            check_at_least(name, getattr(self, name))

    def check_paths(self):
        """What the files say without a tokenizer or a model (no torch imported): --data and --eval-data exist and are
        not empty, --model names a directory that exists or a registered model."""
        from colozoo.finetune.records import check_data_path
        from colozoo.registry import check_model_name

        check_model_name(self.model)
        for path in (self.data, self.eval_data):
            if path is not None:
                check_data_path(path, records=self.task != "imgcls")

    def num_microbatches(self, dp: int) -> int:
        """Micro-batches per optimizer step on each data-parallel rank; the global batch must split evenly."""
        per_step = self.micro_batch_size * dp
        if self.global_batch_size is None:
            return 1
        if self.global_batch_size < 1 or self.global_batch_size % per_step:
            raise ValueError(f"global batch {self.global_batch_size} is not divisible by micro batch x dp = "
                             f"{self.micro_batch_size} x {dp} = {per_step}")
        return self.global_batch_size // per_step

    def lora_target_modules(self) -> tuple[str, ...] | str:
        """--lora-targets as apply_lora takes it: "all-linear", or a tuple of module names."""
        if self.lora_targets.strip() == "all-linear":
            return "all-linear"
        return tuple(t.strip() for t in self.lora_targets.split(",") if t.strip())

    def lora_settings(self):
        """The --lora-* options as one colozoo.runtime.lora.LoraSettings (alpha defaults to r; a classifier's head
        trains whole, as apply_lora's default), or None without --lora-r."""
        if self.lora_r is None:
            return None
        from colozoo.runtime.lora import LoraSettings

        return LoraSettings(r=self.lora_r, alpha=self.lora_alpha or self.lora_r, dropout=self.lora_dropout,
                            targets=self.lora_target_modules(), use_rslora=self.lora_rslora)

    def to_json(self) -> dict:
        """The options as JSON values (reward functions given as callables: their module:function)."""
        out = {f.name: getattr(self, f.name) for f in fields(self)}
        if self.reward_funcs is not None and not isinstance(self.reward_funcs, str):
            from colozoo.finetune.rewards import reward_name

            out["reward_funcs"] = ",".join(reward_name(f) for f in self.reward_list())
        return out


_HELP = {
    "model": "registry name, HF model directory or colozoo checkpoint directory",
    "data": "training data: .jsonl, .txt, .parquet, .arrow or a datasets save_to_disk directory for language tasks "
            "(Parquet / Arrow read lazily, one record batch at a time); .npz or a folder of class folders for images",
    "output": "run directory: checkpoints, metrics.jsonl, loss.png and the HF export",
    "eval_data": "held-out data (default: the last --eval-fraction of --data)",
    "plan": "'auto': let the planner choose tp/pp/dp/ep, micro-batching, schedule, FSDP or DDP and activation "
            "checkpointing for --global-batch-size x --seq-len (excludes --tp/--pp/--dp/--cp/--ep etc.)",
    "dp": "data-parallel degree (default: world size / (tp*pp*cp))",
    "data_parallel": "fsdp (sharded, the default) or ddp (replicated) over the dp ranks",
    "global_batch_size": "rows per optimizer step over all dp ranks, counted as --micro-batch-size counts them "
                         "(default: micro batch x dp; with --plan auto: micro batch x world size)",
    "steps": "optimizer steps (default: --epochs passes over the data)",
    "pack": "text: concatenate documents into full --seq-len sequences joined by EOS; --chat: put several whole samples "
            "in each sequence, position_ids restarting at 0 at each (the model attends within each sample); "
            "--method dpo: each pair's chosen and rejected in one row (where the model's positions hold both). "
            "--no-pack puts one sample, or one piece of at most --seq-len tokens of a document, in each row, and "
            "pads each batch to its longest row rounded up to a multiple of 8 (and of 2 x cp, and of tp under "
            "--sequence-parallel), not to --seq-len: fewer tokens computed, the same loss",
    "chat": "supervised fine-tuning: records with 'messages' (a list of {role, content}, rendered with the tokenizer's "
            "chat template; loss on the assistant turns only), 'prompt' + 'completion' (loss on the completion and "
            "EOS) or plain text (loss on all of it); see --truncate for samples longer than --seq-len",
    "truncate": "--chat: a sample longer than --seq-len keeps the whole turns that fit ('turns': every answer trained "
                "on ends with its end-of-turn token; one whose first answer does not fit is dropped, a plain text is "
                "cut) or is cut at --seq-len ('tokens'); the run counts both at start",
    "lora_r": "train LoRA adapters of this rank instead of all weights (the optimizer holds the adapters only); "
              "the adapters are exported in PEFT format to OUTPUT/adapter and with every checkpoint "
              "(OUTPUT/checkpoints/step-N/adapter)",
    "lora_alpha": "LoRA scaling numerator (scale alpha / r; default: r)",
    "lora_dropout": "dropout on the adapters' input",
    "lora_targets": "comma-separated HF module names to adapt (e.g. q_proj,v_proj), or all-linear",
    "lora_rslora": "rank-stabilised LoRA: scale alpha / sqrt(r)",
    "merge": "LoRA: also export the adapters merged into the weights as a transformers model (OUTPUT/hf)",
    "tensorboard": "also write the metrics.jsonl scalars as TensorBoard events to this directory (needs tensorboard)",
    "dtype": "compute dtype (bfloat16/float16 train in mixed precision over fp32 weights; float16 with "
             "dynamic loss scaling)",
    "activation_checkpointing": "recompute layer activations in backward to save memory",
    "compile": "torch.compile each transformer layer (one graph serves every layer; the first steps compile)",
    "offload": "keep fp32 master weights and AdamW states in CPU memory ('optimizer'), or the FSDP parameter and "
               "gradient shards too ('params', needs FSDP over dp > 1): for models whose training state does not "
               "fit the GPUs",
    "resume": "resume from the newest complete checkpoint in OUTPUT/checkpoints (--no-resume starts over, "
              "replacing OUTPUT's checkpoints and metrics)",
    "collective_timeout": "seconds a rank may wait in a collective for a peer that does not advance (stopped, hung "
                          "or behind): the job then ends naming that rank, its last step and collective (default: "
                          "COLOZOO_COLLECTIVE_TIMEOUT, else 600); must exceed the longest work one rank does while "
                          "the others wait (tokenizing the data, a save)",
    "async_save": "write interval checkpoints in the background (the state is copied to CPU memory at the step, "
                  "then training goes on); still committed atomically, the last one written before exit",
    "export_hf": "write a transformers-loadable directory to OUTPUT/hf at the end (with LoRA: only with --merge)",
    "peak_tflops": "peak TFLOP/s of one device, for the MFU estimate",
    "stop_after": "save and stop at this step, as if interrupted (resume later with the same command)",
    "samples": "causal LM: at every evaluation print (and append to OUTPUT/samples.jsonl) greedy continuations of "
               "this many held-out prompts (0: none)",
    "sample_tokens": "new tokens per sample",
    "task": "lm (causal LM), seqcls (sequence classification), imgcls (image classification)",
    "eval_fraction": "fraction of --data held out for evaluation when there is no --eval-data",
    "tp": "tensor-parallel degree", "pp": "pipeline-parallel degree", "cp": "context-parallel degree",
    "ep": "expert-parallel degree (folded over dp x cp)",
    "sequence_parallel": "shard activations outside attention and MLP over the tp ranks",
    "micro_batch_size": "rows per micro-batch on each dp rank: a packed row (--pack, on unless --no-pack) is "
                        "--seq-len tokens of several documents or samples; with --no-pack a row is one of them",
    "lr": "peak learning rate (AdamW)",
    "min_lr_ratio": "the cosine schedule ends at lr x this", "warmup_steps": "linear warmup steps",
    "weight_decay": "AdamW weight decay", "grad_clip": "clip the global gradient norm to this",
    "epochs": "passes over the data when --steps is not given",
    "seq_len": "tokens per row: a packed row's length, the most an unpacked row holds",
    "num_labels": "classification: classes of a new head (default: the model config's)",
    "text_field": "JSON field holding the text", "label_field": "JSON field holding the label",
    "seed": "seed of data order, dropout and new heads", "log_interval": "log every this many steps",
    "eval_interval": "evaluate every this many steps (0: only at the end)",
    "eval_batches": "an evaluation reads this many --micro-batch-size batches of held-out samples (over all dp ranks; "
                    "all of them when there are fewer) and reports the mean loss over their tokens (--method grpo: "
                    "batches of completions, --num-generations of each held-out prompt, and their rewards)",
    "eval_tasks": "lm-evaluation-harness tasks (comma-separated; colozoo eval's) scored at every evaluation and at the "
                  "end, written beside the eval loss in metrics.jsonl as TASK/METRIC (needs lm-eval: colozoo[eval])",
    "eval_tasks_limit": "--eval-tasks: requests per task at most (below 1: that fraction of them)",
    "eval_include_path": "--eval-tasks: a folder of lm-eval task YAML files of yours",
    "keep_last": "checkpoints kept in OUTPUT/checkpoints",
    "save_interval": "save a resumable checkpoint every this many steps (0: only at the end)",
    "progress": "progress bar", "plot": "write OUTPUT/loss.png at the end",
    **PREFERENCE_HELP,
    **GRPO_HELP,
}


def add_arguments(parser: argparse.ArgumentParser, task: str | None = None):
    """Add one option per FinetuneConfig field; `task` fixes the task (scripts/) instead of offering --task."""
    methods = [{f.name for f in fields(GrpoOptions)}, {f.name for f in fields(PreferenceOptions)}]
    for f in sorted(fields(FinetuneConfig), key=lambda f: [f.name in m for m in methods]):  # the methods' options last
        if f.name == "task" and task is not None:
            parser.set_defaults(task=task)
            continue
        flag = "--" + f.name.replace("_", "-")
        kwargs = dict(dest=f.name, help=_HELP.get(f.name))
        if f.name == "data":
            parser.add_argument(flag, "--dataset", required=True, **kwargs)
        elif f.name == "model":
            parser.add_argument(flag, required=True, **kwargs)
        elif f.type == "bool":
            parser.add_argument(flag, action=argparse.BooleanOptionalAction, default=f.default, **kwargs)
        else:
            kind = {"int": int, "float": float, "int | None": int, "float | None": float}.get(f.type, str)
            choices = {"task": TASKS, "dtype": DTYPES, "data_parallel": DATA_PARALLEL, "plan": PLANS,
                       "offload": OFFLOAD, "truncate": TRUNCATION, **PREFERENCE_CHOICES}.get(f.name)
            parser.add_argument(flag, type=kind, default=f.default, choices=choices, **kwargs)
    return parser


def config_from_args(args: argparse.Namespace) -> FinetuneConfig:
    return FinetuneConfig(**{f.name: getattr(args, f.name) for f in fields(FinetuneConfig)})
