"""Evaluation over dp replicas: requests per second of colozoo's lm-eval backend (ColozooLM) at dp=2 (two gloo ranks,
each scoring its share of the requests, the answers gathered on both) against dp=1 (one rank scoring them all), one
CPU thread per rank. A CPU figure: on a machine with fewer free cores than ranks the ratio says little.

The model and requests are bench/eval.py's (a LLaMA-shaped model of random weights, each shipped task's requests built
by the harness with one few-shot example); each side answers them `repeats` times, the best run counts. The answers
must agree (largest log-likelihood difference, same generated text). One JSON line per task, ratio = requests/s at
dp=2 over dp=1.

    python bench/eval_dp.py [--hidden 256] [--layers 4] [--vocab 8192] [--batch-size 8] [--repeats 2] [--limit 16]
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _ranks import run_ranks  # noqa: E402
from eval import TASKS, answers_agree, make_model, requests  # noqa: E402


def _rank(rank, world, path, args):
    """{task: (best requests/s, answers, kind, requests)} of this rank's ColozooLM on the mesh of `world` ranks (dp)."""
    import copy
    import logging

    import colozoo
    from colozoo.evaluation import ColozooLM, task_manager

    logging.getLogger("lm_eval").setLevel(logging.ERROR)
    manager = task_manager(names=list(TASKS))
    lm = ColozooLM(colozoo.from_pretrained(path), batch_size=args.batch_size, progress=False)
    out = {}
    for name in TASKS:
        instances, kind = requests(manager, name, args)
        best = 0.0
        for _ in range(args.repeats):
            batch = copy.deepcopy(instances)
            started = time.perf_counter()
            answers = getattr(lm, kind)(batch, disable_tqdm=True)
            best = max(best, len(batch) / (time.perf_counter() - started))
        out[name] = (best, answers, kind, len(instances))
    return out


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    for name, default in (("hidden", 256), ("layers", 4), ("vocab", 8192), ("positions", 256), ("batch_size", 8),
                          ("repeats", 2), ("limit", 16)):
        parser.add_argument(f"--{name.replace('_', '-')}", type=int, default=default)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as path:
        make_model(Path(path), args)
        one, two = run_ranks(_rank, 1, path, args)[0], run_ranks(_rank, 2, path, args)[0]
    for name in TASKS:
        (single, single_answers, kind, count), (split, split_answers, _, _) = one[name], two[name]
        print(json.dumps({"bench": f"eval_dp/{name}", "config": dict(vars(args), requests=count, kind=kind,
                                                                     device="cpu", threads_per_rank=1, dp=2),
                          "metrics": {"dp2_requests_per_s": split, "dp1_requests_per_s": single,
                                      "cpu_count": os.cpu_count(), **answers_agree(split_answers, single_answers)},
                          "peer": "ColozooLM at dp=1 (one rank scoring every request), same requests and batch size",
                          "ratio": split / single}), flush=True)


if __name__ == "__main__":
    main()
