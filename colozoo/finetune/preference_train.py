"""`--method dpo` inside the fine-tuning loop: the reference log-probs, the training step and the evaluation.

The reference is, as TRL's DPOTrainer has it: under LoRA the model itself with its adapters switched off for one
forward (colozoo.runtime.lora.adapters_disabled); in full fine-tuning a frozen copy of the starting weights, sharded
on the same mesh (FSDP over the data-parallel ranks); or, with --precompute-ref-logps, the starting model's
log-probs of every pair computed in one pass before the first step and kept in OUTPUT/reference_logps.safetensors,
which every checkpoint carries, so a resumed run reads exactly the values it started with. --reference-free and
SimPO need none. The model trains with dropout off, as DPOTrainer's disable_dropout.
"""
from __future__ import annotations

from pathlib import Path

import torch

from colozoo.finetune import preference
from colozoo.finetune.data import padding_multiple
from colozoo.finetune.preference_data import pack_pairs, pair_rows, sequence_sums, trim_to_longest
from colozoo.runtime.lora import adapters_disabled
from colozoo.runtime.logprobs import forward_backward_logps, forward_logps

REFERENCE_FILE = "reference_logps.safetensors"


def summed_logps(logps, labels, rows):
    """forward_logps' objective for reference log-probs: each sequence's log-prob summed over its labelled tokens."""
    return logps.sum() * 0.0, {"logps": sequence_sums(logps, rows).view(logps.shape[0], -1)}


def load_reference(cfg, plan=None):
    """A frozen copy of the starting weights on the run's mesh, sharded over the data-parallel ranks (FSDP), in the
    run's mixed precision, for full fine-tuning without --precompute-ref-logps."""
    from colozoo.api import from_pretrained
    from colozoo.finetune.runtime import MIXED_PRECISION, mesh_degrees
    from colozoo.runtime.training import parallelize

    reference = from_pretrained(cfg.model, dtype=torch.float32, verify=True, **mesh_degrees(cfg, plan))
    reference.requires_grad_(False)
    parallelize(reference, data_parallel="fsdp", mixed_precision=MIXED_PRECISION[cfg.dtype])
    return reference.eval()


def reference_forward_logps(model, reference_model, *args, **kwargs) -> dict:
    """forward_logps(*args, **kwargs) of the reference: the frozen copy `reference_model` where there is one, else
    `model` with its LoRA adapters switched off."""
    if reference_model is not None:
        return forward_logps(reference_model, *args, **kwargs)
    with adapters_disabled(model):
        return forward_logps(model, *args, **kwargs)


def preference_training(cfg, model, plan=None) -> "PreferenceTraining":
    """The run's PreferenceTraining, with a frozen reference copy where the reference needs one (full fine-tuning
    without --precompute-ref-logps)."""
    frozen = cfg.needs_reference() and not cfg.lora_r and not cfg.precompute_ref_logps
    return PreferenceTraining(cfg, model, load_reference(cfg, plan) if frozen else None)


class PreferenceTraining:
    """The step and the evaluation of --method dpo (and its relatives) for one run. A pair is one row, chosen then
    rejected packed without padding between them (preference_data.pack_pairs), where --pack (the default) asks for
    it and the model's learned positions, if any, hold both; else two rows."""

    def __init__(self, cfg, model, reference_model=None):
        self.cfg, self.loss, self.reference_model = cfg, cfg.preference_loss(), reference_model
        self.precomputed: dict[str, torch.Tensor] | None = None  # "train" / "eval": (pairs, 2)
        parallel, limit = model.parallel, model.position_limit()
        self.multiple = padding_multiple(parallel)
        self.pack = cfg.pack and (limit is None or 2 * cfg.sequence_length() <= limit)

    def rows(self, batch: dict, device) -> dict:
        """A batch of pairs as the model's rows (`split` where each packed row's rejected sequence starts)."""
        rows = pack_pairs(batch, self.multiple) if self.pack else trim_to_longest(pair_rows(batch), self.multiple)
        return {k: v.to(device) for k, v in rows.items()}

    @staticmethod
    def _inputs(rows: dict, reference: torch.Tensor | None = None) -> dict:
        """forward(_backward)_logps' keywords for `rows`, with the per-row values that travel with them."""
        per_row = {"split": rows["split"]} if "split" in rows else {}
        if reference is not None:
            per_row["ref_logps"] = reference.reshape(rows["input_ids"].shape[0], -1)
        return dict(attention_mask=rows.get("attention_mask"), position_ids=rows.get("position_ids"), rows=per_row)

    # --- reference log-probs ------------------------------------------------------------------------------------
    def reference_logps(self, model, rows: dict, num_microbatches: int = 1) -> torch.Tensor | None:
        """The reference's summed log-prob of each sequence in pair order (None when reference-free), from the frozen
        copy or the model with its adapters switched off."""
        if not self.cfg.needs_reference():
            return None
        args = (rows["input_ids"], rows["labels"], summed_logps)
        kwargs = dict(num_microbatches=num_microbatches, **self._inputs(rows))
        return reference_forward_logps(model, self.reference_model, *args, **kwargs)["logps"].reshape(-1)

    def precompute(self, model, data, pairs_per_pass: int, reporter=None, role: str = "train") -> torch.Tensor:
        """The reference log-probs of every pair of `data`, (pairs, 2), in passes of `pairs_per_pass` pairs (the last
        filled up with the first pairs, whose values are dropped): every rank gets all of them."""
        if reporter is not None:
            reporter.print(f"computing the reference log-probs of the {len(data)} {role} pairs "
                           f"(--precompute-ref-logps)")
        out = []
        for start in range(0, len(data), pairs_per_pass):
            index = [i % len(data) for i in range(start, start + pairs_per_pass)]
            rows = self.rows(data.take(index), model.parallel.device)
            out.append(self.reference_logps(model, rows).view(-1, 2)[: len(data) - start].float().cpu())
        return torch.cat(out)

    def _reference(self, model, rows, indices, role: str, num_microbatches: int = 1) -> torch.Tensor | None:
        if self.precomputed is not None and self.cfg.needs_reference():
            return self.precomputed[role][torch.as_tensor(indices)].flatten().to(model.parallel.device)
        return self.reference_logps(model, rows, num_microbatches)

    # --- training and evaluation --------------------------------------------------------------------------------
    def step(self, model, batch: dict, indices, grad_scale: float, step_options: dict):
        """One forward and backward of the global batch of pairs: (its loss, TRL's metrics of it)."""
        rows = self.rows(batch, model.parallel.device)
        reference = self._reference(model, rows, indices, "train", step_options.get("num_microbatches", 1))
        objective = self.loss.objective(global_pairs=len(indices))
        loss, values = forward_backward_logps(model, rows["input_ids"], rows["labels"], objective,
                                              grad_scale=grad_scale, **self._inputs(rows, reference), **step_options)
        return loss, preference.metrics(values)

    @torch.no_grad()
    def evaluate(self, model, data, rows: int, micro_batch_size: int) -> dict[str, float]:
        """TRL's metrics over the first `rows` held-out pairs, eval_-prefixed, the same on every mesh: passes of
        micro batch x dp pairs, the last filled up with the first pairs, whose values are dropped."""
        per_pass = micro_batch_size * model.parallel.size("dp")
        values: dict[str, list] = {}
        for start in range(0, rows, per_pass):
            index = [i % rows for i in range(start, start + per_pass)]
            batch = self.rows(data.take(index), model.parallel.device)
            reference = self._reference(model, batch, index, "eval")
            out = forward_logps(model, batch["input_ids"], batch["labels"], self.loss.objective(per_pass),
                                **self._inputs(batch, reference))
            kept = 2 * min(per_pass, rows - start)  # sequences
            for k in ("logps", "rewards", "pair_loss"):
                values.setdefault(k, []).append(out[k].reshape(-1)[:kept])
        return preference.metrics({k: torch.cat(v) for k, v in values.items()}, prefix="eval_")


# --- the precomputed reference log-probs on disk ---------------------------------------------------------------

def save_reference(path: Path, logps: dict[str, torch.Tensor], digest: str):
    """Rank 0 writes the precomputed reference log-probs (atomically: a temp file renamed into place)."""
    from safetensors.torch import save

    from colozoo.core.files import fsync_write

    fsync_write(path, lambda f: f.write(save({k: v.contiguous() for k, v in logps.items()}, metadata={"data": digest})))


def read_reference(path: Path, digest: str, sizes: dict[str, int]) -> dict[str, torch.Tensor]:
    """The precomputed reference log-probs a checkpoint carries, checked against the run's data."""
    from safetensors import safe_open

    from colozoo.finetune.state import ResumeError

    with safe_open(str(path), "pt") as f:
        saved = f.metadata().get("data")
        logps = {k: f.get_tensor(k) for k in f.keys()}
    wrong = saved != digest or {k: len(v) for k, v in logps.items()} != sizes
    if wrong:
        raise ResumeError(f"{path} holds the reference log-probs of other data; resume with the same data, or "
                          f"pass --no-resume")
    return logps


def prepare_reference(cfg, inputs, trainer, resumed, reporter, rank0: bool) -> Path:
    """--precompute-ref-logps: the reference log-probs of the training (and held-out) pairs, read from the checkpoint
    a run resumes from, else computed now, before the first step, from the starting model (its adapters switched
    off); written to OUTPUT/reference_logps.safetensors, which is returned (every checkpoint carries a copy)."""
    import torch.distributed as dist

    from colozoo.finetune.fingerprint import data_fingerprint
    from colozoo.finetune.state import ResumeError

    sets = {"train": inputs.train, **({"eval": inputs.evaluation} if inputs.evaluation is not None else {})}
    digest = "-".join(data_fingerprint(data) for data in sets.values())
    sizes = {role: len(data) for role, data in sets.items()}
    saved = resumed.path / REFERENCE_FILE if resumed is not None else None
    if saved is not None and saved.exists():
        logps = read_reference(saved, digest, sizes)
    elif saved is not None and not trainer.lora:
        raise ResumeError(f"{resumed.path} was saved without --precompute-ref-logps, and its full fine-tuning has "
                          f"moved the weights the reference log-probs come from: resume without "
                          f"--precompute-ref-logps (a frozen copy of --model is the reference), or pass --no-resume")
    else:
        per_pass = trainer.micro_batch_size * trainer.model.parallel.size("dp")
        logps = {role: trainer.preference.precompute(trainer.model, data, per_pass, reporter, role)
                 for role, data in sets.items()}
    path = Path(cfg.output) / REFERENCE_FILE
    if rank0:
        save_reference(path, logps, digest)
    if dist.is_available() and dist.is_initialized():
        dist.barrier()
    trainer.preference.precomputed = logps
    return path
