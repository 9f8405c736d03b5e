"""Switch-offs of parallelism, training, generation and checkpoint features (tests/helpers/mutations.py runs them)."""
from __future__ import annotations

import functools
import os

from mutation_tools import Mutation, replace, switches


@switches("colozoo.core.mesh:ParallelConfig.for_world")
def _drop_sequence_parallel():
    from colozoo.core.mesh import ParallelConfig

    original = ParallelConfig.for_world.__func__

    def for_world(cls, world_size, **degrees):
        degrees["sequence_parallel"] = False
        return original(cls, world_size, **degrees)

    ParallelConfig.for_world = classmethod(for_world)


@switches("colozoo.runtime.parallelize:COMPUTE_DTYPES")
def _ignore_mixed_precision():
    replace("colozoo.runtime.parallelize:COMPUTE_DTYPES", lambda dtypes: {k: None for k in dtypes})


@switches("colozoo.runtime.checkpointing:checkpoint")
def _checkpoint_nothing():
    from torch.distributed._composable.contract import contract

    @contract()
    def checkpoint(module, **kwargs):  # marks the module checkpointed (is_checkpointed says yes), recomputes nothing
        return module

    replace("colozoo.runtime.checkpointing:checkpoint", lambda original: checkpoint)


@switches("colozoo.cost.planner:plan")
def _rank_worst_first():
    def make(original):
        @functools.wraps(original)
        def plan(*args, **kwargs):
            result = original(*args, **kwargs)
            result.plans.reverse()
            return result
        return plan

    replace("colozoo.cost.planner:plan", make)


@switches("colozoo.cost.profile_cli:workload_from_args")
def _profile_ignores_seq_len():
    import dataclasses

    def make(original):
        return lambda args: dataclasses.replace(original(args), seq_len=None)  # the model's default instead

    replace("colozoo.cost.profile_cli:workload_from_args", make)


@switches("colozoo.layers.context_parallel:_block_mask")
def _window_off_by_one():
    def make(original):
        def block_mask(q_pos, k_pos, key_keep, causal, window, documents=None):
            return original(q_pos, k_pos, key_keep, causal, None if window is None else window + 1, documents)
        return block_mask

    replace("colozoo.layers.context_parallel:_block_mask", make)


@switches("colozoo.layers.context_parallel:_attend_block")
def _ring_blocks_in_bf16():
    import torch

    def make(original):
        def attend_block(q, k, v, mask, scale):
            out, lse = original(q.to(torch.bfloat16), k.to(torch.bfloat16), v.to(torch.bfloat16), mask, scale)
            return out.float(), lse.float()
        return attend_block

    replace("colozoo.layers.context_parallel:_attend_block", make)


@switches("colozoo.layers.batch:BatchContext.documents")
def _packing_ignored():
    from colozoo.layers.batch import BatchContext

    BatchContext.documents = property(lambda self: None)


@switches("colozoo.layers.batch:ContextParallel")
def _cp_drops_documents():
    replace("colozoo.layers.batch:ContextParallel",
            lambda original: lambda *args, documents=None, **kwargs: original(*args, **kwargs))


@switches("colozoo.kernels.attention_triton:flash_attention_triton")
def _flash_ignores_documents():
    import torch

    if not torch.cuda.is_available():  # as tests/test_kernels.py: interpret, so its kernel_module keeps this module
        os.environ["TRITON_INTERPRET"] = "1"
    replace("colozoo.kernels.attention_triton:flash_attention_triton",
            lambda original: lambda *args, documents=None, **kwargs: original(*args, **kwargs))


@switches("colozoo.layers.lora:sum_replica_grads")
def _lora_replicas_unsummed():
    replace("colozoo.layers.lora:sum_replica_grads", lambda original: lambda weight, rows, group: weight)


@switches("colozoo.runtime.lora:TASK_MODULES_TO_SAVE")
def _lora_head_frozen():
    replace("colozoo.runtime.lora:TASK_MODULES_TO_SAVE", lambda original: {})


@switches("colozoo.runtime.compile:_compiled_forward")
def _compile_nothing():  # every layer still gets the compile wrapper (is_compiled says yes), which runs eagerly
    replace("colozoo.runtime.compile:_compiled_forward", lambda original: lambda cls, *options: cls.forward)


@switches("colozoo.runtime.decode_steps:DecodeSteps")
def _kv_cache_off():  # every decoding step encodes the whole sequence again (the tokens stay right)
    def make(original):
        def steps(*args, use_cache=True, **kwargs):
            return original(*args, use_cache=False, **kwargs)
        return steps

    replace("colozoo.runtime.decode_steps:DecodeSteps", make)


@switches("colozoo.runtime.decode_steps:generation_positions")
def _left_padding_ignored():  # positions as if no prompt were padded
    import torch

    def make(original):
        return lambda mask: torch.arange(mask.shape[1], device=mask.device).expand(mask.shape)

    replace("colozoo.runtime.decode_steps:generation_positions", make)


@switches("colozoo.checkpoint.peft:read_adapter_config")
def _adapter_alpha_ignored():  # a PEFT adapter loads with scaling 1.0 instead of alpha / r
    import dataclasses

    def make(original):
        return lambda path: dataclasses.replace(original(path), alpha=original(path).r)

    replace("colozoo.checkpoint.peft:read_adapter_config", make)


@switches("colozoo.checkpoint.convert:SIDE_FILES")
def _chat_template_dropped():
    replace("colozoo.checkpoint.convert:SIDE_FILES",
            lambda files: tuple(f for f in files if f != "chat_template.jinja"))


@switches("colozoo.checkpoint.training_state:ColozooCheckpoint")
def _training_state_unverified():  # resume reads the rank files without checking their sha256
    replace("colozoo.checkpoint.training_state:ColozooCheckpoint",
            lambda original: functools.partial(original, verify=False))


PARALLEL = {
    "sequence_parallel_dropped": Mutation(
        "init_parallel ignores sequence_parallel=True", _drop_sequence_parallel,
        ("tests/test_gpt2.py::test_gpt2_tensor_parallel[2-True]", "tests/test_llama.py::test_llama_tensor_parallel[4-True]",
         "tests/test_layers.py::test_column_parallel_linear[True-2]", "tests/test_layers.py::test_row_parallel_linear[True-4]",
         "tests/test_family_table.py::test_matches_transformers_on_mesh[mixtral-tp2-sp]",
         "tests/test_training.py::test_loss_curve_pp2_tp2_sequence_parallel",
         "tests/test_opt.py::test_opt_dropout_in_training_tp2")),
    "mixed_precision_ignored": Mutation(
        "parallelize(mixed_precision=bf16/fp16) computes in the parameters' fp32", _ignore_mixed_precision,
        ("tests/test_training.py::test_bf16_mixed_precision[2-2-1]", "tests/test_training.py::test_bf16_mixed_precision[1-2-2]",
         "tests/test_amp.py::test_overflow_on_one_rank_skips_the_step_on_every_rank[dp2_fsdp_offloaded_adamw]")),
    "checkpoint_recomputes_nothing": Mutation(
        "activation checkpointing wraps no module", _checkpoint_nothing,
        ("tests/test_training.py::test_checkpointing_recomputes_the_same_dropout_masks",
         "tests/test_training.py::test_activation_checkpointing_matches_single_process[full]",
         "tests/test_training.py::test_activation_checkpointing_matches_single_process[selective]",
         "tests/test_bert.py::test_selective_checkpointing_recomputes_bert_attention",
         "tests/test_vit.py::test_selective_checkpointing_recomputes_vit_attention")),
    "planner_ranks_worst_first": Mutation(
        "colozoo.plan returns its plans slowest first", _rank_worst_first,
        ("tests/test_planner.py::test_plan_ranks_fitting_plans_and_decides_checkpointing_with_layout",)),
    "profile_cli_ignores_seq_len": Mutation(
        "colozoo profile drops --seq-len", _profile_ignores_seq_len,
        ("tests/test_profiler.py::test_cli_json",)),
    "ring_window_off_by_one": Mutation(
        "ring attention's sliding window lets one key too many through", _window_off_by_one,
        ("tests/test_context_parallel.py::test_cp_attention_equals_full_attention[ring-2]",
         "tests/test_context_parallel.py::test_cp_attention_equals_full_attention[ring-4]")),
    "packing_ignored": Mutation(
        "position_ids that restart start no new document (attention crosses packed samples)", _packing_ignored,
        ("tests/test_packing.py::test_packed_parity_tp1[llama]", "tests/test_packing.py::test_packed_parity_tp2[gpt2]",
         "tests/test_packing.py::test_no_leakage_torch_path",
         "tests/test_packing.py::test_changed_token_moves_only_its_document[opt]",
         "tests/test_preference_trl.py::test_first_step_equals_trl_for_every_loss[strings-False-True]")),
    "cp_drops_documents": Mutation(
        "context parallelism loses the packed documents' ids", _cp_drops_documents,
        ("tests/test_packing.py::test_no_leakage_cp2[ring]", "tests/test_packing.py::test_no_leakage_cp2[all_to_all]")),
    "flash_ignores_documents": Mutation(
        "the flash-attention kernel drops the document ids", _flash_ignores_documents,
        ("tests/test_packing.py::test_flash_attention_documents[causal_multiblock_mqa]",
         "tests/test_packing.py::test_no_leakage_flash_kernel")),
    "lora_replicated_kv_grads_unsummed": Mutation(
        "a LoRA B over a kv head replicated on several tp ranks keeps each replica's partial gradient",
        _lora_replicas_unsummed, ("tests/test_lora_families.py::test_lora_replicated_kv_heads_match_peft_tp4",)),
    "lora_classifier_frozen": Mutation(
        "LoRA on a sequence classifier freezes its head (PEFT's SEQ_CLS trains it whole)", _lora_head_frozen,
        ("tests/test_lora.py::test_lora_matches_peft_single_process[bert]", "tests/test_lora.py::test_peft_round_trip")),
    "compile_compiles_nothing": Mutation(
        "compile=True wraps every layer but runs it eagerly", _compile_nothing,
        ("tests/test_compile.py::test_compile_llama_tp1_activation_checkpointing",
         "tests/test_compile.py::test_compile_tp2_sequence_parallel[llama-config0-aot_eager]",
         "tests/test_compile.py::test_finetune_compile_trains_like_eager")),
    "kv_cache_off": Mutation(
        "every decoding step encodes the whole sequence again instead of extending the KV cache", _kv_cache_off,
        ("tests/test_blind_spots.py::test_each_decoding_step_feeds_one_new_token_per_sequence[greedy]",
         "tests/test_blind_spots.py::test_each_decoding_step_feeds_one_new_token_per_sequence[sampled]",
         "tests/test_blind_spots.py::test_each_decoding_step_feeds_one_new_token_per_sequence[beams]",
         "tests/test_blind_spots.py::test_each_decoding_step_feeds_one_new_token_on_a_mesh[2-1]",
         "tests/test_blind_spots.py::test_each_decoding_step_feeds_one_new_token_on_a_mesh[1-2]")),
    "training_state_unverified": Mutation(
        "resume reads a training checkpoint's files without checking their checksums", _training_state_unverified,
        ("tests/test_resume_mesh.py::test_a_corrupted_training_state_is_refused_in_one_line[state tensor]",)),
    "left_padding_ignored": Mutation(
        "generation positions computed as if no prompt were padded", _left_padding_ignored,
        ("tests/test_blind_spots.py::test_left_padding_moves_the_positions_as_in_transformers",
         "tests/test_generate_surface.py::test_greedy_scores_logits_eos_lists_and_lengths_equal_transformers[gpt2]",
         "tests/test_generate_surface.py::test_beam_search_equals_transformers[opt]")),  # rotary: shift-blind
    "adapter_alpha_ignored": Mutation(
        "a PEFT adapter's lora_alpha ignored on load (scaling 1.0 instead of alpha / r)", _adapter_alpha_ignored,
        ("tests/test_blind_spots.py::test_an_adapters_alpha_scales_its_logits_as_in_peft",)),
    "chat_template_dropped": Mutation(
        "convert does not carry chat_template.jinja", _chat_template_dropped,
        ("tests/test_blind_spots.py::test_a_chat_template_survives_hf_to_colozoo_to_hf",)),
    "ring_blocks_in_bf16": Mutation(
        "ring attention computes its blocks in bf16 instead of fp32", _ring_blocks_in_bf16,
        ("tests/test_context_parallel.py::test_ring_attention_bf16",)),
}
