"""GPT-NeoX / Pythia beyond the family table (tests/test_family_table.py: the declared config, parallel residual and
partial rotary, on one process, tp2 with sequence parallelism and pp2 x tp2; greedy generation): the sequential
residual, other rotary fractions and scalings, a tied head without attention biases, tp 2 and 4, the per-head
query_key_value reordered to our [q; k; v] and back bit for bit (the tensors, the HF export), a tied head over pp 2,
the registry's sizes."""
import pytest
import torch

from distributed import run_distributed
from family_cases import tiny_kwargs
from family_parity import family_parity, family_pipeline_parity
from parity import hf_causal_lm, hf_round_trip
from test_generate import greedy_matches_transformers

TIMEOUT = 240
BASE = tiny_kwargs("gpt_neox")  # head_dim 16 with the Pythia rotary_pct 0.25: 4 of 16 features rotate
SEQUENTIAL = dict(use_parallel_residual=False)


def rope(partial: float, **extra) -> dict:
    return {"rope_parameters": {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": partial,
                                **extra}}


OPTIONS = {
    "sequential_residual": SEQUENTIAL,
    "half_rotary_linear_scaling": rope(0.5, rope_type="linear", factor=2.0),
    "full_rotary": rope(1.0),
    "tied_no_attention_bias_relu": dict(tie_word_embeddings=True, attention_bias=False, hidden_act="relu"),
}


@pytest.mark.parametrize("option", sorted(OPTIONS))
def test_gpt_neox_single_process(option):
    family_parity("gpt_neox", overrides=OPTIONS[option])


@pytest.mark.parametrize("tp,sp", [(2, False), (4, False), (4, True)])
def test_gpt_neox_tensor_parallel(tp, sp):
    # vocab 101 is divisible by neither 2 nor 4: the padded vocabulary is always exercised
    run_distributed(family_parity, tp, family="gpt_neox", tp=tp, sequence_parallel=sp, timeout=TIMEOUT)


def test_gpt_neox_sequential_residual_tp2():
    run_distributed(family_parity, 2, family="gpt_neox", overrides=SEQUENTIAL, tp=2, sequence_parallel=True,
                    timeout=TIMEOUT)


def test_gpt_neox_converter_round_trip():
    assert hf_round_trip("gpt_neox", BASE, tp=1) == 1 + 2 + 1 + 12 * BASE["num_hidden_layers"]


def test_gpt_neox_sequential_residual_greedy_generate():
    greedy_matches_transformers(["gpt_neox"], configs={"gpt_neox": {**BASE, **SEQUENTIAL}})


def test_query_key_value_is_regrouped_per_head():
    """Our qkv rows are [q of every head; k of every head; v ...]; HF's query_key_value interleaves them per head.
    The read (a slice of ours from the HF tensor) and the split (ours back to HF) are inverse copies."""
    from colozoo.checkpoint.readers import GlobalTensor, StateDictReader
    from colozoo.converters.source import Source

    heads, head_dim = 4, 3
    hf = torch.randn(heads * 3 * head_dim, 5)
    source = Source.of("qkv", regroup=(heads, 3))
    ours = GlobalTensor(StateDictReader({"qkv": hf}), source).read()
    per_head = hf.view(heads, 3, head_dim, 5)
    assert torch.equal(ours[:heads * head_dim], per_head[:, 0].reshape(-1, 5))  # q
    assert torch.equal(ours[2 * heads * head_dim:], per_head[:, 2].reshape(-1, 5))  # v
    rows = slice(head_dim + 1, 2 * heads * head_dim - 2)  # a slice across q and k, not on head boundaries
    assert torch.equal(GlobalTensor(StateDictReader({"qkv": hf}), source).read((rows,)), ours[rows])
    assert torch.equal(source.split(ours)["qkv"], hf)


def test_gpt_neox_hf_export_and_offline_convert_are_bit_exact(tmp_path):
    """A model saved with format='hf', and an offline conversion HF -> colozoo at tp=2 -> HF, write query_key_value
    and embed_out exactly as transformers saved them; transformers loads the export with the same logits."""
    from safetensors.torch import load_file

    from colozoo.api import from_pretrained
    from colozoo.checkpoint.convert import convert

    config, hf = hf_causal_lm("gpt_neox", BASE)
    hf.save_pretrained(tmp_path / "hf")
    model = from_pretrained(str(tmp_path / "hf"))
    model.save_pretrained(tmp_path / "export", format="hf")
    convert(tmp_path / "hf", tmp_path / "tp2", tp=2)
    convert(tmp_path / "tp2", tmp_path / "back", to_hf=True)
    saved = load_file(tmp_path / "hf" / "model.safetensors")
    for directory in ("export", "back"):
        exported = load_file(tmp_path / directory / "model.safetensors")
        assert sorted(exported) == sorted(saved), directory
        assert all(torch.equal(exported[name], saved[name]) for name in saved), directory
    import transformers

    reloaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "back").eval()
    ids = torch.arange(10)[None] % BASE["vocab_size"]
    assert torch.equal(reloaded(ids).logits, hf(ids).logits)


REGISTERED = {"pythia-70m": 70_426_624, "pythia-160m": 162_322_944, "pythia-410m": 405_334_016,
              "pythia-1b": 1_011_781_632, "EleutherAI/pythia-1.4b": 1_414_647_808, "pythia-2.8b": 2_775_208_960,
              "pythia-6.9b": 6_857_302_016, "pythia-12b": 11_846_072_320}


@pytest.mark.parametrize("name", sorted(REGISTERED))
def test_registered_pythia_configs_have_the_published_sizes(name):
    from colozoo.registry import count_parameters, get_config

    assert count_parameters(get_config(name)) == REGISTERED[name]


def test_gpt_neox_pipeline_parallel_sequential_tied():
    """The tied head's copy on the last stage, the sequential residual."""
    run_distributed(family_pipeline_parity, 2, family="gpt_neox", pp=2, timeout=TIMEOUT,
                    overrides={**SEQUENTIAL, "num_hidden_layers": 4, "tie_word_embeddings": True})
