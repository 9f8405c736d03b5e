"""Switch-offs of the generate surface (tests/helpers/mutations.py runs them): end-of-sequence lists and the model's
generation config, stop strings (greedy and beams), the score processors (repetition penalty, minimum length,
temperature, top-k, top-p), beam search's options, and the static decode step (zeroed cache slots, the host's look
every CHECK_EVERY steps, a draw without host read, a step that compiles whole at tp 2)."""
from __future__ import annotations

from mutation_tools import Mutation, Rewrite, replace, switches

SURFACE = "tests/test_generate_surface.py::"
SAMPLING = "tests/test_sampling.py::"
BEAMS = "tests/test_beam_search_options.py::"
PROCESS = "colozoo.runtime.sampling:process"
GREEDY_OPTIONS = SURFACE + "test_greedy_scores_logits_eos_lists_and_lengths_equal_transformers"
STATIC = "tests/test_static_decode.py::"


@switches("colozoo.layers.kv_cache:StaticKVCache.zeroed")
def _static_cache_not_zeroed():
    replace("colozoo.layers.kv_cache:StaticKVCache.zeroed", lambda original: False)


@switches("colozoo.runtime.static_decode:CHECK_EVERY")
def _static_loop_checks_every_step():
    replace("colozoo.runtime.static_decode:CHECK_EVERY", lambda original: 1)


@switches("colozoo.runtime.sampling:draw")
def _draw_by_multinomial():
    import torch

    replace("colozoo.runtime.sampling:draw", lambda original: lambda probs, generator=None: torch.multinomial(
        probs, 1, generator=generator).squeeze(1))

GENERATE = {
    # end-of-sequence tokens
    "eos_list_first_only": Mutation(
        "greedy decoding ends a sequence only at the first of several eos_token_id",
        Rewrite("colozoo.runtime.sampling:eos_ids",
                ("torch.tensor(options.eos_token_id, device", "torch.tensor(options.eos_token_id[:1], device")),
        (GREEDY_OPTIONS + "[gpt2]", GREEDY_OPTIONS + "[llama]")),
    "generation_config_ignored": Mutation(
        "generate ignores the model's generation_config.json (its eos ids, max_new_tokens)",
        Rewrite("colozoo.runtime.generation_config:resolve",
                ("base = model.generation_config or transformers", "base = transformers")),
        (SURFACE + "test_the_models_generation_config_and_stop_strings",)),
    "min_length_eos_allowed": Mutation(
        "min_length / min_new_tokens do not hold the end-of-sequence tokens back",
        Rewrite(PROCESS, ("if options.eos_token_id is not None and generated.shape[-1] < options.min_length:",
                          "if False:")),
        (SAMPLING + "test_min_length_suppresses_the_end_of_sequence_tokens_until_reached", GREEDY_OPTIONS + "[llama]")),
    # stop strings
    "stop_strings_ignored": Mutation(
        "greedy decoding ignores stop_strings",
        Rewrite("colozoo.runtime.generate:_sample",
                ("unfinished = unfinished & ~stop(sequences, None).to(unfinished.device)", "pass")),
        (SURFACE + "test_the_models_generation_config_and_stop_strings",)),
    "beam_stop_strings_ignored": Mutation(
        "beam search ignores stop_strings",
        Rewrite("colozoo.runtime.generate:generate", ("decoding, stop, num_microbatches)\n",
                                                     "decoding, None, num_microbatches)\n")),
        (BEAMS + "test_stop_strings_end_beams_as_in_transformers",)),
    # the score processors
    "repetition_penalty_ignored": Mutation(
        "repetition_penalty ignored",
        Rewrite(PROCESS, ("if options.repetition_penalty is not None and options.repetition_penalty != 1.0:",
                          "if False:")),
        (SAMPLING + "test_processed_scores_equal_transformers[1.3-1.0-None-None-None]", GREEDY_OPTIONS + "[llama]")),
    "repetition_penalty_divides_negative_scores": Mutation(
        "repetition_penalty divides every seen token's score, the negative ones too (making them likelier)",
        Rewrite(PROCESS, ("torch.where(scores < 0, scores * options.repetition_penalty, scores / options",
                          "torch.where(scores < 0, scores / options.repetition_penalty, scores / options")),
        (SAMPLING + "test_processed_scores_equal_transformers[1.3-1.0-None-None-None]",)),
    "repetition_penalty_counts_padding": Mutation(
        "repetition_penalty also penalises the pad token of left-padded prompts",
        Rewrite(PROCESS, ("if padding is not None:", "if False:")),
        (GREEDY_OPTIONS + "[llama]",)),
    "temperature_ignored": Mutation(
        "sampling ignores temperature",
        Rewrite(PROCESS, ("if options.temperature != 1.0:", "if False:")),
        (SAMPLING + "test_processed_scores_equal_transformers[None-0.7-None-None-None]",)),
    "top_k_ignored": Mutation(
        "sampling ignores top_k",
        Rewrite(PROCESS, ("if options.top_k and options.top_k < scores.shape[-1]:", "if False:")),
        (SAMPLING + "test_processed_scores_equal_transformers[None-1.0-5-None-None]",
         SAMPLING + "test_sampling_keeps_transformers_default_top_k_of_50")),
    "top_p_ignored": Mutation(
        "sampling ignores top_p",
        Rewrite(PROCESS, ("if options.top_p is not None and options.top_p < 1.0:", "if False:")),
        (SAMPLING + "test_processed_scores_equal_transformers[None-1.0-None-0.8-None]",)),
    "output_logits_processed": Mutation(
        "output_logits returns the processed scores instead of the raw logits",
        Rewrite("colozoo.runtime.generate:_sample", ("raw_logits += [logits.float()]", "raw_logits += [processed]")),
        (GREEDY_OPTIONS + "[llama]",)),
    # beam search
    "beam_returns_one_sequence": Mutation(
        "beam search returns one sequence per prompt whatever num_return_sequences",
        Rewrite("colozoo.runtime.beam_search:BeamState.result", ("n = self.decoding.num_return_sequences", "n = 1")),
        (SURFACE + "test_beam_search_equals_transformers[llama]",)),
    "beam_early_stopping_never_as_true": Mutation(
        "beam search takes early_stopping='never' for True",
        Rewrite("colozoo.runtime.generation_config:_lengths_and_checks",
                ("early_stopping=config.early_stopping,",
                 "early_stopping=True if config.early_stopping == 'never' else config.early_stopping,")),
        # (the surface test's gpt2 case no longer tells 'never' from True on the declared tiny config: the
        # dedicated test builds a case where they differ)
        (BEAMS + "test_early_stopping_never_equals_transformers_where_it_differs_from_true",)),
    "beam_length_penalty_ignored": Mutation(
        "beam search ranks finished beams by their summed log-probabilities, without length_penalty",
        Rewrite("colozoo.runtime.beam_search:BeamState._finish",
                ("top_scores / ((length + 1 - self.prompt) ** self.decoding.length_penalty)",
                 "top_scores / (length + 1 - self.prompt)")),
        (SURFACE + "test_beam_search_equals_transformers[llama]",)),
    # the static decode step
    "static_cache_not_zeroed": Mutation(
        "the static KV cache's slots start as whatever the memory held (a step attends over every slot)",
        _static_cache_not_zeroed, (STATIC + "test_unwritten_cache_slots_cannot_poison_a_step",)),
    "static_loop_checks_every_step": Mutation(
        "the static decode loop reads back whether every sequence ended at every step instead of every 8",
        _static_loop_checks_every_step, (STATIC + "test_the_static_loop_reads_nothing_back_per_token",)),
    "draw_by_multinomial": Mutation(
        "sampling draws with torch.multinomial, which reads the probabilities back to the host at every token",
        _draw_by_multinomial, (STATIC + "test_the_static_loop_reads_nothing_back_per_token",)),
    "decode_all_reduce_through_autograd": Mutation(
        "a row-parallel layer's all-reduce without gradients goes through the autograd Function (dynamo breaks the "
        "static step's graph at tp 2)",
        Rewrite("colozoo.layers.comm:reduce_from_parallel",
                ("if not torch.is_grad_enabled():", "if False:")),
        (STATIC + "test_the_step_compiles_whole_at_tp2",)),
}
