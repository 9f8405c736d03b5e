"""The main demo, fully offline on a small CPU machine (`make demo`):

1. make a small GPT-2 with transformers' own save_pretrained, and a word-level tokenizer trained on the
   shipped stories (data/stories.jsonl), saved beside it;
2. convert it to a colozoo checkpoint sharded tp=2 x pp=2;
3. fine-tune it with 4 processes (torchrun's launcher, `colozoo finetune --nproc-per-node 4`) and show the loss falling;
4. export to HF, and prove transformers loads the export and gives the same logits as the colozoo model.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parent.parent
DATA = REPO / "data" / "stories.jsonl"
SPECIAL = {"eos_token": "<|endoftext|>", "pad_token": "<pad>", "unk_token": "<unk>"}


def texts(path=DATA) -> list[str]:
    return [json.loads(line)["text"] for line in Path(path).read_text().splitlines() if line.strip()]


def build_tokenizer(corpus: list[str], path):
    """A word-level tokenizer trained on `corpus`, wrapped as a transformers fast tokenizer and saved to `path`."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.WordLevel(unk_token=SPECIAL["unk_token"]))
    tok.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Whitespace(), pre_tokenizers.Punctuation()])
    tok.train_from_iterator(corpus, trainers.WordLevelTrainer(special_tokens=list(SPECIAL.values())))
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, **SPECIAL)
    fast.save_pretrained(str(path))
    return fast


def make_tiny_causal_lm(path, model_type="gpt2", corpus=None, layers=4, hidden=64, heads=4, positions=64, seed=0,
                        **overrides):
    """A random-weight causal LM checkpoint written by transformers itself, with a tokenizer for `corpus`; `overrides`
    set what else the config holds (a family's own widths: transformers' defaults are those of a large model)."""
    import transformers

    tokenizer = build_tokenizer(corpus if corpus is not None else texts(), path)
    special = dict(bos_token_id=tokenizer.eos_token_id, eos_token_id=tokenizer.eos_token_id,
                   pad_token_id=tokenizer.pad_token_id)
    config = transformers.AutoConfig.for_model(model_type, vocab_size=len(tokenizer), hidden_size=hidden,
                                               num_hidden_layers=layers, num_attention_heads=heads,
                                               max_position_embeddings=positions, **special,
                                               **overrides)
    torch.manual_seed(seed)
    transformers.AutoModelForCausalLM.from_config(config).save_pretrained(str(path))
    return Path(path)


def make_tiny_gpt2(path, corpus=None, n_layer=4, n_embd=64, n_head=4, n_positions=64, seed=0, **overrides):
    return make_tiny_causal_lm(path, "gpt2", corpus, n_layer, n_embd, n_head, n_positions, seed, **overrides)


def convert(src: Path, dst: Path, tp: int, pp: int) -> Path:
    """An HF directory -> a colozoo checkpoint on tp x pp (the tokenizer travels along); the HF dir if convert is missing."""
    try:
        from colozoo.checkpoint.convert import convert as colozoo_convert
    except ImportError:
        print("  (colozoo.checkpoint.convert is not available: training starts from the HF directory instead)")
        return src
    colozoo_convert(str(src), str(dst), tp=tp, pp=pp)
    for file in src.iterdir():
        if file.name.startswith(("tokenizer", "special_tokens")):
            (dst / file.name).write_bytes(file.read_bytes())
    return dst


def finetune(model: Path, output: Path, tp: int, pp: int, steps: int) -> int:
    cmd = [sys.executable, "-m", "colozoo.finetune", "--nproc-per-node", "4",
           "--model", str(model), "--data", str(DATA), "--output", str(output),
           "--tp", str(tp), "--pp", str(pp), "--seq-len", "32", "--micro-batch-size", "4",
           "--global-batch-size", str(16 * 4 // (tp * pp)), "--lr", "3e-3", "--warmup-steps", "5",
           "--steps", str(steps), "--eval-interval", "20", "--save-interval", "20", "--no-resume"]
    env = dict(os.environ, OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1", TRANSFORMERS_VERBOSITY="error")
    process = subprocess.Popen(cmd, env=env)
    while True:  # Ctrl-C reaches the launcher too, which lets the ranks save and exits: wait for it
        try:
            return process.wait()
        except KeyboardInterrupt:
            continue


def check_export(output: Path) -> float:
    """Load the export with transformers and compare its logits with the colozoo model's (probe.pt)."""
    import transformers

    probe = torch.load(output / "probe.pt")
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(output / "hf")).eval()
    with torch.no_grad():
        logits = hf(**probe["inputs"]).logits
    keep = probe["inputs"]["attention_mask"].bool()
    return (logits - probe["logits"])[keep].abs().max().item()


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workdir", default="runs/demo")
    parser.add_argument("--steps", type=int, default=60)
    args = parser.parse_args(argv)
    work = Path(args.workdir)
    shutil.rmtree(work, ignore_errors=True)  # the demo always starts from scratch
    started = time.time()
    tp, pp = 2, 2

    print(f"[1/4] a small GPT-2 made by transformers' save_pretrained, with a tokenizer for {DATA.name}")
    hf_dir = make_tiny_gpt2(work / "gpt2-tiny")
    print(f"      -> {hf_dir}")
    print(f"[2/4] converting to a colozoo checkpoint sharded tp={tp} x pp={pp}")
    model = convert(hf_dir, work / f"gpt2-tiny-tp{tp}-pp{pp}", tp, pp)
    print(f"      -> {model}")
    print(f"[3/4] fine-tuning with 4 processes (--nproc-per-node 4), tp={tp} pp={pp} dp={4 // (tp * pp)}")
    output = work / "run"
    if finetune(model, output, tp, pp, args.steps) != 0:
        print("fine-tuning failed", file=sys.stderr)
        return 1
    if not (output / "hf").is_dir():
        print("fine-tuning was interrupted: run `make demo` again to start over", file=sys.stderr)
        return 130
    from colozoo.finetune.metrics import read_metrics

    losses = [r["loss"] for r in read_metrics(output / "metrics.jsonl") if "loss" in r]
    evals = [r for r in read_metrics(output / "metrics.jsonl") if "eval_loss" in r]
    print(f"      train loss {losses[0]:.3f} -> {losses[-1]:.3f} over {len(losses)} steps; "
          f"eval perplexity {evals[0]['eval_ppl']:.1f} -> {evals[-1]['eval_ppl']:.1f} (before -> after); curve: {output / 'loss.png'}")
    samples = [json.loads(line) for line in (output / "samples.jsonl").read_text().splitlines()]
    first = [r for r in samples if r["prompt"] == samples[0]["prompt"]]
    print(f"      what it writes after {first[0]['prompt']!r}:")
    print(f"        before: {first[0]['completion']!r}")
    print(f"        after:  {first[-1]['completion']!r}  (all samples: {output / 'samples.jsonl'})")
    print("[4/4] loading the export with transformers and comparing logits with the colozoo model")
    diff = check_export(output)
    ok = diff < 1e-5 and losses[-1] < losses[0]
    print(f"      max |logits difference| = {diff:.2e}  ({'match' if diff < 1e-5 else 'MISMATCH'})")
    print(f"done in {time.time() - started:.0f}s: {'OK' if ok else 'FAILED'}; the fine-tuned model is in {output / 'hf'}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
