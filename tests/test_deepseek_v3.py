"""DeepSeek-V3 matches transformers: logits, loss, hidden states and every gathered gradient at tp 1/2/4 with sequence
parallelism on and off, pp 2 and tp2 x pp2, cp 2 (ring and all-to-all), a clipped AdamW step under FSDP (dp2 x tp2),
and HF -> colozoo (tp2 x pp2) -> colozoo (tp4) -> HF bit for bit.

The tiny configs keep every feature of the published model: compressed queries (q_lora_rank) and keys/values
(kv_lora_rank) with their norms, a decoupled rotary key in interleaved pairs (rope_interleave), values narrower than
queries and keys (v_head_dim), YaRN with an mscale_all_dim (the softmax scale times mscale ** 2, transformers'
quirk, and cos/sin times mscale / mscale_all_dim). A variant has an uncompressed query (q_proj), biases on the
compressions and o_proj, and rotary features in halves."""
import pytest

from distributed import run_distributed
from parity import batch, causal_lm_parity, pipeline_parity

TIMEOUT = 300
YARN = {"rope_type": "yarn", "factor": 4.0, "beta_fast": 32.0, "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 0.8,
        "original_max_position_embeddings": 16, "rope_theta": 10000.0}
BASE = dict(vocab_size=101, hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=4, q_lora_rank=24, kv_lora_rank=16, qk_nope_head_dim=12,
            qk_rope_head_dim=8, v_head_dim=10, n_routed_experts=8, n_group=4, topk_group=2, num_experts_per_tok=2,
            n_shared_experts=1, routed_scaling_factor=2.5, max_position_embeddings=64, rope_parameters=YARN,
            pad_token_id=0)
DENSE = {**BASE, "first_k_dense_replace": BASE["num_hidden_layers"]}
VARIANT = dict(q_lora_rank=None, attention_bias=True, rope_interleave=False, tie_word_embeddings=True)
WIDE = dict(num_attention_heads=8, num_key_value_heads=8)


@pytest.mark.parametrize("variant", [False, True])
def test_single_process(variant):
    causal_lm_parity("deepseek_v3", {**DENSE, **(VARIANT if variant else {})})


@pytest.mark.parametrize("tp,sp,wide", [(2, False, False), (2, True, False), (4, True, False), (4, False, True)])
def test_tensor_parallel(tp, sp, wide):
    """tp 4 over 4 heads: one head a rank; the compressions replicated, their gradients whole on every rank."""
    run_distributed(causal_lm_parity, tp, model_type="deepseek_v3", config_kwargs={**DENSE, **(WIDE if wide else {})},
                    tp=tp, sequence_parallel=sp, timeout=TIMEOUT)


def test_tensor_parallel_variant():
    run_distributed(causal_lm_parity, 2, model_type="deepseek_v3", config_kwargs={**DENSE, **VARIANT}, tp=2,
                    sequence_parallel=True, timeout=TIMEOUT)


@pytest.mark.parametrize("pp,tp", [(2, 1), (2, 2)])
def test_pipeline_parallel(pp, tp):
    config = {**DENSE, "num_hidden_layers": 4, "first_k_dense_replace": 4}
    ids, mask, labels = batch(config["vocab_size"], 12)
    run_distributed(pipeline_parity, pp * tp, architecture="DeepseekV3ForCausalLM", config_kwargs=config, ids=ids,
                    mask=mask, labels=labels, pp=pp, tp=tp, sequence_parallel=tp > 1, timeout=TIMEOUT)


@pytest.mark.parametrize("tp,mode", [(1, "ring"), (2, "all_to_all")])
def test_context_parallel(tp, mode):
    """The ring carries keys and values stacked: MLA's narrower values travel zero-padded to the keys' width."""
    from test_context_parallel import cp_parity

    run_distributed(cp_parity, 2 * tp, tp=tp, cp=2, mode=mode, sequence_parallel=tp > 1, family="deepseek_v3",
                    overrides=DENSE, timeout=TIMEOUT)


def test_fsdp_training_step():
    from test_qwen import training_step

    run_distributed(training_step, 4, family="deepseek_v3", config=DENSE, dp=2, tp=2, microbatches=2,
                    options=dict(data_parallel="fsdp"), timeout=TIMEOUT)


def test_convert_reshard_export(tmp_path):
    from test_qwen import convert_round_trip

    convert_round_trip(tmp_path, "deepseek_v3", {**DENSE, **WIDE}, dict(tp=2, pp=2))


def split_after_compressions(sp: bool):
    """At tp 2: the compressions and their norms are whole on every rank (no shard spec) and, under sequence
    parallelism, see only the rank's half of the positions; q_b_proj / kv_b_proj / o_proj hold half the heads; after a
    backward every rank holds the same whole gradient of the replicated weights."""
    import torch
    import torch.distributed as dist

    from colozoo.api import build_model
    from colozoo.checkpoint.load import load_hf_weights
    from colozoo.checkpoint.readers import StateDictReader
    from colozoo.core.mesh import init_parallel
    from colozoo.layers.shard import spec_of
    from parity import hf_causal_lm

    pc = init_parallel(tp=2, sequence_parallel=sp)
    config, hf = hf_causal_lm("deepseek_v3", DENSE)
    model = build_model(config, pc=pc, device="meta")
    load_hf_weights(model, StateDictReader(hf.state_dict()), device="cpu")
    attn = model.layers["0"].self_attn
    replicated = (attn.q_a_proj.weight, attn.q_a_layernorm.weight, attn.kv_a_proj_with_mqa.weight,
                  attn.kv_a_layernorm.weight)
    assert all(not spec_of(p) for p in replicated)
    assert attn.q_a_proj.weight.shape == (24, 64) and attn.kv_a_proj_with_mqa.weight.shape == (16 + 8, 64)
    assert attn.q_b_proj.weight.shape == (2 * 20, 24) and attn.kv_b_proj.weight.shape == (2 * (12 + 10), 16)
    assert attn.o_proj.weight.shape == (64, 2 * 10)
    seen = []
    hook = attn.kv_a_proj_with_mqa.register_forward_pre_hook(lambda m, args: seen.append(args[0].shape[1]))
    ids, mask, labels = batch(config.vocab_size, 12)
    model(ids, attention_mask=mask, labels=labels).loss.backward()
    hook.remove()
    assert seen == [6 if sp else 12]
    for p in replicated:
        other = [torch.empty_like(p.grad) for _ in range(2)]
        dist.all_gather(other, p.grad)
        assert p.grad.abs().sum() > 0 and torch.equal(other[0], other[1])
    return seen


@pytest.mark.parametrize("sp", [False, True])
def test_heads_split_after_the_compressions(sp):
    run_distributed(split_after_compressions, 2, sp=sp, timeout=TIMEOUT)
