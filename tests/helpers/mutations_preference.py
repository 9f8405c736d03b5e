"""Switch-offs of preference tuning and of the lm-eval backend (tests/helpers/mutations.py runs them): DPO's reference
under LoRA, its per-row values gathered over dp, a packed pair's two sums, the implicit prompt; the evaluation's
cross entropy over the tensor-parallel group, where each request's tokens are scored, and the task scores of
colozoo finetune --eval-tasks."""
from __future__ import annotations

from mutation_tools import Mutation, Rewrite, replace, switches

TRL = "tests/test_preference_trl.py::"
EVAL = "tests/test_eval_harness.py::"


@switches("colozoo.finetune.evaluation:task_scores")
def _no_task_scores():
    replace("colozoo.finetune.evaluation:task_scores", lambda original: lambda *args, **kwargs: {})


PREFERENCE = {
    # DPO
    "dpo_reference_keeps_the_adapters": Mutation(
        "under LoRA the reference log-probs are the policy's own (the adapters stay attached)",
        Rewrite("colozoo.runtime.lora:adapters_disabled", ("model.get_submodule(name).lora = None", "pass")),
        (TRL + "test_first_step_equals_trl_for_every_loss[strings-True-True]",)),
    "dpo_values_not_gathered_over_dp": Mutation(
        "the per-row values a preference step reports (log-probs, rewards) are not gathered over dp",
        Rewrite("colozoo.runtime.logprobs:gather_reported", ('if parallel.size("dp") > 1:', "if False:")),
        (TRL + "test_first_step_is_the_same_on_every_mesh[dp2 ddp]",)),
    "dpo_packed_pair_summed_whole": Mutation(
        "a row packing a pair sums all its tokens into the chosen sequence (the rejected one's sum 0)",
        Rewrite("colozoo.finetune.preference_data:sequence_sums", ('< rows["split"][:, None]', "< values.shape[1]")),
        (TRL + "test_first_step_equals_trl_for_every_loss[strings-False-True]",)),
    "dpo_no_implicit_prompt": Mutation(
        "a pair without a prompt keeps the completions whole, no common beginning taken as the prompt (then refused: "
        "nothing predicts the completion's first token)",
        Rewrite("colozoo.finetune.preference_data:split_prompt",
                ("return chosen[:idx], chosen[idx:], rejected[idx:]", "return chosen[:0], chosen, rejected")),
        ("tests/test_finetune_dpo.py::test_truncation_is_counted_and_an_implicit_prompt_extracted_from_jsonl_and_"
         "parquet",)),
    # the lm-eval backend
    "eval_cross_entropy_without_tp_group": Mutation(
        "colozoo eval's log-probabilities taken over each rank's vocab slice alone (no tensor-parallel group)",
        Rewrite("colozoo.evaluation.scoring:score_spans",
                ("target[None], vocab, parallel.tp_group)", "target[None], vocab, None)")),
        (EVAL + "test_colozoo_eval_on_a_mesh_matches_the_hf_backend[llama-2-1-1]",)),
    "eval_every_replica_scores_all": Mutation(
        "every dp replica scores every lm-eval request (no dealing over the replicas)",
        Rewrite("colozoo.evaluation.replicas:replica_group",
                ('if parallel.size("edp") == 1 or sharded_over_replicas(model):', "if True:")),
        ("tests/test_eval_replicas.py::test_each_replica_scores_its_share_and_every_rank_gets_the_hf_backends_answers"
         "[1-1]",)),
    "eval_answers_in_dealing_order": Mutation(
        "the replicas' answers are joined in the order they were dealt, not the requests' order",
        Rewrite("colozoo.evaluation.replicas:on_replicas",
                ("ordered[i] = answer", "ordered[ordered.index(None)] = answer")),
        ("tests/test_eval_replicas.py::test_each_replica_scores_its_share_and_every_rank_gets_the_hf_backends_answers"
         "[1-1]",)),
    "eval_spans_one_token_early": Mutation(
        "colozoo eval scores each continuation one position early",
        Rewrite("colozoo.evaluation.harness:ColozooLM._loglikelihood_tokens",
                ("Span(row, len(inputs[-1]), tuple(member_tokens))",
                 "Span(row, len(inputs[-1]) - 1, tuple(member_tokens))")),
        (EVAL + "test_token_requests_score_as_the_hf_backend",)),
    "finetune_task_scores_dropped": Mutation(
        "colozoo finetune --eval-tasks logs no task score", _no_task_scores,
        (EVAL + "test_finetune_scores_the_tasks_beside_the_eval_loss",)),
}
