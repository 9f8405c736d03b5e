"""GRPO against TRL: TRL's GRPOTrainer scores a fixed set of completions (its generation bypassed: the completions
are what `_generate_single_turn` returns) and computes its loss on them with given old and reference log-probs
(`_compute_loss`); ours scores the same completions and trains on them with the same log-probs.

A tiny LLaMA with a word-level tokenizer and chat template (chat_model.make_chat_llama) is the base; the policy is the
base with its weights moved, so that the old and reference log-probs (the base's) differ from the policy's."""
from __future__ import annotations

import json
import os
from pathlib import Path

import torch

from colozoo.finetune.config import FinetuneConfig

GROUP, ROWS, LENGTH = 4, 8, 6
STRING_PROMPTS = [{"prompt": "the cat ate", "answer": "cat"}, {"prompt": "on Monday the dog", "answer": None}]
CHAT_PROMPTS = [{"prompt": [{"role": "user", "content": "What did the fox eat on Wednesday?"}], "answer": "fox"},
                {"prompt": [{"role": "user", "content": "the dog ran"}], "answer": None}]
LOSS_METRICS = ("kl", "entropy", "clip_ratio/low_mean", "clip_ratio/high_mean", "clip_ratio/region_mean",
                "clip_ratio/low_min", "clip_ratio/high_max", "cispo_clip_ratio")


def words(prompts, completions, **kwargs):
    """A reward for every completion: its words / 4."""
    return [len(_text(c).split()) / 4 for c in completions]


def mentions(prompts, completions, answer, **kwargs):
    """1 where the completion names the record's answer, None where the record has none."""
    return [None if a is None else float(a in _text(c).split()) for c, a in zip(completions, answer)]


def _text(completion) -> str:
    return completion if isinstance(completion, str) else completion[0]["content"]


def write_prompts(path: Path, records) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def fixed_completions(tokenizer, seed: int = 0) -> list[list[int]]:
    """ROWS completions of at most LENGTH tokens: some end with EOS, the others reached LENGTH; some name "cat",
    "fox" or "dog"."""
    g = torch.Generator().manual_seed(seed)
    named = tokenizer.convert_tokens_to_ids(["cat", "fox", "dog"])
    out = []
    for i, n in enumerate([3, 6, 2, 6, 4, 6, 1, 6]):
        ids = torch.randint(10, 120, (n,), generator=g).tolist()
        if i % 3 == 0:
            ids[0] = named[i % 2]
        if n < LENGTH:
            ids.append(tokenizer.eos_token_id)
        out.append(ids[:LENGTH])
    return out


def trl_trainer(policy: Path, data: Path, temperature: float = 1.0):
    import transformers
    from datasets import Dataset
    from trl import GRPOConfig, GRPOTrainer

    os.environ.setdefault("TQDM_DISABLE", "1")
    records = [json.loads(line) for line in data.read_text().splitlines()]
    args = GRPOConfig(output_dir=str(data.parent / "trl-grpo"), per_device_train_batch_size=ROWS,
                      num_generations=GROUP, max_completion_length=LENGTH, report_to="none", use_cpu=True,
                      bf16=False, save_strategy="no", disable_tqdm=True, max_steps=1, beta=0.0,
                      temperature=temperature, reward_weights=[1.0, 0.5])
    model = transformers.AutoModelForCausalLM.from_pretrained(policy, dtype=torch.float32)
    trainer = GRPOTrainer(model=model, reward_funcs=[words, mentions], args=args,
                          train_dataset=Dataset.from_list(records),
                          processing_class=transformers.AutoTokenizer.from_pretrained(policy))
    trainer.current_gradient_accumulation_steps = 1
    return trainer, records


def trl_scored(trainer, records, completions, scale_rewards="group", mask_truncated=False) -> tuple[dict, dict]:
    """(the inputs _compute_loss takes, TRL's rollout metrics) for `completions` of each record sampled GROUP
    times."""
    trainer._generate_single_turn = lambda prompt_ids, *args, **kwargs: ([list(c) for c in completions], None)
    trainer.scale_rewards, trainer.mask_truncated_completions = scale_rewards, mask_truncated
    trainer.beta = 0.0  # no reference forward here: the tests give the reference log-probs
    trainer._metrics["train"].clear()
    trainer.model.train()
    inputs = trainer._generate_and_score_completions([r for r in records for _ in range(GROUP)])
    return inputs, {k: v[0] for k, v in trainer._metrics["train"].items() if k != "num_tokens"}


def trl_loss(trainer, inputs: dict, loss_type: str, beta: float, old=None, ref=None, epsilon=0.2,
             epsilon_high=0.28) -> tuple[float, dict, dict]:
    """(loss, metrics, gradients by HF name) of TRL's _compute_loss on `inputs`, with old / reference log-probs."""
    trainer.loss_type, trainer.beta, trainer.epsilon_low, trainer.epsilon_high = loss_type, beta, epsilon, epsilon_high
    inputs = dict(inputs)
    for key, value in (("old_per_token_logps", old), ("ref_per_token_logps", ref)):
        inputs.pop(key, None)
        if value is not None:
            inputs[key] = value
    trainer._metrics["train"].clear()
    trainer.model.zero_grad()
    loss = trainer._compute_loss(trainer.model, inputs)
    loss.backward()
    grads = {n: p.grad.clone() for n, p in trainer.model.named_parameters() if p.grad is not None}
    return loss.item(), {k: v[0] for k, v in trainer._metrics["train"].items()}, grads


@torch.no_grad()
def hf_completion_logps(model_dir: Path, inputs: dict, temperature: float = 1.0) -> torch.Tensor:
    """Another model's per-token log-probs of the completions (TRL's layout: batch, completion length)."""
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    ids = torch.cat([inputs["prompt_ids"], inputs["completion_ids"]], 1)
    mask = torch.cat([inputs["prompt_mask"], inputs["completion_mask"]], 1)
    length = inputs["completion_ids"].shape[1]
    logits = model(input_ids=ids, attention_mask=mask).logits[:, -length - 1:-1] / temperature
    return logits.log_softmax(-1).gather(-1, inputs["completion_ids"][..., None]).squeeze(-1)


def our_layout(per_completion_token: torch.Tensor, prompt_width: int) -> torch.Tensor:
    """TRL's (batch, completion) log-probs laid out as our rows: the prompt's positions first (0)."""
    return torch.nn.functional.pad(per_completion_token, (prompt_width, 0))


def our_config(model_dir: Path, data: Path, output: Path, **options) -> FinetuneConfig:
    settings = dict(method="grpo", reward_funcs=[words, mentions], reward_weights=[1.0, 0.5], num_generations=GROUP,
                    max_completion_length=LENGTH, micro_batch_size=ROWS, epsilon_high=0.28)
    return FinetuneConfig(model=str(model_dir), data=str(data), output=str(output), **{**settings, **options})


def our_training(cfg: FinetuneConfig, policy: Path, data_parallel: str = "fsdp", adapter: Path | None = None,
                 **degrees):
    """(model, GrpoTraining) of `cfg` on the mesh of `degrees`, as the run would build them."""
    from colozoo.api import from_pretrained
    from colozoo.finetune import data as D
    from colozoo.finetune.grpo_data import prompt_dataset
    from colozoo.finetune.grpo_train import GrpoTraining
    from colozoo.finetune.preference_train import load_reference
    from colozoo.runtime.training import parallelize

    for k, v in degrees.items():
        setattr(cfg, k, v)
    model = from_pretrained(str(policy), dtype=torch.float32, adapter=adapter, **degrees)
    parallelize(model, data_parallel=data_parallel)
    tokenizer = D.load_tokenizer(policy, model.config.vocab_size)
    prompts = prompt_dataset(cfg.data, tokenizer, cfg.max_completion_length)
    sampler = D.BatchSampler(len(prompts), len(prompts), 0, 1, cfg.seed, shuffle=False)
    reference = load_reference(cfg) if cfg.beta and adapter is None and not cfg.lora_r else None
    return model.eval(), GrpoTraining(cfg, model, prompts, tokenizer, sampler, total_steps=1, reference_model=reference)


def our_step(training, model, completions: list[list[int]], old=None, ref=None, num_microbatches: int = 1):
    """(loss, rollout metrics, update metrics) of our first step on `completions` of each prompt sampled GROUP
    times, with old / reference log-probs in TRL's layout (None: computed as the run does)."""
    from colozoo.finetune.grpo_rollout import Completions

    data, eos, pad = training.data, training.eos, training.pad
    indices = torch.arange(len(data)).repeat_interleave(GROUP)
    finished = set(eos) | {pad}
    sampled = Completions(indices, [data.prompt_ids(int(i)) for i in indices], completions,
                          torch.tensor([c[-1] not in finished for c in completions]))
    rollout, rollout_metrics = training.scored(model, sampled, 1)
    prompt_width = rollout.input_ids.shape[1] - max(len(c) for c in completions)
    micro = num_microbatches
    if training.cfg.num_iterations > 1:
        rollout.old_logps = training.token_logps(model, rollout, micro) if old is None else our_layout(old, prompt_width)
    if training.cfg.beta:
        rollout.ref_logps = training.reference_logps(model, rollout, micro) if ref is None else \
            our_layout(ref, prompt_width)
    training.rollout = rollout
    loss, metrics = training.step(model, 1, 1.0, {"num_microbatches": micro})
    return float(loss), rollout_metrics, metrics


def random_adapter(base: Path, path: Path, seed: int = 11) -> Path:
    """A PEFT LoRA adapter (r 4, all linear layers) of `base` whose B is random, so that the policy differs from
    the base its reference is."""
    import peft
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    model = peft.get_peft_model(model, peft.LoraConfig(r=4, lora_alpha=8, target_modules="all-linear"))
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=g) * 0.1)
    model.save_pretrained(str(path))
    return path


def sampled_completions(rollout) -> list[list[int]]:
    return [row[labels != -100].tolist() for row, labels in zip(rollout.input_ids, rollout.labels)]


def mesh_step(base, policy, data, output, degrees: dict, data_parallel: str = "fsdp", micro: int = 1,
              adapter=None, completions=None, **options):
    """(loss, metrics, sampled completions, gradient norm) of the first step on the mesh of `degrees`: sampled
    there, or on `completions`."""
    from colozoo.runtime.clipping import global_grad_norm

    cfg = our_config(base, data, output, micro_batch_size=ROWS // degrees.get("dp", 1) // micro,
                     lora_r=4 if adapter else None, **options)
    model, training = our_training(cfg, policy, data_parallel, adapter, **degrees)
    if completions is None:
        loss, metrics = training.step(model, 1, 1.0, {"num_microbatches": micro})
        loss = float(loss)
    else:
        loss, rollout_metrics, update = our_step(training, model, completions, num_microbatches=micro)
        metrics = {**rollout_metrics, **update}
    return loss, metrics, sampled_completions(training.rollout), float(global_grad_norm(model))


TINY_WORDS = "the cat dog ate sat ran fox bird on a mat".split()
TINY_PROMPTS = ["the dog", "a bird", "the fox sat", "on a mat", "a dog ran", "the bird ate"]


def make_tiny_llama(path: Path) -> Path:
    """A 2-layer LLaMA (hidden 32) over a word-level vocabulary of 14 tokens, and its prompts (OUTPUT/prompts.jsonl)."""
    from colozoo.demo_finetune import make_tiny_causal_lm

    make_tiny_causal_lm(path, "llama", corpus=[" ".join(TINY_WORDS)], layers=2, hidden=32, heads=2, positions=32,
                        num_key_value_heads=1)
    write_prompts(path / "prompts.jsonl", [{"prompt": p, "wanted": "cat"} for p in TINY_PROMPTS])
    return path


def cat_share(completions, wanted, **kwargs):
    """The toy reward: the share of the completion's words that are the record's wanted word."""
    return [sum(w == target for w in text.split()) / max(len(text.split()), 1)
            for text, target in zip(completions, wanted)]


def entropy_error(vocab: int) -> float:
    """The largest difference between vocab_parallel_entropy over this rank's (padded) slice of random logits and
    the entropy of the whole vocabulary's softmax."""
    import torch.distributed as dist

    from colozoo.core.groups import vocab_range
    from colozoo.layers.vocab import vocab_parallel_entropy

    full = torch.randn(3, 5, vocab, generator=torch.Generator().manual_seed(0)) * 3
    start, stop, local = vocab_range(vocab, dist.group.WORLD)
    logits = torch.zeros(3, 5, local)
    logits[..., : stop - start] = full[..., start:stop]
    log_probs = full.log_softmax(-1)
    return float((vocab_parallel_entropy(logits, vocab, dist.group.WORLD) + (log_probs.exp() * log_probs).sum(-1))
                 .abs().max())
