"""Preference tuning (`--method dpo`): the losses as TRL computes them, and the metrics under TRL's names.

DPO's losses are DPOTrainer's (TRL 1.16) on the log-ratios of the policy to the reference, summed over each
completion's tokens: `sigmoid` (DPO), `hinge`, `ipo` (per-token means), `robust` (with --label-smoothing), `apo_zero`,
several at once weighted by --loss-weights (MPO); `simpo` is CPOTrainer's SimPO (reference-free, length-normalised
log-probs, margin --simpo-gamma, cpo_alpha 0). `--reference-free` compares with a reference of log-prob 0. The options are in
colozoo.finetune.preference_options.

Rows come in pairs, the chosen sequence then the rejected one (colozoo.finetune.preference_data.pair_rows); the
objective handed to colozoo.runtime.logprobs returns each micro-batch's share of the global batch's mean loss over
pairs and reports, per row, the sequence's log-prob, its reward and its pair's loss, from which `metrics` computes
`rewards/chosen`, `rewards/rejected`, `rewards/accuracies`, `rewards/margins`, `logps/chosen` and `logps/rejected`.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from colozoo.finetune.preference_data import sequence_sums


@dataclass(frozen=True)
class PreferenceLoss:
    loss_types: tuple[str, ...]
    weights: tuple[float, ...]
    beta: float
    label_smoothing: float = 0.0
    simpo_gamma: float = 0.5
    reference_free: bool = False

    @property
    def simpo(self) -> bool:
        return self.loss_types == ("simpo",)

    def pair_losses(self, logps, tokens, ref_logps=None) -> tuple[torch.Tensor, torch.Tensor]:
        """(loss of each pair, reward of each sequence) from the sequences' summed log-probs, completion token counts
        and reference log-probs (None: reference-free), all (2 * pairs,) in pair order."""
        if self.simpo:
            return self._simpo(logps / tokens)
        ratios = logps if ref_logps is None else logps - ref_logps
        chosen, rejected = ratios[0::2], ratios[1::2]
        b, eps = self.beta, self.label_smoothing
        delta = chosen - rejected
        total = 0.0
        for loss_type, weight in zip(self.loss_types, self.weights):
            if loss_type == "sigmoid":
                loss = -F.logsigmoid(b * delta)
            elif loss_type == "hinge":
                loss = torch.relu(1 - b * delta)
            elif loss_type == "ipo":  # per-token means, as DPOTrainer (confirmed with the IPO authors)
                counts = tokens.clamp(min=1.0)
                loss = (chosen / counts[0::2] - rejected / counts[1::2] - 1 / (2 * b)) ** 2
            elif loss_type == "robust":
                loss = (-(1 - eps) * F.logsigmoid(b * delta) + eps * F.logsigmoid(-b * delta)) / (1 - 2 * eps)
            else:  # apo_zero
                loss = (1 - torch.sigmoid(b * chosen)) + torch.sigmoid(b * rejected)
            total = total + weight * loss
        return total, b * ratios

    def _simpo(self, mean_logps):
        logits = mean_logps[0::2] - mean_logps[1::2] - self.simpo_gamma / self.beta
        eps = self.label_smoothing
        loss = -F.logsigmoid(self.beta * logits) * (1 - eps) - F.logsigmoid(-self.beta * logits) * eps
        return loss, self.beta * mean_logps

    def objective(self, global_pairs: int):
        """The objective of colozoo.runtime.logprobs for a global batch of `global_pairs` pairs. Per-row values:
        "ref_logps", the reference's summed log-prob of the row's sequence(s) (unless reference-free), and "split"
        where a row packs a pair (preference_data.sequence_sums). It reports, per row, each sequence's log-prob (SimPO:
        per token), reward and pair loss."""
        def preference_objective(logps, labels, rows):
            tokens = sequence_sums((labels != -100).to(logps.dtype), rows)
            summed = sequence_sums(logps, rows)
            ref = rows.get("ref_logps")
            loss, rewards = self.pair_losses(summed, tokens, None if ref is None else ref.reshape(-1))
            shown = summed / tokens if self.simpo else summed  # CPOTrainer logs the mean log-probs it trains on
            reported = {"logps": shown, "rewards": rewards, "pair_loss": loss.repeat_interleave(2)}
            return loss.sum() / global_pairs, {k: v.view(labels.shape[0], -1) for k, v in reported.items()}
        return preference_objective


def metrics(values: dict, prefix: str = "") -> dict[str, float]:
    """TRL's metrics of a batch from the objective's per-row values (chosen rows even, rejected odd): means over
    pairs. `prefix`: "eval_" for evaluation (with the loss), "" in training (the step's loss is logged apart)."""
    rewards, logps = values["rewards"].double().flatten(), values["logps"].double().flatten()
    chosen, rejected = rewards[0::2], rewards[1::2]
    out = {"rewards/chosen": chosen.mean(), "rewards/rejected": rejected.mean(),
           "rewards/accuracies": (chosen > rejected).double().mean(), "rewards/margins": (chosen - rejected).mean(),
           "logps/chosen": logps[0::2].mean(), "logps/rejected": logps[1::2].mean()}
    if prefix:
        out = {"loss": values["pair_loss"].flatten()[0::2].double().mean(), **out}
    return {prefix + k: float(v) for k, v in out.items()}
