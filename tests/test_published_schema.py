"""A table of published runs, the package's or a user's own (`colozoo plan --validate --runs FILE`), is checked key
by key: a misspelt or impossible entry is an error naming the run and the key, never a default priced in silence;
a user's rows may name the package's software presets and networks."""
import copy
import json
import re
from pathlib import Path

import pytest

from colozoo.cli import main
from colozoo.cost.published import PublishedRunError, published_runs
from colozoo.cost.validate import validate

ROW = {"id": "mine", "source": "my cluster", "hardware": "H100-80GB", "gpus": 16, "dtype": "bfloat16",
       "model": {"family": "llama", "hidden": 512, "layers": 4, "heads": 8, "kv_heads": 2, "ffn": 1408,
                 "vocab": 4096, "seq": 1024},
       "layout": {"tp": 2, "dp": 8, "micro_batch": 2, "global_batch": 64, "zero": 1},
       "software": {"base": "megatron-core-2024"}, "measured": {"unit": "step_seconds", "value": 1.0}}

BAD = {  # what is changed -> what the error says
    "micro_batch_size": ("layout", {"micro_batch_size": 2}, "unknown keys ['micro_batch_size']"),
    "global_batch": ("layout", {"global_batch": 60}, "global_batch 60 is not a whole number of micro-batches"),
    "tp": ("layout", {"tp": 0}, "tp 0 is not a positive whole number"),
    "balance": ("layout", {"balance": "even"}, "balance 'even' is not 'layers'"),
    "base": ("software", {"base": "megatron-core-2025"}, "base 'megatron-core-2025' is none of"),
    "field": ("software", {"tp_overlap": 1.0}, "['tp_overlap'] are no fields"),
    "unit": ("measured", {"unit": "tflops"}, "unit 'tflops' is not one of"),
    "value": ("measured", {"value": 0}, "value 0 is not a positive number"),
    "family": ("model", {"family": "mistral"}, "family 'mistral' is not one of gpt2, llama"),
    "hiden": ("model", {"hiden": 512}, "unknown keys ['hiden']"),
    "network": (None, {"network": "infiniband"}, "network 'infiniband' is none of"),
    "gpu": (None, {"gpu": 16}, "unknown keys ['gpu']"),
    "gpus": (None, {"gpus": 8}, "tp*pp*dp*cp = 16 != gpus = 8"),
}


def _table(tmp_path, rows, name="runs.json"):
    path = tmp_path / name
    path.write_text(json.dumps({"runs": rows}))
    return str(path)


@pytest.mark.parametrize("case", sorted(BAD))
def test_a_wrong_entry_is_an_error_naming_the_run_and_key(tmp_path, case):
    part, change, message = BAD[case]
    row = copy.deepcopy(ROW)
    (row[part] if part else row).update(change)
    with pytest.raises(PublishedRunError, match="run 'mine'.*" + re.escape(message)):
        published_runs(_table(tmp_path, [row]))


def test_table_shape_and_repeated_ids_are_errors(tmp_path):
    path = tmp_path / "list.json"
    path.write_text(json.dumps([ROW]))
    with pytest.raises(PublishedRunError, match='a list "runs"'):
        published_runs(str(path))
    with pytest.raises(PublishedRunError, match=r"ids repeat: \['mine'\]"):
        published_runs(_table(tmp_path, [ROW, ROW]))
    path = tmp_path / "broken.json"
    path.write_text('{"runs": [')
    with pytest.raises(PublishedRunError, match="not JSON"):
        published_runs(str(path))


def test_a_users_run_names_the_packages_presets(tmp_path, capsys):
    """A row naming the package's Megatron-Core preset prices with it: the file carries no software section."""
    run, = published_runs(_table(tmp_path, [ROW], "probe.json"))
    assert run.software.name == "Megatron-Core r0.8.0" and run.software.grad_clip_passes == 1
    row = copy.deepcopy(ROW)
    row["measured"]["value"] = validate([run])[0].predicted_seconds
    assert main(["plan", "--validate", "--runs", _table(tmp_path, [row])]) == 0
    assert "| mine | 16 |" in capsys.readouterr().out


def test_the_readmes_example_table_is_valid(tmp_path):
    readme = (Path(__file__).parents[1] / "README.md").read_text()
    example = re.search(r'```json\n(\{"runs".*?)\n```', readme, re.S).group(1)
    path = tmp_path / "my_runs.json"
    path.write_text(example)
    run, = published_runs(str(path))
    assert run.plan.mesh() == "tp=2,pp=1,dp=8,cp=1,ep=1,sp" and run.software.name == "Megatron-Core r0.8.0"
    assert main(["plan", "--validate", "--runs", str(path), "--plot", str(tmp_path / "my_runs.png")]) in (0, 1)
    assert (tmp_path / "my_runs.png").exists()


def test_sizes_beside_a_registry_name_replace_its_config():
    """A row may price a model of a registered family at other sizes (Grok-1 as Mixtral's MoE): each size given
    beside the registry name replaces its config's field, the head width derived again; none given, the registry's
    config as it is."""
    from colozoo.cost.published import model_config
    from colozoo.cost.setup import get_config

    sized = model_config({"registry": "Mixtral-8x7B-v0.1", "hidden": 6144, "heads": 48, "layers": 8, "ffn": 32768,
                          "vocab": 128256, "experts_per_token": 2})
    assert (sized.hidden_size, sized.num_attention_heads, sized.num_hidden_layers, sized.intermediate_size,
            sized.vocab_size, sized.num_experts_per_tok) == (6144, 48, 8, 32768, 128256, 2)
    assert (getattr(sized, "head_dim", None) or 128) == 128 and sized.num_local_experts == 8
    assert model_config({"registry": "Mixtral-8x7B-v0.1"}).to_dict() == get_config("Mixtral-8x7B-v0.1").to_dict()


def test_a_preset_builds_on_another(tmp_path):
    """A software preset may name a base preset: its fields over the base's, over that one's base's, down to
    colozoo's defaults; a base that is no preset, and presets that build on each other in a circle, are errors."""
    software = {"mine": {"base": "nemo-distributed-fused-adam-bf16", "grad_reduce_bytes": 2, "source": "my recipe"}}
    path = tmp_path / "runs.json"
    path.write_text(json.dumps({"software": software, "runs": [{**ROW, "software": {"base": "mine"}}]}))
    sw = published_runs(str(path))[0].software
    assert (sw.grad_reduce_bytes, sw.optimizer_state_bytes, sw.master_weight_bytes) == (2, 2, 0)  # own, bf16's
    assert sw.name == "NeMo distributed_fused_adam with bf16 states"  # the nearest preset that names itself
    assert sw.grads_in_reduce_dtype and sw.grad_buckets == "megatron_core"  # megatron-core-2024's, two bases down
    for presets, message in (({"mine": {"base": "nemo-2030"}}, "preset 'mine': base 'nemo-2030' is none of"),
                             ({"mine": {"base": "yours"}, "yours": {"base": "mine"}},
                              "in a circle: mine -> yours -> mine"),
                             ({"mine": {"tp_overlap": 1.0}}, "preset 'mine': ['tp_overlap'] are no fields")):
        path.write_text(json.dumps({"software": presets, "runs": [{**ROW, "software": {"base": "mine"}}]}))
        with pytest.raises(PublishedRunError, match=re.escape(message)):
            published_runs(str(path))
