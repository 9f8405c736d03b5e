"""OLMo 2 and SmolLM3 beyond the family table (tests/test_family_table.py: the declared configs on one process, tp2
with sequence parallelism and pp2 x tp2; round trips, generation, LoRA): a second configuration of each, tp 2 and 4
(tp 4 over 2 kv heads: each kv head, and OLMo 2's share of the k norm, on 2 ranks), cp 2 (ring and all-to-all), a
clipped AdamW step under FSDP (dp2 x tp2), the variants' round trips, and the profile of OLMo-2-32B.

OLMo 2: norms after attention and the MLP, q/k norms over the whole projection (every head at once: under tp the
statistic is summed over the ranks). SmolLM3: no rotary in every fourth layer (NoPE); with use_sliding_window
transformers makes exactly the NoPE layers sliding."""
import pytest

from distributed import run_distributed
from family_cases import tiny_kwargs
from parity import causal_lm_parity, hf_round_trip

TIMEOUT = 300
WIDE = dict(num_attention_heads=8, num_key_value_heads=4)
FAMILIES = ["olmo2", "smollm3"]
CONFIGS = {family: tiny_kwargs(family) for family in FAMILIES}
VARIANTS = {  # a second configuration of each: tied head and attention biases; NoPE layers 1 and 3 without a window
    "olmo2": dict(tie_word_embeddings=True, attention_bias=True),
    "smollm3": dict(no_rope_layer_interval=2, use_sliding_window=False, tie_word_embeddings=False, mlp_bias=True),
}


@pytest.mark.parametrize("variant", [False, True])
@pytest.mark.parametrize("family", FAMILIES)
def test_single_process(family, variant):
    causal_lm_parity(family, {**CONFIGS[family], **(VARIANTS[family] if variant else {})})


@pytest.mark.parametrize("tp,sp,wide", [(2, False, False), (4, True, False), (4, False, True)])
@pytest.mark.parametrize("family", FAMILIES)
def test_tensor_parallel(family, tp, sp, wide):
    config = {**CONFIGS[family], **(WIDE if wide else {})}
    run_distributed(causal_lm_parity, tp, model_type=family, config_kwargs=config, tp=tp, sequence_parallel=sp,
                    timeout=TIMEOUT)


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
def test_variant_converter_round_trip(family):
    hf_round_trip(family, {**CONFIGS[family], **VARIANTS[family]})


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
