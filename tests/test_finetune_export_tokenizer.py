"""A fine-tune's HF export holds the tokenizer as transformers' tokenizer.save_pretrained writes it, also when the
model directory keeps it in another layout (a published one written by an older transformers: specials in
special_tokens_map.json, a tokenizer_config.json of a few keys), as transformers' Trainer saves it beside the model."""
import json
from pathlib import Path

import transformers

from colozoo.demo_finetune import make_tiny_causal_lm
from colozoo.finetune.config import FinetuneConfig
from colozoo.finetune.loop import finetune

STORIES = Path(__file__).resolve().parents[1] / "data" / "stories.jsonl"


def test_the_export_holds_the_tokenizer_as_save_pretrained_writes_it(tmp_path):
    model = make_tiny_causal_lm(tmp_path / "model", "llama", layers=1, hidden=32, positions=32)
    (model / "tokenizer_config.json").write_text(json.dumps({"tokenizer_class": "PreTrainedTokenizerFast",
                                                             "model_max_length": 32}))
    (model / "special_tokens_map.json").write_text(json.dumps({"eos_token": "<|endoftext|>", "pad_token": "<pad>",
                                                               "unk_token": "<unk>"}))
    tokenizer = transformers.AutoTokenizer.from_pretrained(model)
    assert tokenizer.pad_token == "<pad>" and tokenizer.model_max_length == 32
    tokenizer.save_pretrained(tmp_path / "expected")
    finetune(FinetuneConfig(model=str(model), data=str(STORIES), output=str(tmp_path / "run"), seq_len=16,
                            micro_batch_size=2, steps=1, eval_interval=0, save_interval=0, samples=0, progress=False,
                            plot=False, export_hf=True))
    exported = tmp_path / "run" / "hf"
    for file in sorted((tmp_path / "expected").iterdir()):
        assert (exported / file.name).read_bytes() == file.read_bytes(), f"{file.name} is not save_pretrained's"
    again = transformers.AutoTokenizer.from_pretrained(exported)
    assert again("once upon a time")["input_ids"] == tokenizer("once upon a time")["input_ids"]
    assert (again.pad_token, again.model_max_length) == (tokenizer.pad_token, tokenizer.model_max_length)
