"""The newer families on the meshes their own files leave out: context parallelism (ring and all-to-all) for Phi-3
and GPT-NeoX, and a clipped AdamW step under FSDP (dp2 x tp2) for Gemma 3, Phi-3 and GPT-NeoX, each against
transformers (logits, loss, every gathered gradient; the loss, gradient norm and parameters after the step); greedy
generation token for token at tp 4 (kv heads replicated) and tp2 x pp2."""
import pytest

from distributed import run_distributed
from test_gemma import ATTENTION, GEMMA3
from test_gemma import CONFIGS as GEMMA
from test_generate import greedy_matches_transformers
from test_gpt_neox import BASE as NEOX
from test_gpt_neox import GENERATE as NEOX_GENERATE
from test_phi3 import BASE as PHI3
from test_phi3 import GENERATE as PHI3_GENERATE
from test_qwen import GENERATE as QWEN_GENERATE
from test_qwen import training_step

TIMEOUT = 300
CONFIGS = {"phi3": {**PHI3, "sliding_window": 6}, "gpt_neox": {**NEOX, "rope_parameters": {
    "rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5}}, "gemma3_text": GEMMA3}


@pytest.mark.parametrize("mode", ["ring", "all_to_all"])
@pytest.mark.parametrize("family", ["phi3", "gpt_neox"])
def test_context_parallel_matches_transformers(family, mode):
    from test_context_parallel import cp_parity

    run_distributed(cp_parity, 4, tp=2, cp=2, mode=mode, sequence_parallel=True, family=family,
                    overrides=CONFIGS[family], timeout=TIMEOUT)


# parameters after the AdamW step: with Adam's eps of 1e-6 a near-zero gradient's update is about lr whatever its
# size, so fp32 rounding in Gemma's capped, offset-norm gradients moves a parameter by ~2e-6 (the loss and every
# clipped gradient are held to the default tolerances first)
@pytest.mark.parametrize("family,param_atol", [("gemma3_text", 1e-5), ("phi3", 2e-6), ("gpt_neox", 2e-6)])
def test_fsdp_training_step_matches_transformers(family, param_atol):
    run_distributed(training_step, 4, family=family, config=CONFIGS[family], dp=2, tp=2, microbatches=2,
                    param_atol=param_atol, timeout=TIMEOUT)


GENERATE = {**GEMMA, "phi3": PHI3_GENERATE, "gpt_neox": NEOX_GENERATE, **QWEN_GENERATE}
DENSE = ["gemma2", "gemma3_text", "phi3", "gpt_neox", "qwen2", "qwen3"]


@pytest.mark.parametrize("tp,pp", [(4, 1), (2, 2)])
def test_greedy_generate_matches_transformers(tp, pp):
    results = run_distributed(greedy_matches_transformers, tp * pp, families=DENSE, tp=tp, pp=pp, configs=GENERATE,
                              attention=ATTENTION, new=8, timeout=TIMEOUT)
    assert all(r == results[0] for r in results)
