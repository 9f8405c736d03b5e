"""The profiler and planner know generation: weights and KV cache per rank against their formulas, the bound on
decode tokens/s from the bytes a step reads, and the smallest mesh that holds a model for decoding."""
import json

import pytest

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
