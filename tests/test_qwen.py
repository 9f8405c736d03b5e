"""Qwen2 / Qwen2.5, Qwen3 and Qwen3-MoE match transformers: logits, loss and every gathered gradient at tp 1/2/4
with and without sequence parallelism (Qwen2's sliding-window layers over a sequence longer than the window, Qwen3's
per-head q/k norms), Qwen3-MoE at ep 2 (with tp 2), a pipeline step, converter round trips bit for bit, greedy
generation token for token, and the registry's published sizes."""
import pytest
import torch

from distributed import run_distributed
from parity import batch, causal_lm_parity, hf_round_trip, pipeline_parity
from test_generate import greedy_matches_transformers
from test_mixtral import mixtral_parity

TIMEOUT = 240
# odd vocabulary (padded at every tp), 4 query heads over 2 kv heads; WIDE for tp=4 (4 kv heads)
BASE = dict(vocab_size=101, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=32, pad_token_id=0)
WIDE = dict(num_attention_heads=8, num_key_value_heads=4)
# layers 0 and 1 full, 2 sliding (transformers: layers >= max_window_layers slide); window 4 < sequence 12
SLIDING = dict(num_hidden_layers=3, use_sliding_window=True, sliding_window=4, max_window_layers=2)
CASES = {
    "qwen2": ("qwen2", {}),
    "qwen2_tied": ("qwen2", dict(tie_word_embeddings=True)),
    "qwen2_sliding": ("qwen2", SLIDING),
    "qwen3": ("qwen3", dict(head_dim=32)),  # head_dim != hidden / heads: the q/k norms are over head_dim
    "qwen3_sliding_bias": ("qwen3", dict(SLIDING, attention_bias=True, tie_word_embeddings=True)),
}
# layer 0 and 2 sparse (top-2 of 4 experts, renormalised), layer 1 dense (mlp_only_layers), no shared expert
QWEN3_MOE = dict(vocab_size=101, hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=3,
                 num_attention_heads=4, num_key_value_heads=2, head_dim=24, num_experts=4, num_experts_per_tok=2,
                 norm_topk_prob=True, mlp_only_layers=[1], max_position_embeddings=64, output_router_logits=True,
                 router_aux_loss_coef=0.05)


@pytest.mark.parametrize("case", sorted(CASES))
def test_qwen_single_process(case):
    family, options = CASES[case]
    causal_lm_parity(family, {**BASE, **options})


@pytest.mark.parametrize("case,tp,sp", [("qwen2_sliding", 2, False), ("qwen2", 4, True), ("qwen3", 2, True),
                                        ("qwen3_sliding_bias", 4, False), ("qwen2_tied", 2, True)])
def test_qwen_tensor_parallel(case, tp, sp):
    family, options = CASES[case]
    config = {**BASE, **options, **(WIDE if tp == 4 else {})}
    run_distributed(causal_lm_parity, tp, model_type=family, config_kwargs=config, tp=tp, sequence_parallel=sp,
                    timeout=TIMEOUT)


@pytest.mark.parametrize("case", ["qwen2_tied", "qwen3_sliding_bias"])
def test_qwen_converter_round_trip(case):
    family, options = CASES[case]
    hf_round_trip(family, {**BASE, **options})


def test_qwen_converter_round_trip_tp2():
    run_distributed(hf_round_trip, 2, model_type="qwen2", config_kwargs=BASE, tp=2, timeout=TIMEOUT)
    run_distributed(hf_round_trip, 2, model_type="qwen3", config_kwargs={**BASE, **CASES["qwen3"][1]}, tp=2,
                    timeout=TIMEOUT)


def test_qwen3_moe_converter_round_trip():
    # embeddings, final norm, head; per layer q/k/v/o, q/k norms, 2 norms; routers and 4 experts x 3 (one tensor
    # each in the file) in the 2 sparse layers, gate/up/down in the dense one
    assert hf_round_trip("qwen3_moe", QWEN3_MOE) == 3 + 3 * 8 + 2 * (1 + 4 * 3) + 3


def test_qwen3_moe_single_process():
    mixtral_parity(config_overrides=QWEN3_MOE, family="qwen3_moe")


@pytest.mark.parametrize("tp,ep,sp", [(1, 2, False), (2, 2, True)])
def test_qwen3_moe_expert_and_tensor_parallel(tp, ep, sp):
    run_distributed(mixtral_parity, tp * ep, tp=tp, ep=ep, cp=1, sequence_parallel=sp, cp_mode="ring",
                    config_overrides=QWEN3_MOE, family="qwen3_moe", timeout=TIMEOUT)


@pytest.mark.parametrize("mode", ["ring", "all_to_all"])
def test_qwen3_sliding_layers_context_parallel(mode):
    """cp=2 x tp=2: full and sliding layers across the cp ranks, the q/k norms on the rank's tokens."""
    from test_context_parallel import cp_parity

    config = {**BASE, **CASES["qwen3_sliding_bias"][1]}
    run_distributed(cp_parity, 4, tp=2, cp=2, mode=mode, sequence_parallel=True, family="qwen3", overrides=config,
                    timeout=TIMEOUT)


def convert_round_trip(directory, family, config_kwargs, mesh, attn_implementation="sdpa"):
    """transformers' save_pretrained -> colozoo on `mesh` -> colozoo at tp=4 -> HF: bit for bit, and transformers
    loads the export."""
    from safetensors.torch import load_file

    from colozoo.checkpoint.convert import convert
    from parity import hf_causal_lm

    config, hf = hf_causal_lm(family, config_kwargs, attn_implementation=attn_implementation)
    hf.save_pretrained(directory / "hf")
    convert(directory / "hf", directory / "first", **mesh)
    convert(directory / "first", directory / "tp4", tp=4)
    convert(directory / "tp4", directory / "back", to_hf=True)
    original, back = load_file(directory / "hf" / "model.safetensors"), load_file(directory / "back" / "model.safetensors")
    assert sorted(original) == sorted(back), set(original) ^ set(back)
    for name, tensor in original.items():
        assert torch.equal(tensor, back[name]), name
    import transformers

    exported = transformers.AutoModelForCausalLM.from_pretrained(directory / "back",
                                                                 attn_implementation=attn_implementation).eval()
    ids, mask, _ = batch(config.vocab_size, 12)
    with torch.no_grad():
        assert torch.equal(hf(ids, attention_mask=mask).logits, exported(ids, attention_mask=mask).logits)


@pytest.mark.parametrize("family", ["qwen2", "qwen3", "qwen3_moe"])
def test_qwen_convert_reshard_export(tmp_path, family):
    config = {"qwen2": {**BASE, **WIDE, **SLIDING}, "qwen3": {**BASE, **WIDE, **CASES["qwen3_sliding_bias"][1]},
              "qwen3_moe": {**QWEN3_MOE, **WIDE}}[family]
    mesh = dict(tp=2, pp=2, ep=2) if family == "qwen3_moe" else dict(tp=2, pp=2)
    convert_round_trip(tmp_path, family, config, mesh)


def test_qwen3_pipeline_parallel():
    config = {**BASE, **CASES["qwen3"][1], "num_hidden_layers": 4}
    ids, mask, labels = batch(BASE["vocab_size"], 12)
    run_distributed(pipeline_parity, 2, architecture="Qwen3ForCausalLM", config_kwargs=config, ids=ids, mask=mask,
                    labels=labels, pp=2, tp=1, sequence_parallel=False, timeout=TIMEOUT)


@pytest.mark.parametrize("pp,tp,ep", [(2, 2, 1), (2, 1, 2)])
def test_qwen3_moe_pipeline_parallel(pp, tp, ep):
    """Qwen3-MoE over 2 stages (sparse layer 0 | dense 1 and sparse 2) with tp 2 or ep 2: logits, loss and aux loss,
    then a forward_backward's loss and every gathered gradient against transformers."""
    from test_mixtral import _pipeline_parity

    names = run_distributed(_pipeline_parity, pp * tp * ep, family="qwen3_moe", pp=pp, tp=tp, ep=ep,
                            config_kwargs=QWEN3_MOE, timeout=TIMEOUT)
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
    config = {"qwen3": {**BASE, **CASES["qwen3"][1]}, "qwen3_moe": QWEN3_MOE}[family]
    ep = 2 if family == "qwen3_moe" else 1
    run_distributed(training_step, 4, family=family, config=config, dp=2, cp=1, ep=ep, tp=2, microbatches=1,
                    options=options, timeout=TIMEOUT)


# --- generation ------------------------------------------------------------------------------------------------

GENERATE = {
    # layers 2 and 3 slide over 5 positions (prompt 9 + 6 new tokens): a ring cache beside full ones
    "qwen2": dict(vocab_size=101, hidden_size=32, intermediate_size=64, num_hidden_layers=4, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=64, use_sliding_window=True, sliding_window=5,
                  max_window_layers=2),
    "qwen3": dict(vocab_size=101, hidden_size=32, intermediate_size=64, num_hidden_layers=4, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=16, max_position_embeddings=64, tie_word_embeddings=True),
    "qwen3_moe": dict(vocab_size=101, hidden_size=32, intermediate_size=48, moe_intermediate_size=24,
                      num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                      num_experts=4, num_experts_per_tok=2, norm_topk_prob=True, mlp_only_layers=[1]),
}


def test_qwen_greedy_generate_one_process():
    greedy_matches_transformers(list(GENERATE), configs=GENERATE)


def test_qwen2_cache_keeps_a_window_only_for_sliding_layers():
    from colozoo.core.mesh import single_process
    from test_generate import NEW, ours_and_hf, prompts

    config, hf, model = ours_and_hf("qwen2", single_process(), GENERATE["qwen2"])
    ids, mask = prompts(config.vocab_size)  # 9 + 6 positions, window 5
    out = model.generate(ids, attention_mask=mask, max_new_tokens=NEW, pad_token_id=0, eos_token_id=None,
                         return_dict_in_generate=True)
    per_position = 2 * config.num_key_value_heads * (config.hidden_size // config.num_attention_heads) * ids.shape[0]
    full, sliding = config.layer_types.count("full_attention"), config.layer_types.count("sliding_attention")
    assert (full, sliding) == (2, 2)
    expected = per_position * (full * (ids.shape[1] + NEW) + sliding * config.sliding_window)
    assert out.cache_elements == expected


def test_qwen_greedy_generate_tp2():
    results = run_distributed(greedy_matches_transformers, 2, families=list(GENERATE), tp=2, configs=GENERATE,
                              timeout=TIMEOUT)
    assert all(r == results[0] for r in results)


def test_qwen_greedy_generate_tp2_pp2():
    run_distributed(greedy_matches_transformers, 4, families=["qwen2"], tp=2, pp=2, configs=GENERATE, timeout=TIMEOUT)


def test_qwen3_moe_greedy_generate_expert_parallel():
    run_distributed(greedy_matches_transformers, 2, families=["qwen3_moe"], dp=2, ep=2, configs=GENERATE,
                    timeout=TIMEOUT)


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
