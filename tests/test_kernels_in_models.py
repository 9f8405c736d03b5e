"""The layers on the Triton kernels, end to end: GPT-2, LLaMA, Gemma 2 and Mixtral on the forced Triton path still
match transformers to 1e-5 (with call counts proving each kernel ran), on one process and on two tensor-parallel ranks,
through the logits and through the LM head fused into the loss; 'auto' takes the kernels only when asked. Without a
GPU the kernels run on triton's CPU interpreter (tests/test_kernels.py explains how it is set up)."""
from __future__ import annotations

import collections
import inspect
import os
import tempfile

import pytest
import torch

CUDA = torch.cuda.is_available()
if not CUDA:
    os.environ["TRITON_INTERPRET"] = "1"
triton = pytest.importorskip("triton")

from distributed import run_distributed  # noqa: E402
from parity import causal_lm_parity, close  # noqa: E402
from test_kernels import DEVICE, assert_close, kernel_module, randn  # noqa: E402

from colozoo.kernels import dispatch  # noqa: E402

GPT2 = dict(vocab_size=101, n_positions=32, n_embd=64, n_layer=2, n_head=4, resid_pdrop=0.0, embd_pdrop=0.0,
            attn_pdrop=0.0)


KERNEL_MODULES = ("norms_triton", "attention_triton", "rope_triton", "activations_triton", "cross_entropy_triton",
                  "moe_triton")
LLAMA = dict(vocab_size=101, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=32, pad_token_id=0)
QWEN2 = dict(LLAMA, pad_token_id=None)  # its qkv projection has a bias
MIXTRAL = dict(vocab_size=101, hidden_size=64, intermediate_size=32, num_hidden_layers=1, num_attention_heads=4,
               num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2, max_position_embeddings=32,
               output_router_logits=True, router_aux_loss_coef=0.05)


def _parity_on_kernels(mode, *args):
    for name in KERNEL_MODULES:
        kernel_module(name)
    with dispatch.use_kernels(mode):
        return causal_lm_parity(*args)


CPU_PARITY = pytest.mark.skipif(CUDA, reason="the HF parity harness runs on CPU, where this machine compiles "
                                              "kernels for CUDA instead of interpreting them")


@CPU_PARITY
def test_gpt2_on_triton_path_matches_transformers():
    """LayerNorm, flash attention (padded, causal), GeLU and the loss all on Triton; still 1e-5 from HF."""
    _parity_on_kernels("triton", "gpt2", GPT2)


@CPU_PARITY
def test_gpt2_on_triton_path_tp2_sequence_parallel():
    run_distributed(_parity_on_kernels, 2, "triton", "gpt2", GPT2, 2, True, timeout=150)


def test_layers_take_the_triton_path(monkeypatch):
    """The dispatch really reaches the kernels (a test that would pass on the torch path alone proves nothing)."""
    from colozoo.layers import LayerNorm, RMSNorm, attention, vocab_parallel_cross_entropy
    from colozoo.layers.activations import get_activation, swiglu

    calls = []
    for module, names in (("norms_triton", ["layer_norm_triton", "rms_norm_triton"]),
                          ("attention_triton", ["flash_attention_triton"]),
                          ("activations_triton", ["bias_gelu_triton", "swiglu_triton"]),
                          ("cross_entropy_triton", ["cross_entropy_triton"])):
        mod = kernel_module(module)
        for name in names:
            original = getattr(mod, name)
            monkeypatch.setattr(mod, name, lambda *a, _f=original, _n=name, **k: calls.append(_n) or _f(*a, **k))
    x = randn(2, 5, 16).to(DEVICE)
    q = randn(1, 2, 5, 16).to(DEVICE)
    with dispatch.use_kernels("triton"):
        LayerNorm(16, device=DEVICE)(x), RMSNorm(16, device=DEVICE)(x, x)
        attention(q, q, q, causal=True)
        get_activation("gelu")(x), swiglu(x, x)
        vocab_parallel_cross_entropy(x, torch.zeros(2, 5, dtype=torch.long, device=DEVICE), 16)
    assert sorted(calls) == sorted(["layer_norm_triton", "rms_norm_triton", "flash_attention_triton",
                                    "bias_gelu_triton", "swiglu_triton", "cross_entropy_triton"])
    calls.clear()
    with dispatch.use_kernels("torch"):
        LayerNorm(16, device=DEVICE)(x), attention(q, q, q, causal=True), get_activation("gelu")(x)
    assert calls == []


def count_kernel_calls(monkeypatch) -> collections.Counter:
    """Counts every call of a `*_triton` entry point of the kernel modules (patched, still computing)."""
    calls = collections.Counter()
    for module in KERNEL_MODULES:
        mod = kernel_module(module)
        for name in [n for n in vars(mod) if n.endswith("_triton") and callable(getattr(mod, n))]:
            original = getattr(mod, name)
            monkeypatch.setattr(mod, name, lambda *a, _f=original, _n=name, **k: calls.update([_n]) or _f(*a, **k))
    return calls


def count_fused_norm_calls(monkeypatch) -> collections.Counter:
    """Counts the norm kernels' calls that were handed a residual, i.e. that fused the residual add (patched, still
    computing)."""
    kernels = kernel_module("norms_triton")
    calls = collections.Counter()
    for name in ("layer_norm_triton", "rms_norm_triton", "rms_norm_linear_triton"):
        original = getattr(kernels, name)

        def counted(*args, _f=original, _n=name, _signature=inspect.signature(original), **kwargs):
            if _signature.bind(*args, **kwargs).arguments.get("residual") is not None:
                calls[_n] += 1
            return _f(*args, **kwargs)

        monkeypatch.setattr(kernels, name, counted)
    return calls


OPT_POST_LN = dict(vocab_size=101, hidden_size=64, num_hidden_layers=2, ffn_dim=96, num_attention_heads=4,
                   max_position_embeddings=32, dropout=0.0, attention_dropout=0.0, pad_token_id=1,
                   do_layer_norm_before=False)


@CPU_PARITY
@pytest.mark.parametrize("family,config,kernel,fused_calls", [
    ("gpt2", GPT2, "layer_norm_triton", 2),         # ln_2 of each of 2 layers
    ("llama", LLAMA, "rms_norm_linear_triton", 2),  # post_attention_layernorm of each layer, with gate_up
    ("opt", OPT_POST_LN, "layer_norm_triton", 4),   # post-LN: both norms of each layer take their residual sums
])
def test_models_fuse_the_residual_add_into_the_norm_kernel(monkeypatch, family, config, kernel, fused_calls):
    """The model's residual adds run inside the norm kernel, and logits, loss and every gradient still match HF."""
    calls = count_fused_norm_calls(monkeypatch)
    _parity_on_kernels("triton", family, config)
    assert calls == {kernel: fused_calls}, calls


@CPU_PARITY
def test_bert_fuses_the_residual_add_into_the_norm_kernel(monkeypatch):
    """Post-LN BERT: both norms of every layer and the embeddings' LayerNorm take their sums fused; still HF's
    hidden states, masked-LM logits, loss and gradients."""
    from test_bert import bert_parity

    calls = count_fused_norm_calls(monkeypatch)
    for name in KERNEL_MODULES:
        kernel_module(name)
    with dispatch.use_kernels("triton"):
        bert_parity("BertForMaskedLM")
    assert calls == {"layer_norm_triton": 2 * 2 + 1}, calls


def _fused_loss_parity(model_type, config_kwargs, tp=1, sequence_parallel=False):
    """A training step on Triton (labels, no logits: the LM head fused into the loss) matches HF's loss (with the
    aux loss, for MoE) and every (gathered) gradient. Loaded from save_pretrained, the layout converters read."""
    from parity import batch, hf_causal_lm

    from colozoo.checkpoint.load import load_hf_weights
    from colozoo.checkpoint.safetensors_io import SafetensorsReader
    from colozoo.checkpoint.readers import GlobalTensor, StateDictReader
    from colozoo.converters import family_module
    from colozoo.layers.shard import gather_tensor, spec_of
    from colozoo.api import build_model
    from colozoo.core.mesh import coords_of, init_parallel

    parallel = init_parallel(tp=tp, sequence_parallel=sequence_parallel)

    config, hf = hf_causal_lm(model_type, config_kwargs)
    ids, mask, labels = batch(config.vocab_size, 12)
    ref = hf(ids, attention_mask=mask, labels=labels)
    ref.loss.backward()
    model = build_model(config, parallel=parallel, device="meta")
    converter = family_module(model_type)
    if hasattr(converter, "module_sources"):  # transformers fuses experts in memory, not in its files
        with tempfile.TemporaryDirectory() as directory:
            hf.save_pretrained(directory)
            load_hf_weights(model, SafetensorsReader(directory), device="cpu")
    else:
        load_hf_weights(model, StateDictReader(hf.state_dict()), device="cpu")
    with dispatch.use_kernels("triton"):  # training's path (no logits asked for), without dropout
        out = model.eval()(ids, attention_mask=mask, labels=labels, return_logits=False)
        out.loss.backward()
    assert out.logits is None
    close(out.loss, ref.loss, 1e-5, "loss")
    sources = getattr(converter, "module_sources", converter.hf_sources)(config)  # names of HF's in-memory grads
    hf_grads = StateDictReader({n: p.grad for n, p in hf.named_parameters()})
    for name, p in model.named_parameters():
        expected = GlobalTensor(hf_grads, sources[name], name).read()
        full = gather_tensor(p.grad, spec_of(p), expected.shape, parallel.groups, coords_of(parallel))
        assert_close(full, expected, torch.float32, f"grad of {name}")
    return True


@CPU_PARITY
def test_llama_on_triton_path_matches_transformers(monkeypatch):
    """RMSNorm, rotary, flash attention (GQA, padded), SwiGLU, cross entropy on Triton: logits, loss and
    gradients within 1e-5 of HF; then a training step through the fused LM-head loss, also against HF."""
    calls = count_kernel_calls(monkeypatch)
    _parity_on_kernels("triton", "llama", LLAMA)
    assert {"rms_norm_triton", "rms_norm_linear_triton", "rotate_qk_in_place_triton", "flash_attention_triton",
            "swiglu_linear_triton", "cross_entropy_triton"} <= set(calls), calls
    layers = LLAMA["num_hidden_layers"]
    assert calls["rms_norm_linear_triton"] == 2 * layers and calls["rms_norm_triton"] == 1, calls  # the final norm
    assert calls["rotate_qk_in_place_triton"] == layers and "apply_rotary_triton" not in calls, calls
    assert "linear_cross_entropy_triton" not in calls  # logits were requested: no fused head
    calls.clear()
    _fused_loss_parity("llama", LLAMA)
    assert calls["linear_cross_entropy_triton"] == 1 and "cross_entropy_triton" not in calls, calls


@CPU_PARITY
def test_qwen2_biased_qkv_on_triton_path_matches_transformers(monkeypatch):
    """A qkv projection with a bias (Qwen2, gpt-oss) fused with its norm: the rotary turns q and k in place in the
    fused function's output, which must be a tensor of its own (F.linear with a bias returns a view of its 2-D
    product, and autograd refuses to change a custom function's view output in place): logits, loss and gradients
    of transformers' Qwen2."""
    calls = count_kernel_calls(monkeypatch)
    _parity_on_kernels("triton", "qwen2", QWEN2)
    layers = QWEN2["num_hidden_layers"]
    assert calls["rms_norm_linear_triton"] == 2 * layers and calls["rotate_qk_in_place_triton"] == layers, calls


@CPU_PARITY
def test_gemma2_on_triton_path_matches_transformers(monkeypatch):
    """(1 + weight) RMSNorm with an fp32 weight and the residual fused, soft-capped flash attention over sliding and
    full layers, GeGLU: logits, loss and gradients of transformers' eager Gemma 2 (an unpadded batch: the kernel
    and eager attention fill rows that see no key differently)."""
    from test_gemma import GEMMA2

    fused = count_fused_norm_calls(monkeypatch)  # first: it reads the kernel's own signature
    calls = count_kernel_calls(monkeypatch)
    _parity_on_kernels("triton", "gemma2", GEMMA2, 1, False, False, 12, 1e-5, 1e-5, "eager")
    layers = GEMMA2["num_hidden_layers"]
    assert calls["flash_attention_triton"] == layers and calls["bias_gelu_triton"] == layers, calls
    assert fused == {"rms_norm_linear_triton": layers}, fused  # pre_feedforward_layernorm takes the residual sum


@CPU_PARITY
def test_llama_fused_loss_tp2_sequence_parallel():
    """The fused LM-head loss keeps its vocab slices and sequence-parallel gather over two ranks."""
    assert run_distributed(_fused_loss_parity, 2, model_type="llama", config_kwargs=LLAMA, tp=2,
                           sequence_parallel=True, timeout=150) == [True, True]


@CPU_PARITY
def test_qwen2_biased_qkv_tp2_sequence_parallel_on_triton_path():
    """The column-parallel qkv projection with a bias on two ranks: its function's output is a tensor of its own too,
    which the rotary turns in place (a view there failed the first training step at tp > 1)."""
    assert run_distributed(_fused_loss_parity, 2, model_type="qwen2", config_kwargs=QWEN2, tp=2,
                           sequence_parallel=True, timeout=150) == [True, True]


@CPU_PARITY
def test_mixtral_on_triton_path_matches_transformers(monkeypatch):
    """The MoE layer on Triton too: permute/unpermute around SwiGLU experts, router weights' gradients included."""
    calls = count_kernel_calls(monkeypatch)
    _fused_loss_parity("mixtral", MIXTRAL)
    assert calls["moe_permute_triton"] == calls["moe_unpermute_triton"] == MIXTRAL["num_hidden_layers"], calls
    assert calls["swiglu_triton"] >= MIXTRAL["num_hidden_layers"] and calls["linear_cross_entropy_triton"] == 1


def _moe_layer_on_triton(tp, ep, sequence_parallel):
    from test_moe import moe_matches_qwen

    for name in KERNEL_MODULES:
        kernel_module(name)
    with dispatch.use_kernels("triton"):
        return moe_matches_qwen(tp, ep, sequence_parallel)


@CPU_PARITY
def test_moe_layer_on_triton_path_ep2():
    """Permute/unpermute kernels around the experts' all-to-all: still Qwen2-MoE's block to 1e-5."""
    run_distributed(_moe_layer_on_triton, 2, tp=1, ep=2, sequence_parallel=False, timeout=150)


def test_gelu_linear_fuses_its_bias(monkeypatch):
    """A column-parallel linear with a GeLU (the GPT-2/OPT/BERT/ViT MLPs) hands its bias to the bias-GeLU kernel
    on the Triton path; outputs and gradients agree with torch's path."""
    from colozoo.layers import ColumnParallelLinear

    act = kernel_module("activations_triton")
    biases, original = [], act.bias_gelu_triton
    monkeypatch.setattr(act, "bias_gelu_triton",
                        lambda x, bias=None, approximate="none": biases.append(bias) or original(x, bias, approximate))
    torch.manual_seed(0)
    fc = ColumnParallelLinear(16, 24, activation="gelu_new", device=DEVICE)
    x = randn(2, 5, 16).to(DEVICE).requires_grad_()
    results = {}
    for mode in ("triton", "torch"):
        with dispatch.use_kernels(mode):
            y = fc(x)
        results[mode] = (y, *torch.autograd.grad(y, (x, fc.weight, fc.bias), torch.ones_like(y)))
    assert len(biases) == 1 and biases[0] is fc.bias
    for what, fused, plain in zip(("output", "input grad", "weight grad", "bias grad"), *results.values()):
        assert_close(fused, plain, torch.float32, f"bias-gelu linear {what}")


def test_models_take_the_triton_path_only_when_asked(monkeypatch):
    """Every newly wired hot path reaches its kernel with triton forced, and none does with torch forced."""
    from transformers import AutoConfig

    from colozoo.api import build_model

    calls = count_kernel_calls(monkeypatch)
    tiny = dict(num_hidden_layers=1, hidden_size=32, intermediate_size=32, num_attention_heads=2, vocab_size=50)
    ids = torch.randint(0, 50, (1, 4), device=DEVICE)
    for model_type, extra in (("llama", dict(num_key_value_heads=1)),
                              ("mixtral", dict(num_key_value_heads=1, num_local_experts=2, num_experts_per_tok=1))):
        torch.manual_seed(0)
        model = build_model(AutoConfig.for_model(model_type, **tiny, **extra), device=DEVICE)
        with dispatch.use_kernels("torch"):
            expected = model(ids, labels=ids).loss
            model(ids, labels=ids).loss.backward()
        assert not calls, calls
        with dispatch.use_kernels("triton"):
            loss = model(ids, labels=ids).loss
            loss.backward()
        assert_close(loss, expected, torch.float32, f"{model_type} loss")
        wired = {"rotate_qk_in_place_triton", "rms_norm_linear_triton", "linear_cross_entropy_triton"}
        if model_type == "mixtral":  # the experts' SwiGLU, unfused
            wired |= {"moe_permute_triton", "moe_unpermute_triton", "swiglu_triton"}
        else:
            wired |= {"swiglu_linear_triton"}
        assert wired <= set(calls), (model_type, calls)
        calls.clear()


@CPU_PARITY
def test_auto_caps_gemma2_scores_in_the_flash_kernel_unless_padded(monkeypatch):
    """'auto' on CUDA (pretended: the attention op's use_triton answers what 'auto' asks) runs Gemma 2's capped
    attention in the flash kernel on its full and its sliding-window layers for an unpadded batch (torch's path keeps
    each layer's scores whole: a 1 x 16384-token step ran out of an H200's memory), with the torch path's numbers; a
    padded batch keeps it on torch, whose rows that see no key are transformers' eager ones."""
    import colozoo
    from parity import hf_causal_lm
    from test_gemma import GEMMA2

    from colozoo.kernels import attention as attention_op

    config, _ = hf_causal_lm("gemma2", GEMMA2, attn_implementation="eager")
    model = colozoo.build_model(config).eval()
    ids = torch.randint(3, config.vocab_size, (2, 12))
    padding = torch.ones_like(ids)
    padding[0, :3] = 0
    with torch.no_grad(), dispatch.use_kernels("torch"):
        expected = model(ids).logits
    calls = count_kernel_calls(monkeypatch)
    monkeypatch.setattr(attention_op, "use_triton", lambda *tensors, auto=True, elementwise=False: auto)
    with torch.no_grad():
        got = model(ids).logits
        assert calls["flash_attention_triton"] == config.num_hidden_layers > 1, calls
        assert config.sliding_window < ids.shape[1] and "sliding_attention" in config.layer_types
        close(got, expected, 1e-5, "the flash kernel's capped scores against the torch path's")
        calls.clear()
        model(ids, attention_mask=padding)
    assert "flash_attention_triton" not in calls, calls
