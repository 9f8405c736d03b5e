"""LoRA against PEFT on transformers (tests/lora_parity.py): loss, logits and every adapter gradient at tp 1, 2
and 4, tp2 x pp2 and dp2 with FSDP; the PEFT format both ways; the merged export; bad input."""
import pytest
from distributed import run_distributed
from lora_parity import FAMILIES, lora_parity

TIMEOUT = 240


@pytest.mark.parametrize("family", FAMILIES)
def test_lora_matches_peft_single_process(family):
    assert lora_parity(family) > 0


def _every_family(**mesh):
    return {family: lora_parity(family, **mesh) for family in FAMILIES}


def test_lora_matches_peft_tp2():
    results = run_distributed(_every_family, 2, tp=2, timeout=TIMEOUT)
    assert all(n > 0 for result in results for n in result.values())


def test_lora_matches_peft_tp4_llama():
    assert all(n > 0 for n in run_distributed(lora_parity, 4, family="llama", tp=4, timeout=TIMEOUT))


def _pipelined():
    return {family: lora_parity(family, tp=2, pp=2) for family in ("gpt2", "opt", "llama")}


def test_lora_matches_peft_tp2_pp2():
    results = run_distributed(_pipelined, 4, timeout=TIMEOUT)
    assert all(n > 0 for result in results for n in result.values())


def test_lora_matches_peft_dp2_fsdp():
    results = run_distributed(_every_family, 2, dp=2, data_parallel="fsdp", timeout=TIMEOUT)
    assert all(n > 0 for result in results for n in result.values())
