import pytest

from distributed import run_distributed
from parity import causal_lm_parity

BASE = dict(vocab_size=101, n_positions=32, n_embd=64, n_layer=2, n_head=4,
            resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
OPTIONS = {
    "default": {},
    "inverse_layer_idx": dict(scale_attn_by_inverse_layer_idx=True),
    "upcast": dict(reorder_and_upcast_attn=True),
    "untied_relu_inner": dict(tie_word_embeddings=False, activation_function="relu", n_inner=96),
    "unscaled": dict(scale_attn_weights=False),
}


@pytest.mark.parametrize("option", sorted(OPTIONS))
def test_gpt2_single_process(option):
    causal_lm_parity("gpt2", {**BASE, **OPTIONS[option]}, tp=1)


@pytest.mark.parametrize("tp,sp", [(2, False), (2, True), (4, False), (4, True)])
def test_gpt2_tensor_parallel(tp, sp):
    # vocab 101 is divisible by neither 2 nor 4: the padding path is always exercised
    run_distributed(causal_lm_parity, tp, "gpt2", BASE, tp, sp)


@pytest.mark.parametrize("option", ["inverse_layer_idx", "untied_relu_inner"])
def test_gpt2_options_tp2(option):
    run_distributed(causal_lm_parity, 2, "gpt2", {**BASE, **OPTIONS[option]}, 2, True)


def test_gpt2_unpadded_batch_tp2():
    run_distributed(causal_lm_parity, 2, "gpt2", BASE, 2, False, False)
