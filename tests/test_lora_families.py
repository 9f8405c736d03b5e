"""LoRA against PEFT on transformers for every family of the table beyond GPT-2, OPT, LLaMA and BERT
(tests/lora_parity.py: each family's tiny config and the targets it declares): the loss and every adapter gradient on
one process and at tp 2 (q/k/v biases, q/k norms, soft-capping, Phi-3's fused qkv_proj and gate_up_proj, GPT-NeoX's
per-head query_key_value, MoE attention and shared experts, MLA's compressions, sinks, ViT), at tp 4 over kv heads
replicated on 2 ranks each, the MoE families at ep 2, and cp 2; MoE expert targets refused."""
import pytest
from distributed import run_distributed
from family_cases import MOE
from lora_parity import MORE, lora_parity

TIMEOUT = 300


@pytest.mark.parametrize("family", sorted(MORE))
def test_lora_family_matches_peft_single_process(family):
    assert lora_parity(family) > 0


def _families(families, **mesh):
    return {family: lora_parity(family, **mesh) for family in families}


def test_lora_families_match_peft_tp2():
    results = run_distributed(_families, 2, families=sorted(MORE), tp=2, timeout=TIMEOUT)
    assert all(n > 0 for result in results for n in result.values())


def test_lora_replicated_kv_heads_match_peft_tp4():
    # 2 kv heads over tp=4: each k/v head (and its B rows) on 2 ranks, its gradient summed over them; LLaMA's
    # k_proj / v_proj adapters and Phi-3's one qkv_proj adapter over q, k and v
    results = run_distributed(_families, 4, families=("llama", "phi3"), tp=4, timeout=TIMEOUT)
    assert all(n > 0 for result in results for n in result.values())


def test_lora_moe_matches_peft_ep2():
    # without the router's aux loss: split over data ranks it is a different function of the batch (tp2 checks it)
    results = run_distributed(_families, 2, families=MOE, dp=2, ep=2, overrides={"output_router_logits": False},
                              timeout=TIMEOUT)
    assert all(n > 0 for result in results for n in result.values())


def test_lora_matches_peft_cp2():
    assert all(n > 0 for n in run_distributed(lora_parity, 2, family="qwen2", cp=2, timeout=TIMEOUT))


@pytest.mark.parametrize("targets", [("w1",), ("experts",), ("gate_up_proj",), "all-linear"])
def test_lora_refuses_moe_expert_targets(targets):
    from lora_parity import hf_and_batch

    from colozoo.api import build_model
    from colozoo.runtime.lora import apply_lora

    config, _, _, _ = hf_and_batch("mixtral")
    model = build_model(config, device="meta")
    with pytest.raises(ValueError, match="MoE expert linears .*not supported|not supported: PEFT's all-linear"):
        apply_lora(model, r=4, targets=targets)
