"""Shared by the fine-tuning-method benchmarks (dpo.py, grpo.py): a LLaMA-shaped model with a word-level tokenizer
of `--vocab` words, saved as transformers saves it, and the clock they time steps with."""
from __future__ import annotations

import time
from pathlib import Path

import torch
import transformers

from colozoo.demo_finetune import build_tokenizer


def clock() -> float:
    """The process's CPU time on CPU (steps run on one thread), wall time after a synchronize on CUDA."""
    return time.process_time() if not torch.cuda.is_available() else (torch.cuda.synchronize(), time.perf_counter())[1]


def word_llama(path: Path, args) -> list[str]:
    """A LLaMA of `args.hidden` x `args.layers` over `args.vocab` words w0, w1, ... saved to `path`; returns the
    words."""
    words = [f"w{i}" for i in range(args.vocab)]
    build_tokenizer([" ".join(words)], path)
    tokenizer = transformers.AutoTokenizer.from_pretrained(path)
    config = transformers.LlamaConfig(vocab_size=len(tokenizer), hidden_size=args.hidden, num_hidden_layers=args.layers,
                                      intermediate_size=2 * args.hidden, num_attention_heads=max(1, args.hidden // 64),
                                      num_key_value_heads=max(1, args.hidden // 128), max_position_embeddings=512,
                                      eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(config).save_pretrained(path)
    return words
