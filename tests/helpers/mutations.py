"""Switch features off, one at a time, and check that the tests named for them fail.

A test named for a feature that still passes with the feature off proves nothing. Each mutation below patches the
running code through a module attribute (no file is edited) and names the tests that must then fail:

    python tests/helpers/mutations.py                    # every mutation; exit 1 if a named test still passes
    python tests/helpers/mutations.py ring_window_off_by_one checkpoint_recomputes_nothing
    make mutations                                       # the whole audit, recorded in mutations_audit.json
    make mutations-ci                                    # what CI runs after `make test` (see ci_plan)

A patch that no longer applies (a renamed attribute) is reported as such before any test runs: its tests would fail
for the wrong reason.

`COLOZOO_MUTATION=<name>` applies a mutation in the pytest process (tests/conftest.py) and in every distributed
worker (tests/helpers/distributed.py), so the multi-rank tests see it too.
"""
from __future__ import annotations

import argparse
import functools
import hashlib
import importlib
import inspect
import json
import os
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

ENV = "COLOZOO_MUTATION"


@dataclass(frozen=True)
class Mutation:
    what: str             # the feature switched off, in words
    patch: callable       # applies it
    tests: tuple          # pytest ids, every one of which must fail


def _replace(module: str, name: str, make):
    """Replace `module.name` by `make(original)`."""
    mod = importlib.import_module(module)
    setattr(mod, name, make(getattr(mod, name)))


def _drop_sequence_parallel():
    from colozoo.core.mesh import ParallelConfig

    original = ParallelConfig.for_world.__func__

    def for_world(cls, world_size, **degrees):
        degrees["sequence_parallel"] = False
        return original(cls, world_size, **degrees)

    ParallelConfig.for_world = classmethod(for_world)


def _ignore_mixed_precision():
    _replace("colozoo.runtime.parallelize", "COMPUTE_DTYPES", lambda dtypes: {k: None for k in dtypes})


def _checkpoint_nothing():
    from torch.distributed._composable.contract import contract

    @contract()
    def checkpoint(module, **kwargs):  # marks the module checkpointed (is_checkpointed says yes), recomputes nothing
        return module

    _replace("colozoo.runtime.checkpointing", "checkpoint", lambda original: checkpoint)


def _rank_worst_first():
    def make(original):
        @functools.wraps(original)
        def plan(*args, **kwargs):
            result = original(*args, **kwargs)
            result.plans.reverse()
            return result
        return plan

    _replace("colozoo.cost.planner", "plan", make)


def _profile_ignores_seq_len():
    import dataclasses

    def make(original):
        return lambda args: dataclasses.replace(original(args), seq_len=None)  # the model's default instead

    _replace("colozoo.cost.profile_cli", "workload_from_args", make)


def _window_off_by_one():
    def make(original):
        def block_mask(q_pos, k_pos, key_keep, causal, window, documents=None):
            return original(q_pos, k_pos, key_keep, causal, None if window is None else window + 1, documents)
        return block_mask

    _replace("colozoo.layers.context_parallel", "_block_mask", make)


def _ring_blocks_in_bf16():
    import torch

    def make(original):
        def attend_block(q, k, v, mask, scale):
            out, lse = original(q.to(torch.bfloat16), k.to(torch.bfloat16), v.to(torch.bfloat16), mask, scale)
            return out.float(), lse.float()
        return attend_block

    _replace("colozoo.layers.context_parallel", "_attend_block", make)


def _packing_ignored():
    from colozoo.layers.batch import BatchContext

    BatchContext.documents = property(lambda self: None)


def _cp_drops_documents():
    _replace("colozoo.layers.batch", "ContextParallel",
             lambda original: lambda *args, documents=None, **kwargs: original(*args, **kwargs))


def _flash_ignores_documents():
    import torch

    if not torch.cuda.is_available():  # as tests/test_kernels.py: interpret, so its kernel_module keeps this module
        os.environ["TRITON_INTERPRET"] = "1"
    _replace("colozoo.kernels.attention_triton", "flash_attention_triton",
             lambda original: lambda *args, documents=None, **kwargs: original(*args, **kwargs))


def _lora_replicas_unsummed():
    _replace("colozoo.layers.lora", "sum_replica_grads", lambda original: lambda weight, rows, group: weight)


def _lora_head_frozen():
    _replace("colozoo.runtime.lora", "TASK_MODULES_TO_SAVE", lambda original: {})


def _compile_nothing():  # every layer still gets the compile wrapper (is_compiled says yes), which runs eagerly
    _replace("colozoo.runtime.compile", "_compiled_forward", lambda original: lambda cls, *options: cls.forward)


def _kv_cache_off():  # every decoding step encodes the whole sequence again (the tokens stay right)
    def make(original):
        def steps(*args, use_cache=True, **kwargs):
            return original(*args, use_cache=False, **kwargs)
        return steps

    _replace("colozoo.runtime.decode_steps", "DecodeSteps", make)


def _left_padding_ignored():  # positions as if no prompt were padded
    import torch

    def make(original):
        return lambda mask: torch.arange(mask.shape[1], device=mask.device).expand(mask.shape)

    _replace("colozoo.runtime.decode_steps", "generation_positions", make)


def _adapter_alpha_ignored():  # a PEFT adapter loads with scaling 1.0 instead of alpha / r
    import dataclasses

    def make(original):
        return lambda path: dataclasses.replace(original(path), alpha=original(path).r)

    _replace("colozoo.checkpoint.peft", "read_adapter_config", make)


def _chat_template_dropped():
    _replace("colozoo.checkpoint.convert", "SIDE_FILES",
             lambda files: tuple(f for f in files if f != "chat_template.jinja"))


def _training_state_unverified():  # resume reads the rank files without checking their sha256
    _replace("colozoo.checkpoint.training_state", "ColozooCheckpoint",
             lambda original: functools.partial(original, verify=False))


MUTATIONS = {
    "sequence_parallel_dropped": Mutation(
        "init_parallel ignores sequence_parallel=True", _drop_sequence_parallel,
        ("tests/test_gpt2.py::test_gpt2_tensor_parallel[2-True]", "tests/test_llama.py::test_llama_tensor_parallel[4-True]",
         "tests/test_layers.py::test_column_parallel_linear[True-2]", "tests/test_layers.py::test_row_parallel_linear[True-4]",
         "tests/test_mixtral.py::test_mixtral_expert_and_tensor_parallel[2-1-True]",
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
         "tests/test_packing.py::test_changed_token_moves_only_its_document[opt]")),
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
        ("tests/test_compile.py::test_compile_gpt2_tp1",
         "tests/test_compile.py::test_compile_tp2_sequence_parallel[llama-config0]",
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


def apply_from_environment():
    """Apply the mutation named by COLOZOO_MUTATION, if any (called by conftest.py and the distributed workers)."""
    name = os.environ.get(ENV)
    if name:
        if name not in MUTATIONS:
            raise SystemExit(f"{ENV}={name!r} is not a mutation; known: {sorted(MUTATIONS)}")
        MUTATIONS[name].patch()


ROOT = Path(__file__).resolve().parents[2]
AUDIT = Path(__file__).with_name("mutations_audit.json")  # the last whole audit: fingerprints and seconds per test


def fingerprint(name: str) -> str:
    """What a mutation's verdict depends on besides the code it switches off: its patch and its named test files."""
    mutation = MUTATIONS[name]
    digest = hashlib.sha256(f"{name}\n{mutation.what}\n{mutation.tests}\n".encode())
    digest.update(inspect.getsource(mutation.patch).encode())
    for file in sorted({test.split("::")[0] for test in mutation.tests}):
        digest.update((ROOT / file).read_bytes())
    return digest.hexdigest()


def patches_apply() -> list[str]:
    """Every mutation's patch applied in one fresh process; the ones that raise (a renamed attribute would make
    their named tests fail for the wrong reason and pass the audit)."""
    script = ("import sys, traceback; sys.path.insert(0, 'tests/helpers'); import mutations\n"
              "for name, m in mutations.MUTATIONS.items():\n"
              "    try: m.patch()\n"
              "    except Exception: print(name, traceback.format_exc(limit=1).splitlines()[-1])\n")
    result = subprocess.run([sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True)
    if result.returncode:
        raise SystemExit(f"applying the patches failed:\n{result.stderr}")
    return result.stdout.splitlines()


def run_test(name: str, test: str) -> tuple[bool, float]:
    """(whether `test` fails under mutation `name`, its seconds)."""
    start = time.perf_counter()
    result = subprocess.run([sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider", test],
                            cwd=ROOT, env={**os.environ, ENV: name}, capture_output=True, text=True)
    return result.returncode != 0, time.perf_counter() - start


def run(plan: dict[str, tuple]) -> tuple[list[str], dict]:
    """Run each mutation's tests in `plan` ({name: tests}); (the tests that passed, {name: {test: seconds}})."""
    survivors, seconds = [], {}
    for name, tests in plan.items():
        mutation, start, failed = MUTATIONS[name], time.perf_counter(), 0
        for test in tests:
            caught, took = run_test(name, test)
            seconds.setdefault(name, {})[test] = round(took, 1)
            failed += caught
            if not caught:
                survivors.append(test)
        whole = "" if len(tests) == len(mutation.tests) else f" (fast: {len(tests)} of {len(mutation.tests)})"
        print(f"{'caught ' if failed == len(tests) else 'MISSED '} {name}: {mutation.what}: {failed}/{len(tests)} "
              f"named tests fail{whole} ({time.perf_counter() - start:.0f}s)", flush=True)
    return survivors, seconds


def ci_plan(budget: float) -> dict[str, tuple]:
    """The whole audit for every mutation whose patch or named test files changed since mutations_audit.json (or
    is not in it); for the others, each one's fastest test while `budget` seconds last, starting at a place that
    moves with the commit so that successive changes cover them all."""
    audited = json.loads(AUDIT.read_text())["mutations"] if AUDIT.exists() else {}
    changed = [n for n in MUTATIONS if audited.get(n, {}).get("fingerprint") != fingerprint(n)]
    plan = {n: MUTATIONS[n].tests for n in changed}
    steady = [n for n in MUTATIONS if n not in changed]
    if steady:
        head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True).stdout.strip()
        first = int(head or "0", 16) % len(steady)
        for name in steady[first:] + steady[:first]:
            test, took = min(audited[name]["seconds"].items(), key=lambda item: item[1])
            if took > budget:
                break
            plan[name], budget = (test,), budget - took
    skipped = len(MUTATIONS) - len(plan)
    print(f"mutations: {len(changed)} changed since the last whole audit run whole, {len(plan) - len(changed)} by "
          f"their fastest test, {skipped} left for later runs (budget)", flush=True)
    return plan


def record(seconds: dict):
    """After a whole audit that caught everything: its fingerprints and timings, for ci_plan and the README."""
    mutations = {n: {"fingerprint": fingerprint(n), "seconds": seconds[n], "total": round(sum(seconds[n].values()))}
                 for n in MUTATIONS}
    AUDIT.write_text(json.dumps({"total_seconds": sum(m["total"] for m in mutations.values()),
                                 "mutations": mutations}, indent=1) + "\n")


def main(argv) -> int:
    parser = argparse.ArgumentParser(description="Switch features off one at a time; the tests named for each "
                                                 "must fail.")
    parser.add_argument("names", nargs="*", help="mutations to run (default: all, recorded in mutations_audit.json)")
    parser.add_argument("--ci", type=float, metavar="SECONDS", help="the CI form: mutations changed since the last "
                        "whole audit run whole, the others by their fastest test within SECONDS")
    args = parser.parse_args(argv)
    unknown = [n for n in args.names if n not in MUTATIONS]
    if unknown:
        raise SystemExit(f"unknown mutation(s) {unknown}; known: {sorted(MUTATIONS)}")
    broken = patches_apply()
    if broken:
        print("patches that no longer apply (a renamed attribute?):\n  " + "\n  ".join(broken))
        return 1
    plan = ci_plan(args.ci) if args.ci is not None else {n: MUTATIONS[n].tests for n in args.names or MUTATIONS}
    survivors, seconds = run(plan)
    if survivors:
        print("tests that pass with their feature switched off:\n  " + "\n  ".join(survivors))
        return 1
    if args.ci is None and not args.names:
        record(seconds)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
