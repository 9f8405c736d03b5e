"""Switch-offs of fine-tuning's honesty (tests/helpers/mutations.py runs them): what a resume checks it continues
from, the token-weighted evaluation loss, the tokenizer in the HF export; and what a newcomer meets: --no-pack's
batches padded to their longest row, an all-masked batch's NaN loss, the data checked in the first second,
transformers' dtype names."""
from __future__ import annotations

from mutation_tools import Mutation, Rewrite, replace, switches

HONEST = "tests/test_finetune_honest.py::"
RESUME = HONEST + "test_resume_checks_the_weights_adapters_and_data_it_started_from"
EVALUATE = "colozoo.finetune.evaluation:evaluate"


@switches("colozoo.finetune.fingerprint:weights_fingerprint")
def _weights_fingerprint_constant():
    replace("colozoo.finetune.fingerprint:weights_fingerprint", lambda original: lambda name_or_path: "0" * 16)


@switches("colozoo.finetune.data:trim_padding")
def _padded_to_seq_len():
    replace("colozoo.finetune.data:trim_padding", lambda original: lambda batch, multiple=8: batch)


@switches("colozoo.finetune.records:check_data_path")
def _data_path_unchecked():
    replace("colozoo.finetune.records:check_data_path", lambda original: lambda path, records=True: None)


@switches("colozoo.finetune.fingerprint:data_fingerprint")
def _data_fingerprint_constant():
    replace("colozoo.finetune.fingerprint:data_fingerprint", lambda original: lambda data: "0" * 16)


FINETUNE = {
    "reward_neighbours_not_found": Mutation(
        "a reward function cannot import the modules beside it when it is called",
        Rewrite("colozoo.finetune.rewards:searched_first",
                ("added = directory is not None and directory not in sys.path", "added = False")),
        ("tests/test_rewards.py::test_a_file_reward_imports_the_module_beside_it[True]",)),
    "sequence_split_checked_on_the_ranks": Mutation(
        "a --seq-len the mesh cannot split is found only by the launched ranks",
        Rewrite("colozoo.finetune.inputs:check_sequence_split",
                ('if cfg.task != "imgcls" and cfg.sequence_length() % multiple:', "if False:")),
        ("tests/test_bad_input_table.py::test_bad_input_is_one_line_exit_1_and_leaves_nothing"
         "[seq-len over cp, before launching]",)),
    "resume_weights_unchecked": Mutation(
        "a resume takes any base weights (their fingerprint is the same for all)", _weights_fingerprint_constant,
        (RESUME,)),
    "resume_data_unchecked": Mutation(
        "a resume takes any training rows (their fingerprint is the same for all)", _data_fingerprint_constant,
        (RESUME,)),
    "resume_adapters_unchecked": Mutation(
        "a resume takes other LoRA settings than the run started with",
        Rewrite("colozoo.finetune.state:check_started_from",
                ('if "adapters" in saved and "adapters" in mine and saved["adapters"] != mine["adapters"]:',
                 "if False:")),
        (RESUME,)),
    "eval_loss_unweighted": Mutation(
        "the evaluation loss is the mean of the micro-batches' means, not weighted by their tokens",
        Rewrite(EVALUATE, ("weight = int(data.tokens[list(rows_of)].sum()) if lm else len(rows_of)",
                           "weight = 1")),
        (HONEST + "test_eval_loss_is_the_token_weighted_mean_on_every_mesh",)),
    "eval_counts_the_rerun_batch": Mutation(
        "a dp rank left without a micro-batch counts the one it runs again",
        Rewrite(EVALUATE, ("if counted and weight:", "if weight:")),
        (HONEST + "test_eval_loss_is_the_token_weighted_mean_on_every_mesh",)),
    "chat_turns_cut_mid_answer": Mutation(
        "--chat cuts a sample longer than --seq-len at seq_len instead of keeping its whole turns",
        Rewrite("colozoo.finetune.sft:fit_sample",
                ('if truncate == "turns" and not all(flag for _, flag in segments):', "if False:")),
        (HONEST + "test_chat_keeps_whole_turns_and_counts_what_it_drops",)),
    "throughput_counts_padding_as_trained": Mutation(
        "throughput counts every computed position as a trained token",
        Rewrite("colozoo.finetune.loop:step_tokens", ("int(inputs.train.tokens[indices].sum())",
                                                      'batch["input_ids"].numel()')),
        (HONEST + "test_throughput_counts_tokens_computed_and_trained_and_mfu_what_lora_computes",)),
    "export_tokenizer_not_saved": Mutation(
        "the fine-tune's HF export copies the model directory's tokenizer files instead of tokenizer.save_pretrained",
        Rewrite("colozoo.finetune.loop:export", ("tokenizer.save_pretrained(str(path))", "pass")),
        ("tests/test_finetune_export_tokenizer.py::test_the_export_holds_the_tokenizer_as_save_pretrained_writes_it",)),
    # what a newcomer meets
    "no_pack_padded_to_seq_len": Mutation(
        "--no-pack pads every batch to --seq-len instead of its longest row", _padded_to_seq_len,
        (HONEST + "test_no_pack_pads_each_batch_to_its_longest_sample_and_trains_as_full_padding",)),
    "all_masked_batch_is_zero": Mutation(
        "a batch without a labelled token has loss 0 (a perfect batch) instead of transformers' NaN",
        Rewrite("colozoo.layers.vocab:token_mean", ("torch.where(count > 0, total / count.clamp(min=1), torch.nan)",
                                                    "total / count.clamp(min=1)")),
        ("tests/test_training.py::test_an_all_masked_batch_is_nan_as_in_transformers_and_weighs_nothing_within_a_"
         "step",)),
    "data_path_checked_late": Mutation(
        "a missing or empty --data is found only after the model and tokenizer are read", _data_path_unchecked,
        ("tests/test_bad_input_table.py::test_cheap_checks_refuse_before_the_model_is_read",)),
    "short_dtype_names_accepted": Mutation(
        "dtype='bf16' (and fp16, fp32) is taken for bfloat16 instead of refused as transformers refuses it",
        Rewrite("colozoo.core.names:check_dtype_name",
                ("if name == \"auto\" or name in DTYPE_NAMES:\n        return DTYPE_NAMES.get(name, name)",
                 "if name == \"auto\" or name in DTYPE_NAMES or name in SHORT_DTYPE_NAMES:\n"
                 "        return DTYPE_NAMES.get(name, SHORT_DTYPE_NAMES.get(name, name))")),
        ("tests/test_checkpoint.py::test_dtype_names_are_transformers_and_nothing_else_passes[bf16-bfloat16]",)),
}
