"""The README's Python examples run as written, on tiny models, so that they cannot drift from the code.

Each example is found in README.md by a line it holds (EXAMPLES); its model names are pointed at tiny local
checkpoints of the same family and its meshes shrunk to at most 4 gloo ranks by the replacements listed beside it,
each of which must occur (an edited example fails here until its row follows it). Everything else runs unchanged,
in one namespace per example that holds the inputs it names (input_ids, labels, mask) and the tiny checkpoints'
paths. What an example's comments promise is then checked: the same loss on every rank, a directory transformers
loads, a sharded checkpoint, adapters peft reads.
"""
import json
import os
import re
from pathlib import Path

import pytest
import torch

from distributed import run_distributed
from eval_model import make_eval_model

README = Path(__file__).resolve().parents[1] / "README.md"
TIMEOUT = 300

# an example: a line it holds -> (gloo ranks, 0 for the test process; {README text: what runs instead})
EXAMPLES = {
    "first": ('model = colozoo.from_pretrained("opt-30b", tp=4, pp=2)',
              4, {'"opt-30b", tp=4, pp=2': 'OPT, tp=2, pp=2'}),
    "training": ("from colozoo.runtime.training import parallelize, build_optimizer, clip_grad_norm_",
                 4, {'"gpt2", tp=2, pp=2, dp=2': 'GPT2, tp=1, pp=2, dp=2'}),
    "loss scaling": ("scaler = DynamicLossScaler()", 4, {}),
    "generation": ('model = colozoo.from_pretrained("Llama-3.1-8B", tp=2, pp=2)',
                   4, {'"Llama-3.1-8B"': 'LLAMA'}),
    "evaluation": ("import lm_eval, colozoo", 2,
                   {'"./my-model", tp=2, pp=2': 'LLAMA, tp=2', 'tasks=["colozoo_mc"],': 'tasks=["colozoo_mc"], limit=3,'}),
    "profiler": ("from colozoo.cost.hardware import get_hardware", 0, {}),
    "checkpoints": ('model = colozoo.from_pretrained("opt-1.3b", tp=2, pp=2)',
                    0, {'"opt-1.3b", tp=2, pp=2': 'OPT', '"hf_dir"': 'OPT'}),
    "lora": ("from colozoo.runtime.lora import apply_lora",
             2, {'"Llama-3.2-1B", tp=2': 'LLAMA, tp=2', '"Llama-3.2-1B", tp=4': 'LLAMA, tp=2'}),
    "rewards": ("def exact_answer(prompts, completions, answer, **kwargs):", 0, {}),
}


def python_blocks() -> list[str]:
    return re.findall(r"^```python\n(.*?)^```", README.read_text(), re.S | re.M)


def example(name: str) -> str:
    """The README's block holding EXAMPLES[name]'s line, with its replacements made (each must occur)."""
    line, _, replacements = EXAMPLES[name]
    found = [b for b in python_blocks() if line in b]
    assert len(found) == 1, f"README.md has {len(found)} python blocks holding {line!r} (the {name} example)"
    code = found[0]
    for old, new in replacements.items():
        assert old in code, f"the README's {name} example no longer holds {old!r}: update EXAMPLES"
        code = code.replace(old, new)
    return code


def test_every_python_block_of_the_readme_is_an_example_here():
    lines = [line for line, _, _ in EXAMPLES.values()]
    assert [sum(line in block for line in lines) for block in python_blocks()] == [1] * len(python_blocks())


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("readme")
    return {name: str(make_eval_model(root / family, family, positions=128))
            for name, family in (("OPT", "opt"), ("GPT2", "gpt2"), ("LLAMA", "llama"))}


def inputs(vocab_size: int = 100, batch: int = 8, seq: int = 12) -> dict:
    generator = torch.Generator().manual_seed(0)
    ids = torch.randint(3, vocab_size, (batch, seq), generator=generator)
    return {"input_ids": ids, "labels": ids.clone(), "mask": torch.ones_like(ids)}


def run_examples(names: list[str], directory: str, checkpoints: dict, batch: int = 8) -> dict:
    """`names`' examples one after another in one namespace, in `directory` (every rank the same: a shared file
    system); returns what the checks read."""
    import colozoo
    from colozoo.runtime.amp import DynamicLossScaler

    namespace = {"colozoo": colozoo, "torch": torch, "DynamicLossScaler": DynamicLossScaler, **checkpoints,
                 **inputs(batch=batch)}
    here = os.getcwd()
    os.chdir(directory)
    try:
        for name in names:
            exec(compile(example(name), f"README.md ({name} example)", "exec"), namespace)  # noqa: S102
    finally:
        os.chdir(here)
    loss = namespace.get("loss")
    out = namespace.get("out")
    return {"loss": None if loss is None else float(loss),
            "out_loss": None if out is None or getattr(out, "loss", None) is None else float(out.loss),
            "ids": namespace["ids"].tolist() if "ids" in namespace else None,
            "results": namespace.get("results") is not None}


def test_the_first_example(checkpoints, tmp_path):
    import transformers

    ranks = run_distributed(run_examples, 4, names=["first"], directory=str(tmp_path), checkpoints=checkpoints,
                            timeout=TIMEOUT)
    assert ranks[0]["loss"] is not None and ranks[0]["out_loss"] is not None
    assert len({r["loss"] for r in ranks}) == 1 and len({r["out_loss"] for r in ranks}) == 1  # every rank alike
    transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf")  # "a directory transformers loads"
    index = json.loads((tmp_path / "ckpt" / "colozoo_index.json").read_text())  # "sharded, reshardable"
    assert index["mesh"]["tp"] == 2 and index["mesh"]["pp"] == 2


def test_the_training_step_and_loss_scaling_examples(checkpoints, tmp_path):
    ranks = run_distributed(run_examples, 4, names=["training", "loss scaling"], directory=str(tmp_path),
                            checkpoints=checkpoints, batch=16, timeout=TIMEOUT)
    assert ranks[0]["loss"] is not None and len({r["loss"] for r in ranks}) == 1  # "the mean loss ... on every rank"


def test_the_generation_example(checkpoints, tmp_path):
    ranks = run_distributed(run_examples, 4, names=["generation"], directory=str(tmp_path), checkpoints=checkpoints,
                            timeout=TIMEOUT)
    assert all(r["ids"] == ranks[0]["ids"] for r in ranks)  # "(batch, prompt + new), every rank"


def test_the_evaluation_example(checkpoints, tmp_path):
    ranks = run_distributed(run_examples, 2, names=["evaluation"], directory=str(tmp_path), checkpoints=checkpoints,
                            timeout=TIMEOUT)
    assert [r["results"] for r in ranks] == [True, False]  # "the results on rank 0, None elsewhere"


def test_the_lora_example(checkpoints, tmp_path):
    import peft
    import transformers

    run_distributed(run_examples, 2, names=["lora"], directory=str(tmp_path), checkpoints=checkpoints,
                    timeout=TIMEOUT)
    base = transformers.AutoModelForCausalLM.from_pretrained(checkpoints["LLAMA"])
    peft.PeftModel.from_pretrained(base, tmp_path / "adapter")  # "adapter_config.json + adapter_model.safetensors"
    transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "merged")


def test_the_checkpoint_and_profiler_examples(checkpoints, tmp_path):
    import transformers

    run_examples(["checkpoints", "profiler"], str(tmp_path), checkpoints)
    ours = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf_out").state_dict()
    theirs = transformers.AutoModelForCausalLM.from_pretrained(checkpoints["OPT"]).state_dict()
    assert ours.keys() == theirs.keys() and all(torch.equal(ours[k], theirs[k]) for k in ours)


def test_the_reward_functions_example():
    namespace = {}
    exec(compile(example("rewards"), "README.md (rewards example)", "exec"), namespace)  # noqa: S102
    assert namespace["exact_answer"](["q"] * 2, ["so 4", "so 5"], ["4", "4"]) == [1.0, 0.0]
    assert namespace["short"](["a b"]) == [-0.02]
