"""`colozoo generate`: text from a model on any mesh, streamed to the terminal as it is produced.

    colozoo generate gpt2 --prompt "Once upon a time" --max-new-tokens 40
    torchrun --nproc-per-node 4 -m colozoo.cli generate ./ckpt --tp 2 --pp 2 --prompt-file prompts.txt --chat

Every rank runs it; rank 0 prints. The tokenizer (and with --chat its chat template) comes from the model's
directory.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

from colozoo.core.names import FLOAT_CHOICES


def add_parser(subparsers):
    p = subparsers.add_parser(
        "generate", help="generate text from a model on any mesh (launch with torchrun for more than one process)",
        description="Generate text: greedy by default, sampled with --temperature/--top-k/--top-p. Prompts of "
                    "different lengths are left-padded into one batch. Tokens stream to the terminal on rank 0, "
                    "then prefill and decode tokens/s.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("model", help="a registry name (see `colozoo models`) or a local HF / colozoo directory")
    p.add_argument("--prompt", action="append", default=[], help="a prompt; repeat for a batch")
    p.add_argument("--prompt-file", type=Path, help="one prompt per line (or a .jsonl with a 'prompt' field)")
    p.add_argument("--chat", action="store_true", help="wrap each prompt as a user message in the chat template")
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--temperature", type=float, default=None, help="sample at this temperature (default: greedy)")
    p.add_argument("--top-k", type=int, default=None, help="sample from the k most likely tokens")
    p.add_argument("--top-p", type=float, default=None, help="sample from the smallest set of probability >= p")
    p.add_argument("--repetition-penalty", type=float, default=None)
    p.add_argument("--seed", type=int, default=0, help="sampling seed (every rank samples the same tokens)")
    p.add_argument("--tp", type=int, default=1)
    p.add_argument("--pp", type=int, default=1)
    p.add_argument("--dtype", choices=FLOAT_CHOICES, default=None, help="default: the checkpoint's")
    p.set_defaults(func=run)
    return p


def read_prompts(args) -> list[str]:
    prompts = list(args.prompt)
    if args.prompt_file is not None:
        lines = [line for line in args.prompt_file.read_text().splitlines() if line.strip()]
        if args.prompt_file.suffix == ".jsonl":
            lines = [json.loads(line)["prompt"] for line in lines]
        prompts += lines
    if not prompts:
        raise ValueError("give at least one --prompt or a --prompt-file")
    return prompts


def load_tokenizer(model_dir: Path | None, name: str):
    import transformers

    if model_dir is None or not (model_dir / "tokenizer_config.json").exists() and \
            not (model_dir / "tokenizer.json").exists():
        raise ValueError(f"no tokenizer found with {name} (the directory needs tokenizer files)")
    tokenizer = transformers.AutoTokenizer.from_pretrained(model_dir)
    tokenizer.padding_side = "left"
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


def encode(tokenizer, prompts: list[str], chat: bool):
    if chat:
        if not getattr(tokenizer, "chat_template", None):
            raise ValueError("--chat needs a tokenizer with a chat template")
        prompts = [tokenizer.apply_chat_template([{"role": "user", "content": p}], tokenize=False,
                                                 add_generation_prompt=True) for p in prompts]
    return tokenizer(prompts, return_tensors="pt", padding=True, add_special_tokens=not chat)


def run(args) -> int:
    from transformers import TextStreamer

    from colozoo.api import from_pretrained, resolve

    prompts = read_prompts(args)
    source = resolve(args.model, verify=False)  # for its directory: from_pretrained verifies what it loads
    tokenizer = load_tokenizer(getattr(source, "path", None), args.model)
    batch = encode(tokenizer, prompts, args.chat)
    model = from_pretrained(args.model, tp=args.tp, pp=args.pp, dtype=args.dtype)
    rank0 = int(os.environ.get("RANK", "0")) == 0
    streamer = TextStreamer(tokenizer, skip_prompt=False) if rank0 and len(prompts) == 1 else None
    sampling = any(v is not None for v in (args.temperature, args.top_k, args.top_p))
    out = model.generate(batch["input_ids"], attention_mask=batch["attention_mask"],
                         max_new_tokens=args.max_new_tokens, do_sample=sampling,
                         temperature=args.temperature or 1.0, top_k=args.top_k or 0, top_p=args.top_p,
                         repetition_penalty=args.repetition_penalty, seed=args.seed,
                         pad_token_id=tokenizer.pad_token_id, streamer=streamer, return_dict_in_generate=True)
    if rank0:
        if streamer is None:
            for text in tokenizer.batch_decode(out.sequences, skip_special_tokens=True):
                print(text, end="\n\n")
        stats = out.timings
        prompt_tokens = int(batch["attention_mask"].sum())
        decode = stats["decode_steps"] * stats["batch"] / max(stats["decode_s"], 1e-9)
        print(f"prefill {prompt_tokens / max(stats['prefill_s'], 1e-9):.1f} tokens/s, decode {decode:.1f} "
              f"tokens/s ({stats['new_tokens']} new tokens x {stats['batch']} sequences)", file=sys.stderr)
    return 0
