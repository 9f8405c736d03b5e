import pytest
import torch
import transformers

from colozoo.checkpoint.load import load_hf_weights
from colozoo.checkpoint.readers import StateDictReader
from colozoo.models.base import UnsupportedConfig
from colozoo.api import build_model
from colozoo.core.mesh import init_parallel
from distributed import run_distributed
from family_cases import tiny_kwargs
from parity import GRAD_ATOL, LOGITS_ATOL, batch, causal_lm_parity, hf_causal_lm

BASE = tiny_kwargs("gpt2")  # the declared config: tests/test_family_table.py runs it on one process and pp2 x tp2
OPTIONS = {
    "inverse_layer_idx": dict(scale_attn_by_inverse_layer_idx=True),
    "untied_relu_inner": dict(tie_word_embeddings=False, activation_function="relu", n_inner=96),
    "unscaled": dict(scale_attn_weights=False),
}


@pytest.mark.parametrize("option", sorted(OPTIONS))
def test_gpt2_single_process(option):
    causal_lm_parity("gpt2", {**BASE, **OPTIONS[option]}, tp=1)


@pytest.mark.parametrize("tp,sp", [(2, False), (2, True), (4, False), (4, True)])
def test_gpt2_tensor_parallel(tp, sp):
    # vocab 101 is divisible by neither 2 nor 4: the padding path is always exercised
    run_distributed(causal_lm_parity, tp, model_type="gpt2", config_kwargs=BASE, tp=tp, sequence_parallel=sp)


@pytest.mark.parametrize("option", ["inverse_layer_idx", "untied_relu_inner"])
def test_gpt2_options_tp2(option):
    run_distributed(causal_lm_parity, 2, model_type="gpt2", config_kwargs={**BASE, **OPTIONS[option]}, tp=2,
                    sequence_parallel=True)


def test_gpt2_unpadded_batch_tp2():
    run_distributed(causal_lm_parity, 2, model_type="gpt2", config_kwargs=BASE, tp=2, sequence_parallel=False,
                    padded=False)


UPCAST = {**BASE, "reorder_and_upcast_attn": True, "scale_attn_by_inverse_layer_idx": True}


def test_gpt2_upcast_fp32_gradients_vs_eager():
    # transformers honours reorder_and_upcast_attn only in its eager attention
    causal_lm_parity("gpt2", UPCAST, tp=1, attn_implementation="eager")


def test_gpt2_upcast_tp2_sequence_parallel():
    run_distributed(causal_lm_parity, 2, model_type="gpt2", config_kwargs=UPCAST, tp=2, sequence_parallel=True,
                    padded=True, seq_len=12, logits_atol=LOGITS_ATOL, grad_atol=GRAD_ATOL, attn_implementation="eager")


def test_gpt2_upcast_bf16_matches_eager_and_differs_without_it():
    """In fp32 the option changes nothing; in bf16 it keeps the scores and softmax in fp32. Large weights give
    large scores, where rounding them to bf16 visibly moves the logits, so the check can tell the option apart."""
    options = {**UPCAST, "initializer_range": 0.3}
    parallel = init_parallel(tp=1)
    config, hf_on = hf_causal_lm("gpt2", options, attn_implementation="eager")
    _, hf_off = hf_causal_lm("gpt2", {**options, "reorder_and_upcast_attn": False}, attn_implementation="eager")
    hf_on, hf_off = hf_on.to(torch.bfloat16), hf_off.to(torch.bfloat16)
    model = build_model(config, parallel=parallel, device="meta", dtype=torch.bfloat16)
    load_hf_weights(model, StateDictReader(hf_on.state_dict()), device="cpu")
    model.eval()
    ids, mask, labels = batch(config.vocab_size, 12)
    keep = mask.bool()
    with torch.no_grad():
        ours = model(ids, attention_mask=mask, labels=labels, return_logits=True)
        ref_on = hf_on(ids, attention_mask=mask, labels=labels)
        ref_off = hf_off(ids, attention_mask=mask, labels=labels)
    assert ours.logits.dtype == torch.bfloat16
    unit_roundoff = torch.finfo(torch.bfloat16).eps / 2
    atol = unit_roundoff * ref_on.logits[keep].abs().max().item()  # one bf16 rounding of the largest logit

    def logits_diff(ref):
        return (ours.logits.float() - ref.logits.float())[keep].abs().max().item()

    assert logits_diff(ref_on) <= atol, f"logits differ by {logits_diff(ref_on)} (atol {atol})"
    assert abs(ours.loss.item() - ref_on.loss.item()) <= unit_roundoff * ref_on.loss.item()
    assert logits_diff(ref_off) > atol, "the test cannot tell reorder_and_upcast_attn on from off"


@pytest.mark.parametrize("option,message", [
    (dict(add_cross_attention=True), "cross-attention is not supported"),
    (dict(activation_function="no_such_activation"), "unsupported activation 'no_such_activation'"),
])
def test_gpt2_refuses_unsupported_options(option, message):
    config = transformers.GPT2Config(**BASE, **option)
    with pytest.raises(UnsupportedConfig if "add_cross_attention" in option else ValueError, match=message):
        build_model(config, parallel=init_parallel(tp=1), device="meta")


def test_upcast_attention_never_takes_the_triton_kernel(monkeypatch):
    """The Triton flash kernel has no upcast mode: with the option on, attention stays on the torch path."""
    import sys

    from colozoo.layers import attention

    module = sys.modules["colozoo.kernels.attention"]
    q, k, v = torch.randn(3, 2, 4, 6, 16, dtype=torch.bfloat16).unbind(0)
    expected = attention(q, k, v, causal=True, upcast=True)
    monkeypatch.setattr(module, "use_triton", lambda *tensors: True)  # as on a GPU with triton

    def no_kernel(*args, **kwargs):
        raise AssertionError("the Triton kernel ran for upcast attention")

    monkeypatch.setattr("colozoo.kernels.attention_triton.flash_attention_triton", no_kernel, raising=False)
    assert torch.equal(attention(q, k, v, causal=True, upcast=True), expected)
