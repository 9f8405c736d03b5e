"""What the model writes while it learns: at every evaluation of a causal LM, greedy continuations of a few
held-out prompts, printed and appended to OUTPUT/samples.jsonl."""
from __future__ import annotations

import json
from pathlib import Path

import torch


def held_out_prompts(data, count: int, prompt_tokens: int, until_answer: bool = False
                     ) -> tuple[torch.Tensor, torch.Tensor] | None:
    """The first `prompt_tokens` real tokens of the first `count` held-out sequences, left-padded; None without
    data. `until_answer` (chat data): only the tokens before each sequence's first trained label, i.e. the
    conversation up to the assistant's first answer, with the template's generation prompt."""
    if data is None or len(data) == 0 or count == 0:
        return None
    rows = data.take(range(min(count, len(data))))
    ids, mask = rows["input_ids"], rows.get("attention_mask", torch.ones_like(rows["input_ids"]))
    prompts = [row[keep.bool()][:prompt_tokens] for row, keep in zip(ids, mask)]
    if until_answer:
        answers = (rows["labels"] != -100).int().argmax(1).tolist()
        prompts = [p[:min(prompt_tokens, first)] for p, first in zip(prompts, answers)]
    width = max(len(p) for p in prompts)
    padded = torch.zeros(len(prompts), width, dtype=torch.long)
    attention = torch.zeros(len(prompts), width, dtype=torch.long)
    for i, p in enumerate(prompts):
        padded[i, width - len(p):], attention[i, width - len(p):] = p, 1
    return padded, attention


def why_no_samples(model) -> str | None:
    parallel = model.parallel
    if parallel.config.cp > 1 or parallel.sequence_parallel:
        return "samples need cp=1 and no sequence parallelism (generation runs one token at a time)"
    return None


def write_samples(model, prompts, tokenizer, step: int, output: Path, new_tokens: int, reporter,
                  rank0: bool) -> list[dict]:
    """Generate (collective: every rank), then print and append the samples on rank 0."""
    ids, mask = prompts
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    was_training = model.training
    model.eval()
    out = model.generate(ids, attention_mask=mask, max_new_tokens=new_tokens, do_sample=False, pad_token_id=pad)
    model.train(was_training)
    records = []
    for row, (full, keep) in enumerate(zip(out, mask)):
        prompt = full[: ids.shape[1]][keep.bool().to(full.device)]
        completion = full[ids.shape[1]:]
        records.append({"step": step, "prompt": tokenizer.decode(prompt, skip_special_tokens=True),
                        "completion": tokenizer.decode(completion, skip_special_tokens=True)})
    if rank0:
        with open(output / "samples.jsonl", "a") as f:
            for record in records:
                f.write(json.dumps(record) + "\n")
        for record in records:
            reporter.print(f"  sample at step {step}: {record['prompt']!r} -> {record['completion']!r}")
    return records
