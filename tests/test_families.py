"""What a family must provide, read off the family table (colozoo.models.family): adding a family touches its model
file (the model class and its FAMILIES declaration with its tiny test config), its converter (a module of
colozoo.converters declaring the class in its CONVERTS) and its registry file, and nothing else."""
import importlib
import json
from pathlib import Path

import pytest
import transformers

from colozoo.converters import converters, family_module
from colozoo.models import build_shard, families, family_of
from colozoo.models.base import ParallelModel

ROOT = Path(__file__).resolve().parent.parent
FAMILIES = sorted({f.name: f for f in families().values()}.values(), key=lambda f: f.name)


@pytest.mark.parametrize("family", FAMILIES, ids=lambda f: f.name)
def test_every_family_provides_what_the_table_promises(family):
    # the model file: a ParallelModel subclass named for its family, declared in the file that defines it
    assert issubclass(family.model, ParallelModel)
    assert family.model.family == family.name
    module = importlib.import_module(family.model.__module__)
    assert family in module.FAMILIES
    # transformers knows every model type it builds (its configs and tokenizers are what we load)
    for model_type in family.model_types:
        assert transformers.AutoConfig.for_model(model_type).model_type == model_type
    # the converter: an HF name map for every parameter of the model, in the module declaring the class
    converter = family_module(family.name)
    assert family.model in converter.CONVERTS
    assert callable(converter.hf_sources) and isinstance(converter.HF_PREFIX, str)
    # the tiny config its tests build: one transformers knows, of one of its model types
    assert family.tiny is not None and family.tiny.config, f"{family.name} declares no tiny config"
    config = transformers.AutoConfig.for_model(family.model_types[0], **family.tiny.config)
    assert config.model_type in family.model_types
    # the registry file, named after the family, whose models are of its types
    registry_file = ROOT / "colozoo" / "model_configs" / f"{family.name}.json"
    assert registry_file.is_file() == family.registered, registry_file
    if family.registered:
        types = {entry["config"]["model_type"] for entry in json.loads(registry_file.read_text()).values()}
        assert types <= set(family.model_types), (registry_file.name, types)


def test_every_registry_file_belongs_to_a_family():
    names = {f.name for f in FAMILIES}
    assert {p.stem for p in (ROOT / "colozoo" / "model_configs").glob("*.json")} <= names


def test_every_converter_declares_families_of_the_table():
    models = {f.model for f in FAMILIES}
    assert set(converters()) == models, {m.__name__ for m in set(converters()) ^ models}


def test_traits_are_read_from_the_table():
    assert family_module("mistral").__name__ == "colozoo.converters.llama"
    assert family_of("mistral").model.__name__ == "MistralForCausalLM"
    assert family_of("gpt2").learned_positions and not family_of("llama").learned_positions
    assert family_of("qwen3_moe").gated_mlp and not family_of("opt").gated_mlp
    with pytest.raises(ValueError, match="unsupported model type 'nope'"):
        family_of("nope")


def test_a_model_type_builds_its_familys_class_and_names_it():
    config = transformers.MistralConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                        num_attention_heads=4, num_key_value_heads=2, vocab_size=64)
    model = build_shard(config, device="meta")
    assert type(model).__name__ == "MistralForCausalLM" and model.family == "mistral"
    assert "family" not in vars(model)  # a class attribute, never overwritten on an instance


def test_the_readme_holds_the_family_table():
    from colozoo.registry import family_table

    assert family_table() in (ROOT / "README.md").read_text(), (
        "README.md's family table is not the families' declarations: paste `colozoo models --markdown` into its "
        "Families section")


def test_colozoo_models_markdown_prints_it(capsys):
    from colozoo.cli import main
    from colozoo.registry import family_table

    assert main(["models", "--markdown"]) == 0
    assert capsys.readouterr().out == family_table()
