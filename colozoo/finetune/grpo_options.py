"""The options of `--method grpo` (reinforcement learning from rewards), with TRL's GRPOConfig names and meanings.

`--beta` and `--loss-type` are shared with `--method dpo` (colozoo.finetune.preference_options) and take GRPO's defaults
(TRL's: beta 0, loss type dapo) under --method grpo; --max-prompt-length too (the last tokens of a longer prompt).
"""
from __future__ import annotations

from dataclasses import dataclass, fields

GRPO_LOSSES = ("dapo", "grpo", "dr_grpo", "bnpo", "cispo")
SCALE_REWARDS = ("group", "batch", "none")
SCALE_ALIASES = {"true": "group", "false": "none"}  # TRL's boolean spellings


@dataclass(kw_only=True)
class GrpoOptions:
    """The options of `--method grpo` (FinetuneConfig inherits them)."""
    num_generations: int = 8            # completions sampled per prompt (a group)
    max_completion_length: int = 512    # new tokens per completion at most
    temperature: float = 1.0
    top_p: float = 1.0
    epsilon: float = 0.2
    epsilon_high: float | None = None   # default: --epsilon
    num_iterations: int = 1             # optimizer steps on each batch of rollouts (mu)
    scale_rewards: str = "group"
    mask_truncated_completions: bool = False
    reward_funcs: str | None = None     # comma-separated module:function (from Python also a list of callables)
    reward_weights: str | None = None   # comma-separated, one per reward function (default: 1 each)
    log_completions: int = 10           # write the step's prompts, completions and rewards every this many steps

    def check_grpo_options(self):
        if isinstance(self.reward_weights, (list, tuple)):  # TRL's list form, from Python
            self.reward_weights = ",".join(str(w) for w in self.reward_weights)
        if self.method != "grpo":
            changed = [f.name for f in fields(GrpoOptions) if getattr(self, f.name) != f.default]
            if changed:
                raise ValueError(f"--{changed[0].replace('_', '-')} goes with --method grpo")
            return
        self._check_run_options()
        self._check_sampling_and_loss()
        if not self.reward_list():
            raise ValueError("--method grpo needs --reward-funcs: one or more module:function (comma-separated), "
                             "each called as f(prompts=..., completions=..., **columns) -> list[float | None]")
        if len(self.weights_of_rewards()) != len(self.reward_list()):
            raise ValueError(f"--reward-weights {self.reward_weights} gives {len(self.weights_of_rewards())} "
                             f"weights for {len(self.reward_list())} reward functions")

    def _check_run_options(self):
        """What --method grpo does not combine with: other tasks, the other methods' data options, meshes generate
        does not run on, dropout."""
        if self.task != "lm":
            raise ValueError(f"--method grpo trains causal LMs (--task lm), not --task {self.task}")
        for flag, value in (("chat", self.chat), ("truncate", self.truncate != "turns"), ("no-pack", not self.pack),
                            ("seq-len", self.seq_len != 128)):
            if value:
                raise ValueError(f"--{flag} is for --method sft: --method grpo reads prompts (strings, or "
                                 f"conversations rendered with the chat template) and samples up to "
                                 f"--max-completion-length tokens after each")
        if self.plan is not None:
            raise ValueError("--plan auto plans supervised steps; --method grpo (generation, then the update) is not "
                             "planned yet: give the mesh (--tp, --pp, --dp)")
        if self.cp > 1 or self.sequence_parallel:
            raise ValueError("--method grpo samples its completions one token at a time on the training mesh, which "
                             "needs cp=1 and no --sequence-parallel")
        if self.lora_dropout:
            raise ValueError("--lora-dropout: --method grpo trains with dropout off, so that the log-probs of the "
                             "update are those of the policy that sampled (TRL's disable_dropout)")

    def _check_sampling_and_loss(self):
        if self.beta is None:
            self.beta = 0.0
        if self.loss_type is None:
            self.loss_type = "dapo"
        self.scale_rewards = SCALE_ALIASES.get(str(self.scale_rewards).lower(), str(self.scale_rewards))
        if self.num_generations < 2:
            raise ValueError(f"--num-generations must be >= 2: each completion's advantage is its reward against "
                             f"the others of its prompt's group, got {self.num_generations}")
        for name in ("max_completion_length", "num_iterations"):
            if getattr(self, name) < 1:
                raise ValueError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(self, name)}")
        if self.log_completions < 0:
            raise ValueError(f"--log-completions must be >= 0 (0: never), got {self.log_completions}")
        if not self.temperature > 0:
            raise ValueError(f"--temperature must be > 0, got {self.temperature:g}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"--top-p must be in (0, 1], got {self.top_p:g}")
        if self.beta < 0:
            raise ValueError(f"--beta must be >= 0 (0: no reference model), got {self.beta:g}")
        if self.epsilon < 0 or self.epsilon_high is not None and self.epsilon_high < 0:
            raise ValueError(f"--epsilon and --epsilon-high must be >= 0, got {self.epsilon:g} and "
                             f"{self.epsilon_high}")
        if self.loss_type not in GRPO_LOSSES:
            raise ValueError(f"--loss-type {self.loss_type} is not one of {', '.join(GRPO_LOSSES)} (--method grpo)")
        if self.scale_rewards not in SCALE_REWARDS:
            raise ValueError(f"--scale-rewards must be one of {', '.join(SCALE_REWARDS)}, got {self.scale_rewards!r}")

    def reward_list(self) -> list:
        """--reward-funcs as a list: module:function names, and from Python callables too."""
        funcs = self.reward_funcs
        if funcs is None:
            return []
        if isinstance(funcs, str):
            return [name.strip() for name in funcs.split(",") if name.strip()]
        return list(funcs) if isinstance(funcs, (list, tuple)) else [funcs]

    def weights_of_rewards(self) -> tuple[float, ...]:
        from colozoo.finetune.preference_options import comma_weights

        return comma_weights(self.reward_weights, len(self.reward_list()), "reward-weights")

    @property
    def epsilon_upper(self) -> float:
        return self.epsilon if self.epsilon_high is None else self.epsilon_high

    def samples_per_step(self, global_batch: int) -> int:
        """What the data sampler draws per step: --method grpo draws prompts (each sampled --num-generations times,
        the global batch counting completions, as TRL's), the other methods the global batch's samples."""
        if self.method != "grpo":
            return global_batch
        if global_batch % self.num_generations:
            raise ValueError(f"global batch {global_batch} (completions per step) is not divisible by "
                             f"--num-generations {self.num_generations}: every prompt's group of completions is "
                             f"trained on in one step")
        return global_batch // self.num_generations


GRPO_HELP = {
    "num_generations": "--method grpo: completions sampled for each prompt (its group); the global batch counts "
                       "completions and must be divisible by it",
    "max_completion_length": "--method grpo: new tokens per completion at most (a completion cut there is "
                             "'clipped')",
    "temperature": "--method grpo: sampling temperature (the log-probs trained on are of the same distribution)",
    "top_p": "--method grpo: nucleus sampling: the smallest set of tokens whose probabilities reach this",
    "epsilon": "--method grpo: the ratio of new to old policy is clipped to [1 - epsilon, 1 + epsilon-high]",
    "epsilon_high": "--method grpo: the upper clipping epsilon (default: --epsilon; DAPO: 0.28); cispo: the "
                    "largest importance weight",
    "num_iterations": "--method grpo: optimizer steps on each batch of rollouts (TRL's mu), with the log-probs of "
                      "the policy that sampled them kept",
    "scale_rewards": "--method grpo: divide each advantage by the standard deviation of its group's rewards "
                     "(group), of the whole batch's (batch), or not at all (none)",
    "mask_truncated_completions": "--method grpo: completions that reach --max-completion-length without an end of "
                                  "sequence add nothing to the loss",
    "reward_funcs": "--method grpo: comma-separated reward functions, module:function or path/to/file.py:function, "
                    "each called as f(prompts=..., completions=..., completion_ids=..., **other columns of the "
                    "records) -> one float (or None) per completion",
    "reward_weights": "--method grpo: comma-separated weights of the reward functions (default: 1 each)",
    "log_completions": "--method grpo: append the step's prompts, completions, rewards and advantages to "
                       "OUTPUT/completions.jsonl every this many steps (0: never)",
}
