"""`--method grpo` inside the fine-tuning loop: rollouts, the update, the evaluation and what a checkpoint carries.

A step samples a batch of rollouts (colozoo.finetune.grpo_rollout) every --num-iterations steps and trains on it
for that many steps. The policy's log-probs of the sampled tokens come from the training forward (vocab-parallel,
at the sampling temperature), never from generation; with --num-iterations > 1 those of the policy that sampled
them are computed once, right after sampling, and kept with the batch ("old" log-probs). The reference's (beta > 0)
too: under LoRA the same shards with the adapters switched off, else a frozen copy sharded on the same mesh. The
model trains with dropout off. A checkpoint taken between two uses of a batch carries the batch
(OUTPUT/rollout.safetensors), so a resumed run trains on what the uninterrupted one did.
"""
from __future__ import annotations

import functools
import json
from dataclasses import dataclass, fields
from pathlib import Path

import torch

from colozoo.finetune import grpo
from colozoo.finetune.data import pad_id
from colozoo.finetune.grpo_data import PromptData
from colozoo.finetune.grpo_rollout import (Completions, decoded, end_of_sequence_ids, rollout_seed, sample, score,
                                           training_rows)
from colozoo.finetune.preference_train import load_reference, reference_forward_logps
from colozoo.finetune.rewards import RewardFunctions
from colozoo.runtime.logprobs import forward_backward_logps, forward_logps

ROLLOUT_FILE = "rollout.safetensors"
COMPLETIONS_FILE = "completions.jsonl"


@dataclass
class Rollout:
    """A batch of rollouts as the update trains on it (global tensors, the same on every rank)."""
    step: int                            # the step that sampled it
    indices: torch.Tensor                # (rows,) each row's prompt
    input_ids: torch.Tensor
    attention_mask: torch.Tensor
    position_ids: torch.Tensor
    labels: torch.Tensor
    advantages: torch.Tensor
    rewards: torch.Tensor                # (rows, functions)
    old_logps: torch.Tensor | None = None
    ref_logps: torch.Tensor | None = None

    def per_row(self) -> dict[str, torch.Tensor]:
        return {k: getattr(self, k) for k in ("advantages", "old_logps", "ref_logps") if getattr(self, k) is not None}

    def tensors(self) -> dict[str, torch.Tensor]:
        return {f.name: getattr(self, f.name).contiguous() for f in fields(self)
                if isinstance(getattr(self, f.name), torch.Tensor)}


def load_rollout(path: Path) -> Rollout:
    from safetensors import safe_open

    with safe_open(str(path), "pt") as f:
        tensors = {k: f.get_tensor(k) for k in f.keys()}
        step = int(f.metadata()["step"])
    return Rollout(step=step, **tensors)


class GrpoTraining:
    """The step and the evaluation of --method grpo for one run."""

    def __init__(self, cfg, model, data: PromptData, tokenizer, sampler, total_steps: int, reference_model=None):
        self.cfg, self.data, self.tokenizer, self.sampler = cfg, data, tokenizer, sampler
        self.total_steps, self.reference_model = total_steps, reference_model
        self.rewards = RewardFunctions(cfg.reward_list(), cfg.weights_of_rewards())
        self.loss = grpo.GrpoLoss(cfg.loss_type, cfg.beta, cfg.epsilon, cfg.epsilon_upper, cfg.max_completion_length)
        self.eos, self.pad = end_of_sequence_ids(tokenizer, model), pad_id(tokenizer)
        self.rollout: Rollout | None = None  # the batch the steps of this --num-iterations cycle train on
        self.unlogged: dict = {}  # the metrics of a rollout sampled before its step

    # --- rollouts ---------------------------------------------------------------------------------------------
    def first_step_of_cycle(self, number: int) -> int:
        return number - (number - 1) % self.cfg.num_iterations

    def make_rollout(self, model, number: int, step_options: dict) -> tuple[Rollout, dict]:
        """Sample and score the batch of step `number` (its prompts: the sampler's batch of the cycle), with the
        old and reference log-probs it needs; returns it and TRL's rollout metrics."""
        indices = self.sampler.global_indices((number - 1) // self.cfg.num_iterations)
        seed = rollout_seed(self.cfg.seed, number, model.parallel.rank("dp"))
        completions = sample(model, self.data, indices, self.cfg, self.eos, self.pad, seed)
        rollout, metrics = self.scored(model, completions, number)
        micro = step_options.get("num_microbatches", 1)
        if self.cfg.num_iterations > 1:
            rollout.old_logps = self.token_logps(model, rollout, micro)
        if self.cfg.beta != 0.0:
            rollout.ref_logps = self.reference_logps(model, rollout, micro)
        return rollout, metrics

    def scored(self, model, completions: Completions, number: int) -> tuple[Rollout, dict]:
        """The rollout of sampled `completions`: rewards, advantages, the rows to train on; and TRL's metrics."""
        rewards, logged, _ = score(model, self.data, completions, self.tokenizer, self.rewards, number,
                                   self.total_steps)
        advantage, metrics = grpo.advantages(rewards, self.rewards.weights, self.cfg.num_generations,
                                             self.cfg.scale_rewards)
        rows = training_rows(completions, self.pad, self.cfg.mask_truncated_completions)
        metrics = {**grpo.completion_metrics(completions.lengths, completions.truncated),
                   **grpo.reward_metrics(rewards, self.rewards.names), **metrics, **logged}
        return Rollout(number, completions.indices, **rows, advantages=advantage, rewards=rewards), metrics

    def token_logps(self, model, rollout: Rollout, num_microbatches: int = 1, reference: bool = False) -> torch.Tensor:
        """`model`'s per-token log-probs of the rollout's completions (no gradients), at the sampling temperature;
        `reference`: the reference's (the frozen copy, or `model` with its adapters off)."""
        device = model.parallel.device
        forward = functools.partial(reference_forward_logps, model, self.reference_model) if reference else \
            functools.partial(forward_logps, model)
        out = forward(rollout.input_ids.to(device), rollout.labels.to(device),
                      attention_mask=rollout.attention_mask.to(device), position_ids=rollout.position_ids.to(device),
                      num_microbatches=num_microbatches, temperature=self.cfg.temperature)
        return out["logps"].float().cpu()

    def reference_logps(self, model, rollout: Rollout, num_microbatches: int = 1) -> torch.Tensor:
        return self.token_logps(model, rollout, num_microbatches, reference=True)

    # --- the step -----------------------------------------------------------------------------------------------
    def step(self, model, number: int, grad_scale: float, step_options: dict):
        """Step `number`'s forward and backward: a new batch of rollouts on the first step of each --num-iterations
        cycle, the clipped policy-gradient loss on it. Returns (the loss, TRL's metrics of the step)."""
        if self.rollout is None or self.rollout.step != self.first_step_of_cycle(number):
            self.rollout, self.unlogged = self.make_rollout(model, number, step_options)
        metrics, self.unlogged = self.unlogged, {}
        r, device = self.rollout, model.parallel.device
        mask = r.labels != -100
        objective = self.loss.objective(global_rows=len(r.labels), global_tokens=int(mask.sum()))
        loss, values = forward_backward_logps(
            model, r.input_ids.to(device), r.labels.to(device), objective, attention_mask=r.attention_mask.to(device),
            position_ids=r.position_ids.to(device), rows={k: v.to(device) for k, v in r.per_row().items()},
            grad_scale=grad_scale, temperature=self.cfg.temperature, entropy=True, **step_options)
        return loss, {**metrics, **grpo.update_metrics(values)}

    def tokens(self) -> tuple[int, int]:
        """(the positions of the batch the last step trained on, its completion tokens)."""
        r = self.rollout
        return r.input_ids.numel(), int((r.labels != -100).sum())

    # --- what a run writes --------------------------------------------------------------------------------------
    def completions_record(self, number: int) -> list[dict]:
        """The current batch's prompts, completions, rewards and advantages, one record per completion."""
        r = self.rollout
        ids = [row[m].tolist() for row, m in zip(r.input_ids, r.attention_mask.bool())]
        prompts = [self.data.prompt_ids(int(i)) for i in r.indices]
        completions = Completions(r.indices, prompts, [row[len(p):] for row, p in zip(ids, prompts)],
                                  torch.zeros(len(ids), dtype=torch.bool))
        shown_prompts, texts = decoded(self.data, completions, self.tokenizer)
        return [{"step": number, "sampled_at": r.step, "prompt": p, "completion": c,
                 "rewards": dict(zip(self.rewards.names, [None if v != v else v for v in rewards.tolist()])),
                 "advantage": float(a)}
                for p, c, rewards, a in zip(shown_prompts, texts, r.rewards, r.advantages)]

    def log_completions(self, number: int, output: Path, rank0: bool):
        """Every --log-completions steps, rank 0 appends the step's completions to OUTPUT/completions.jsonl."""
        every = self.cfg.log_completions
        if not rank0 or not every or number % every or self.rollout is None:
            return
        with open(output / COMPLETIONS_FILE, "a") as f:
            for record in self.completions_record(number):
                f.write(json.dumps(record) + "\n")

    def write_state(self, output: Path, rank0: bool) -> list[Path]:
        """What a checkpoint must carry beside the weights: the batch of rollouts, while later steps of its cycle
        train on it (rank 0 writes it, atomically)."""
        if self.cfg.num_iterations == 1 or self.rollout is None:
            return []
        from safetensors.torch import save

        from colozoo.core.files import fsync_write

        path = output / ROLLOUT_FILE
        if rank0:
            metadata = {"step": str(self.rollout.step)}
            fsync_write(path, lambda f: f.write(save(self.rollout.tensors(), metadata=metadata)))
        return [path]

    def begin(self, model, start: int, checkpoint: Path | None, step_options: dict):
        """Before the run's first step (`start` steps done): the rollouts it trains on, read from the checkpoint
        it resumes from (the middle of a --num-iterations cycle) or sampled and scored now, so that reward functions
        that fail stop the run before it writes anything."""
        if checkpoint is not None:
            self.resume(checkpoint, start)
        if self.rollout is None and start < self.total_steps:
            self.rollout, self.unlogged = self.make_rollout(model, start + 1, step_options)

    def resume(self, checkpoint: Path, start: int):
        """A run resumed after step `start` reads the batch its next step trains on, when it is not a new one."""
        from colozoo.finetune.state import ResumeError

        first = self.first_step_of_cycle(start + 1)
        if first == start + 1:
            return
        path = checkpoint / ROLLOUT_FILE
        saved = load_rollout(path) if path.exists() else None
        if saved is None or saved.step != first:
            raise ResumeError(f"{checkpoint} lacks the rollouts sampled at step {first}, which step {start + 1} trains "
                              f"on (--num-iterations {self.cfg.num_iterations}); pass --no-resume")
        self.rollout = saved

    # --- evaluation ---------------------------------------------------------------------------------------------
    @torch.no_grad()
    def evaluate(self, model, data: PromptData, prompts: int, step: int, show=None) -> dict[str, float]:
        """TRL's rollout metrics, eval_-prefixed, of --num-generations completions of each of the first `prompts`
        held-out prompts, sampled with the same seeds at every evaluation, in passes of one step's prompts (the last
        filled up with the first prompts, whose completions are dropped); `show(line)` gets the first --samples."""
        per_pass, group = self.sampler.global_batch, self.cfg.num_generations
        parts: dict[str, list] = {"rewards": [], "lengths": [], "truncated": []}
        shown = []
        for n, start in enumerate(range(0, prompts, per_pass)):
            index = torch.tensor([i % prompts for i in range(start, start + per_pass)])
            seed = rollout_seed(self.cfg.seed, n, model.parallel.rank("dp"), stream=1)
            completions = sample(model, data, index, self.cfg, self.eos, self.pad, seed)
            rewards, _, _ = score(model, data, completions, self.tokenizer, self.rewards, step, self.total_steps)
            kept = group * min(per_pass, prompts - start)
            parts["rewards"].append(rewards[:kept])
            parts["lengths"].append(completions.lengths[:kept])
            parts["truncated"].append(completions.truncated[:kept])
            if show is not None and len(shown) < self.cfg.samples:
                texts = decoded(data, completions, self.tokenizer)
                shown += list(zip(*texts, rewards.tolist()))[: min(kept, self.cfg.samples - len(shown))]
        rewards = torch.cat(parts["rewards"])
        metrics = {**grpo.completion_metrics(torch.cat(parts["lengths"]), torch.cat(parts["truncated"])),
                   **grpo.reward_metrics(rewards, self.rewards.names),
                   **grpo.advantages(rewards, self.rewards.weights, group, self.cfg.scale_rewards)[1]}
        for prompt, completion, values in shown:
            show(f"  sample at step {step}: {prompt!r} -> {completion!r}  rewards {values}")
        return {f"eval_{k}": v for k, v in metrics.items()}


def grpo_training(cfg, model, inputs, sampler, total_steps: int, plan=None) -> GrpoTraining:
    """The run's GrpoTraining, with a frozen reference copy where the KL term needs one (beta > 0, full weights)."""
    frozen = cfg.beta != 0.0 and not cfg.lora_r
    return GrpoTraining(cfg, model, inputs.train, inputs.tokenizer, sampler, total_steps,
                        load_reference(cfg, plan) if frozen else None)
