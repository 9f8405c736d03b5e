"""A GRPO step at tp=1 against TRL's GRPOTrainer on the same LLaMA-shaped model, prompts, group size and CPU, the
rollout (sampling the group's completions, scoring them) and the update (the policy's forward and backward on the
completions, clipping, AdamW) timed apart.

Ours: colozoo.finetune's --method grpo (colozoo's own generate through the KV cache, then forward_backward_logps on the
vocab-parallel log-probs). Peer: GRPOTrainer._generate_and_score_completions (transformers' generate) and
_compute_loss + backward, then the same clipping and optimizer step. Both sample --completion tokens from each of the
same prompts (a random model rarely ends a completion early; the mean completion lengths are reported as the check),
score them with the same reward function and start from the same weights. Steps alternate and the clock is the
process's CPU time (one thread) on CPU. "ratio" > 1: colozoo's whole step is faster.

    python bench/grpo.py [--layers 4] [--hidden 256] [--prompts 2] [--group 4] [--words 32] [--completion 32]
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
from colozoo.finetune.data import BatchSampler, load_tokenizer  # noqa: E402
from colozoo.finetune.grpo_data import prompt_dataset  # noqa: E402
from colozoo.finetune.grpo_train import GrpoTraining  # noqa: E402


def length_reward(completions, **kwargs):
    """Longer completions score higher (any reward will do: both sides call it on the same kind of batch)."""
    return [len(c.split()) / 10 for c in completions]


def make_model(work: Path, args) -> tuple[Path, Path]:
    """A LLaMA-shaped model with a word-level tokenizer, and string prompts of its words."""
    rng = random.Random(0)
    words = word_llama(work / "model", args)
    prompts = [{"prompt": " ".join(rng.choice(words) for _ in range(args.words))} for _ in range(args.prompts)]
    (work / "prompts.jsonl").write_text("".join(json.dumps(p) + "\n" for p in prompts))
    return work / "model", work / "prompts.jsonl"


def ours(model_dir: Path, data: Path, args):
    cfg = FinetuneConfig(model=str(model_dir), data=str(data), method="grpo", reward_funcs=[length_reward],
                         num_generations=args.group, max_completion_length=args.completion,
                         micro_batch_size=args.prompts * args.group, lr=1e-6, eval_fraction=0.0)
    model, _ = runtime.load_model(cfg, "lm")
    runtime.prepare_training(model, cfg)
    model.eval()  # dropout off
    optimizer = runtime.build_optimizer(model, cfg.lr, 0.0)
    tokenizer = load_tokenizer(model_dir, model.config.vocab_size)
    prompts = prompt_dataset(data, tokenizer, args.completion)
    sampler = BatchSampler(len(prompts), len(prompts), 0, 1, cfg.seed)
    training = GrpoTraining(cfg, model, prompts, tokenizer, sampler, total_steps=10 ** 6)
    number = iter(range(1, 10 ** 6))

    def rollout():
        training.rollout, training.unlogged = training.make_rollout(model, next(number), {})
        return training.unlogged["completions/mean_length"]

    def update():
        optimizer.zero_grad(set_to_none=True)
        training.step(model, training.rollout.step, 1.0, {"num_microbatches": 1})
        runtime.clip_grad_norm(model, 1.0)
        optimizer.step()
    return rollout, update


def trl(model_dir: Path, data: Path, args, work: Path):
    from datasets import Dataset
    from trl import GRPOConfig, GRPOTrainer

    records = [json.loads(line) for line in data.read_text().splitlines()]
    config = GRPOConfig(output_dir=str(work / "trl"), per_device_train_batch_size=args.prompts * args.group,
                        num_generations=args.group, max_completion_length=args.completion, max_steps=10,
                        report_to="none", use_cpu=True, bf16=False, save_strategy="no", learning_rate=1e-6,
                        disable_tqdm=True)
    trainer = GRPOTrainer(model=transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32),
                          reward_funcs=length_reward, args=config, train_dataset=Dataset.from_list(records),
                          processing_class=transformers.AutoTokenizer.from_pretrained(model_dir))
    trainer.create_optimizer_and_scheduler(num_training_steps=10)
    trainer.current_gradient_accumulation_steps = 1  # what train() sets before its first training_step
    model = trainer.model.train()
    batch = [r for r in records for _ in range(args.group)]
    scored = {}

    def rollout():
        trainer._metrics["train"].clear()
        scored["inputs"] = trainer._generate_and_score_completions(batch)
        return trainer._metrics["train"]["completions/mean_length"][0]

    def update():
        trainer.optimizer.zero_grad(set_to_none=True)
        trainer._compute_loss(model, scored["inputs"]).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        trainer.optimizer.step()
    return rollout, update


def timed(part) -> float:
    start = clock()
    part()
    return clock() - start


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--vocab", type=int, default=4000, help="words of the tokenizer")
    parser.add_argument("--prompts", type=int, default=2)
    parser.add_argument("--group", type=int, default=4, help="completions per prompt (--num-generations)")
    parser.add_argument("--words", type=int, default=32, help="words of each prompt")
    parser.add_argument("--completion", type=int, default=32, help="--max-completion-length")
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        torch.set_num_threads(1)
    work = Path(tempfile.mkdtemp(prefix="colozoo-bench-grpo-"))
    model_dir, data = make_model(work, args)
    sides = {"colozoo": ours(model_dir, data, args), "trl": trl(model_dir, data, args, work)}
    lengths = {name: rollout() for name, (rollout, update) in sides.items()}  # warmup
    for _, update in sides.values():
        update()
    times = {name: {"rollout": [], "update": []} for name in sides}
    for _ in range(args.repeats):
        for name, (rollout, update) in sides.items():
            times[name]["rollout"].append(timed(rollout))
            times[name]["update"].append(timed(update))
    median = {name: {part: statistics.median(t) for part, t in parts.items()} for name, parts in times.items()}
    step = {name: parts["rollout"] + parts["update"] for name, parts in median.items()}
    print(json.dumps({
        "bench": "grpo/llama",
        "config": {"hidden": args.hidden, "layers": args.layers, "vocab": args.vocab, "prompts": args.prompts,
                   "num_generations": args.group, "prompt_tokens": args.words, "max_completion_length": args.completion,
                   "beta": 0.0, "loss_type": "dapo", "dtype": "float32", "threads": torch.get_num_threads(),
                   "device": "cuda" if torch.cuda.is_available() else "cpu", "repeats": args.repeats},
        "metrics": {"colozoo_s_per_step": step["colozoo"], "trl_s_per_step": step["trl"],
                    "colozoo_rollout_s": median["colozoo"]["rollout"], "trl_rollout_s": median["trl"]["rollout"],
                    "colozoo_update_s": median["colozoo"]["update"], "trl_update_s": median["trl"]["update"],
                    "rollout_ratio": median["trl"]["rollout"] / median["colozoo"]["rollout"],
                    "update_ratio": median["trl"]["update"] / median["colozoo"]["update"],
                    "colozoo_mean_completion_length": lengths["colozoo"], "trl_mean_completion_length": lengths["trl"],
                    "steps_s": times},
        "peer": "TRL GRPOTrainer: _generate_and_score_completions (transformers generate) and _compute_loss + backward "
                "+ clip + AdamW, same weights, prompts and group size",
        "ratio": step["trl"] / step["colozoo"]}))


if __name__ == "__main__":
    main()
