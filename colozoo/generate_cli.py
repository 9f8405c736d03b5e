"""`colozoo generate`: text from a model on any mesh, streamed to the terminal as it is produced.

    colozoo generate gpt2 --prompt "Once upon a time" --max-new-tokens 40
    colozoo generate ./chat-model --chat --system "Answer briefly." --prompt "Hi!" --prompt "Why is the sky blue?"
    colozoo generate ./ckpt --nproc-per-node 4 --tp 2 --pp 2 --prompt-file prompts.txt --chat

Every rank runs it; rank 0 prints. The tokenizer (and with --chat its chat template) comes from the model's
directory, else from the adapter's. Everything that needs no model (the options, the prompts, the tokenizer, the mesh
against the model's heads, the prompts' length against its positions) is checked before any rank starts.
"""
from __future__ import annotations

import json
import os
import sys
from pathlib import Path

from colozoo.core.names import FLOAT_CHOICES
from colozoo.core.names import HelpFormatter
from colozoo.finetune.config import check_at_least
from colozoo.finetune.records import utf8_text


def add_parser(subparsers):
    p = subparsers.add_parser(
        "generate", help="generate text from a model on any mesh (--nproc-per-node or torchrun: several processes)",
        description="Generate text: greedy by default, sampled with --temperature > 0, --top-k or --top-p. Prompts of "
                    "different lengths are left-padded into one batch. Rank 0 prints each prompt's text in order as "
                    "it is produced, then prefill and decode tokens/s.",
        formatter_class=HelpFormatter)
    p.add_argument("model", help="a registry name (see `colozoo models`), a local HF / colozoo directory, or a "
                                 "checkpoint of a fine-tuning run (OUTPUT/checkpoints/step-N)")
    p.add_argument("--prompt", action="append", help="a prompt; repeat for a batch")
    p.add_argument("--prompt-file", type=Path, help="one prompt per line, or a .jsonl file of records with a "
                                                    "'prompt' field")
    p.add_argument("--chat", action="store_true", help="apply the tokenizer's chat template (each prompt a user "
                                                       "message) and print the replies only")
    p.add_argument("--system", help="with --chat: a system message before each prompt")
    p.add_argument("--reply-only", action="store_true", help="print only the generated text, not the prompt "
                                                             "(always so with --chat)")
    p.add_argument("--stop", action="append", metavar="TEXT", help="end a reply at this text, which is not printed; "
                                                                   "repeat for several")
    p.add_argument("--adapter", help="a PEFT LoRA adapter directory to attach (colozoo finetune --lora-r's, or peft's)")
    p.add_argument("--max-new-tokens", type=int, default=64, help="new tokens per prompt at most")
    p.add_argument("--temperature", type=float, help="sample at this temperature (0: greedy; default: greedy unless "
                                                     "--top-k or --top-p, which sample at 1)")
    p.add_argument("--top-k", type=int, help="sample from the k most likely tokens")
    p.add_argument("--top-p", type=float, help="sample from the smallest set of tokens whose probability is >= p")
    p.add_argument("--repetition-penalty", type=float, help="divide the scores of tokens already present by this")
    p.add_argument("--seed", type=int, default=0, help="sampling seed (every rank samples the same tokens)")
    add_mesh_arguments(p)
    p.set_defaults(func=run, command_parser=p)
    return p


def add_mesh_arguments(p, nproc: str = "N = tp x pp"):
    """--tp, --pp, --dtype and --nproc-per-node, as every command that runs a model on a tp x pp mesh offers them."""
    p.add_argument("--tp", type=int, default=1, help="tensor-parallel degree")
    p.add_argument("--pp", type=int, default=1, help="pipeline-parallel degree")
    p.add_argument("--dtype", choices=FLOAT_CHOICES, help="compute dtype (default: the checkpoint's)")
    p.add_argument("--nproc-per-node", type=int, metavar="N", help="start N processes on this machine (torchrun "
                                                                   f"--standalone, in this process); {nproc}")


# --- checks that need no model ------------------------------------------------------------------------------------

def check_options(args):
    for flag in ("max_new_tokens", "tp", "pp", "nproc_per_node", "top_k"):
        check_at_least(flag, getattr(args, flag))
    if args.temperature is not None and args.temperature < 0:
        raise ValueError(f"--temperature must be >= 0, got {args.temperature}")
    if args.temperature == 0 and (args.top_k is not None or args.top_p is not None):
        raise ValueError("--temperature 0 is greedy decoding, and --top-k / --top-p sample: drop one or the other")
    if args.top_p is not None and not 0 < args.top_p <= 1:
        raise ValueError(f"--top-p must be in (0, 1], got {args.top_p}")
    if args.repetition_penalty is not None and args.repetition_penalty <= 0:
        raise ValueError(f"--repetition-penalty must be > 0, got {args.repetition_penalty}")
    if args.system is not None and not args.chat:
        raise ValueError("--system goes with --chat (a system message is part of the chat template)")
    if args.adapter is not None and not (Path(args.adapter) / "adapter_config.json").is_file():
        raise ValueError(f"--adapter {args.adapter} is not a PEFT adapter directory (no adapter_config.json)")


def decoding_options(args) -> dict:
    """model.generate's options: greedy unless a positive temperature, --top-k or --top-p asks to sample."""
    sampling = bool(args.temperature) or args.top_k is not None or args.top_p is not None
    options = dict(max_new_tokens=args.max_new_tokens, do_sample=sampling, seed=args.seed)
    if sampling:
        options.update(temperature=args.temperature or 1.0, top_k=args.top_k or 0, top_p=args.top_p or 1.0)
    if args.repetition_penalty is not None:
        options["repetition_penalty"] = args.repetition_penalty
    return options


def stops_early(tokenizer, stop: list[str] | None) -> bool:
    """Whether generation itself can end a sequence at the stop strings: transformers' matcher needs a tokenizer
    whose tokens spell text piece by piece, which a word-level one does not. Without it the printed text still ends
    at the stop string (colozoo.generate_stream cuts it there); only the tokens after it are generated for nothing."""
    if not stop:
        return False
    from transformers.generation import StopStringCriteria

    try:
        StopStringCriteria(tokenizer, list(stop))
    except ValueError:
        return False
    return True


def read_prompts(args) -> list[str]:
    prompts = [(f"--prompt number {i + 1}", p) for i, p in enumerate(args.prompt or [])]
    if args.prompt_file is not None:
        prompts += prompt_file_records(args.prompt_file)
    if not prompts:
        raise ValueError("give at least one --prompt or a --prompt-file")
    empty = next((where for where, text in prompts if not text.strip()), None)
    if empty is not None:
        raise ValueError(f"{empty}: the prompt is empty (give the text to continue, or a question with --chat)")
    return [text for _, text in prompts]


def prompt_file_records(path: Path) -> list[tuple[str, str]]:
    """(where, prompt) for every non-blank line of a text file, or every record of a .jsonl file."""
    if not path.is_file():
        raise ValueError(f"--prompt-file {path} does not exist")
    lines = utf8_text(path.read_bytes(), path).splitlines()
    found = []
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        where = f"{path}:{number}"
        if path.suffix != ".jsonl":
            found.append((where, line))
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as e:
            raise ValueError(f"{where}: not valid JSON ({e.msg})") from None
        if not isinstance(record, dict) or "prompt" not in record:
            fields = list(record) if isinstance(record, dict) else f"a JSON {type(record).__name__}"
            raise ValueError(f"{where}: no field 'prompt' (the record is {fields})")
        if not isinstance(record["prompt"], str):
            raise ValueError(f"{where}: field 'prompt' is {record['prompt']!r}, not a string")
        found.append((where, record["prompt"]))
    if not found:
        raise ValueError(f"--prompt-file {path} is empty")
    return found


def load_tokenizer(directories: list, name: str):
    import transformers

    found = next((d for d in directories if d is not None and ((Path(d) / "tokenizer_config.json").exists()
                                                               or (Path(d) / "tokenizer.json").exists())), None)
    if found is None:
        raise ValueError(f"no tokenizer found with {name} (its directory needs tokenizer.json or "
                         f"tokenizer_config.json)")
    tokenizer = transformers.AutoTokenizer.from_pretrained(str(found), local_files_only=True)
    tokenizer.padding_side = "left"
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


def render(tokenizer, prompts: list[str], chat: bool, system: str | None) -> list[str]:
    """The prompts as the model reads them: with --chat, each a user message (after the system one) in the chat
    template, ending with the generation prompt."""
    if not chat:
        return prompts
    if not getattr(tokenizer, "chat_template", None):
        raise ValueError("--chat needs a tokenizer with a chat template, and this one has none")
    head = [{"role": "system", "content": system}] if system is not None else []
    return [tokenizer.apply_chat_template(head + [{"role": "user", "content": p}], tokenize=False,
                                          add_generation_prompt=True) for p in prompts]


def encode(tokenizer, texts: list[str], chat: bool):
    # a rendered chat template holds its special tokens already
    return tokenizer(texts, return_tensors="pt", padding=True, add_special_tokens=not chat)


class Prepared:
    """What generation needs before the model loads: the source, tokenizer and the encoded batch."""

    def __init__(self, args):
        from colozoo.api import resolve
        from colozoo.checkpoint.layout import check_mesh
        from colozoo.registry import check_positions

        self.prompts = read_prompts(args)
        self.source = resolve(args.model, verify=False)  # its directory and config: from_pretrained verifies weights
        check_mesh(self.source.config, tp=args.tp, pp=args.pp)  # the heads split over tp, the layers over pp
        self.tokenizer = load_tokenizer([getattr(self.source, "path", None), args.adapter], args.model)
        self.texts = render(self.tokenizer, self.prompts, args.chat, args.system)
        self.batch = encode(self.tokenizer, self.texts, args.chat)
        width = self.batch["input_ids"].shape[1]
        check_positions(self.source.config, width + args.max_new_tokens,
                        f"the longest prompt ({width} tokens) plus --max-new-tokens {args.max_new_tokens}")


# --- running --------------------------------------------------------------------------------------------------------

def run(args) -> int:
    check_options(args)
    try:
        return on_ranks(args, Prepared, generate)
    except KeyboardInterrupt:
        return 130


def on_ranks(args, prepare, work, dp: int | None = 1) -> int:
    """`work(args, prepare(args))` on every rank of a tp x pp job (dp=None: tp x pp x dp, dp the ranks left). With
    --nproc-per-node (outside torchrun) this process checks the mesh and `prepare`s first, so bad input is one line
    before any rank starts, then starts the ranks, which run the same command."""
    from colozoo.core.mesh import ParallelConfig
    from colozoo.finetune import launch

    command = args.command
    if args.nproc_per_node and not launch.under_torchrun():
        ParallelConfig.for_world(args.nproc_per_node, tp=args.tp, pp=args.pp, dp=dp)
        prepare(args)
        return launch.launch(args.nproc_per_node, [command, *launch.command_line(args.command_parser, args)],
                             module="colozoo.cli", command=command)
    ParallelConfig.for_world(int(os.environ.get("WORLD_SIZE", "1")), tp=args.tp, pp=args.pp, dp=dp)
    return work(args, prepare(args))


def end_token_ids(model, width: int, options: dict) -> tuple[int, ...]:
    """The tokens that end a sequence in this generate call, as it resolves them (the options, else the model's
    generation_config.json, else its config): the streamer stops printing a sequence where generation ends it."""
    from colozoo.runtime.generation_config import resolve

    return resolve(model, width, **options).eos_token_id or ()


def generate(args, prepared: Prepared) -> int:
    from colozoo.api import from_pretrained
    from colozoo.generate_stream import OrderedStreamer

    tokenizer, batch = prepared.tokenizer, prepared.batch
    model = from_pretrained(args.model, tp=args.tp, pp=args.pp, dtype=args.dtype, adapter=args.adapter)
    rank0 = int(os.environ.get("RANK", "0")) == 0
    options = dict(decoding_options(args), pad_token_id=tokenizer.pad_token_id)
    streamer = None
    if rank0:
        prompt_ids = [ids[mask.bool()].tolist() for ids, mask in zip(batch["input_ids"], batch["attention_mask"])]
        echo = None if args.chat or args.reply_only else prepared.prompts
        ends = end_token_ids(model, batch["input_ids"].shape[1], options)
        streamer = OrderedStreamer(tokenizer, prompt_ids, echo, args.stop, ends)
    if stops_early(tokenizer, args.stop):
        options.update(stop_strings=list(args.stop), tokenizer=tokenizer)
    out = model.generate(batch["input_ids"], attention_mask=batch["attention_mask"], streamer=streamer,
                         return_dict_in_generate=True, **options)
    if rank0:
        stats = out.timings
        prompt_tokens = int(batch["attention_mask"].sum())
        decode = stats["decode_steps"] * stats["batch"] / max(stats["decode_s"], 1e-9)
        print(f"prefill {prompt_tokens / max(stats['prefill_s'], 1e-9):.1f} tokens/s, decode {decode:.1f} "
              f"tokens/s ({stats['new_tokens']} new tokens x {stats['batch']} sequences)", file=sys.stderr)
    return 0
