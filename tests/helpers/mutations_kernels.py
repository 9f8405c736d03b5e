"""Switch-offs of the kernels that save memory (tests/helpers/mutations.py runs them): the fused LM head + loss (its
chunks, its softmax combined over tensor-parallel ranks, Gemma's soft-cap, its gradients taken in the forward) and
what a training layer keeps for backward (SwiGLU fused with down_proj, the norm with its projection, rotary in place,
a hooked norm left alone, the norm computed again in backward)."""
from __future__ import annotations

from mutation_tools import Mutation, Rewrite, replace, switches

HEAD = "tests/test_linear_cross_entropy.py::"
MEMORY = "tests/test_activation_memory.py::"
ENTROPY = "tests/test_label_entropy.py::"
PRICED = "tests/test_priced_fusions.py::"
REFERENCE = "colozoo.kernels.linear_cross_entropy:linear_cross_entropy_reference"


@switches("colozoo.kernels.head_loss:MIN_CHUNK_ROWS")
def _one_chunk():
    replace("colozoo.kernels.head_loss:MIN_CHUNK_ROWS", lambda original: 1 << 30)


@switches(REFERENCE)
def _gradients_in_backward():  # the logits made whole, then the cross entropy: autograd takes the gradients after
    def make(original):
        def reference(hidden, weight, target, vocab_size, bias=None, group=None, ignore_index=-100,
                      label_smoothing=0.0, softcap=None, chunk_size=None):
            import torch
            import torch.nn.functional as F

            from colozoo.kernels.cross_entropy import vocab_parallel_cross_entropy_reference

            logits = F.linear(hidden, weight, bias)
            if softcap is not None:
                logits = torch.tanh(logits / softcap) * softcap
            return vocab_parallel_cross_entropy_reference(logits.reshape(-1, logits.shape[-1]), target.reshape(-1),
                                                          vocab_size, group, ignore_index, label_smoothing).sum()
        return reference

    replace(REFERENCE, make)


@switches("colozoo.layers.linear:_watched")
def _hooks_unseen():
    replace("colozoo.layers.linear:_watched", lambda original: lambda module: False)


@switches("colozoo.kernels.norms_triton:_normalise_again")
def _normalised_again_as_zeros():
    import torch

    replace("colozoo.kernels.norms_triton:_normalise_again",
            lambda original: lambda h, weight, bias, mean, rstd: torch.zeros_like(h))


KERNELS = {
    # the fused LM head + loss
    "fused_head_one_chunk": Mutation(
        "the fused LM head takes every token in one chunk (a whole (tokens, vocab) logits tensor at once)",
        _one_chunk, (HEAD + "test_peak_memory_is_a_chunk_of_logits_plus_the_gradients[None]",)),
    "fused_head_softmax_not_combined_over_tp": Mutation(
        "the cross entropy's softmax statistics are not gathered over the tensor-parallel ranks (each rank's own "
        "vocab slice taken for the whole)",
        Rewrite("colozoo.kernels.head_loss:combine_stats",
                ("gathered = all_gather(stats.unsqueeze(0), 0, group)", "gathered = stats.unsqueeze(0)")),
        (HEAD + "test_fused_head_tp2_sequence_parallel_both_paths",)),
    "fused_head_softcap_dropped": Mutation(
        "the fused head's torch path ignores the final logit soft-cap (Gemma 2)",
        Rewrite("colozoo.kernels.linear_cross_entropy:_chunk_loss", ("if softcap is not None:", "if False:")),
        (HEAD + "test_fused_head_matches_unfused[softcap_chunks_of_4]",)),
    "fused_head_gradients_in_backward": Mutation(
        "the fused head's torch path makes the logits whole and leaves the gradients to autograd's backward",
        _gradients_in_backward, (HEAD + "test_gradients_only_where_wanted",)),
    # what a training layer keeps for backward
    "swiglu_product_kept": Mutation(
        "SwiGLU and down_proj are not fused (the product silu(gate) * up is kept for backward)",
        Rewrite("colozoo.kernels.activations:swiglu_linear",
                ("fused = torch.is_grad_enabled() and not autocasting(gate_up) and same_dtype", "fused = False")),
        (MEMORY + "test_cuda_path_keeps_its_budget",)),
    "norm_not_fused_with_its_projection": Mutation(
        "an RMSNorm and the projection after it are not fused (the normed tensor is kept for backward)",
        Rewrite("colozoo.kernels.norms:rms_norm_linear",
                ("fused = torch.is_grad_enabled() and not autocasting(x)", "fused = False")),
        (MEMORY + "test_cuda_path_keeps_its_budget",)),
    "rotary_into_copies": Mutation(
        "q and k are rotated into copies instead of in place inside the qkv projection",
        Rewrite("colozoo.kernels.rope:rotary_qkv",
                ("if priced.on_fused_path(qkv) and qkv.is_contiguous():", "if False:")),
        (MEMORY + "test_cuda_path_keeps_its_budget",)),
    "hooked_norm_fused": Mutation(
        "a norm watched by a forward hook still fuses with its projection (the hook never sees its output)",
        _hooks_unseen, (MEMORY + "test_a_hooked_norm_runs_on_its_own",)),
    "fusions_priced_as_torch": Mutation(
        "the profiler prices a GPU run's layers as the torch composition keeps them, not colozoo's Triton fusions",
        Rewrite("colozoo.cost.model_trace:trace_model", ('fusions and target == "cuda")', "False)")),
        (PRICED + "test_the_traced_layer_keeps_what_the_triton_layer_keeps",)),
    "fused_projection_output_a_view": Mutation(
        "the fused norm + projection returns F.linear's output, a view where it adds a bias (the rotary then cannot "
        "turn q and k in place)",
        Rewrite("colozoo.kernels.fused_functions:rms_norm_linear_function",
                ("out = linear_of_its_own(normed, weight, bias)", "out = torch.nn.functional.linear(normed, weight, "
                 "bias)")),
        ("tests/test_kernels_in_models.py::test_qwen2_biased_qkv_on_triton_path_matches_transformers",)),
    "column_parallel_output_a_view": Mutation(
        "a column-parallel projection's function returns F.linear's output, a view where it adds a bias (the rotary "
        "then cannot turn q and k in place at tp > 1)",
        Rewrite("colozoo.layers.linear:_ColumnParallel.forward",
                ("return linear_of_its_own(x, weight, bias)", "return F.linear(x, weight, bias)")),
        ("tests/test_kernels_in_models.py::test_qwen2_biased_qkv_tp2_sequence_parallel_on_triton_path",
         PRICED + "test_every_family_traces_on_the_fused_gpu_path[qwen2-tp=2,sp]")),
    "norm_recomputed_as_zeros": Mutation(
        "the fused norm + projection's backward normalises the rows again as zeros (the weight's gradient lost)",
        _normalised_again_as_zeros, (MEMORY + "test_rms_norm_linear[plain-dtype0]",)),
    "entropy_second_pass": Mutation(
        "GRPO's entropy metric makes its own fp32 pass over the vocab slice after the log-probs'",
        Rewrite("colozoo.runtime.logprobs:ObjectiveStep.objective_loss",
                ('logps, rows["entropy"] = head.label_log_probs_and_entropy(logits, labels, cp=cp)',
                 'logps, rows["entropy"] = (head.label_log_probs(logits, labels, cp=cp), '
                 'head.label_entropy(logits.detach(), labels, cp=cp))')),
        (ENTROPY + "test_softmax_of_the_vocab_slice_is_made_once",)),
    "entropy_sums_unchunked": Mutation(
        "the entropy's row sums make a whole vocab slice of temporaries at once",
        Rewrite("colozoo.kernels.head_loss:row_sums",
                ("rows = max(1, ROW_SUM_ELEMENTS // max(x.shape[-1], 1))", "rows = flat.shape[0] or 1")),
        (ENTROPY + "test_softmax_of_the_vocab_slice_is_made_once",)),
    "entropy_slices_not_rescaled": Mutation(
        "each rank's entropy statistics are added without moving them to the global max",
        Rewrite("colozoo.kernels.head_loss:_entropy", ("rescale = offset.exp()", "rescale = offset * 0 + 1")),
        (ENTROPY + "test_entropy_of_the_log_probs_pass_at_tp2_and_cp2",)),
    "entropy_differentiable": Mutation(
        "the entropy by-product of the cross entropy is left differentiable",
        Rewrite("colozoo.kernels.cross_entropy:_outputs", ("ctx.mark_non_differentiable(*by_product)", "pass")),
        (ENTROPY + "test_entropy_of_the_log_probs_pass_at_tp1",)),
    "capped_window_attention_on_torch": Mutation(
        "'auto' keeps capped attention under a sliding-window mask on torch's path, which holds each layer's scores "
        "whole, also where no padding leaves a row without keys",
        Rewrite("colozoo.kernels.attention:local_attention", ("(mask is None or unpadded)", "mask is None")),
        ("tests/test_kernels_in_models.py::test_auto_caps_gemma2_scores_in_the_flash_kernel_unless_padded",)),
}
