"""Datasets larger than memory: a causal LM's rows are tokenized once, streaming, into a memory-mapped cache under
OUTPUT/data-cache and read back a batch at a time; a resumed run reuses the cache, a changed dataset rebuilds it."""
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

sys.path.insert(0, os.path.dirname(__file__))
from test_finetune import STORIES, losses, small_run, tiny  # noqa: E402,F401 (fixture)

from colozoo.demo_finetune import texts  # noqa: E402
from colozoo.finetune import data as D  # noqa: E402
from colozoo.finetune import sft  # noqa: E402
from colozoo.finetune import token_cache as T  # noqa: E402
from colozoo.finetune.loop import finetune  # noqa: E402

REPO = Path(__file__).resolve().parent.parent
IN_MEMORY_BYTES = 3 * 8  # per token, as the in-memory dataset holds it: int64 input_ids, attention_mask, labels


def big_parquet(path: Path, tokens: int) -> Path:
    """A Parquet file of the demo stories repeated until about `tokens` words, written a row group at a time."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    stories = texts()
    words = sum(len(s.split()) for s in stories)
    with pq.ParquetWriter(path, pa.schema([("text", pa.string())])) as writer:
        for _ in range(max(1, tokens // words)):
            writer.write_table(pa.table({"text": stories}))
    return path


MEASURE = textwrap.dedent("""
    import json, sys
    from types import SimpleNamespace
    import pyarrow.parquet  # noqa: F401 - loading the library is not the data's memory
    from colozoo.finetune import data as D, token_cache as T

    model, warm_up, data, output, seq_len = sys.argv[1:6]
    tok = D.load_tokenizer(model, 131)
    cfg = SimpleNamespace(output=output, chat=False, pack=True, seq_len=int(seq_len), text_field="text", progress=False)
    T.lm_rows(cfg, tok, warm_up, "warm-up").take([0, 1])  # lazy imports, thread pools: memory that does not scale
    def status(field):
        return int(open("/proc/self/status").read().split(field + ":")[1].split()[0])

    open("/proc/self/clear_refs", "w").write("5")  # the peak resident set restarts from now (not the imports')
    before = status("VmRSS")
    rows = T.lm_rows(cfg, tok, data, "train")
    train, held_out = rows.split(0.01)
    for step in range(5):
        batch = train.take(list(range(step * 997 % len(train), len(train), len(train) // 7))[:4])
    held_out.take(range(4))
    peak = status("VmHWM")
    print(json.dumps({"rows": len(rows), "seq_len": int(seq_len), "grown_kib": peak - before}))
""")


@pytest.mark.skipif(not Path("/proc/self/status").exists(), reason="measures the resident set from /proc")
def test_dataset_larger_than_the_memory_it_may_use_trains(tiny, tmp_path):  # noqa: F811
    data = big_parquet(tmp_path / "big.parquet", tokens=5_000_000)
    output = tmp_path / "run"
    warm_up = big_parquet(tmp_path / "small.parquet", tokens=10_000)
    done = subprocess.run([sys.executable, "-c", MEASURE, str(tiny), str(warm_up), str(data), str(output), "16"],
                          capture_output=True, text=True, timeout=600, cwd=REPO)
    assert done.returncode == 0, done.stderr[-2000:]
    measured = json.loads(done.stdout.strip().splitlines()[-1])
    in_memory = measured["rows"] * measured["seq_len"] * IN_MEMORY_BYTES
    assert in_memory > 130e6, measured  # what the in-memory dataset would hold
    assert measured["grown_kib"] * 1024 < 60e6, measured  # the data path's peak, building and reading batches
    # the run reuses that cache (same dataset, tokenizer and options) and trains on it
    summary = finetune(small_run(tiny, output, data=str(data), steps=3, eval_interval=0, eval_fraction=0.01,
                                 save_interval=0))
    assert summary["step"] == 3 and len(losses(output)) == 3
    assert len(list((output / "data-cache").glob("train-*"))) == 1


def test_cache_is_reused_on_resume_and_rebuilt_when_the_dataset_changes(tiny, tmp_path):  # noqa: F811
    data = tmp_path / "stories.jsonl"
    data.write_bytes(STORIES.read_bytes())
    output = tmp_path / "run"
    finetune(small_run(tiny, output, data=str(data), stop_after=2, eval_fraction=0.1))
    (cache,) = (output / "data-cache").glob("train-*")
    built = (cache / "meta.json").stat().st_mtime_ns
    finetune(small_run(tiny, output, data=str(data), eval_fraction=0.1))  # resumes at step 2: same rows, not rebuilt
    assert len(losses(output)) == 6 and (cache / "meta.json").stat().st_mtime_ns == built
    with data.open("a") as f:
        f.write(json.dumps({"text": "one more story about a cat and a dog"}) + "\n")
    finetune(small_run(tiny, output, data=str(data), eval_fraction=0.1, resume=False))
    (rebuilt,) = (output / "data-cache").glob("train-*")  # a new cache; the stale one is gone
    assert rebuilt != cache and not cache.exists()


def test_cached_rows_are_the_in_memory_rows(tiny, tmp_path):  # noqa: F811
    """Plain text packed and padded, chat packed and padded: the same rows, trained tokens and held-out split."""
    from chat_model import CHAT, make_chat_llama

    text_tok, chat_tok = D.load_tokenizer(tiny, 131), D.load_tokenizer(make_chat_llama(tmp_path / "chat"), 10_000)
    cases = [(D.lm_blocks, STORIES, text_tok, 16, pack) for pack in (True, False)]
    cases += [(sft.sft_blocks, CHAT, chat_tok, 96, pack) for pack in (True, False)]
    for blocks, path, tok, seq_len, pack in cases:
        reference = D.collect(blocks(path, tok, seq_len, pack))
        cached, built = T.cached_rows(tmp_path / "cache", f"{blocks.__name__}-{pack}", path, tok,
                                      lambda: blocks(path, tok, seq_len, pack), pack=pack)
        assert built and len(cached) == len(reference)
        got = cached.take(range(len(cached)))
        assert list(got) == list(reference.tensors)
        assert all(torch.equal(got[k], reference.tensors[k]) for k in got)
        order = torch.randperm(len(cached))[:7]
        assert torch.equal(cached.tokens[order], reference.tokens[order])
        (head, tail), (ref_head, ref_tail) = cached.split(0.1), reference.split(0.1)
        assert (len(head), len(tail)) == (len(ref_head), len(ref_tail))
        assert torch.equal(tail.take(range(len(tail)))["labels"], ref_tail.take(range(len(tail)))["labels"])
        assert not T.cached_rows(tmp_path / "cache", f"{blocks.__name__}-{pack}", path, tok,
                                 lambda: blocks(path, tok, seq_len, pack), pack=pack)[1]  # found, not rebuilt
