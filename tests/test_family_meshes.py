"""The newer families on meshes the family table leaves out (tests/test_family_table.py): context parallelism (ring
and all-to-all) for Phi-3 and GPT-NeoX, and a clipped AdamW step under FSDP (dp2 x tp2) for Gemma 3, Phi-3 and
GPT-NeoX, each against transformers (logits, loss, every gathered gradient; the loss, gradient norm and parameters
after the step); greedy generation token for token at tp 4 (kv heads replicated)."""
import pytest

from distributed import run_distributed
from family_cases import tiny_kwargs
from test_generate import greedy_matches_transformers
from test_qwen import training_step

TIMEOUT = 300


@pytest.mark.parametrize("mode", ["ring", "all_to_all"])
@pytest.mark.parametrize("family", ["phi3", "gpt_neox"])
def test_context_parallel_matches_transformers(family, mode):
    from test_context_parallel import cp_parity

    run_distributed(cp_parity, 4, tp=2, cp=2, mode=mode, sequence_parallel=True, family=family, timeout=TIMEOUT)


# parameters after the AdamW step: with Adam's eps of 1e-6 a near-zero gradient's update is about lr whatever its
# size, so fp32 rounding in Gemma's capped, offset-norm gradients moves a parameter by ~2e-6 (the loss and every
# clipped gradient are held to the default tolerances first)
@pytest.mark.parametrize("family,param_atol", [("gemma3_text", 1e-5), ("phi3", 2e-6), ("gpt_neox", 2e-6)])
def test_fsdp_training_step_matches_transformers(family, param_atol):
    run_distributed(training_step, 4, family=family, config=tiny_kwargs(family), dp=2, tp=2, microbatches=2,
                    param_atol=param_atol, timeout=TIMEOUT)


DENSE = ["gemma2", "gemma3_text", "phi3", "gpt_neox", "qwen2", "qwen3"]


def test_greedy_generate_matches_transformers_tp4():
    results = run_distributed(greedy_matches_transformers, 4, families=DENSE, tp=4, new=8, timeout=TIMEOUT)
    assert all(r == results[0] for r in results)
