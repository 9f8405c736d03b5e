"""GRPO's numbers as TRL's GRPOTrainer (1.16) computes them: advantages from the rewards of each prompt's group, the
clipped policy-gradient loss with its KL term, and the metrics under TRL's names.

Advantages: the weighted sum of the reward functions (None -> NaN, left out of the means), minus the mean of the
prompt's group, divided by the standard deviation of the group (`scale_rewards` "group"), of the batch ("batch") or
not ("none") plus 1e-4; a completion no function scored gets 0.

Per completion token, with r = exp(log pi - log pi_old) (1 on the first use of a rollout) and advantage A:
`dapo`, `grpo`, `dr_grpo`, `bnpo`: -min(r A, clip(r, 1 - epsilon, 1 + epsilon_high) A); `cispo`:
-min(r, epsilon_high).detach() A log pi; plus beta x the k3 estimate of KL(pi || pi_ref), exp(d) - d - 1 with
d = log pi_ref - log pi, times r (TRL's use_bias_correction_kl). Summed over the batch's completion tokens and divided
by their count (dapo, cispo), averaged per sequence then over sequences (grpo), divided by the rows times
--max-completion-length (dr_grpo), or by the tokens of each micro-batch, then averaged over micro-batches and dp
ranks (bnpo, TRL's local normalisation: the only one that depends on how the batch is split).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch


def nanstd(x: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """TRL's nanstd: the standard deviation ignoring NaNs, with Bessel's correction (NaN for fewer than 2)."""
    mean = torch.nanmean(x, dim=dim, keepdim=True)
    variance = torch.nanmean((x - mean) ** 2, dim=dim, keepdim=True)
    count = (~torch.isnan(x)).sum(dim=dim, keepdim=True)
    variance = variance * torch.where(count > 1, count / (count - 1), torch.full_like(variance, math.nan))
    return variance.sqrt().squeeze(dim) if dim is not None else variance.sqrt().reshape(())


def advantages(rewards_per_func: torch.Tensor, weights: torch.Tensor, group: int, scale: str
               ) -> tuple[torch.Tensor, dict[str, float]]:
    """(each completion's advantage, TRL's reward metrics but the per-function ones) from the rewards of every
    completion of the global batch (completions, functions), NaN where a function returned None."""
    unscorable = torch.isnan(rewards_per_func).all(dim=1)
    rewards = (rewards_per_func * weights[None]).nansum(dim=1)
    rewards[unscorable] = math.nan
    grouped = rewards.view(-1, group)
    mean = torch.nanmean(grouped, dim=1).repeat_interleave(group)
    if scale == "batch":
        std = nanstd(rewards).expand_as(rewards)
    else:  # "none" keeps the group's std for frac_reward_zero_std
        std = nanstd(grouped, dim=1).repeat_interleave(group)
    advantage = rewards - mean
    if scale != "none":
        advantage = advantage / (std + 1e-4)
    zero_std = torch.isclose(std, torch.zeros_like(std))
    metrics = {"reward": torch.nanmean(rewards).item(), "reward_std": nanstd(rewards).item(),
               "frac_reward_zero_std": zero_std.float().mean().item()}
    return torch.nan_to_num(advantage, nan=0.0), metrics


def reward_metrics(rewards_per_func: torch.Tensor, names: list[str]) -> dict[str, float]:
    out = {}
    for i, name in enumerate(names):
        out[f"rewards/{name}/mean"] = torch.nanmean(rewards_per_func[:, i]).item()
        out[f"rewards/{name}/std"] = nanstd(rewards_per_func[:, i]).item()
    return out


def completion_metrics(lengths: torch.Tensor, truncated: torch.Tensor) -> dict[str, float]:
    """TRL's completions/* metrics from each completion's length (its end-of-sequence token included) and whether
    it reached --max-completion-length without one."""
    lengths = lengths.float()
    terminated = lengths[~truncated]
    if terminated.numel() == 0:
        terminated = torch.zeros(1)
    return {"completions/mean_length": lengths.mean().item(), "completions/min_length": lengths.min().item(),
            "completions/max_length": lengths.max().item(),
            "completions/clipped_ratio": truncated.float().mean().item(),
            "completions/mean_terminated_length": terminated.mean().item(),
            "completions/min_terminated_length": terminated.min().item(),
            "completions/max_terminated_length": terminated.max().item()}


@dataclass(frozen=True)
class GrpoLoss:
    loss_type: str = "dapo"
    beta: float = 0.0
    epsilon_low: float = 0.2
    epsilon_high: float = 0.2
    max_completion_length: int = 512

    def per_token(self, logps, rows):
        """(per-token loss, the ratio r, the clipped mask regions or None) of a micro-batch; `rows` hold its
        "advantages" (n,) and, per token, "old_logps" (later uses of a rollout) and "ref_logps" (beta > 0)."""
        advantage = rows["advantages"].to(logps.dtype)[:, None]
        old = rows.get("old_logps")
        old = logps.detach() if old is None else old
        ratio = torch.exp(logps - old)
        if self.loss_type == "cispo":
            loss = -torch.clamp(ratio, max=self.epsilon_high).detach() * advantage * logps
        else:
            clipped = torch.clamp(ratio, 1 - self.epsilon_low, 1 + self.epsilon_high)
            loss = -torch.min(ratio * advantage, clipped * advantage)
        kl = None
        if self.beta != 0.0:
            delta = rows["ref_logps"] - logps
            kl = (torch.exp(delta) - delta - 1) * ratio
            loss = loss + self.beta * kl
        return loss, ratio, kl

    def share(self, loss, mask, global_rows: int, global_tokens: int) -> torch.Tensor:
        """The micro-batch's share of the global batch's loss."""
        summed = (loss * mask).sum()
        if self.loss_type in ("dapo", "cispo"):
            return summed / max(global_tokens, 1)
        if self.loss_type == "grpo":
            return ((loss * mask).sum(1) / mask.sum(1).clamp(min=1.0)).sum() / global_rows
        if self.loss_type == "dr_grpo":
            return summed / (global_rows * self.max_completion_length)
        return summed / mask.sum().clamp(min=1.0) * mask.shape[0] / global_rows  # bnpo: micro-batches equal

    def objective(self, global_rows: int, global_tokens: int):
        """The objective of colozoo.runtime.logprobs for a global batch of `global_rows` completions holding
        `global_tokens` completion tokens (those with a label); it reports per row the sums from which `metrics`
        computes TRL's kl, entropy and clip ratios over the whole batch."""
        def grpo_objective(logps, labels, rows):
            mask = (labels != -100).to(logps.dtype)
            loss, ratio, kl = self.per_token(logps, rows)
            advantage = rows["advantages"][:, None]
            reported = {"tokens": mask.sum(1), "entropy": (rows["entropy"] * mask).sum(1)}
            if kl is not None:
                reported["kl"] = (kl.detach() * mask).sum(1)
            ratio = ratio.detach()
            if self.loss_type == "cispo":
                reported["cispo"] = (((ratio > self.epsilon_high) & (advantage > 0)) * mask).sum(1)
            else:
                low = (ratio < 1 - self.epsilon_low) & (advantage < 0)
                high = (ratio > 1 + self.epsilon_high) & (advantage > 0)
                reported.update(low=(low * mask).sum(1), high=(high * mask).sum(1), region=((low | high) * mask).sum(1))
            return self.share(loss, mask, global_rows, global_tokens), reported
        return grpo_objective


def update_metrics(values: dict) -> dict[str, float]:
    """TRL's kl, entropy and clip-ratio metrics of a step from the objective's per-row sums: means over every
    completion token of the batch (clip_ratio/low_min and high_max: the extremes of the per-completion means)."""
    values = {k: v.double().flatten() for k, v in values.items()}
    tokens = values["tokens"]
    total = tokens.sum().clamp(min=1.0)
    out = {"entropy": values["entropy"].sum() / total}
    if "kl" in values:
        out["kl"] = values["kl"].sum() / total
    if "cispo" in values:
        out["cispo_clip_ratio"] = values["cispo"].sum() / total
    else:
        for side in ("low", "high", "region"):
            out[f"clip_ratio/{side}_mean"] = values[side].sum() / total
        scored = tokens > 0
        out["clip_ratio/low_min"] = (values["low"][scored] / tokens[scored]).min() if scored.any() else math.nan
        out["clip_ratio/high_max"] = (values["high"][scored] / tokens[scored]).max() if scored.any() else math.nan
    return {k: float(v) for k, v in out.items()}
