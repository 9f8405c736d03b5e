"""The model registry: offline configs with real hyperparameters, name / repo-id lookup, `colozoo models`."""
import io
import json

import pytest
import torch
import transformers

from colozoo import cli, registry

REQUIRED = ["gpt2", "gpt2-medium", "gpt2-large", "gpt2-xl", "opt-125m", "opt-350m", "opt-1.3b", "opt-2.7b",
            "opt-6.7b", "opt-13b", "opt-30b", "opt-66b"]


def test_required_names_present():
    models = registry.registry()
    assert set(REQUIRED) <= set(models)
    for name in REQUIRED:
        entry = models[name]
        assert entry["config"]["model_type"] == entry["family"]
        assert entry["architecture"] in entry["config"]["architectures"]


@pytest.mark.parametrize("name,cls,expected", [
    ("gpt2", transformers.GPT2Config, dict(n_embd=768, n_layer=12, n_head=12, vocab_size=50257, n_positions=1024)),
    ("gpt2-xl", transformers.GPT2Config, dict(n_embd=1600, n_layer=48, n_head=25)),
    ("opt-350m", transformers.OPTConfig, dict(hidden_size=1024, word_embed_proj_dim=512, do_layer_norm_before=False)),
    ("facebook/opt-30b", transformers.OPTConfig, dict(hidden_size=7168, num_hidden_layers=48, num_attention_heads=56,
                                                      ffn_dim=28672, vocab_size=50272, max_position_embeddings=2048)),
    ("opt-66b", transformers.OPTConfig, dict(hidden_size=9216, num_hidden_layers=64, num_attention_heads=72)),
    ("openai-community/gpt2-medium", transformers.GPT2Config, dict(n_embd=1024, n_layer=24, n_head=16)),
])
def test_get_config(name, cls, expected):
    config = registry.get_config(name)
    assert type(config) is cls
    assert {k: getattr(config, k) for k in expected} == expected


@pytest.mark.parametrize("name,params", [("gpt2", 124_439_808), ("opt-125m", 125_239_296), ("opt-350m", 331_196_416)])
def test_parameter_counts_match_the_published_models(name, params):
    assert registry.count_parameters(registry.get_config(name)) == params


PUBLISHED = {"Qwen1.5-MoE-A2.7B": 14_315_784_192, "Qwen2-57B-A14B": 57_408_658_944, "vit-large": 304_326_632,
             "vit-huge": 632_404_480, "gpt-oss-20b": 20_914_757_184, "gpt-oss-120b": 116_829_156_672,
             "OLMo-2-1124-7B": 7_298_617_344, "OLMo-2-1124-13B": 13_716_198_400, "OLMo-2-0325-32B": 32_234_279_936,
             "SmolLM3-3B": 3_075_098_624}


@pytest.mark.parametrize("name", sorted(PUBLISHED))
def test_parameter_counts_match_transformers(name):
    """Our model on meta has the parameters transformers builds from the same config, the published total, and
    the count the registry shows (`colozoo list`)."""
    config = registry.get_config(name)
    with torch.device("meta"):
        hf = getattr(transformers, config.architectures[0])(config)
    shown = registry.get_entry(name)[1].get("params", PUBLISHED[name])
    assert registry.count_parameters(config) == sum(p.numel() for p in hf.parameters()) == shown == PUBLISHED[name]


@pytest.mark.parametrize("alias,name,expected", [
    ("vit-base", "vit-base-patch16-224", dict(hidden_size=768, num_hidden_layers=12, patch_size=16)),
    ("vit-large", "vit-large-patch16-224", dict(hidden_size=1024, num_hidden_layers=24, patch_size=16)),
    ("vit-huge", "vit-huge-patch14-224-in21k", dict(hidden_size=1280, num_hidden_layers=32, patch_size=14)),
])
def test_short_aliases(alias, name, expected):
    assert registry.lookup(alias)[0] == name
    config = registry.get_config(alias)
    assert {k: getattr(config, k) for k in expected} == expected


def test_qwen2_moe_configs():
    config = registry.get_config("Qwen/Qwen1.5-MoE-A2.7B")
    assert type(config) is transformers.Qwen2MoeConfig
    expected = dict(hidden_size=2048, num_hidden_layers=24, num_experts=60, num_experts_per_tok=4,
                    moe_intermediate_size=1408, shared_expert_intermediate_size=5632, vocab_size=151936)
    assert {k: getattr(config, k) for k in expected} == expected


def test_unknown_name_suggests_close_ones():
    with pytest.raises(registry.UnknownModelError, match=r"unknown model 'opt-13B'.*opt-13b"):
        registry.get_config("opt-13B")
    with pytest.raises(registry.UnknownModelError, match=r"unknown model 'vit-larg'.*vit-large"):
        registry.get_config("vit-larg")


def test_registry_files_are_well_formed():
    for path in registry.CONFIG_DIR.glob("*.json"):
        for name, entry in json.loads(path.read_text()).items():
            assert set(entry) - {"aliases", *registry.STORED} == {"repo", "architecture", "config"}, (path.name, name)
            assert entry["config"]["model_type"] == path.stem, (path.name, name)
            assert entry["config"]["model_type"] and entry["repo"].count("/") == 1, (path.name, name)


@pytest.mark.parametrize("file", sorted(p.name for p in registry.CONFIG_DIR.glob("*.json")))
def test_stored_facts(file):
    """`colozoo models` prints the parameter counts and tp / ep degrees stored in the registry files (no torch): they
    are the built model's."""
    stale = {name: f"stored {stored}, the model has {built}"
             for name, (stored, built) in registry.stored_facts(registry.CONFIG_DIR / file).items() if stored != built}
    assert not stale, (f"colozoo/model_configs/{file} has missing or stale facts {stale}; run "
                       f"`python scripts/update_param_counts.py {file}`")


def test_update_stored_facts_rewrites_only_the_facts(tmp_path):
    original = registry.CONFIG_DIR / "gpt2.json"
    path = tmp_path / "gpt2.json"
    models = json.loads(original.read_text())
    models["gpt2"]["params"] = 1
    del models["gpt2-xl"]["tp"]
    path.write_text(json.dumps(models, indent=1))
    assert registry.update_stored_facts(path) == ["gpt2", "gpt2-xl"]
    assert path.read_text() == original.read_text()
    assert registry.update_stored_facts(path) == []


def test_models_command(capsys):
    assert cli.main(["models"]) == 0
    out = capsys.readouterr().out
    for name in REQUIRED:
        assert name in out
    assert "facebook/opt-66b" in out and "65.7B" in out and "124.4M" in out
    buffer = io.StringIO()
    registry.print_models(file=buffer)
    assert "openai-community/gpt2-xl" in buffer.getvalue()
    assert "vit-large-patch16-224 (vit-large)" in buffer.getvalue() and "Qwen/Qwen1.5-MoE-A2.7B" in buffer.getvalue()


def row(table: str, name: str) -> list[str]:
    line, = [line for line in table.splitlines() if line.split() and line.split()[0] == name]
    return line.split()


def test_models_says_the_tp_and_ep_degrees_each_model_allows(tmp_path, capsys):
    """The table (from the registry files, no torch) and --help say which tp degrees a model allows (heads, kv heads
    and widths divisible) and, for MoE models, which ep (experts divisible); a model directory is checked as given."""
    assert cli.main(["models"]) == 0
    table = capsys.readouterr().out
    assert row(table, "gpt2-xl")[3:5] == ["1,5,25", "-"]  # 25 heads
    assert row(table, "Qwen2.5-0.5B")[3:5] == ["1,2", "-"]  # 14 heads over 2 kv heads, MLP width 4864
    assert row(table, "Mixtral-8x7B-v0.1")[3:5] == ["1,2,4,8,16,32", "1,2,4,8"]  # 8 experts
    assert row(table, "DeepSeek-V3")[4:6] == ["1,2,4,…,128", "1,2,4,…,256"]  # 256 experts
    assert row(table, "opt-66b")[3:6] == ["divisors", "of", "72"]
    smollm2 = tmp_path / "SmolLM2-135M"  # 9 heads, 3 kv heads, MLP width 1536: tp=2 is impossible, tp=9 too
    transformers.LlamaConfig(hidden_size=576, intermediate_size=1536, num_attention_heads=9, num_key_value_heads=3,
                             num_hidden_layers=2, vocab_size=64).save_pretrained(smollm2)
    assert cli.main(["models", str(smollm2), "gpt2"]) == 0
    table = capsys.readouterr().out
    assert row(table, str(smollm2))[1:5] == ["llama", "7.2M", "1,3", "-"] and row(table, "gpt2")[3] == "1,2,3,4,6,12"
    with pytest.raises(SystemExit):
        cli.main(["models", "--help"])
    assert "tp must divide the attention heads, divide the key/value heads or be a multiple" in \
        " ".join(capsys.readouterr().out.split())
