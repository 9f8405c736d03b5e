"""GPT-NeoX / Pythia against transformers: logits, loss and every gathered gradient (fp32, vocab 101) at tp 1/2/4 with
and without sequence parallelism, parallel and sequential residuals, partial rotary (rotary_pct), tied or untied head,
attention without biases; the per-head query_key_value reordered to our [q; k; v] and back bit for bit (the round
trip and the HF export); greedy generate token for token at tp 1/2."""
import pytest
import torch

from distributed import run_distributed
from parity import causal_lm_parity, hf_causal_lm, hf_round_trip
from test_phi3 import greedy_equals_transformers

TIMEOUT = 240
# head_dim 16 with the Pythia rotary_pct 0.25: 4 of 16 features rotate
BASE = dict(vocab_size=101, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
            max_position_embeddings=32, bos_token_id=1, eos_token_id=2)
SEQUENTIAL = dict(use_parallel_residual=False)


def rope(partial: float, **extra) -> dict:
    return {"rope_parameters": {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": partial,
                                **extra}}


OPTIONS = {
    "parallel_residual": {},
    "sequential_residual": SEQUENTIAL,
    "half_rotary_linear_scaling": rope(0.5, rope_type="linear", factor=2.0),
    "full_rotary": rope(1.0),
    "tied_no_attention_bias_relu": dict(tie_word_embeddings=True, attention_bias=False, hidden_act="relu"),
}


@pytest.mark.parametrize("option", sorted(OPTIONS))
def test_gpt_neox_single_process(option):
    causal_lm_parity("gpt_neox", {**BASE, **OPTIONS[option]}, tp=1)


@pytest.mark.parametrize("tp,sp", [(2, False), (2, True), (4, False), (4, True)])
def test_gpt_neox_tensor_parallel(tp, sp):
    # vocab 101 is divisible by neither 2 nor 4: the padded vocabulary is always exercised
    run_distributed(causal_lm_parity, tp, model_type="gpt_neox", config_kwargs=BASE, tp=tp, sequence_parallel=sp,
                    timeout=TIMEOUT)


def test_gpt_neox_sequential_residual_tp2():
    run_distributed(causal_lm_parity, 2, model_type="gpt_neox", config_kwargs={**BASE, **SEQUENTIAL}, tp=2,
                    sequence_parallel=True, timeout=TIMEOUT)


def test_gpt_neox_converter_round_trip():
    assert hf_round_trip("gpt_neox", BASE, tp=1) == 1 + 2 + 1 + 12 * BASE["num_hidden_layers"]


def test_gpt_neox_converter_round_trip_tp2():
    run_distributed(hf_round_trip, 2, model_type="gpt_neox", config_kwargs=BASE, tp=2, timeout=TIMEOUT)


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


def test_gpt_neox_convert_reshard_export(tmp_path):
    """HF (per-head query_key_value) -> colozoo at tp2 x pp2 -> tp4 -> HF, bit for bit; transformers loads it."""
    from test_qwen import convert_round_trip

    convert_round_trip(tmp_path, "gpt_neox", {**BASE, "num_hidden_layers": 4}, dict(tp=2, pp=2))


# larger weights than transformers' default, so that a wrong rotation or residual changes the greedy tokens
GENERATE = {**BASE, "num_hidden_layers": 3, "initializer_range": 0.2}


def test_gpt_neox_greedy_generate_equals_transformers():
    greedy_equals_transformers("gpt_neox", GENERATE)
    greedy_equals_transformers("gpt_neox", {**GENERATE, **SEQUENTIAL})


def test_gpt_neox_greedy_generate_equals_transformers_tp2():
    results = run_distributed(greedy_equals_transformers, 2, model_type="gpt_neox", config_kwargs=GENERATE, tp=2,
                              timeout=TIMEOUT)
    assert results[0] == results[1]


REGISTERED = {"pythia-70m": 70_426_624, "pythia-160m": 162_322_944, "pythia-410m": 405_334_016,
              "pythia-1b": 1_011_781_632, "EleutherAI/pythia-1.4b": 1_414_647_808, "pythia-2.8b": 2_775_208_960,
              "pythia-6.9b": 6_857_302_016, "pythia-12b": 11_846_072_320}


@pytest.mark.parametrize("name", sorted(REGISTERED))
def test_registered_pythia_configs_have_the_published_sizes(name):
    from colozoo.registry import count_parameters, get_config

    assert count_parameters(get_config(name)) == REGISTERED[name]


def test_gpt_neox_pipeline_parallel():
    from parity import batch, pipeline_parity

    ids, mask, labels = batch(BASE["vocab_size"], 12)
    config = {**BASE, **SEQUENTIAL, "num_hidden_layers": 4, "tie_word_embeddings": True}  # the tied copy on stage 2
    run_distributed(pipeline_parity, 2, architecture="GPTNeoXForCausalLM", config_kwargs=config, ids=ids, mask=mask,
                    labels=labels, pp=2, tp=1, timeout=TIMEOUT)


def test_gpt_neox_pipeline_parallel_pp2_tp2():
    """tp2 x pp2 with sequence parallelism: the parallel residual, partial rotary and the padded vocabulary (101)."""
    from parity import batch, pipeline_parity

    ids, mask, labels = batch(BASE["vocab_size"], 12)
    config = {**BASE, "num_hidden_layers": 4}
    run_distributed(pipeline_parity, 4, architecture="GPTNeoXForCausalLM", config_kwargs=config, ids=ids, mask=mask,
                    labels=labels, pp=2, tp=2, sequence_parallel=True, timeout=TIMEOUT)
