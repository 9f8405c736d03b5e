"""Preference tuning against TRL: the first step's loss, metrics and gradients of TRL's DPOTrainer (CPOTrainer for
SimPO), run in this process on CPU, and ours, for the same weights, pairs and settings.

A tiny LLaMA with a word-level tokenizer and chat template (chat_model.make_chat_llama) is the reference model; the
policy is the same model with its weights moved (full fine-tuning), or the base with LoRA adapters whose B is random
(so that the policy differs from the reference and every gradient is non-trivial). One trainer is set up per data
format and fine-tuning kind; each loss type is then TRL's own compute_loss on the same batch."""
from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import torch

from colozoo.finetune.config import FinetuneConfig

PAIRS = 4
LOSSES = {  # name: (our options, TRL's trainer attributes)
    "sigmoid": (dict(), dict(loss_types=["sigmoid"])),
    "hinge": (dict(loss_type="hinge", beta=0.3), dict(loss_types=["hinge"], beta=0.3)),
    "ipo": (dict(loss_type="ipo"), dict(loss_types=["ipo"])),
    "robust": (dict(loss_type="robust", label_smoothing=0.1), dict(loss_types=["robust"], label_smoothing=0.1)),
    "apo_zero": (dict(loss_type="apo_zero"), dict(loss_types=["apo_zero"])),
    "mpo": (dict(loss_type="sigmoid,ipo,apo_zero", loss_weights="0.8,0.2,1.0"),
            dict(loss_types=["sigmoid", "ipo", "apo_zero"], loss_weights=[0.8, 0.2, 1.0])),
}
METRICS = ("rewards/chosen", "rewards/rejected", "rewards/accuracies", "rewards/margins", "logps/chosen",
           "logps/rejected")


def string_records(path: Path) -> Path:
    """The shipped preference pairs as plain strings (prompt text, completions without their EOS)."""
    out = []
    for r in conversations()[:PAIRS]:
        prompt = " ".join(m["content"] for m in r["prompt"])
        out.append({"prompt": prompt, "chosen": " " + r["chosen"][0]["content"],
                    "rejected": " " + r["rejected"][0]["content"]})
    path.write_text("".join(json.dumps(r) + "\n" for r in out))
    return path


def conversation_records(path: Path) -> Path:
    """The shipped pairs as whole conversations, their prompt implicit in chosen and rejected (TRL extracts it for the
    whole dataset when its first record has none)."""
    out = [{"chosen": r["prompt"] + r["chosen"], "rejected": r["prompt"] + r["rejected"]}
           for r in conversations()[:PAIRS]]
    path.write_text("".join(json.dumps(r) + "\n" for r in out))
    return path


def conversations() -> list[dict]:
    repo = Path(__file__).resolve().parents[2]
    return [json.loads(line) for line in (repo / "data" / "preference.jsonl").read_text().splitlines()]


def moved_copy(model_dir: Path, dst: Path, std: float = 0.02, seed: int = 5) -> Path:
    """The model with every weight moved by normal noise: the policy of full fine-tuning (the reference stays)."""
    import transformers

    shutil.copytree(model_dir, dst)
    model = transformers.AutoModelForCausalLM.from_pretrained(dst, dtype=torch.float32)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=g) * std)
    model.save_pretrained(dst)
    return dst


def trl_dpo(model_dir: Path, policy_dir: Path, data: Path, adapter_dir: Path | None = None, losses=tuple(LOSSES)
            ) -> dict:
    """{loss name: (loss, metrics, {HF parameter: gradient})} of TRL's DPOTrainer on the first batch (all pairs), for
    the `losses` of LOSSES; with `adapter_dir` the policy is LoRA on the base (B random), whose adapters are written
    there in PEFT format."""
    import peft
    import transformers
    from datasets import Dataset
    from trl import DPOConfig, DPOTrainer

    os.environ.setdefault("TQDM_DISABLE", "1")
    records = [json.loads(line) for line in data.read_text().splitlines()]
    tokenizer = transformers.AutoTokenizer.from_pretrained(model_dir)
    load = lambda path: transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)  # noqa: E731
    args = DPOConfig(output_dir=str(data.parent / "trl"), per_device_train_batch_size=PAIRS, max_steps=1,
                     report_to="none", use_cpu=True, bf16=False, gradient_checkpointing=False, save_strategy="no",
                     eval_strategy="no", max_length=64, disable_tqdm=True)
    lora = peft.LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, target_modules="all-linear") if adapter_dir else None
    trainer = DPOTrainer(model=load(model_dir if lora else policy_dir), ref_model=None if lora else load(model_dir),
                         args=args, train_dataset=Dataset.from_list(records), processing_class=tokenizer,
                         peft_config=lora)
    model = trainer.model.train()
    if lora:
        g = torch.Generator().manual_seed(11)
        with torch.no_grad():
            for name, p in model.named_parameters():
                if "lora_B" in name:
                    p.copy_(torch.randn(p.shape, generator=g) * 0.1)
        model.save_pretrained(str(adapter_dir))
    batch = trainer.data_collator([trainer.train_dataset[i] for i in range(PAIRS)])
    results = {}
    for name in losses:
        attributes = LOSSES[name][1]
        for key, value in {"loss_weights": [1.0] * len(attributes["loss_types"]), "beta": 0.1,
                           "label_smoothing": 0.0, **attributes}.items():
            setattr(trainer, key, value)
        trainer._metrics["train"].clear()
        model.zero_grad()
        loss = trainer.compute_loss(model, batch)
        loss.backward()
        metrics = {k: v[0] for k, v in trainer._metrics["train"].items() if k in METRICS}
        grads = {n.removeprefix("base_model.model."): p.grad.clone() for n, p in model.named_parameters()
                 if p.grad is not None}
        results[name] = (loss.item(), metrics, grads)
    return results


def trl_simpo(model_dir: Path, data: Path, gamma: float = 0.5, beta: float = 2.0) -> tuple[float, dict]:
    """(loss, metrics) of TRL's CPOTrainer with loss_type="simpo" (cpo_alpha 0: SimPO alone) on the first batch."""
    import transformers
    from datasets import Dataset
    from trl.experimental.cpo import CPOConfig, CPOTrainer

    records = [json.loads(line) for line in data.read_text().splitlines()]
    tokenizer = transformers.AutoTokenizer.from_pretrained(model_dir)
    args = CPOConfig(output_dir=str(data.parent / "cpo"), per_device_train_batch_size=PAIRS, max_steps=1,
                     report_to="none", use_cpu=True, bf16=False, save_strategy="no", eval_strategy="no",
                     loss_type="simpo", cpo_alpha=0.0, simpo_gamma=gamma, beta=beta, max_length=64,
                     disable_tqdm=True)
    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    trainer = CPOTrainer(model=model, args=args, train_dataset=Dataset.from_list(records), processing_class=tokenizer)
    batch = trainer.data_collator([trainer.train_dataset[i] for i in range(PAIRS)])
    loss, metrics = trainer.get_batch_loss_metrics(trainer.model.train(), batch)
    return loss.item(), {k: v for k, v in metrics.items() if k in METRICS}


def our_config(model_dir: Path, data: Path, output: Path, **options) -> FinetuneConfig:
    return FinetuneConfig(model=str(model_dir), data=str(data), output=str(output), method="dpo", max_length=64,
                          micro_batch_size=PAIRS, **options)


def our_step(cfg: FinetuneConfig, policy_dir: Path, adapter_dir: Path | None = None, data_parallel: str = "fsdp",
             num_microbatches: int = 1, **degrees):
    """(loss, metrics, model) of our first step on all pairs of cfg.data, the policy from `policy_dir` (with the
    PEFT adapters of `adapter_dir`), the reference as the run would have it, on the mesh of `degrees`."""
    from colozoo.api import from_pretrained
    from colozoo.finetune import data as D
    from colozoo.finetune.preference_data import preference_dataset
    from colozoo.finetune.preference_train import PreferenceTraining, load_reference
    from colozoo.runtime.training import parallelize

    for k, v in degrees.items():
        setattr(cfg, k, v)
    model = from_pretrained(str(policy_dir), dtype=torch.float32, adapter=adapter_dir, **degrees)
    parallelize(model, data_parallel=data_parallel)
    reference = load_reference(cfg) if cfg.needs_reference() and adapter_dir is None else None
    tokenizer = D.load_tokenizer(policy_dir, model.config.vocab_size)
    data = preference_dataset(cfg.data, tokenizer, cfg.sequence_length())
    training = PreferenceTraining(cfg, model.eval(), reference)
    loss, metrics = training.step(model, data.take(range(len(data))), list(range(len(data))), 1.0,
                                  {"num_microbatches": num_microbatches})
    return float(loss), metrics, model
