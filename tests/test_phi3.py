"""Phi-3 against transformers: logits, loss and every gathered gradient (fp32, vocab 101) at tp 1/2/4 with and
without sequence parallelism, LongRoPE on both sides of original_max_position_embeddings, partial rotary, sliding
window; the fused-checkpoint round trip bit for bit; greedy generate token for token, across the LongRoPE switch."""
import pytest
import torch

from distributed import run_distributed
from parity import causal_lm_parity, hf_causal_lm, hf_round_trip

TIMEOUT = 240
# 4 query heads over 2 kv heads (head_dim 16: 8 rotary frequencies); bos/eos inside the vocabulary
BASE = dict(vocab_size=101, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=32, pad_token_id=0, bos_token_id=1, eos_token_id=2)
WIDE = dict(num_attention_heads=8, num_key_value_heads=4)  # tp=4 shards whole kv heads (head_dim 8)


def longrope(pairs: int, original: int = 8, partial: float = 1.0) -> dict:
    """LongRoPE with distinct short and long factors per frequency; factor 32/8 gives an attention factor != 1."""
    return dict(original_max_position_embeddings=original,
                rope_parameters={"rope_type": "longrope", "rope_theta": 10000.0, "partial_rotary_factor": partial,
                                 "short_factor": [1.0 + 0.25 * i for i in range(pairs)],
                                 "long_factor": [1.0 + 3.0 * i for i in range(pairs)]})


OPTIONS = {  # option: (config, sequence length)
    "default": ({}, 12),
    "longrope_long": (longrope(8), 12),   # 12 > original 8: the long factors
    "longrope_short": (longrope(8), 6),   # 6 <= 8: the short factors
    "partial_rotary_longrope": (longrope(4, partial=0.5), 12),  # only 8 of 16 features rotate
    "partial_rotary": ({"rope_parameters": {"rope_type": "default", "rope_theta": 10000.0,
                                            "partial_rotary_factor": 0.75}}, 12),
    "sliding_window": ({"sliding_window": 4}, 12),
}


@pytest.mark.parametrize("option", sorted(OPTIONS))
def test_phi3_single_process(option):
    config, seq_len = OPTIONS[option]
    causal_lm_parity("phi3", {**BASE, **config}, tp=1, seq_len=seq_len)


@pytest.mark.parametrize("tp,sp", [(2, False), (2, True), (4, False), (4, True)])
def test_phi3_tensor_parallel_longrope(tp, sp):
    # vocab 101 is divisible by neither 2 nor 4: the padded vocabulary is always exercised
    config = {**BASE, **longrope(8)} if tp == 2 else {**BASE, **WIDE, **longrope(4)}
    run_distributed(causal_lm_parity, tp, model_type="phi3", config_kwargs=config, tp=tp, sequence_parallel=sp,
                    timeout=TIMEOUT)


def test_phi3_partial_rotary_sliding_window_tp2():
    config = {**BASE, **longrope(4, partial=0.5), "sliding_window": 4}
    run_distributed(causal_lm_parity, 2, model_type="phi3", config_kwargs=config, tp=2, sequence_parallel=True,
                    timeout=TIMEOUT)


def test_phi3_converter_round_trip():
    assert hf_round_trip("phi3", {**BASE, **longrope(8)}, tp=1) == 1 + 1 + 1 + 6 * BASE["num_hidden_layers"]


def test_phi3_converter_round_trip_tp2():
    run_distributed(hf_round_trip, 2, model_type="phi3", config_kwargs={**BASE, **longrope(8)}, tp=2, timeout=TIMEOUT)


def test_phi3_convert_reshard_export(tmp_path):
    """HF (fused qkv / gate_up) -> colozoo at tp2 x pp2 -> tp4 (kv heads replicated) -> HF, bit for bit."""
    from test_qwen import convert_round_trip

    convert_round_trip(tmp_path, "phi3", {**BASE, **longrope(8), "num_hidden_layers": 4}, dict(tp=2, pp=2))


def greedy_equals_transformers(model_type: str, config_kwargs: dict, tp: int = 1):
    """model.generate == transformers' generate (greedy, fp32) on left-padded prompts of 5, 9 and 3 tokens."""
    from test_generate import greedy_matches_transformers

    return greedy_matches_transformers([model_type], tp=tp, configs={model_type: config_kwargs})[model_type]


# prompts 9 wide + 6 new tokens: the sequence passes original_max_position_embeddings=11 at its 3rd new token, where
# the cache is encoded again with the long factors (weights large enough that keeping the short-rotated cache changes
# the tokens); the sliding window (6) is shorter than the sequence
GENERATE = {**BASE, **longrope(8, original=11), "sliding_window": 6, "initializer_range": 0.2}


def test_phi3_greedy_generate_equals_transformers():
    greedy_equals_transformers("phi3", GENERATE)


def test_phi3_greedy_generate_equals_transformers_tp2():
    results = run_distributed(greedy_equals_transformers, 2, model_type="phi3", config_kwargs=GENERATE, tp=2,
                              timeout=TIMEOUT)
    assert results[0] == results[1]


REGISTERED = {"Phi-3-mini-4k-instruct": 3_821_079_552, "microsoft/Phi-3-mini-128k-instruct": 3_821_079_552,
              "Phi-3-medium-4k-instruct": 13_960_238_080, "Phi-3-medium-128k-instruct": 13_960_238_080}


@pytest.mark.parametrize("name", sorted(REGISTERED))
def test_registered_phi3_configs_have_the_published_sizes(name):
    from colozoo.registry import count_parameters, get_config

    assert count_parameters(get_config(name)) == REGISTERED[name]


# LongRoPE factors of microsoft/Phi-3-{mini,medium}-128k-instruct's config.json as published (transformers 4.39.3, the
# copies in dotnet/machinelearning's Microsoft.ML.GenAI.Phi resources): count, sum and a few by index
PUBLISHED_FACTORS = {
    "Phi-3-mini-128k-instruct": {
        "short_factor": (48, 93.35, {0: 1.05, 5: 1.1500000000000001, 10: 1.5000000000000004, 47: 2.9499999999999975}),
        "long_factor": (48, 1513.020151, {0: 1.0299999713897705, 29: 53.840003967285156, 47: 64.81001281738281})},
    "Phi-3-medium-128k-instruct": {
        "short_factor": (64, 538.87, {5: 1.0, 6: 1.01, 20: 2.759999999999992, 63: 16.799999999999827}),
        "long_factor": (64, 2064.25, {12: 1.0, 13: 1.25, 35: 42.25, 63: 65.0})},
}


@pytest.mark.parametrize("name", sorted(PUBLISHED_FACTORS))
def test_registered_phi3_128k_longrope_factors_are_the_published_ones(name):
    from colozoo.registry import get_config

    rope = get_config(name).rope_parameters
    assert rope["rope_type"] == "longrope" and rope["original_max_position_embeddings"] == 4096
    for key, (count, total, by_index) in PUBLISHED_FACTORS[name].items():
        factors = rope[key]
        assert len(factors) == count and sum(factors) == pytest.approx(total, abs=1e-6), key
        assert {i: factors[i] for i in by_index} == by_index, key


def test_registered_phi3_128k_symbolic_forward_past_the_original_length():
    from colozoo.api import build_model
    from colozoo.registry import get_config

    model = build_model(get_config("Phi-3-mini-128k-instruct"), device="meta")
    ids = torch.zeros(1, 16, dtype=torch.long, device="meta")
    assert model(ids, labels=ids).loss.is_meta


def test_phi3_pipeline_parallel_longrope():
    from parity import batch, pipeline_parity

    ids, mask, labels = batch(BASE["vocab_size"], 12)
    config = {**BASE, **longrope(8), "num_hidden_layers": 4}
    run_distributed(pipeline_parity, 2, architecture="Phi3ForCausalLM", config_kwargs=config, ids=ids, mask=mask,
                    labels=labels, pp=2, tp=1, timeout=TIMEOUT)


def test_phi3_pipeline_parallel_pp2_tp2():
    """tp2 x pp2 with sequence parallelism, LongRoPE past the original length, a window shorter than the sequence."""
    from parity import batch, pipeline_parity

    ids, mask, labels = batch(BASE["vocab_size"], 12)
    config = {**BASE, **longrope(8), "num_hidden_layers": 4, "sliding_window": 6}
    run_distributed(pipeline_parity, 4, architecture="Phi3ForCausalLM", config_kwargs=config, ids=ids, mask=mask,
                    labels=labels, pp=2, tp=2, sequence_parallel=True, timeout=TIMEOUT)
