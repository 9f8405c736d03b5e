"""OLMo 2 and SmolLM3 match transformers: logits, loss, hidden states and every gathered gradient at tp 1/2/4 with
sequence parallelism on and off (tp 4 over 2 kv heads: each kv head, and OLMo 2's share of the k norm, on 2 ranks),
pp 2 and tp2 x pp2 (eval and a forward_backward), cp 2 (ring and all-to-all), a clipped AdamW step under FSDP
(dp2 x tp2), HF -> colozoo (tp2 x pp2) -> colozoo (tp4) -> HF bit for bit, greedy generation token for token
(tp 1, tp 2, tp2 x pp2, left-padded prompts), LoRA against PEFT, and the registry's sizes against transformers'.

OLMo 2: norms after attention and the MLP, q/k norms over the whole projection (every head at once: under tp the
statistic is summed over the ranks). SmolLM3: no rotary in every fourth layer (NoPE); with use_sliding_window
transformers makes exactly the NoPE layers sliding."""
import pytest

from distributed import run_distributed
from parity import batch, causal_lm_parity, pipeline_parity
from test_generate import greedy_matches_transformers

TIMEOUT = 300
BASE = dict(vocab_size=101, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=64, pad_token_id=0)
WIDE = dict(num_attention_heads=8, num_key_value_heads=4)
CONFIGS = {
    "olmo2": {**BASE, "rms_norm_eps": 1e-6},
    # 4 layers: layer 3 is NoPE and (use_sliding_window) slides over 5 positions of 12
    "smollm3": {**BASE, "num_hidden_layers": 4, "use_sliding_window": True, "sliding_window": 5},
}
VARIANTS = {  # a second configuration of each: tied head and attention biases; NoPE layers 1 and 3 without a window
    "olmo2": dict(tie_word_embeddings=True, attention_bias=True),
    "smollm3": dict(no_rope_layer_interval=2, use_sliding_window=False, tie_word_embeddings=False, mlp_bias=True),
}
ARCHITECTURES = {"olmo2": "Olmo2ForCausalLM", "smollm3": "SmolLM3ForCausalLM"}
FAMILIES = sorted(CONFIGS)


@pytest.mark.parametrize("variant", [False, True])
@pytest.mark.parametrize("family", FAMILIES)
def test_single_process(family, variant):
    causal_lm_parity(family, {**CONFIGS[family], **(VARIANTS[family] if variant else {})})


@pytest.mark.parametrize("tp,sp,wide", [(2, False, False), (2, True, False), (4, True, False), (4, False, True)])
@pytest.mark.parametrize("family", FAMILIES)
def test_tensor_parallel(family, tp, sp, wide):
    config = {**CONFIGS[family], **(WIDE if wide else {})}
    run_distributed(causal_lm_parity, tp, model_type=family, config_kwargs=config, tp=tp, sequence_parallel=sp,
                    timeout=TIMEOUT)


@pytest.mark.parametrize("pp,tp", [(2, 1), (2, 2)])
@pytest.mark.parametrize("family", FAMILIES)
def test_pipeline_parallel(family, pp, tp):
    config = {**CONFIGS[family], "num_hidden_layers": 4}
    ids, mask, labels = batch(config["vocab_size"], 12)
    run_distributed(pipeline_parity, pp * tp, architecture=ARCHITECTURES[family], config_kwargs=config, ids=ids,
                    mask=mask, labels=labels, pp=pp, tp=tp, sequence_parallel=tp > 1, timeout=TIMEOUT)


@pytest.mark.parametrize("tp,mode", [(1, "ring"), (2, "all_to_all")])
@pytest.mark.parametrize("family", FAMILIES)
def test_context_parallel(family, tp, mode):
    from test_context_parallel import cp_parity

    run_distributed(cp_parity, 2 * tp, tp=tp, cp=2, mode=mode, sequence_parallel=tp > 1, family=family,
                    overrides=CONFIGS[family], timeout=TIMEOUT)


@pytest.mark.parametrize("family", FAMILIES)
def test_fsdp_training_step(family):
    """dp2 x tp2 under FSDP, 2 micro-batches: loss, clipped gradients and parameters after one AdamW step. With Adam's
    eps of 1e-6 a gradient of 1e-7 has its rounding amplified ~800x: OLMo-2's o_proj holds one whose 2.6e-9 of fp32
    rounding (summed in another order by the fused LM head) moves its parameter by 2.1e-6 (the gradients themselves
    are held to the default tolerances first)."""
    from test_qwen import training_step

    run_distributed(training_step, 4, family=family, config=CONFIGS[family], dp=2, tp=2, microbatches=2,
                    param_atol=4e-6 if family == "olmo2" else 2e-6, timeout=TIMEOUT)


@pytest.mark.parametrize("family", FAMILIES)
def test_convert_reshard_export(tmp_path, family):
    from test_qwen import convert_round_trip

    convert_round_trip(tmp_path, family, {**CONFIGS[family], **VARIANTS[family]}, dict(tp=2, pp=2))


GENERATE = {family: {**config, "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 4}
            for family, config in CONFIGS.items()}
GENERATE["smollm3"]["sliding_window"] = 4  # 9 prompt + 6 new positions: the NoPE layer's ring cache wraps


def test_greedy_generate_one_process():
    greedy_matches_transformers(FAMILIES, configs=GENERATE)


@pytest.mark.parametrize("tp,pp", [(2, 1), (2, 2)])
def test_greedy_generate_parallel(tp, pp):
    results = run_distributed(greedy_matches_transformers, tp * pp, families=FAMILIES, tp=tp, pp=pp,
                              configs=GENERATE, timeout=TIMEOUT)
    assert all(r == results[0] for r in results)


LORA = {"olmo2": ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "down_proj"), "smollm3": "all-linear"}


def lora(family, **mesh):
    """tests/lora_parity.py on this file's configs (registered on each rank, where the check runs)."""
    import lora_parity

    lora_parity.CASES[family] = (family, CONFIGS[family], LORA[family])
    return lora_parity.lora_parity(family, **mesh)


@pytest.mark.parametrize("family", FAMILIES)
def test_lora_matches_peft(family):
    assert lora(family) > 0
    assert all(n > 0 for n in run_distributed(lora, 2, family=family, tp=2, timeout=TIMEOUT))


def test_profile_olmo2_32b_tp8():
    """The profiler builds OLMo-2-32B at tp 8: the q/k norms split by heads like q and k (one kv head a rank), and
    their statistic summed over tp (two fp32 values per token forward, two backward) beside the blocks' reduces."""
    from colozoo.cost.profiler import profile_for

    b, s, h, hd, inner = 1, 128, 5120, 128, 27648
    report = profile_for("OLMo-2-0325-32B", batch_size=b, seq_len=s, mesh="tp=8")
    layer = next(u for u in report.units if u["name"].startswith("layer"))
    split = (40 + 2 * 8) * hd * h + 40 * hd * h + 3 * h * inner + (40 + 8) * hd  # q/k/v, o, MLP, q/k norms
    assert layer["param_bytes"] == 2 * (split // 8 + 2 * h)  # and the two replicated post-norms
    assert layer["comm"] == {"tp.all_reduce": 4 * b * s * h * 2 + 4 * b * s * 4}
