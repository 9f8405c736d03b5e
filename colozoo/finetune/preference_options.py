"""The options of preference tuning (`--method dpo`), their checks and help: no torch here, so that `colozoo
finetune` refuses a bad option in its first second (colozoo.finetune.preference holds the losses)."""
from __future__ import annotations

from dataclasses import dataclass, fields

from colozoo.core.sequence import SPLIT_REASON, sequence_multiple

METHODS = ("sft", "dpo", "grpo")
LOSS_TYPES = ("sigmoid", "hinge", "ipo", "robust", "apo_zero", "simpo")
SMOOTHED = ("robust", "simpo")  # the losses --label-smoothing applies to


@dataclass(kw_only=True)
class PreferenceOptions:
    """The options of `--method dpo` (FinetuneConfig inherits them)."""
    method: str = "sft"                 # sft (supervised), dpo (preference tuning and its relatives) or grpo
    beta: float | None = None           # dpo: 0.1; grpo: 0 (TRL's defaults)
    loss_type: str | None = None        # dpo: sigmoid, comma-separated for several at once (MPO); grpo: dapo
    loss_weights: str | None = None     # comma-separated, one per loss type (default: 1 each)
    label_smoothing: float = 0.0
    simpo_gamma: float = 0.5
    reference_free: bool = False
    precompute_ref_logps: bool = False
    max_length: int | None = None       # tokens of prompt + completion (default: --seq-len)
    max_prompt_length: int | None = None

    def check_preference_options(self):
        if self.method not in METHODS:
            raise ValueError(f"method must be one of {METHODS}, got {self.method!r}")
        if isinstance(self.loss_type, (list, tuple)):  # TRL's list form, from Python
            self.loss_type = ",".join(self.loss_type)
        if isinstance(self.loss_weights, (list, tuple)):
            self.loss_weights = ",".join(str(w) for w in self.loss_weights)
        if self.method != "dpo":
            shared = ("method", "beta", "loss_type", "max_prompt_length") if self.method == "grpo" else ("method",)
            changed = [f.name for f in fields(PreferenceOptions) if f.name not in shared and
                       getattr(self, f.name) != f.default]
            if changed:
                raise ValueError(f"--{changed[0].replace('_', '-')} goes with --method dpo")
            return
        self._check_dpo()

    def _check_dpo(self):
        if self.task != "lm":
            raise ValueError(f"--method dpo trains causal LMs (--task lm), not --task {self.task}")
        for flag, value in (("chat", self.chat), ("truncate", self.truncate != "turns")):
            if value:
                raise ValueError(f"--{flag} is for --method sft: preference records are read as they are "
                                 f"(strings, or conversations rendered with the chat template)")
        if self.plan is not None:
            raise ValueError("--plan auto plans supervised steps; --method dpo (two rows per pair, and the reference's "
                             "forward) is not planned yet: give the mesh (--tp, --pp, --dp, ...)")
        split = sequence_multiple(self.cp, self.tp if self.sequence_parallel else 1)
        if self.sequence_length() % split:
            raise ValueError(f"--max-length {self.sequence_length()} must be a multiple of {split}: {SPLIT_REASON}")
        if self.lora_dropout:
            raise ValueError("--lora-dropout: --method dpo trains with dropout off, as TRL's DPOTrainer "
                             "(disable_dropout)")
        self.beta = 0.1 if self.beta is None else self.beta
        self.loss_type = "sigmoid" if self.loss_type is None else self.loss_type
        if not self.beta > 0:
            raise ValueError(f"--beta must be > 0, got {self.beta:g}")
        losses = self.loss_types()
        unknown = [t for t in losses if t not in LOSS_TYPES]
        if unknown or not losses:
            raise ValueError(f"--loss-type {unknown[0] if unknown else self.loss_type!r} is not one of "
                             f"{', '.join(LOSS_TYPES)}")
        if "simpo" in losses and len(losses) > 1:
            raise ValueError("--loss-type simpo (reference-free, length-normalised) does not combine with DPO losses")
        if len(self.weights()) != len(losses):
            raise ValueError(f"--loss-weights {self.loss_weights} gives {len(self.weights())} weights for "
                             f"{len(losses)} loss types ({self.loss_type})")
        if self.label_smoothing and not set(losses) & set(SMOOTHED):
            raise ValueError(f"--label-smoothing applies to --loss-type {' or '.join(SMOOTHED)}, not {self.loss_type}")
        if not 0.0 <= self.label_smoothing < 0.5:
            raise ValueError(f"--label-smoothing must be in [0, 0.5), got {self.label_smoothing:g}")
        if self.simpo_gamma != 0.5 and "simpo" not in losses:
            raise ValueError("--simpo-gamma goes with --loss-type simpo")
        if self.precompute_ref_logps and not self.needs_reference():
            raise ValueError(f"--precompute-ref-logps: {'--reference-free' if self.reference_free else 'simpo'} "
                             f"has no reference model to precompute")
        if self.max_length is not None and self.max_length < 2:
            raise ValueError(f"--max-length must be >= 2, got {self.max_length}")
        length = self.sequence_length()
        if self.max_prompt_length is not None and not 1 <= self.max_prompt_length < length:
            raise ValueError(f"--max-prompt-length must be >= 1 and < --max-length {length}, got "
                             f"{self.max_prompt_length}")

    def loss_types(self) -> tuple[str, ...]:
        return tuple(t.strip() for t in str(self.loss_type).split(",") if t.strip())

    def weights(self) -> tuple[float, ...]:
        return comma_weights(self.loss_weights, len(self.loss_types()), "loss-weights")

    def needs_reference(self) -> bool:
        return self.method == "dpo" and not self.reference_free and "simpo" not in self.loss_types()

    def sequence_length(self) -> int:
        """The longest row: --max-length under --method dpo (default --seq-len), else --seq-len."""
        return self.max_length if self.method == "dpo" and self.max_length is not None else self.seq_len

    def preference_loss(self):
        from colozoo.finetune.preference import PreferenceLoss

        return PreferenceLoss(self.loss_types(), self.weights(), self.beta, self.label_smoothing, self.simpo_gamma,
                              self.reference_free)


def comma_weights(value, count: int, flag: str) -> tuple[float, ...]:
    """--loss-weights / --reward-weights: comma-separated numbers, or 1 for each of `count` when not given."""
    if value is None:
        return (1.0,) * count
    try:
        return tuple(float(w) for w in str(value).split(",") if w.strip())
    except ValueError:
        raise ValueError(f"--{flag} must be comma-separated numbers, got {value!r}") from None


PREFERENCE_HELP = {
    "method": "sft: supervised fine-tuning (text, or --chat records); dpo: preference tuning on records with 'prompt', "
              "'chosen' and 'rejected' (strings or conversations), with the losses of --loss-type; grpo: "
              "reinforcement learning on records with a 'prompt', scored by --reward-funcs",
    "beta": "--method dpo: how far the policy may move from the reference (TRL's beta; IPO's tau), 0.1 unless "
            "given; --method grpo: the weight of the KL term to the reference model, 0 (no reference model) unless "
            "given",
    "loss_type": "--method dpo: sigmoid (DPO, unless given), hinge, ipo, robust, apo_zero, or simpo (CPOTrainer's "
                 "SimPO, reference-free); several comma-separated are summed with --loss-weights (MPO). --method "
                 "grpo: dapo (unless given: token-level, normalised by the batch's completion tokens), grpo (per "
                 "sequence), dr_grpo, bnpo or cispo",
    "loss_weights": "--method dpo: comma-separated weights of the --loss-type losses (default: 1 each)",
    "label_smoothing": "--method dpo: the probability that a preference is flipped (robust, simpo)",
    "simpo_gamma": "--loss-type simpo: the target reward margin gamma",
    "reference_free": "--method dpo: no reference model (its log-probs taken as 0)",
    "precompute_ref_logps": "--method dpo: compute the reference log-probs of every pair in one pass before training "
                            "(kept with the checkpoints), instead of a frozen copy of the model (full fine-tuning) or "
                            "the model with its adapters switched off (LoRA) at every step",
    "max_length": "--method dpo: tokens of prompt + completion; longer ones keep their start, cut and counted "
                  "(default: --seq-len)",
    "max_prompt_length": "--method dpo / grpo: a longer prompt keeps its last this many tokens, counted (default: "
                         "whole)",
}
PREFERENCE_CHOICES = {"method": METHODS}
