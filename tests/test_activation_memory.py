"""What one decoder layer keeps for its backward, counted: the bytes of every distinct storage autograd saves (views
of one storage once, parameters and the batch's rotary angles, which every layer shares, not at all), recorded with
saved-tensor hooks, against budgets written as formulas of the layer's widths. And the fused functions that make the
CUDA path keep less, each against its torch composition.

The CUDA path is the Triton kernels (here on triton's CPU interpreter, in fp32); the torch path is the CPU's. The
figure Liger-Kernel's patched transformers keeps is derived from its source in `liger_bytes_per_token` (nothing of
Liger runs here): the README's "Activation memory" section states all three at the Llama-3.2-1B shape.
"""
from __future__ import annotations

import os

import pytest
import torch

CUDA = torch.cuda.is_available()
if not CUDA:
    os.environ["TRITON_INTERPRET"] = "1"
triton = pytest.importorskip("triton")

from test_kernels import DEVICE, DTYPES, check, kernel_module, randn  # noqa: E402

from colozoo.kernels import activations, dispatch, norms, rope  # noqa: E402

# Llama-3.2-1B: hidden 2048, 32 heads / 8 kv heads of 64, intermediate 8192
LLAMA_1B = dict(hidden=2048, heads=32, kv_heads=8, head_dim=64, inner=8192)
TINY = dict(hidden=64, heads=4, kv_heads=2, head_dim=8, inner=96)  # q = heads x head_dim is not hidden here
FP32_STATISTIC = 4  # bytes of one fp32 number (norm statistics, attention log-sum-exp), whatever the dtype


def colozoo_bytes_per_token(hidden, heads, kv_heads, head_dim, inner, element):
    """The CUDA path, by design: the layer input x and the residual sum h (2 hidden; each norm keeps the rows it
    normalised, its projection normalises them again), the qkv projection with q and k rotated in place (q + 2 kv: the
    attention keeps q, k, v as views of it), the attention output (q: o_proj keeps the same storage), gate | up
    (2 inner: down_proj computes the product again); in fp32 the two norms' rstd and the attention's log-sum-exp
    per head."""
    q, kv = heads * head_dim, kv_heads * head_dim
    return element * (2 * hidden + 2 * q + 2 * kv + 2 * inner) + FP32_STATISTIC * (2 + heads)


def liger_bytes_per_token(hidden, heads, kv_heads, head_dim, inner, element):
    """transformers' LlamaDecoderLayer (SDPA, flash kernel, grouped-query: no repeated k/v) patched by Liger-Kernel
    (rms_norm, rope, swiglu), from Liger's source: LigerRMSNormFunction saves X and the fp32 RSTD (x and the sum h: 2
    hidden, 2 rstd); q_proj/k_proj/v_proj and gate_proj/up_proj save their inputs, the two norms' outputs (2 hidden);
    LigerRopeFunction rotates q and k in place and saves cos/sin only; SDPA saves q, k, v, its output (which o_proj
    saves too) and the log-sum-exp (2 q + 2 kv, heads fp32); LigerSiLUMulFunction saves gate and up and down_proj
    saves their product (3 inner)."""
    q, kv = heads * head_dim, kv_heads * head_dim
    return element * (4 * hidden + 2 * q + 2 * kv + 3 * inner) + FP32_STATISTIC * (2 + heads)


def torch_path_bytes_per_token(hidden, heads, kv_heads, head_dim, inner, element):
    """The torch (CPU) path in fp32, as counted: each RMSNorm keeps its input, its rstd, x / rms (for the weight's
    gradient) and its output (the projection's input: 3 hidden); rotary keeps nothing but the angles; training SDPA
    keeps q, the repeated k and v and its output (4 q: o_proj shares the output) and the log-sum-exp; SwiGLU keeps
    gate | up and silu(gate), down_proj the product (4 inner)."""
    q = heads * head_dim
    return element * (6 * hidden + 4 * q + 4 * inner) + FP32_STATISTIC * (2 + heads)


def kept_bytes(mode: str, device=DEVICE, batch: int = 2, seq: int = 8) -> int:
    """Bytes one LLaMA decoder layer of TINY widths (fp32) keeps for backward on the `mode` kernels."""
    import transformers

    from colozoo.api import build_model

    config = transformers.LlamaConfig(vocab_size=101, hidden_size=TINY["hidden"], intermediate_size=TINY["inner"],
                                      num_hidden_layers=1, num_attention_heads=TINY["heads"],
                                      num_key_value_heads=TINY["kv_heads"], head_dim=TINY["head_dim"],
                                      max_position_embeddings=64)
    torch.manual_seed(0)
    model = build_model(config, device=device, dtype=torch.float32)
    ids = torch.randint(0, config.vocab_size, (batch, seq), device=device)
    batch_context = model.batch_context(ids)
    shared = {t.untyped_storage().data_ptr() for t in (*model.parameters(), *batch_context.rope())}
    kept = {}

    def pack(t):
        storage = t.untyped_storage()
        if storage.data_ptr() not in shared:
            kept[storage.data_ptr()] = storage.nbytes()
        return t

    x = torch.randn(batch, seq, TINY["hidden"], device=device, requires_grad=True)
    with dispatch.use_kernels(mode), torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = model.layers["0"](x, batch_context)
    with dispatch.use_kernels(mode):
        out.sum().backward()  # what was kept sufficed
    return sum(kept.values())


def test_cuda_path_keeps_its_budget():
    """The Triton path's layer keeps exactly what the design's formula says (measured here, at a tiny shape), and the
    formula at the 1B shape is at most 0.9x Liger's (Liger's by its autograd functions' saved tensors: counted, not
    measured on a GPU)."""
    tokens, element = 2 * 8, 4
    budget = tokens * colozoo_bytes_per_token(**TINY, element=element)
    kept = kept_bytes("triton")
    assert kept == budget, f"the Triton path keeps {kept / tokens:.0f} bytes a token, its formula {budget / tokens:.0f}"
    ours, liger = (f(**LLAMA_1B, element=2) for f in (colozoo_bytes_per_token, liger_bytes_per_token))
    assert ours <= 0.9 * liger, (ours, liger)


def test_torch_path_count():
    """The CPU's torch path keeps more (no fused norm or SwiGLU, repeated k/v): its figure, counted, as the README
    says (on CUDA, SDPA's kernels keep other statistics)."""
    tokens = 2 * 8
    assert kept_bytes("torch", "cpu") == tokens * torch_path_bytes_per_token(**TINY, element=4)


# ----------------------------------------------------------------------------------- the fused functions


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("case", ["plain", "residual_bias", "offset"])
def test_rms_norm_linear(case, dtype):
    """linear(rms_norm(x [+ residual])) as one function: output, sum and every gradient as the composition's."""
    kernels = kernel_module("norms_triton")
    n, out = 37, 10
    x, r = randn(3, 5, n, seed=1), randn(3, 5, n, seed=2)
    norm_w, w, b = 1 + randn(n, seed=3, scale=0.2), randn(out, n, seed=4, scale=0.3), randn(out, seed=5)
    offset = case == "offset"
    if case == "residual_bias":
        kernel = lambda x, nw, w, b, r: kernels.rms_norm_linear_triton(x, nw, 1e-6, w, b, r)  # noqa: E731
        tensors = [x, norm_w, w, b, r]
    else:
        kernel = lambda x, nw, w: kernels.rms_norm_linear_triton(x, 1 + nw if offset else nw, 1e-6, w)  # noqa: E731
        tensors = [x, norm_w - 1 if offset else norm_w, w]

    def reference(x, nw, w, b=None, r=None):
        normed = norms.rms_norm_reference(x, nw, 1e-6, r, offset=offset)
        return (torch.nn.functional.linear(normed[0], w, b), normed[1]) if r is not None else \
            torch.nn.functional.linear(normed, w, b)

    check(kernel, reference, dtype, tensors, f"rms_norm_linear {case}")


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rotary_dim", [16, 10], ids=["full", "partial"])
def test_rotary_qkv_in_place(rotary_dim, dtype):
    """q and k rotated inside the fused projection: the views and the projection's gradient as rotating copies."""
    heads, kv_heads, head_dim = 4, 2, 16
    angles = randn(2, 5, rotary_dim // 2, seed=7)
    cos, sin = (torch.cat((t, t), -1).to(DEVICE) for t in (angles.cos(), angles.sin()))
    qkv = randn(2, 5, (heads + 2 * kv_heads) * head_dim, seed=8)

    def rotated(qkv, in_place):
        with dispatch.use_kernels("triton" if in_place else "torch"):
            return rope.rotary_qkv(qkv * 1, cos, sin, heads, kv_heads, head_dim)  # * 1: not a leaf

    kernel_module("rope_triton")
    check(lambda t: rotated(t, True), lambda t: rotated(t, False), dtype, [qkv], "rotary qkv")
    q, k, v = rotated(qkv.to(DEVICE), True)
    assert q.untyped_storage().data_ptr() == k.untyped_storage().data_ptr() == v.untyped_storage().data_ptr()


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("bias", [False, True], ids=["no_bias", "bias"])
def test_swiglu_linear(bias, dtype):
    """linear(silu(gate) * up) of one gate | up tensor as one function, and SwiGLU reading the halves in place."""
    act = kernel_module("activations_triton")
    act_block, act.BLOCK = act.BLOCK, 64  # several programs and a masked tail on a tiny tensor
    tensors = [randn(3, 5, 2 * 23, seed=1, scale=3), randn(7, 23, seed=2, scale=0.3)] + ([randn(7, seed=3)] * bias)
    try:
        check(act.swiglu_linear_triton, lambda gu, w, b=None: torch.nn.functional.linear(
            activations.swiglu_reference(*gu.chunk(2, -1)), w, b), dtype, tensors, "swiglu_linear")
        check(lambda gu: act.swiglu_triton(*gu.chunk(2, -1)),
              lambda gu: activations.swiglu_reference(*gu.chunk(2, -1)), dtype, tensors[:1], "swiglu of halves")
    finally:
        act.BLOCK = act_block


def test_a_hooked_norm_runs_on_its_own():
    """A forward hook on a norm sees the normed tensor, as always: the norm then does not fuse with its projection."""
    from colozoo.layers import GatedMLP, RMSNorm

    norm, mlp = RMSNorm(16, device=DEVICE), GatedMLP(16, 24, device=DEVICE)
    x = randn(2, 3, 16).to(DEVICE).requires_grad_()
    seen = []
    kernel_module("norms_triton")
    with dispatch.use_kernels("triton"):
        plain = mlp(x, norm=norm)
        handle = norm.register_forward_hook(lambda module, args, out: seen.append(out))
        hooked = mlp(x, norm=norm)
        handle.remove()
    assert len(seen) == 1 and seen[0].shape == x.shape
    torch.testing.assert_close(hooked, plain)
