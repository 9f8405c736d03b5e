"""LoRA on DeepSeek-V3 against PEFT on transformers: every MLA projection (the replicated compressions q_a_proj and
kv_a_proj_with_mqa, q_b_proj and kv_b_proj split by heads, o_proj; q_proj where the query is not compressed). Logits,
loss and every adapter's gradient at tp 1 and tp 2 (sequence parallelism off and on: the compressions' adapters then
see each rank's share of the tokens) and at dp2 x ep2; colozoo's PEFT adapter directory (saved at tp 2) loads in peft
with the same logits and back in colozoo bit for bit; greedy generation with adapters token for token against peft's,
with every step's logits (the up-projections absorbed into the query and the output, kv_b_proj's adapter joining them
on its rank: no step expands the cached latent, adapted or not).

The MLPs are refused, with a reason: the routed experts as for every MoE family (transformers holds them as stacked
parameters), and the dense MLPs and shared expert too, since PEFT 0.21 on transformers 5 turns any target named
gate_proj, up_proj or down_proj of a DeepSeek-V3 model into one on the routed experts (an adapter colozoo saved on them
would not load in peft)."""
import pytest

from distributed import run_distributed
from test_deepseek_v3 import DENSE, GENERATE, MOE, VARIANT

TIMEOUT = 300
MLA = ("q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj", "o_proj")
CASES = {"deepseek_v3": ("deepseek_v3", MOE, MLA),
         "deepseek_v3_q_proj": ("deepseek_v3", {**DENSE, **VARIANT}, ("q_proj", "kv_a_proj_with_mqa", "kv_b_proj",
                                                                      "o_proj")),
         "deepseek_v3_generate": ("deepseek_v3", GENERATE["deepseek_v3"], MLA),
         "deepseek_v3_absorbed": ("deepseek_v3", GENERATE["deepseek_v3"], ("q_a_proj", "q_b_proj", "o_proj"))}


def lora(case="deepseek_v3", **mesh):
    """tests/helpers/lora_parity.py on this file's cases (registered on each rank, where the check runs)."""
    import lora_parity

    lora_parity.CASES.update(CASES)
    return lora_parity.lora_parity(case, **mesh)


def test_lora_matches_peft_single_process():
    """The uncompressed query's q_proj (the declared config's MLA targets: tests/test_lora_families.py)."""
    assert lora("deepseek_v3_q_proj") == 2 * 4


@pytest.mark.parametrize("targets,reason", [
    (("q_a_proj", "mlp.gate_proj"), "PEFT .* takes modules named .*'gate_proj'.* for its routed experts"),
    (("shared_experts.down_proj",), "PEFT .* takes modules named .*'down_proj'.* for its routed experts"),
    (("up_proj",), "MoE expert linears .*not supported"),
    ("all-linear", "not supported: PEFT's all-linear")])
def test_lora_refuses_the_mlps(targets, reason):
    import transformers

    from colozoo.api import build_model
    from colozoo.runtime.lora import apply_lora

    model = build_model(transformers.AutoConfig.for_model("deepseek_v3", **MOE), device="meta")
    with pytest.raises(ValueError, match=reason):
        apply_lora(model, r=4, targets=targets)


def lora_generation(case: str, tp: int = 1):
    """Greedy generation of ours and of peft's model holding the same adapters: the tokens and every step's logits;
    how many positions kv_b_proj projected in each layer (the prefill's; decoding steps attend over the latent)."""
    import torch

    import lora_parity
    from colozoo.core.mesh import init_parallel, single_process
    from colozoo.runtime.lora import apply_lora
    from parity import close
    from test_generate import NEW, ours_and_hf, prompts

    lora_parity.CASES.update(CASES)
    parallel = init_parallel(tp=tp) if tp > 1 else single_process()
    config, hf, model = ours_and_hf("deepseek_v3", parallel, CASES[case][1])
    apply_lora(model, r=lora_parity.R, alpha=lora_parity.ALPHA, targets=CASES[case][2])
    lora_parity.randomize_b(model)
    reference = lora_parity.peft_model(case, hf).eval()
    ids, mask = prompts(config.vocab_size)
    options = dict(max_new_tokens=NEW, do_sample=False, pad_token_id=0, eos_token_id=None,
                   return_dict_in_generate=True, output_logits=True)
    projected = []
    hook = model.layers["0"].self_attn.kv_b_proj.register_forward_pre_hook(
        lambda m, args: projected.append(args[0].shape[1]))
    with torch.no_grad():
        out, ref = model.generate(ids, attention_mask=mask, **options), reference.generate(
            input_ids=ids, attention_mask=mask, **options)
    hook.remove()
    assert out.sequences.tolist() == ref.sequences.tolist()
    for step, (ours, theirs) in enumerate(zip(out.logits, ref.logits, strict=True)):
        close(ours, theirs, 1e-5, f"logits of step {step}")
    return projected


@pytest.mark.parametrize("case", ["deepseek_v3_generate", "deepseek_v3_absorbed"])
def test_greedy_generate_with_adapters(case):
    assert lora_generation(case) == [9]  # the prompt's 9 positions; no step expands the cached latent


def test_an_adapter_drawing_dropout_decodes_expanded_in_training_mode():
    """The absorbed form cannot draw the adapter's dropout mask on the latent: in training mode such a step expands
    the cached latent through kv_b_proj and its adapter; in eval mode it attends over the latent."""
    import transformers

    from colozoo.api import build_model
    from colozoo.runtime.lora import apply_lora

    model = build_model(transformers.AutoConfig.for_model("deepseek_v3", **GENERATE["deepseek_v3"]), device="meta")
    apply_lora(model, r=4, dropout=0.1, targets=("kv_b_proj",))
    attention = model.layers["0"].self_attn
    assert attention.eval()._absorbable() and not attention.train()._absorbable()


def tp2_adapters(directory: str):
    """At tp 2: parity without and with sequence parallelism and at dp2 x ep2, greedy generation with adapters (kv_b_proj
    adapted), then the adapters saved as PEFT writes them; returns the saved model's logits."""
    import torch
    import torch.distributed as dist

    import colozoo
    import lora_parity
    from colozoo.runtime.lora import apply_lora

    assert lora(tp=2) > 0 and lora(tp=2, sequence_parallel=True) > 0
    assert lora("deepseek_v3_q_proj", tp=2, sequence_parallel=True) > 0
    assert lora(dp=2, ep=2) > 0
    lora_generation("deepseek_v3_generate", tp=2)
    _, hf, inputs, _ = lora_parity.hf_and_batch("deepseek_v3")
    if dist.get_rank() == 0:
        hf.save_pretrained(f"{directory}/base")
    dist.barrier()
    model = colozoo.from_pretrained(f"{directory}/base", tp=2, sequence_parallel=True)
    apply_lora(model, r=lora_parity.R, alpha=lora_parity.ALPHA, targets=CASES["deepseek_v3"][2])
    lora_parity.randomize_b(model)
    model.save_pretrained(f"{directory}/adapter", format="peft")
    with torch.no_grad():
        return model.eval()(**inputs, return_logits=True).logits


def test_lora_tp2_and_the_peft_directory(tmp_path):
    import peft
    import torch
    import transformers
    from safetensors.torch import load_file

    import colozoo
    import lora_parity
    from colozoo.checkpoint.peft import gather_adapters
    from parity import close

    logits = run_distributed(tp2_adapters, 2, directory=str(tmp_path), timeout=TIMEOUT)[0]
    lora_parity.CASES.update(CASES)
    base, adapter = tmp_path / "base", tmp_path / "adapter"
    saved = load_file(adapter / "adapter_model.safetensors")
    assert {k.split(".")[-3] for k in saved} == set(MLA)
    reference = peft.PeftModel.from_pretrained(transformers.AutoModelForCausalLM.from_pretrained(base), adapter)
    _, _, inputs, _ = lora_parity.hf_and_batch("deepseek_v3")
    with torch.no_grad():
        close(logits, reference.eval()(**inputs).logits, 1e-5, "logits through peft")
    ours = gather_adapters(colozoo.from_pretrained(base, adapter=adapter))
    assert ours.keys() == saved.keys() and all(torch.equal(ours[k], saved[k]) for k in saved)
