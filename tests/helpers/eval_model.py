"""Tiny causal LMs for the evaluation tests, saved by transformers on random weights with a byte-level BPE tokenizer
trained on the shipped tasks' text (tokens that spell text piece by piece, spaces and newlines included, as real
tokenizers do). LLaMA's tokenizer starts every text with <s>, the others add no token, as their real ones.

Weights are drawn with std 0.2 (transformers' default, 0.02, makes a tiny random GPT-2 repeat one token forever):
greedy continuations then differ from prompt to prompt."""
import json
from pathlib import Path

import torch

TASKS = Path(__file__).resolve().parents[2] / "colozoo" / "evaluation" / "tasks" / "data"
# widths of a tiny model of hidden size h (transformers' defaults are a large model's)
EXTRAS = {"opt": lambda h: dict(word_embed_proj_dim=h, ffn_dim=2 * h),
          "llama": lambda h: dict(intermediate_size=2 * h, num_key_value_heads=2),
          "qwen3": lambda h: dict(intermediate_size=2 * h, num_key_value_heads=2, head_dim=16)}


def corpus() -> list[str]:
    texts = []
    for path in sorted(TASKS.glob("*.jsonl")):
        for line in path.read_text().splitlines():
            texts += [v if isinstance(v, str) else " ".join(map(str, v)) for v in json.loads(line).values()
                      if not isinstance(v, int)]
    return texts + ["Question: What did give the ?\nAnswer:"]


def byte_level_tokenizer(path, bos: bool, vocab_size: int = 800):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    special = {"bos_token": "<s>", "eos_token": "</s>"} if bos else {"bos_token": "<|endoftext|>",
                                                                       "eos_token": "<|endoftext|>"}
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(corpus(), trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=sorted(set(
        special.values())), initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    if bos:
        tok.post_processor = processors.TemplateProcessing(single="<s> $A", pair="<s> $A <s> $B",
                                                           special_tokens=[("<s>", tok.token_to_id("<s>"))])
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, **special)
    fast.save_pretrained(str(path))
    return fast


def make_eval_model(path, family: str, positions: int = 64, layers: int = 2, hidden: int = 64, seed: int = 0) -> Path:
    import transformers

    tokenizer = byte_level_tokenizer(path, bos=family == "llama")
    special = dict(bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id)
    extras = EXTRAS.get(family, lambda h: {})(hidden)
    config = transformers.AutoConfig.for_model(family, vocab_size=len(tokenizer), hidden_size=hidden,
                                               num_hidden_layers=layers, num_attention_heads=4,
                                               max_position_embeddings=positions, initializer_range=0.2, **special,
                                               **extras)
    torch.manual_seed(seed)
    transformers.AutoModelForCausalLM.from_config(config).save_pretrained(str(path))
    return Path(path)
