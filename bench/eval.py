"""Evaluation speed: requests per second of colozoo's lm-eval backend (ColozooLM, tp=1) against the harness's HF
backend (`lm_eval --model hf`) on the same CPU threads, model and requests.

A LLaMA-shaped model of random weights (saved by transformers, with the tests' byte-level BPE tokenizer trained on the
shipped tasks' text, tests/helpers/eval_model.py), and each shipped task's requests built once by the harness (one few-shot example): colozoo_mc
(loglikelihood), colozoo_ppl (loglikelihood_rolling) and colozoo_gen (generate_until). Both backends answer the same
request objects, alternating over `repeats` runs; the best run of each counts (the machines this runs on are shared).
The answers must agree: the largest log-likelihood difference, and whether every generated text is the same. One
JSON line per task, ratio = colozoo requests/s over the HF backend's.

    python bench/eval.py [--hidden 512] [--layers 4] [--vocab 32000] [--batch-size 8] [--repeats 3] [--threads 2]
"""
from __future__ import annotations

import argparse
import copy
import json
import os
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

import torch  # noqa: E402
import transformers  # noqa: E402

TASKS = ("colozoo_mc", "colozoo_ppl", "colozoo_gen")


def make_model(path: Path, args):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests" / "helpers"))
    from eval_model import byte_level_tokenizer

    tokenizer = byte_level_tokenizer(path, bos=True)
    config = transformers.LlamaConfig(vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=3 * args.hidden,
                                      num_hidden_layers=args.layers, num_attention_heads=8, num_key_value_heads=4,
                                      max_position_embeddings=args.positions, eos_token_id=tokenizer.eos_token_id,
                                      bos_token_id=tokenizer.bos_token_id)
    torch.manual_seed(0)
    transformers.AutoModelForCausalLM.from_config(config).save_pretrained(str(path))


def requests(manager, name: str, args):
    """The task's requests as the harness builds them (one few-shot example), and their kind."""
    from colozoo.evaluation.run import load_tasks

    task, = load_tasks([name], manager)
    task.set_config(key="num_fewshot", value=1)
    task.set_fewshot_seed(seed=1234)
    task.build_all_requests(limit=args.limit, rank=0, world_size=1)
    return task.instances, task.instances[0].request_type


def answers_agree(ours: list, theirs: list) -> dict:
    if isinstance(theirs[0], str):
        return {"same_generations": ours == theirs}
    flat = lambda answers: [a[0] if isinstance(a, tuple) else a for a in answers]  # noqa: E731
    diff = max(abs(a - b) for a, b in zip(flat(ours), flat(theirs)))
    return {"max_loglikelihood_diff": diff}


def measure(backends: dict, instances, kind: str, repeats: int) -> tuple[dict, dict]:
    """Best requests/s of each backend over `repeats` alternating runs, and their answers."""
    best, answers = {side: 0.0 for side in backends}, {}
    for _ in range(repeats):
        for side, lm in backends.items():
            batch = copy.deepcopy(instances)
            started = time.perf_counter()
            answers[side] = getattr(lm, kind)(batch, disable_tqdm=True)
            best[side] = max(best[side], len(batch) / (time.perf_counter() - started))
    return best, answers


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    for name, default in (("hidden", 512), ("layers", 4), ("vocab", 32000), ("positions", 256), ("batch_size", 8),
                          ("repeats", 3), ("threads", 2)):
        parser.add_argument(f"--{name.replace('_', '-')}", type=int, default=default)
    parser.add_argument("--limit", type=int, default=None, help="documents per task (default: all)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    import logging

    from lm_eval.models.huggingface import HFLM

    import colozoo
    from colozoo.evaluation import ColozooLM, task_manager

    logging.getLogger("lm_eval").setLevel(logging.ERROR)
    manager = task_manager(names=list(TASKS))
    with tempfile.TemporaryDirectory() as path:
        make_model(Path(path), args)
        backends = {"colozoo": ColozooLM(colozoo.from_pretrained(path), batch_size=args.batch_size, progress=False),
                    "hf": HFLM(pretrained=path, device="cpu", dtype="float32", batch_size=args.batch_size)}
        for name in TASKS:
            instances, kind = requests(manager, name, args)
            best, answers = measure(backends, instances, kind, args.repeats)
            print(json.dumps({"bench": f"eval/{name}", "config": dict(vars(args), requests=len(instances), kind=kind,
                                                                      device="cpu", tp=1),
                              "metrics": {"colozoo_requests_per_s": best["colozoo"], "hf_requests_per_s": best["hf"],
                                          **answers_agree(answers["colozoo"], answers["hf"])},
                              "peer": "lm-eval's HF backend (lm_eval --model hf), same requests and batch size",
                              "ratio": best["colozoo"] / best["hf"]}), flush=True)


if __name__ == "__main__":
    main()
