"""A DPO step (the reference's forward, the policy's forward and backward over chosen and rejected, AdamW) at tp=1
against TRL's DPOTrainer on the same LLaMA-shaped model, pairs and CPU.

Ours: colozoo.finetune's --method dpo step (the frozen reference copy, forward_backward_logps on the vocab-parallel
log-probs, global-norm clipping, AdamW). Peer: DPOTrainer.training_step (its reference model's forward, the policy's
forward and backward through TRL's fused LM head) then the same clipping and optimizer step. Both tokenize the same
string pairs, start from the same weights and log the same first-step logps/chosen (reported as a check). Steps
alternate and the clock is the process's CPU time (one thread) on CPU. "ratio" > 1: colozoo is faster.

    python bench/dpo.py [--layers 4] [--hidden 256] [--pairs 4] [--words 48] [--repeats 5]
"""
from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import tempfile
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
os.environ.setdefault("TQDM_DISABLE", "1")

import torch  # noqa: E402
import transformers  # noqa: E402

from _word_llama import clock, word_llama  # noqa: E402

from colozoo.finetune import runtime  # noqa: E402
from colozoo.finetune.config import FinetuneConfig  # noqa: E402
from colozoo.finetune.data import load_tokenizer  # noqa: E402
from colozoo.finetune.preference_data import preference_dataset  # noqa: E402
from colozoo.finetune.preference_train import PreferenceTraining, load_reference  # noqa: E402


def make_model(work: Path, args) -> tuple[Path, Path]:
    """A LLaMA-shaped model with a word-level tokenizer, and string pairs of its words (prompt, chosen, rejected)."""
    rng = random.Random(0)
    words = word_llama(work / "model", args)
    text = lambda: " ".join(rng.choice(words) for _ in range(args.words))  # noqa: E731
    pairs = [{"prompt": text(), "chosen": " " + text(), "rejected": " " + text()} for _ in range(args.pairs)]
    (work / "pairs.jsonl").write_text("".join(json.dumps(p) + "\n" for p in pairs))
    return work / "model", work / "pairs.jsonl"


def ours(model_dir: Path, data: Path, max_length: int, pairs: int):
    cfg = FinetuneConfig(model=str(model_dir), data=str(data), method="dpo", max_length=max_length,
                         micro_batch_size=pairs, lr=1e-6)
    model, _ = runtime.load_model(cfg, "lm")
    runtime.prepare_training(model, cfg)
    model.eval()  # dropout off, as DPOTrainer
    optimizer = runtime.build_optimizer(model, cfg.lr, 0.0)
    training = PreferenceTraining(cfg, model, load_reference(cfg))
    dataset = preference_dataset(data, load_tokenizer(model_dir, model.config.vocab_size), max_length)
    batch = dataset.take(range(pairs))

    def step():
        optimizer.zero_grad(set_to_none=True)
        _, metrics = training.step(model, batch, list(range(pairs)), 1.0, {"num_microbatches": 1})
        runtime.clip_grad_norm(model, 1.0)
        optimizer.step()
        return metrics["logps/chosen"]
    return step


def trl(model_dir: Path, data: Path, max_length: int, pairs: int, work: Path):
    from datasets import Dataset
    from trl import DPOConfig, DPOTrainer

    records = [json.loads(line) for line in data.read_text().splitlines()]
    args = DPOConfig(output_dir=str(work / "trl"), per_device_train_batch_size=pairs, max_steps=10, report_to="none",
                     use_cpu=True, bf16=False, gradient_checkpointing=False, save_strategy="no", eval_strategy="no",
                     max_length=max_length, learning_rate=1e-6, disable_tqdm=True)
    load = lambda: transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)  # noqa: E731
    trainer = DPOTrainer(model=load(), ref_model=load(), args=args, train_dataset=Dataset.from_list(records),
                         processing_class=transformers.AutoTokenizer.from_pretrained(model_dir))
    trainer.create_optimizer_and_scheduler(num_training_steps=10)
    trainer.current_gradient_accumulation_steps = 1  # what train() sets before its first training_step
    model = trainer.model.train()
    batch = trainer.data_collator([trainer.train_dataset[i] for i in range(pairs)])

    def step():
        trainer.optimizer.zero_grad(set_to_none=True)
        trainer._metrics["train"].clear()
        trainer.training_step(model, batch)
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        trainer.optimizer.step()
        return trainer._metrics["train"]["logps/chosen"][0]
    return step


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--vocab", type=int, default=4000, help="words of the tokenizer")
    parser.add_argument("--pairs", type=int, default=4)
    parser.add_argument("--words", type=int, default=48, help="words of each prompt and completion")
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        torch.set_num_threads(1)
    work = Path(tempfile.mkdtemp(prefix="colozoo-bench-dpo-"))
    model_dir, data = make_model(work, args)
    max_length = 2 * args.words + 8
    sides = {"colozoo": ours(model_dir, data, max_length, args.pairs), "trl": trl(model_dir, data, max_length,
                                                                                   args.pairs, work)}
    first = {name: step() for name, step in sides.items()}  # warmup, and the same first step on both sides
    times = {name: [] for name in sides}
    for _ in range(args.repeats):
        for name, step in sides.items():
            start = clock()
            step()
            times[name].append(clock() - start)
    median = {name: statistics.median(t) for name, t in times.items()}
    print(json.dumps({
        "bench": "dpo/llama",
        "config": {"hidden": args.hidden, "layers": args.layers, "vocab": args.vocab, "pairs": args.pairs,
                   "tokens_per_sequence": 2 * args.words + 1, "dtype": "float32", "threads": torch.get_num_threads(),
                   "device": "cuda" if torch.cuda.is_available() else "cpu", "repeats": args.repeats},
        "metrics": {"colozoo_s_per_step": median["colozoo"], "trl_s_per_step": median["trl"],
                    "colozoo_steps_s": times["colozoo"], "trl_steps_s": times["trl"],
                    "first_step_logps_chosen_diff": abs(first["colozoo"] - first["trl"])},
        "peer": "TRL DPOTrainer.training_step (reference model, fused LM head) + clip + AdamW, same weights and pairs",
        "ratio": median["trl"] / median["colozoo"]}))


if __name__ == "__main__":
    main()
