"""The data files of the tasks shipped with colozoo, as absolute paths.

`datasets` reads a task's relative `data_files` from the working directory, so each YAML here names its files with
`data_files: !function paths.<task>` (lm-eval resolves the tag to this module's value of that name, beside the YAML):
the tasks run from any directory, installed or not.
"""
from pathlib import Path

DATA = Path(__file__).resolve().parent / "data"

colozoo_mc = {"train": str(DATA / "mc_train.jsonl"), "test": str(DATA / "mc_test.jsonl")}
colozoo_ppl = {"test": str(DATA / "ppl_test.jsonl")}
colozoo_gen = {"train": str(DATA / "gen_train.jsonl"), "test": str(DATA / "gen_test.jsonl")}
