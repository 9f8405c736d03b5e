"""Phi-3 beyond the family table (tests/test_family_table.py: the declared config, LongRoPE past its original 11
positions with a window of 6, on one process, tp2 with sequence parallelism and pp2 x tp2; generation across the
LongRoPE switch): LongRoPE's short factors, partial rotary, plain RoPE, tp 2 without and tp 4 with sequence
parallelism, the fused checkpoint's tensors, the registry's sizes and LongRoPE factors."""
import pytest
import torch

from distributed import run_distributed
from family_cases import tiny_kwargs
from family_parity import family_parity
from parity import hf_causal_lm, hf_round_trip

TIMEOUT = 240
WIDE = dict(num_attention_heads=8, num_key_value_heads=4)  # tp=4 shards whole kv heads (head_dim 8)


def longrope(pairs: int, original: int = 8, partial: float = 1.0) -> dict:
    """LongRoPE with distinct short and long factors per frequency; factor 32/8 gives an attention factor != 1."""
    return dict(original_max_position_embeddings=original,
                rope_parameters={"rope_type": "longrope", "rope_theta": 10000.0, "partial_rotary_factor": partial,
                                 "short_factor": [1.0 + 0.25 * i for i in range(pairs)],
                                 "long_factor": [1.0 + 3.0 * i for i in range(pairs)]})


OPTIONS = {  # option: (overrides of the declared config, sequence length)
    "plain_rope": ({"rope_parameters": {"rope_type": "default", "rope_theta": 10000.0}, "sliding_window": None}, 12),
    "longrope_short": ({}, 6),   # 6 <= 11: the short factors
    "partial_rotary_longrope": (longrope(4, partial=0.5), 12),  # only 8 of 16 features rotate
    "partial_rotary": ({"rope_parameters": {"rope_type": "default", "rope_theta": 10000.0,
                                            "partial_rotary_factor": 0.75}}, 12),
}


@pytest.mark.parametrize("option", sorted(OPTIONS))
def test_phi3_single_process(option):
    overrides, seq_len = OPTIONS[option]
    family_parity("phi3", overrides=overrides, seq_len=seq_len)


@pytest.mark.parametrize("tp,sp", [(2, False), (4, False), (4, True)])
def test_phi3_tensor_parallel_longrope(tp, sp):
    # vocab 101 is divisible by neither 2 nor 4: the padded vocabulary is always exercised
    overrides = {} if tp == 2 else {**WIDE, **longrope(4, original=11)}
    run_distributed(family_parity, tp, family="phi3", overrides=overrides, tp=tp, sequence_parallel=sp,
                    timeout=TIMEOUT)


def test_phi3_partial_rotary_sliding_window_tp2():
    overrides = {**longrope(4, partial=0.5), "sliding_window": 4}
    run_distributed(family_parity, 2, family="phi3", overrides=overrides, tp=2, sequence_parallel=True,
                    timeout=TIMEOUT)


def test_phi3_fused_checkpoint_round_trip():
    """The checkpoint's fused qkv_proj and gate_up_proj: one tensor each per layer."""
    assert hf_round_trip("phi3", tiny_kwargs("phi3"), tp=1) == 1 + 1 + 1 + 6 * tiny_kwargs("phi3")["num_hidden_layers"]


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
