"""The profiler and planner know DeepSeek-V3: multi-head latent attention (the compressions, the heads' up-projections,
scores over qk_head_dim = qk_nope + qk_rope and values of v_head_dim), DeepSeekMoE (the ungated shared expert, the
router and its frozen bias, first_k_dense_replace dense layers) and the latent KV cache. FLOPs and saved bytes of a
tiny model against a real run and a hand count; `colozoo plan deepseek-v3 --gpus 256 --gpu-memory 80GB` and
`colozoo plan deepseek-v3 --generate` with the fullest rank's memory counted by hand from the published config."""
import warnings

import pytest
import transformers

from test_deepseek_v3 import MOE

warnings.filterwarnings("ignore", category=FutureWarning)

# the published config (colozoo/model_configs/deepseek_v3.json), written out for the hand counts below
H, LAYERS, DENSE_LAYERS, HEADS, VOCAB = 7168, 61, 3, 128, 129280
Q_LORA, KV_LORA, NOPE, ROPE, V = 1536, 512, 128, 64, 128
EXPERTS, MOE_INNER, INNER = 256, 2048, 18432


def test_the_published_config_is_the_one_counted():
    from colozoo.cost.setup import get_config

    c = get_config("deepseek-v3")
    assert (c.hidden_size, c.num_hidden_layers, c.first_k_dense_replace, c.num_attention_heads, c.vocab_size) == \
        (H, LAYERS, DENSE_LAYERS, HEADS, VOCAB)
    assert (c.q_lora_rank, c.kv_lora_rank, c.qk_nope_head_dim, c.qk_rope_head_dim, c.v_head_dim) == \
        (Q_LORA, KV_LORA, NOPE, ROPE, V)
    assert (c.n_routed_experts, c.n_shared_experts, c.moe_intermediate_size, c.intermediate_size) == \
        (EXPERTS, 1, MOE_INNER, INNER)


def attention_params(tp: int = 1) -> int:
    """q_a_proj, q_a_layernorm, kv_a_proj_with_mqa, kv_a_layernorm (replicated); q_b_proj, kv_b_proj and o_proj (split
    by heads)."""
    replicated = H * Q_LORA + Q_LORA + H * (KV_LORA + ROPE) + KV_LORA
    return replicated + (Q_LORA * HEADS * (NOPE + ROPE) + KV_LORA * HEADS * (NOPE + V) + HEADS * V * H) // tp


def test_profiler_counts_mla_and_deepseek_moe():
    """A tiny DeepSeek-V3 step (layer 0 dense, 1 and 2 DeepSeekMoE) traced on meta: the FLOPs and the bytes saved for
    backward of a real CPU run (torch.utils.flop_counter, saved-tensor hooks), and each layer's forward FLOPs by hand:
    the matmuls of the compressions, the heads' up-projections and o_proj, scores over qk_head_dim and values of
    v_head_dim, then the dense MLP, or the router, the shared expert and top-k routed experts a token. On the CUDA
    target, values narrower than the keys run the memory-efficient kernel: no (s, s) tensor saved, the same forward
    FLOPs, and a backward that recomputes the scores."""
    from colozoo.cost.profiler import profile_for
    from test_profiler import B, S, real_step

    config = transformers.AutoConfig.for_model("deepseek_v3", **MOE)
    real_flops, real_saved = real_step(config)
    report = profile_for(config, batch_size=B, seq_len=S, dtype="float32", target="cpu")
    assert report.step_flops == real_flops
    assert report.stages[0]["activations"] == pytest.approx(real_saved, rel=0.05)

    c, tokens = config, B * S
    qk = c.qk_nope_head_dim + c.qk_rope_head_dim
    projections = (c.hidden_size * c.q_lora_rank + c.q_lora_rank * c.num_attention_heads * qk
                   + c.hidden_size * (c.kv_lora_rank + c.qk_rope_head_dim)
                   + c.kv_lora_rank * c.num_attention_heads * (c.qk_nope_head_dim + c.v_head_dim)
                   + c.num_attention_heads * c.v_head_dim * c.hidden_size)
    scores_and_values = 2 * B * c.num_attention_heads * S * S * (qk + c.v_head_dim)
    dense = 3 * c.hidden_size * c.intermediate_size
    moe = (c.hidden_size * c.n_routed_experts + 3 * c.hidden_size * c.moe_intermediate_size * c.n_shared_experts
           + c.num_experts_per_tok * 3 * c.hidden_size * c.moe_intermediate_size)
    units = {u["name"]: u for u in report.units}
    assert units["layer 0"]["count"] == 1 and units["layer 1"]["count"] == 2
    assert units["layer 0"]["fwd_flops"] == 2 * tokens * (projections + dense) + scores_and_values
    assert units["layer 1"]["fwd_flops"] == 2 * tokens * (projections + moe) + scores_and_values

    cuda = profile_for(config, batch_size=B, seq_len=S, dtype="bfloat16")
    layer = next(u for u in cuda.units if u["name"] == "layer 0")
    assert layer["ops"]["scaled_dot_product_efficient_attention"]["fwd_flops"] == scores_and_values
    recomputed_scores = 2 * B * c.num_attention_heads * S * S * qk  # the fused kernel's backward, in every layer
    assert layer["attention_core_bytes"] == 0
    assert cuda.step_flops == report.step_flops + c.num_hidden_layers * recomputed_scores


def test_training_plan_on_256_gpus():
    """`colozoo plan deepseek-v3 --gpus 256 --gpu-memory 80GB` (bf16, AdamW, 512 x 2048 tokens a step) ranks
    tp=1, pp=32, dp=8, ep=8 first: 1 x 64 micro-batches under 1F1B, DDP, both layers of a stage recomputed (the whole
    search, over 30 tp x ep layouts, takes minutes; this test searches pp, dp, micro-batching, schedules, ZeRO and
    recomputation at that tp and ep). FSDP comes a close second: it would gather the two layers' weights for each
    of the 64 micro-batches, twice, and the SMs NCCL takes slow the compute they overlap, where DDP reduces once;
    the experts, nine tenths of the weights, are split over ep either way, so DDP still fits. The fullest rank holds
    two DeepSeekMoE layers (stage 3: layers 4 and 5); its memory counted by hand from the published config: every
    rank keeps its 32 of the 256 experts and the rest of the two layers whole; the frozen routing bias has no
    gradient or state."""
    from colozoo.cost.hardware import get_hardware
    from colozoo.cost.planner import plan_for
    from colozoo.cost.profiler import profile
    from colozoo.cost.setup import Workload

    result = plan_for("deepseek-v3", gpus=256, gpu_memory="80GB", degrees={"tp": 1, "ep": 8})
    best = result.best
    assert (best.mesh(), best.micro_batch_size, best.num_microbatches, best.schedule, best.zero) == \
        ("tp=1,pp=32,dp=8,cp=1,ep=8", 1, 64, "1f1b", 0)
    assert (best.checkpointing, best.checkpoint_layers, best.offload) == ("full", 2, "none")
    assert best.memory <= get_hardware("H100-80GB", gpus=256, gpu_memory="80GB").memory_limit
    fsdp = min((p for p in result.plans if p.zero == 3), key=lambda p: p.step_seconds)
    assert fsdp.mesh() == best.mesh() and best.step_seconds < fsdp.step_seconds < 1.05 * best.step_seconds

    report = profile("deepseek-v3", best.choices(), Workload(seq_len=2048))
    fullest = max(report.stages, key=lambda s: s["peak"])
    assert fullest["peak"] == report.peak_memory == best.memory and fullest["layers"] == [4, 5]
    shared, router, bias, norms = 3 * H * MOE_INNER, EXPERTS * H, EXPERTS, 2 * H
    non_expert = attention_params() + norms + router + shared  # trained, whole on every dp rank
    experts = EXPERTS // 8 * 3 * H * MOE_INNER  # this ep rank's 32
    assert fullest["weights"] == 2 * 2 * (non_expert + bias + experts)  # two layers, bf16
    assert fullest["grads"] == 2 * 2 * (non_expert + experts)
    assert fullest["master"] == 2 * 4 * (non_expert + experts)  # fp32
    assert fullest["optimizer"] == 2 * 8 * (non_expert + experts)  # AdamW's two fp32 states
    assert fullest["fsdp_buffers"] == 0
    # full recompute keeps each layer's input, for the 29 micro-batches stage 3 has in flight under 1F1B
    assert fullest["activations"] == (32 - 3) * 2 * 2048 * H * 2
    assert sum(fullest[k] for k in ("weights", "master", "optimizer")) < fullest["peak"] < 80e9


def test_generation_plan_holds_the_latent_cache():
    """`colozoo plan deepseek-v3 --gpus 32 --generate` (bf16, batch 1 x 2048 tokens): 671B parameters need 17 or more
    GPUs; the fewest that hold them are 20, as tp=4 x pp=5 (stages of 12, 12, 12, 13 and 12 layers). The fullest rank:
    stage 3, 13 DeepSeekMoE layers (experts and heads split over tp 4, the compressions and the router whole), and the
    latent cache of those layers: kv_lora_rank + qk_rope_head_dim numbers a position and layer on every rank, 5.6% of
    the keys (qk_head_dim) and values (v_head_dim) of its 32 heads that a full cache would hold."""
    from colozoo.cost.inference import plan_generation

    found = plan_generation("deepseek-v3", gpus=32)
    assert found.mesh == "tp=4,pp=5" and found.fits
    tp, layers, positions = 4, 13, 2048
    moe_layer = (attention_params(tp) + 2 * H + EXPERTS * H + EXPERTS  # norms, router and its bias
                 + 3 * H * MOE_INNER // tp + EXPERTS * 3 * H * MOE_INNER // tp)  # shared and routed experts
    assert found.weights_bytes == 2 * layers * moe_layer
    assert found.kv_cache_bytes == layers * positions * (KV_LORA + ROPE) * 2
    full = layers * positions * HEADS // tp * (NOPE + ROPE + V) * 2
    assert found.kv_cache_bytes / full == (KV_LORA + ROPE) / (HEADS // tp * (NOPE + ROPE + V)) < 0.06
    assert found.weights_bytes + found.kv_cache_bytes < 80e9


def test_lora_cost_counts_the_compressions_adapters_whole():
    """LoRA on every MLA projection at tp 8: the replicated compressions' adapters (A and B) whole on every rank,
    q_b_proj's and kv_b_proj's B split by heads (A whole), o_proj's A split (B whole)."""
    from colozoo.cost.lora import adapter_params_per_layer
    from colozoo.cost.setup import get_config
    from colozoo.runtime.lora import LoraSettings

    r, tp = 16, 8
    targets = ("q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj", "o_proj")
    counts = adapter_params_per_layer(get_config("deepseek-v3"), tp, LoraSettings(r=r, targets=targets))
    compressions = r * (H + Q_LORA) + r * (H + KV_LORA + ROPE)
    heads = r * (Q_LORA + HEADS * (NOPE + ROPE) // tp) + r * (KV_LORA + HEADS * (NOPE + V) // tp)
    assert counts["0"] == counts["60"] == compressions + heads + r * (HEADS * V // tp + H)
