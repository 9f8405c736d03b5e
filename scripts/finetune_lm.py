"""Causal-LM fine-tuning (GPT-2, OPT, LLaMA-style) with colozoo. Launch on every rank, e.g.

    torchrun --nproc-per-node 4 scripts/finetune_lm.py --model MODEL_DIR --data DATA --tp 2 --pp 2

Options: python scripts/finetune_lm.py --help
"""
import sys

from colozoo.finetune import main

if __name__ == "__main__":
    sys.exit(main(task="lm"))
