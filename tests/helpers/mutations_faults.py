"""Switch-offs of what a user sees when things go wrong (tests/helpers/mutations.py runs them): checksums.json over a
colozoo checkpoint's files, one job per run directory, every rank's error said once, the stuck rank named, and the
settings a resume takes from its checkpoint."""
from __future__ import annotations

from mutation_tools import Mutation, Rewrite, replace, switches


@switches("colozoo.checkpoint.checksums:verify_checksums")
def _checksums_unchecked():
    replace("colozoo.checkpoint.checksums:verify_checksums", lambda original: lambda directory: None)


@switches("colozoo.runtime.failures:is_transport_error")
def _no_transport_errors():
    replace("colozoo.runtime.failures:is_transport_error", lambda original: lambda error: False)


@switches("colozoo.finetune.watchdog:find_stuck")
def _nobody_stuck():
    replace("colozoo.finetune.watchdog:find_stuck", lambda original: lambda me, before, after: [])


@switches("colozoo.finetune.state:RESTORED_SETTINGS")
def _no_settings_restored():
    replace("colozoo.finetune.state:RESTORED_SETTINGS", lambda original: ())


FAULTS = {
    "checksums_unchecked": Mutation(
        "a colozoo checkpoint opens without checking its files against checksums.json", _checksums_unchecked,
        ("tests/test_checkpoint_errors.py::test_corrupted_input_one_clear_error[colozoo_index_swapped]",)),
    "run_lock_not_exclusive": Mutation(
        "a job takes the run directory's lock even while another live job holds it (the lock file overwritten)",
        Rewrite("colozoo.finetune.run_lock:RunLock.acquire", ("os.O_CREAT | os.O_EXCL", "os.O_CREAT | os.O_TRUNC")),
        ("tests/test_run_directory.py::test_a_live_lock_of_another_host_holds",)),
    "follower_errors_said_as_their_own": Mutation(
        "a rank whose collective failed because another rank failed prints gloo's error as its own",
        _no_transport_errors,
        ("tests/test_rank_failures.py::test_the_first_failure_is_said_once_and_the_others_follow_it",)),
    "stuck_rank_never_named": Mutation(
        "the watchdog never names a stuck rank", _nobody_stuck,
        ("tests/test_stuck_rank.py::test_the_stuck_rank_is_the_frozen_one_else_the_one_outside_a_collective_else_"
         "the_one_behind",)),
    "resume_settings_unchecked": Mutation(
        "a resume takes --lr / --weight-decay different from its checkpoint's without a word (the optimizer's "
        "state overrides them)", _no_settings_restored,
        ("tests/test_run_directory.py::test_takeover_temp_names_and_a_finished_run_are_said_and_other_settings_"
         "refused",)),
}
