"""Qwen2 / Qwen2.5, Qwen3 and Qwen3-MoE beyond the family table (tests/test_family_table.py: each declared config on
one process, tp2 with sequence parallelism, pp2 x tp2, ep 2): a tied head, Qwen3 with sliding layers and biases, tp 4
over 4 kv heads, Qwen3-MoE at tp2 x ep2 and pp2 x ep2, context parallelism over full and sliding layers, converter
round trips of the variants, FSDP / DDP training steps, the sliding layers' cache, the registry's published
sizes."""
import pytest
import torch

from distributed import run_distributed
from family_cases import tiny_kwargs
from family_parity import family_parity, family_pipeline_parity
from parity import hf_round_trip

TIMEOUT = 240
WIDE = dict(num_attention_heads=8, num_key_value_heads=4)  # tp=4 shards whole kv heads
# the declared Qwen2 slides over 4 positions in layer 2; a variant with a tied head, and Qwen3 sliding with biases
CASES = {
    "qwen2_tied": ("qwen2", dict(tie_word_embeddings=True)),
    "qwen3_sliding_bias": ("qwen3", dict(num_hidden_layers=3, use_sliding_window=True, sliding_window=4,
                                         max_window_layers=2, attention_bias=True, tie_word_embeddings=True)),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_qwen_single_process(case):
    family, options = CASES[case]
    family_parity(family, overrides=options)


@pytest.mark.parametrize("case,tp,sp", [("qwen2", 4, True), ("qwen3_sliding_bias", 4, False), ("qwen2_tied", 2, True)])
def test_qwen_tensor_parallel(case, tp, sp):
    family, options = CASES.get(case, (case, {}))
    run_distributed(family_parity, tp, family=family, overrides={**options, **(WIDE if tp == 4 else {})}, tp=tp,
                    sequence_parallel=sp, timeout=TIMEOUT)


@pytest.mark.parametrize("case", sorted(CASES))
def test_qwen_converter_round_trip(case):
    family, options = CASES[case]
    hf_round_trip(family, tiny_kwargs(family, **options))


def test_qwen3_moe_expert_and_tensor_parallel():
    run_distributed(family_parity, 4, family="qwen3_moe", tp=2, ep=2, sequence_parallel=True, timeout=TIMEOUT)


@pytest.mark.parametrize("mode", ["ring", "all_to_all"])
def test_qwen3_sliding_layers_context_parallel(mode):
    """cp=2 x tp=2: full and sliding layers across the cp ranks, the q/k norms on the rank's tokens."""
    run_distributed(family_parity, 4, family="qwen3", tp=2, cp=2, cp_mode=mode, sequence_parallel=True,
                    overrides=CASES["qwen3_sliding_bias"][1], timeout=TIMEOUT)


def test_qwen3_moe_pipeline_parallel_ep2():
    """Qwen3-MoE over 2 stages (sparse layer 0 | dense 1 and sparse 2) with ep 2: logits, loss and aux loss, then a
    forward_backward's loss and every gathered gradient against transformers."""
    names = run_distributed(family_pipeline_parity, 4, family="qwen3_moe", pp=2, tp=1, ep=2, timeout=TIMEOUT)
    assert {n.split(".")[1] for ranks in names for n in ranks if n.startswith("layers.")} == {"0", "1", "2"}


def training_step(family, config, *args, **kwargs):
    """test_training_cp_ep's optimizer step against transformers (clipped gradients, AdamW), on a Qwen config."""
    import test_training_cp_ep

    test_training_cp_ep.CONFIGS[family] = config
    return test_training_cp_ep.step_against_hf(family, *args, **kwargs)


@pytest.mark.parametrize("family,options", [("qwen3", {}), ("qwen3_moe", dict(data_parallel="ddp"))])
def test_qwen3_training_step_dp2_tp2(family, options):
    """dp=2 x tp=2 (FSDP for Qwen3, DDP and ep=2 for Qwen3-MoE): loss, clipped gradients (the replicated q/k norms
    counted once in the norm) and parameters after one AdamW step equal transformers'."""
    ep = 2 if family == "qwen3_moe" else 1
    run_distributed(training_step, 4, family=family, config=tiny_kwargs(family), dp=2, cp=1, ep=ep, tp=2,
                    microbatches=1, options=options, timeout=TIMEOUT)


# --- generation ------------------------------------------------------------------------------------------------

def test_qwen2_cache_keeps_a_window_only_for_sliding_layers():
    from colozoo.core.mesh import single_process
    from test_generate import NEW, ours_and_hf, prompts

    config, hf, model = ours_and_hf("qwen2", single_process())
    ids, mask = prompts(config.vocab_size)  # 9 + 6 positions, window 4
    out = model.generate(ids, attention_mask=mask, max_new_tokens=NEW, pad_token_id=0, eos_token_id=None,
                         return_dict_in_generate=True)
    per_position = 2 * config.num_key_value_heads * (config.hidden_size // config.num_attention_heads) * ids.shape[0]
    full, sliding = config.layer_types.count("full_attention"), config.layer_types.count("sliding_attention")
    assert (full, sliding) == (2, 1)
    expected = per_position * (full * (ids.shape[1] + NEW) + sliding * config.sliding_window)
    assert out.cache_elements == expected


# --- registry ----------------------------------------------------------------------------------------------------

PUBLISHED = {"Qwen2.5-0.5B": 494_032_768, "Qwen2.5-1.5B": 1_543_714_304, "Qwen2.5-3B": 3_085_938_688,
             "Qwen2.5-7B": 7_615_616_512, "Qwen2.5-14B": 14_770_033_664, "Qwen2.5-32B": 32_763_876_352,
             "Qwen2.5-72B": 72_706_203_648, "Qwen3-0.6B": 596_049_920, "Qwen3-1.7B": 1_720_574_976,
             "Qwen3-4B": 4_022_468_096, "Qwen3-8B": 8_190_735_360, "Qwen3-14B": 14_768_307_200,
             "Qwen3-32B": 32_762_123_264, "Qwen3-30B-A3B": 30_532_122_624, "Qwen3-235B-A22B": 235_093_634_560}


@pytest.mark.parametrize("name", sorted(PUBLISHED))
def test_registered_qwen_sizes_match_transformers(name):
    import transformers

    from colozoo.registry import count_parameters, get_config

    config = get_config(f"Qwen/{name}")
    with torch.device("meta"):
        hf = getattr(transformers, config.architectures[0])(config)
    assert count_parameters(config) == sum(p.numel() for p in hf.parameters()) == PUBLISHED[name]


def test_profile_qwen3_32b_tp8():
    """The profiler builds Qwen3-32B on an 8-way tp mesh: whole-head q/k norms stay replicated (their gradients
    summed over tp), everything else is split by 8."""
    from colozoo.cost.profiler import profile_for

    b, s, h, hd = 1, 128, 5120, 128
    report = profile_for("Qwen3-32B", batch_size=b, seq_len=s, mesh="tp=8")
    assert report.total_params == PUBLISHED["Qwen3-32B"]
    layer = next(u for u in report.units if u["name"].startswith("layer"))
    split = (64 + 2 * 8) * hd * h + 64 * hd * h + 3 * h * 25600  # q/k/v, o_proj, gate/up/down
    replicated = 2 * h + 2 * hd  # the two layer norms and q/k norms
    assert layer["param_bytes"] == 2 * (split // 8 + replicated)
    # two all-reduces forward and two backward of the bf16 activations, and the q/k norm gradients
    assert layer["comm"] == {"tp.all_reduce": 4 * b * s * h * 2 + 2 * hd * 2}
