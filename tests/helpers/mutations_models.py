"""Switch-offs of model features (tests/helpers/mutations.py runs them): multi-head latent attention and its cache,
DeepSeekMoE routing, attention sinks in each kernel, sliding windows, MXFP4 dequantisation, OLMo 2's post-norms,
SmolLM3's NoPE layers, YaRN's truncate option, the one forward path and logits_to_keep."""
from __future__ import annotations

from mutation_tools import Mutation, Rewrite, replace, switches

DEEPSEEK = "tests/test_deepseek_v3.py::"
SINKS = "tests/test_sink_kernels.py::"
OLMO2_SMOLLM3 = "tests/test_olmo2_smollm3.py::"
GPT_OSS = "tests/test_gpt_oss.py::"
MLA = "colozoo.layers.mla:LatentAttention."
ROUTER = "colozoo.layers.moe:GroupLimitedRouter.forward"


@switches("colozoo.layers.vocab:keep_positions")
def _logits_to_keep_ignored():
    replace("colozoo.layers.vocab:keep_positions", lambda original: lambda x, keep: x)


def _run_forward(*pairs):
    """Run.forward compiled again with `pairs` changed (and __call__, which names the original)."""
    Rewrite("colozoo.runtime.run:Run.forward", *pairs)()
    from colozoo.runtime.run import Run

    Run.__call__ = Run.forward


@switches("colozoo.runtime.run:Run.forward")
def _pipeline_training_forward_allowed():
    _run_forward(("if labels is not None and torch.is_grad_enabled():", "if False:"))


@switches("colozoo.runtime.run:Run.forward")
def _training_forward_keeps_logits():
    _run_forward(("return_logits = labels is None or not model.training", "return_logits = True"))


MODELS = {
    "moe_module_disagrees_silently": Mutation(
        "a router or experts module given to MoE that disagrees with its MoESpec is taken silently",
        Rewrite("colozoo.layers.moe:_check_agrees",
                ("if value is not _UNSAID and value != getattr(spec, field):", "if False:")),
        ("tests/test_moe.py::test_a_module_given_to_moe_that_disagrees_with_the_spec_is_refused[router-said0]",)),
    "capacity_factor_unread": Mutation(
        "an MoE family ignores its config's capacity_factor",
        Rewrite("colozoo.models.decoder:MoEDecoderModel.moe",
                ('capacity_factor=getattr(config, "capacity_factor", None)', "capacity_factor=None")),
        ("tests/test_mixtral.py::test_every_moe_family_reads_capacity_factor_and_its_sparse_layers"
         "[qwen2_moe]",)),
    # multi-head latent attention: the latent cache and the decoding steps that attend over it
    "mla_absorbed_decode_off": Mutation(
        "MLA decoding steps expand the cached latent through kv_b_proj instead of attending over it",
        Rewrite(MLA + "forward", ("if batch.cache is not None and q.shape[2]", "if False and q.shape[2]")),
        (DEEPSEEK + "test_latent_cache[1]",)),
    "mla_absorbed_decode_without_rotary_key": Mutation(
        "MLA's absorbed decoding step drops the cached rotary key from its keys",
        Rewrite(MLA + "_attend_latent", ("torch.cat((latent, k_rot), dim=-1)",
                                         "torch.cat((latent, torch.zeros_like(k_rot)), dim=-1)")),
        (DEEPSEEK + "test_latent_cache[1]",)),
    "mla_rotary_key_cached_unrotated": Mutation(
        "MLA caches its rotary key unrotated and rotates the whole cache by each step's positions",
        Rewrite(MLA + "forward", ("k_rot = self._rotate(k_rot.unsqueeze(1), cos, sin)", "k_rot = k_rot.unsqueeze(1)"),
                ("latent.unsqueeze(1), k_rot)\n", "latent.unsqueeze(1), k_rot)\n    k_rot = self._rotate(k_rot, cos, sin)\n")),
        (DEEPSEEK + "test_latent_cache[1]",)),
    "mla_cache_counted_full": Mutation(
        "MLA's cache width (what the planner counts) is every head's keys and values, not the latent",
        Rewrite(MLA + "cache_width", ("return self.kv_lora_rank + self.rope_dim",
                                      "return 2 * self.local_heads * (self.nope_dim + self.rope_dim) // tp")),
        (DEEPSEEK + "test_latent_cache[1]",)),
    # DeepSeekMoE routing
    "routing_bias_ignored": Mutation(
        "DeepSeekMoE chooses experts without the e_score_correction_bias",
        Rewrite(ROUTER, ("choice = scores + self.e_score_correction_bias.float()", "choice = scores")),
        (DEEPSEEK + "test_moe_single_process",)),
    "routing_groups_ignored": Mutation(
        "DeepSeekMoE chooses among all experts instead of the topk_group best groups",
        Rewrite(ROUTER, ("if self.topk_group < self.groups:", "if False:")),
        (DEEPSEEK + "test_moe_single_process",)),
    "routing_groups_by_best_expert": Mutation(
        "DeepSeekMoE ranks a group by its best expert instead of its two best",
        Rewrite(ROUTER, ("per_group.topk(2, dim=-1).values.sum(dim=-1)", "per_group.max(dim=-1).values")),
        (DEEPSEEK + "test_moe_single_process",)),
    "routing_weights_with_bias": Mutation(
        "DeepSeekMoE weighs the chosen experts by their bias-corrected scores",
        Rewrite(ROUTER, ("weights = scores.gather(1, experts)", "weights = choice.gather(1, experts)")),
        (DEEPSEEK + "test_moe_single_process",)),
    "routed_scaling_ignored": Mutation(
        "DeepSeekMoE leaves out routed_scaling_factor",
        Rewrite(ROUTER, ("return logits, weights * self.scaling, experts", "return logits, weights, experts")),
        (DEEPSEEK + "test_moe_single_process",)),
    # attention sinks, in each kernel
    "sinks_torch_path_dropped": Mutation(
        "the torch attention path leaves the sinks out of the softmax",
        Rewrite("colozoo.kernels.attention:_sink_attention",
                ("sink = sinks.float()", "sink = float('-inf') + 0 * sinks.float()")),
        (SINKS + "test_torch_path_matches_transformers_eager", GPT_OSS + "test_single_process")),
    "sinks_flash_kernel_dropped": Mutation(
        "the flash-attention kernel's output is not rescaled by the sinks",
        Rewrite("colozoo.kernels.attention:with_sinks",
                ("torch.sigmoid(lse - sinks.float().view(1, -1, 1))",
                 "torch.sigmoid(lse - 0 * sinks.float().view(1, -1, 1) + float('inf'))")),
        (SINKS + "test_flash_kernel_with_sinks[dtype0-True]",)),
    "sinks_decode_kernel_dropped": Mutation(
        "the flash-decoding kernel combines its chunks without the sinks",
        Rewrite("colozoo.kernels.decode_triton:decode_attention_triton",
                ("HAS_SINKS=sinks is not None", "HAS_SINKS=False")),
        (SINKS + "test_decode_kernel_with_sinks[dtype0-None]", SINKS + "test_decode_step_takes_the_kernel_with_sinks")),
    # sliding windows
    "window_mask_ignored": Mutation(
        "the batch's attention mask ignores the sliding window",
        Rewrite("colozoo.layers.attention:dense_attention_mask",
                ("windowed = window is not None and window < seq_len", "windowed = False")),
        ("tests/test_llama.py::test_mistral_sliding_window", GPT_OSS + "test_single_process")),
    "window_cache_keeps_everything": Mutation(
        "a sliding-window layer's KV cache keeps every position instead of a ring of its window",
        Rewrite("colozoo.layers.kv_cache:KVCache.update",
                ("ring = window is not None and window < self.max_len", "ring = False")),
        ("tests/test_generate.py::test_sliding_window_layers_keep_only_their_window",)),
    "window_cache_mask_ignored": Mutation(
        "the KV cache's mask lets a sliding-window layer see past its window",
        Rewrite("colozoo.layers.kv_cache:KVCache._mask", ("if window is not None:", "if False:")),
        ("tests/test_generate.py::test_greedy_generate_equals_transformers_on_one_process[mistral]",)),
    "window_decode_kernel_ignored": Mutation(
        "the flash-decoding kernel attends over the whole cache instead of the window",
        Rewrite("colozoo.kernels.decode_triton:decode_attention_triton",
                ("start = 0 if window is None else max(0, length - window)", "start = 0")),
        (SINKS + "test_decode_kernel_with_sinks[dtype0-5]",)),
    "smollm3_window_ignored": Mutation(
        "SmolLM3's sliding-window layers attend over the whole sequence",
        Rewrite("colozoo.models.smollm3:smollm3_window",
                ("return config.sliding_window if sliding else None", "return None")),
        (OLMO2_SMOLLM3 + "test_single_process[smollm3-False]",)),
    # MXFP4 checkpoints
    "mxfp4_nibbles_swapped": Mutation(
        "MXFP4 dequantisation reads a byte's high nibble first",
        Rewrite("colozoo.checkpoint.mxfp4:dequantize",
                ("torch.stack((blocks & 0x0F, blocks >> 4), dim=-1)", "torch.stack((blocks >> 4, blocks & 0x0F), dim=-1)")),
        (GPT_OSS + "test_mxfp4_checkpoint_loads_dequantised",)),
    "mxfp4_scale_bias_off_by_one": Mutation(
        "MXFP4 dequantisation takes the E8M0 exponent bias as 128",
        Rewrite("colozoo.checkpoint.mxfp4:dequantize", ("scales.float() - 127", "scales.float() - 128")),
        (GPT_OSS + "test_mxfp4_checkpoint_loads_dequantised",)),
    # OLMo 2's norms after attention and MLP, SmolLM3's NoPE layers
    "olmo2_attention_post_norm_dropped": Mutation(
        "OLMo 2 adds attention's output unnormalised",
        Rewrite("colozoo.models.olmo2:Olmo2DecoderLayer.forward",
                ("x + self.post_attention_layernorm(self.self_attn(x, batch))", "x + self.self_attn(x, batch)")),
        (OLMO2_SMOLLM3 + "test_single_process[olmo2-False]",)),
    "olmo2_mlp_norm_before": Mutation(
        "OLMo 2 normalises the MLP's input instead of its output",
        Rewrite("colozoo.models.olmo2:Olmo2DecoderLayer.forward",
                ("self.post_feedforward_layernorm(self.mlp(x))", "self.mlp(self.post_feedforward_layernorm(x))")),
        (OLMO2_SMOLLM3 + "test_single_process[olmo2-False]",)),
    "smollm3_nope_ignored": Mutation(
        "SmolLM3's NoPE layers rotate their queries and keys",
        Rewrite("colozoo.models.smollm3:SmolLM3ForCausalLM.build_attention",
                ('rotary = "global" if config.no_rope_layers[layer_idx] else None', 'rotary = "global"')),
        (OLMO2_SMOLLM3 + "test_single_process[smollm3-False]",)),
    # RoPE and the head's output
    "yarn_truncate_ignored": Mutation(
        "YaRN rounds its ramp's bounds even with truncate=False (gpt-oss)",
        Rewrite("colozoo.layers.rope:_yarn_inv_freq", ('if params.get("truncate", True):', "if True:")),
        ("tests/test_rope_frequencies.py::test_gpt_oss_yarn_without_truncation_rotates_as_transformers",
         "tests/test_rope_frequencies.py::test_registered_frequencies_equal_transformers[gpt-oss-20b-None]")),
    "pipeline_training_forward_allowed": Mutation(
        "a forward with labels under gradients at pp > 1 is not refused (its loss cannot reach the other stages)",
        _pipeline_training_forward_allowed,
        ("tests/test_forward_path.py::test_a_pipeline_refuses_a_training_forward_and_evaluates",)),
    "training_forward_keeps_logits": Mutation(
        "a training forward with labels computes and returns the logits (the head is not fused with the loss)",
        _training_forward_keeps_logits,
        ("tests/test_forward_path.py::test_a_training_forward_after_any_call_gives_a_fresh_models_gradients"
         "[generate-gpt2]",)),
    "logits_to_keep_ignored": Mutation(
        "logits_to_keep ignored: every position's logits returned", _logits_to_keep_ignored,
        ("tests/test_logits_to_keep.py::test_logits_to_keep_equals_transformers[1]",
         "tests/test_logits_to_keep.py::test_logits_to_keep_equals_transformers[2]")),
}
