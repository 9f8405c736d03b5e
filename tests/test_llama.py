import pytest
import torch
import transformers

from distributed import run_distributed
from family_cases import tiny_kwargs
from parity import causal_lm_parity, hf_round_trip

# the declared config (tests/test_family_table.py runs it on one process, at tp2 with sequence parallelism and pp2 x
# tp2): 4 query heads sharing 2 kv heads; the tp=4 runs use 8 heads over 4 kv heads
BASE = tiny_kwargs("llama")
WIDE_GQA = dict(num_attention_heads=8, num_key_value_heads=4)
LLAMA3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
          "original_max_position_embeddings": 16, "rope_theta": 500.0}
OPTIONS = {
    "mha": dict(num_key_value_heads=4),
    "multi_query": dict(num_key_value_heads=1),
    "tied_biases_head_dim": dict(tie_word_embeddings=True, attention_bias=True, mlp_bias=True, head_dim=32),
    "rope_linear": dict(rope_parameters={"rope_type": "linear", "factor": 2.0, "rope_theta": 10000.0}),
    # max_position_embeddings below the sequence length (12), so the NTK base really is rescaled
    "rope_dynamic": dict(max_position_embeddings=8, rope_parameters={"rope_type": "dynamic", "factor": 2.0,
                                                                      "rope_theta": 10000.0}),
    "rope_llama3": dict(rope_parameters=LLAMA3),
    "rope_yarn": dict(rope_parameters={"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 8,
                                       "rope_theta": 10000.0}),
    # 12 tokens > original 8: LongRoPE's long factors (the layers.rope code Phi-3 uses), attention factor 2
    "rope_longrope": dict(rope_parameters={"rope_type": "longrope", "rope_theta": 10000.0, "attention_factor": 2.0,
                                           "original_max_position_embeddings": 8,
                                           "short_factor": [1.0] * 8, "long_factor": [1.0 + i for i in range(8)]}),
    "rope_yarn_mscale": dict(rope_parameters={"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 8,
                                              "rope_theta": 10000.0, "mscale": 0.8, "mscale_all_dim": 0.3,
                                              "beta_fast": 16, "truncate": False}),
}


@pytest.mark.parametrize("option", sorted(OPTIONS))
def test_llama_single_process(option):
    causal_lm_parity("llama", {**BASE, **OPTIONS[option]}, tp=1)


def test_llama_unpadded_batch():
    causal_lm_parity("llama", BASE, tp=1, padded=False)


def test_mistral_sliding_window():
    causal_lm_parity("mistral", {**BASE, "sliding_window": 4}, tp=1)


@pytest.mark.parametrize("tp,sp", [(2, False), (4, False), (4, True)])
def test_llama_tensor_parallel(tp, sp):
    # vocab 101 is divisible by neither 2 nor 4: the padded vocabulary is always exercised
    config = {**BASE, **(WIDE_GQA if tp == 4 else {})}
    run_distributed(causal_lm_parity, tp, model_type="llama", config_kwargs=config, tp=tp, sequence_parallel=sp)


@pytest.mark.parametrize("option", ["tied_biases_head_dim", "rope_llama3", "rope_dynamic"])
def test_llama_options_tp2(option):
    run_distributed(causal_lm_parity, 2, model_type="llama", config_kwargs={**BASE, **OPTIONS[option]}, tp=2,
                    sequence_parallel=True)


def test_mistral_sliding_window_tp2():
    run_distributed(causal_lm_parity, 2, model_type="mistral", config_kwargs={**BASE, "sliding_window": 4}, tp=2,
                    sequence_parallel=True)


def _build_at_tp(config_kwargs, tp):
    from colozoo.api import build_model
    from colozoo.core.mesh import init_parallel

    parallel = init_parallel(tp=tp)
    config = transformers.LlamaConfig(**config_kwargs)
    try:
        build_model(config, parallel=parallel, device="meta")
    except ValueError as e:
        return str(e)
    return None


def test_kv_heads_not_divisible_is_a_clear_error():
    # 3 kv heads can be neither split over 4 ranks nor replicated on them (2 kv heads can: test_kv_replication.py)
    config = {**BASE, "hidden_size": 96, "num_attention_heads": 12, "num_key_value_heads": 3}
    messages = run_distributed(_build_at_tp, 4, config_kwargs=config, tp=4)
    assert all(m and "num_key_value_heads" in m and "tp=4" in m for m in messages), messages


def test_unsupported_rope_type_is_a_clear_error():
    # longrope is supported since Phi-3 (tests/test_phi3.py); Gemma's proportional RoPE is not
    config = transformers.LlamaConfig(**BASE, rope_parameters={"rope_type": "proportional", "rope_theta": 1e4})
    from colozoo.api import build_model

    with pytest.raises(ValueError, match="RoPE type 'proportional'"):
        build_model(config, device="meta")


def test_llama_converter_round_trip_tied_biases_head_dim():
    hf_round_trip("llama", {**BASE, **OPTIONS["tied_biases_head_dim"]}, tp=1)


def test_llama_converter_round_trip_tp2():
    run_distributed(hf_round_trip, 2, model_type="llama", config_kwargs={**BASE, **OPTIONS["tied_biases_head_dim"]},
                    tp=2)


def test_meta_init_restores_rope_buffers():
    from colozoo.checkpoint.load import load_hf_weights
    from colozoo.checkpoint.readers import StateDictReader
    from colozoo.api import build_model
    from colozoo.layers.rope import rope_inv_freq

    config = transformers.LlamaConfig(**BASE, rope_parameters=LLAMA3)
    hf = transformers.LlamaForCausalLM(config)
    model = build_model(config, device="meta")
    load_hf_weights(model, StateDictReader(hf.state_dict()), device="cpu")
    assert torch.equal(model.rotary.inv_freq, rope_inv_freq(config))
    assert torch.equal(model.rotary.inv_freq, hf.model.rotary_emb.inv_freq)


REGISTERED = {"meta-llama/Llama-3.2-1B": 1_235_814_400, "Llama-3.1-8B": 8_030_261_248,
              "Llama-3.1-70B": 70_553_706_496, "TinyLlama-1.1B": 1_100_048_384,
              "bert-base-uncased": 109_514_298, "bert-large-uncased": 335_174_458,
              "google/vit-base-patch16-224": 86_567_656, "vit-large-patch16-224": 304_326_632,
              "vit-huge-patch14-224-in21k": 632_404_480}


@pytest.mark.parametrize("name", sorted(REGISTERED))
def test_registered_configs_build_offline_with_the_published_sizes(name):
    from colozoo.registry import count_parameters, get_config

    assert count_parameters(get_config(name)) == REGISTERED[name]  # as transformers counts them (tied once)


def test_registered_llama_symbolic_forward():
    from colozoo.api import build_model
    from colozoo.registry import get_config

    model = build_model(get_config("Llama-3.2-1B"), device="meta")
    ids = torch.zeros(1, 16, dtype=torch.long, device="meta")
    assert model(ids, labels=ids).loss.is_meta


@pytest.mark.parametrize("pp,tp,sp,tied", [(2, 2, True, True), (2, 1, False, False), (2, 4, True, False)])
def test_llama_pipeline_parallel(pp, tp, sp, tied):
    from parity import batch, pipeline_parity

    heads = WIDE_GQA if tp == 4 else {}  # tp=4 needs 4 kv heads
    config = {**BASE, **heads, "num_hidden_layers": 4, "tie_word_embeddings": tied, "rope_parameters": LLAMA3}
    ids, mask, labels = batch(BASE["vocab_size"], 12)
    run_distributed(pipeline_parity, pp * tp, architecture="LlamaForCausalLM", config_kwargs=config, ids=ids, mask=mask,
                    labels=labels, pp=pp, tp=tp, sequence_parallel=sp)
