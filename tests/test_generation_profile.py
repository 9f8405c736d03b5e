"""The profiler and planner know generation: weights and KV cache per rank against their formulas, the bound on
decode tokens/s from the bytes a step reads, and the smallest mesh that holds a model for decoding."""
import json

import pytest

from family_cases import GENERATING, attention, tiny_kwargs

from colozoo.cost.hardware import get_hardware
from colozoo.cost.inference import kv_cache_bytes, plan_generation, profile_generation
from colozoo.cost.setup import ProfilerError, get_config


def test_kv_cache_and_weights_per_rank_follow_their_formulas():
    config = get_config("Llama-3.1-8B")  # 32 layers, 8 kv heads of 128
    found = profile_generation("Llama-3.1-8B", batch_size=4, seq_len=4096, mesh="tp=2")
    assert found.kv_cache_bytes == 2 * 32 * (8 // 2) * 128 * 4096 * 4 * 2
    total = 8.03e9 * 2  # bf16 weights of the whole model
    assert found.weights_bytes == pytest.approx(total / 2, rel=0.02)  # the embedding and head split too
    piped = profile_generation("Llama-3.1-8B", batch_size=4, seq_len=4096, mesh="tp=1,pp=2")
    assert piped.kv_cache_bytes == kv_cache_bytes(config, 16, 1, 4, 4096, 2)  # half the layers on a stage
    hbm = get_hardware("H100-80GB").hbm_bw
    assert found.decode_tokens_per_s_bound == pytest.approx(4 * hbm / found.bytes_per_decode_step)
    assert piped.bytes_per_decode_step == pytest.approx(2 * found.bytes_per_decode_step, rel=0.02)  # stages in turn


def test_longer_sequences_cost_cache_and_speed():
    short = profile_generation("opt-1.3b", batch_size=8, seq_len=512)
    long = profile_generation("opt-1.3b", batch_size=8, seq_len=2048)
    assert long.kv_cache_bytes == 4 * short.kv_cache_bytes and long.weights_bytes == short.weights_bytes
    assert long.decode_tokens_per_s_bound < short.decode_tokens_per_s_bound


def test_plan_generation_picks_the_smallest_mesh_that_holds_the_model():
    small = plan_generation("Llama-3.1-8B", gpus=8, batch_size=1, seq_len=2048)
    assert small.mesh == "tp=1,pp=1" and small.fits
    big = plan_generation("Llama-3.1-70B", gpus=8, batch_size=64, seq_len=8192)  # 141 GB of weights + 320 GB cache
    assert big.mesh == "tp=4,pp=1" and big.fits
    assert not profile_generation("Llama-3.1-70B", batch_size=64, seq_len=8192, mesh="tp=2").fits
    with pytest.raises(ProfilerError, match="does not fit on 1"):
        plan_generation("Llama-3.1-70B", gpus=1)


def test_cli_generate_reflects_every_argument(capsys):
    from colozoo.cli import main

    assert main(["profile", "gpt2", "--generate", "--batch-size", "2", "--seq-len", "512", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert (out["batch_size"], out["seq_len"], out["mesh"]) == (2, 512, "tp=1,pp=1")
    assert out["kv_cache_bytes"] == 2 * 12 * 12 * 64 * 512 * 2 * 2
    assert main(["plan", "Llama-3.1-70B", "--generate", "--gpus", "8", "--batch-size", "64", "--seq-len", "8192",
                 "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["mesh"] == "tp=4,pp=1"


# --- the formula against the cache a real generate allocates ----------------------------------------------------

def cache_against_formula(family, config_kwargs, attn_implementation="sdpa", tp=1, pp=1):
    """Greedy generate on prompts of 9 tokens + 6 new (past every window of the declared configs): the bytes of the
    cache this rank allocated (fp32) and kv_cache_bytes of this rank's layers."""
    from test_generate import NEW, ours_and_hf, prompts

    from colozoo.core.mesh import init_parallel, single_process

    parallel = init_parallel(tp=tp, pp=pp) if tp * pp > 1 else single_process()
    config, _, model = ours_and_hf(family, parallel, config_kwargs, attn_implementation)
    ids, mask = prompts(config.vocab_size)
    out = model.eval().generate(ids, attention_mask=mask, max_new_tokens=NEW, pad_token_id=0, eos_token_id=None,
                                return_dict_in_generate=True)
    formula = kv_cache_bytes(config, [int(i) for i in model.layers], tp, ids.shape[0], ids.shape[1] + NEW, 4)
    return out.cache_elements * 4, formula


@pytest.mark.parametrize("family", GENERATING)
def test_kv_cache_bytes_equal_what_generate_allocates(family):
    """Every causal family of the table, its declared config: Gemma's alternating sliding layers, Qwen2's sliding layer
    from layer_types, one window on every layer (Mistral, Phi-3), gpt-oss's alternation, SmolLM3's sliding NoPE layer,
    MLA's latent and rotary key, head_dim != hidden / heads (Qwen3), full layers."""
    from test_generate import FAMILIES

    measured, formula = cache_against_formula(family, FAMILIES[family], attention(family))
    assert formula == measured


def test_kv_cache_bytes_per_rank_at_tp2_pp2():
    """Gemma 3 at tp2 x pp2: each rank holds one of the 2 kv heads of its stage's layers, sliding and full."""
    from distributed import run_distributed

    for measured, formula in run_distributed(cache_against_formula, 4, family="gemma3_text",
                                             config_kwargs=tiny_kwargs("gemma3_text"),
                                             attn_implementation=attention("gemma3_text"), tp=2, pp=2, timeout=240):
        assert formula == measured


def test_generation_profile_keeps_only_the_window_of_sliding_layers():
    """gemma-2-9b: 21 sliding layers (window 4096) and 21 full ones, 8 kv heads of 256: at 8192 positions the sliding
    layers hold half of what the full ones do; below the window every layer holds the whole sequence."""
    long = profile_generation("gemma-2-9b", batch_size=2, seq_len=8192)
    assert long.kv_cache_bytes == 2 * 8 * 256 * (21 * 8192 + 21 * 4096) * 2 * 2
    short = profile_generation("gemma-2-9b", batch_size=2, seq_len=2048)
    assert short.kv_cache_bytes == 2 * 8 * 256 * 42 * 2048 * 2 * 2
