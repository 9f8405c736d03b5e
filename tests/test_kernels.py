"""Every Triton kernel against its op's torch reference (flash attention: against an fp32 oracle here), forward and
backward, on small odd shapes.

Without a GPU the kernels run on triton's CPU interpreter in fp32 and fp16 (it computes bf16 wrongly, so bf16
runs only on CUDA). triton decides whether to interpret when a kernel is decorated, i.e. when its module
(colozoo.kernels.<op>_triton) is imported, so TRITON_INTERPRET is set here before any kernel module loads, and
`kernel_module` reloads a module that something imported earlier in the other mode. References are evaluated in
fp32 on the same (rounded) inputs. The layers are checked end to end too: GPT-2, LLaMA and Mixtral on the forced
Triton path still match transformers to 1e-5 (with call counts proving each kernel ran), on one process and on two
tensor-parallel ranks, through the logits and through the LM head fused into the loss.
"""
from __future__ import annotations

import collections
import importlib
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

from colozoo.kernels import activations, dispatch, moe, norms, rope  # noqa: E402
from colozoo.kernels.cross_entropy import vocab_parallel_cross_entropy_reference  # noqa: E402


def torch_cross_entropy(logits_local, target, vocab_size, group=None, label_smoothing=0.0):
    """The torch path of the vocab-parallel loss, the cross-entropy kernels' reference."""
    return vocab_parallel_cross_entropy_reference(logits_local, target, vocab_size, group,
                                                  label_smoothing=label_smoothing)

DEVICE = "cuda" if CUDA else "cpu"
NEEDS_GPU = pytest.mark.skipif(not CUDA, reason="the triton interpreter computes bf16 wrongly; bf16 needs a GPU")
DTYPES = [torch.float32, torch.float16, pytest.param(torch.bfloat16, marks=NEEDS_GPU)]
TOLERANCE = {torch.float32: 1e-5, torch.float16: 1e-2, torch.bfloat16: 5e-2}


def kernel_module(name: str):
    """Import colozoo.kernels.<name> (an <op>_triton module) with its kernels decorated for this machine (interpreted
    on CPU)."""
    from triton.runtime.interpreter import InterpretedFunction
    from triton.runtime.jit import KernelInterface

    module = importlib.import_module(f"colozoo.kernels.{name}")
    kernels = [v for v in vars(module).values() if isinstance(v, KernelInterface)]
    assert kernels, f"no triton kernels found in colozoo.kernels.{name}"
    if any(isinstance(k, InterpretedFunction) == CUDA for k in kernels):
        module = importlib.reload(module)
    return module


def leaves(dtype, *tensors):
    """(kernel inputs in `dtype`, the same rounded values in fp32 for the reference), all requiring grad."""
    low = [t.to(DEVICE, dtype).requires_grad_() for t in tensors]
    high = [t.detach().float().requires_grad_() for t in low]
    return low, high


def assert_close(actual, expected, dtype, what):
    tol = TOLERANCE[dtype]
    scale = max(1.0, expected.abs().max().item())
    diff = (actual.float() - expected.float()).abs().max().item() if expected.numel() else 0.0
    assert actual.shape == expected.shape, f"{what}: shape {tuple(actual.shape)} != {tuple(expected.shape)}"
    assert diff <= tol * scale, f"{what}: max difference {diff:.3g} exceeds {tol * scale:.3g} ({dtype})"


def check(kernel_fn, reference_fn, dtype, tensors, what, seed=0, out_dtype=None):
    """Outputs (of `out_dtype`, default `dtype`) and the gradients of every input agree between kernel (inputs
    in dtype) and reference (fp32)."""
    low, high = leaves(dtype, *tensors)
    out, ref = kernel_fn(*low), reference_fn(*high)
    out, ref = (out, ref) if isinstance(out, tuple) else ((out,), (ref,))
    g = torch.Generator().manual_seed(seed)
    grads = [torch.randn(r.shape, generator=g).to(DEVICE) for r in ref]
    for i, (o, r) in enumerate(zip(out, ref)):
        assert o.dtype == (out_dtype or dtype), f"{what}: output {i} has dtype {o.dtype}"
        assert_close(o, r, dtype, f"{what} output {i}")
    got = torch.autograd.grad(out, low, [gr.to(dtype) for gr in grads])
    want = torch.autograd.grad(ref, high, grads)
    for i, (a, b) in enumerate(zip(got, want)):
        assert_close(a, b, dtype, f"{what} grad of input {i}")


def randn(*shape, seed=0, scale=1.0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)) * scale


# ----------------------------------------------------------------------------------------------- dispatch


def test_dispatch_modes(monkeypatch):
    cpu = torch.zeros(1)
    monkeypatch.setenv("COLOZOO_KERNELS", "torch")
    assert dispatch.kernel_mode() == "torch" and not dispatch.use_triton(cpu)
    monkeypatch.setenv("COLOZOO_KERNELS", "auto")
    assert dispatch.use_triton(cpu) is False  # auto never sends CPU tensors to triton
    assert dispatch.use_triton(cpu.to(DEVICE)) is CUDA
    with dispatch.use_kernels("triton"):
        assert dispatch.kernel_mode() == "triton" and dispatch.use_triton(cpu.to(DEVICE))
    assert dispatch.kernel_mode() == "auto"
    monkeypatch.setenv("COLOZOO_KERNELS", "fast")
    with pytest.raises(ValueError, match="COLOZOO_KERNELS"):
        dispatch.kernel_mode()
    with pytest.raises(ValueError, match="set_kernels"):
        dispatch.set_kernels("cuda")


def test_forced_triton_on_cpu_without_interpreter_is_a_clear_error(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)  # triton reads it again at every check
    with dispatch.use_kernels("triton"), pytest.raises(RuntimeError, match="TRITON_INTERPRET"):
        dispatch.use_triton(torch.zeros(1))


# ----------------------------------------------------------------------------------------------- norms


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("residual", [False, True], ids=["plain", "residual"])
@pytest.mark.parametrize("kind", ["layer", "layer_no_affine", "rms"])
def test_norms(kind, residual, dtype):
    kernels = kernel_module("norms_triton")
    n = 37  # not a power of two: a masked tail in every row; 3*7 rows spread unevenly over the programs
    x, r = randn(3, 7, n, seed=1), randn(3, 7, n, seed=2)
    w, b = 1 + randn(n, seed=3, scale=0.2), randn(n, seed=4, scale=0.2)
    if kind == "rms":
        kernel = lambda x, w, *r: kernels.rms_norm_triton(x, w, 1e-6, *r)  # noqa: E731
        reference = lambda x, w, *r: norms.rms_norm_reference(x, w, 1e-6, *r)  # noqa: E731
        tensors = [x, w]
    elif kind == "layer":
        kernel = lambda x, w, b, *r: kernels.layer_norm_triton(x, w, b, 1e-5, *r)  # noqa: E731
        reference = lambda x, w, b, *r: norms.layer_norm_reference(x, w, b, 1e-5, *r)  # noqa: E731
        tensors = [x, w, b]
    else:
        kernel = lambda x, *r: kernels.layer_norm_triton(x, None, None, 1e-5, *r)  # noqa: E731
        reference = lambda x, *r: norms.layer_norm_reference(x, None, None, 1e-5, *r)  # noqa: E731
        tensors = [x]
    check(kernel, reference, dtype, tensors + ([r] if residual else []), f"{kind} norm")


def test_norm_rejects_wrong_weight_shape():
    kernels = kernel_module("norms_triton")
    with pytest.raises(ValueError, match="weight has shape"):
        kernels.layer_norm_triton(torch.zeros(2, 5, device=DEVICE), torch.ones(4, device=DEVICE))


# ----------------------------------------------------------------------------------------------- attention

ATTENTION_CASES = {
    # name: (batch, q heads, kv heads, q len, k len, head dim, causal, padding mask)
    "causal_padded_gqa": (2, 4, 2, 13, 13, 24, True, True),
    "padded_bidirectional": (2, 2, 2, 19, 19, 16, False, True),
    "causal_multiblock_mqa": (1, 3, 1, 80, 80, 40, True, False),
    "cross_lengths": (1, 2, 1, 9, 21, 16, False, False),
    "head_dim_64": (1, 2, 2, 20, 20, 64, True, True),
    "head_dim_128": (1, 2, 1, 11, 11, 128, True, False),
}


def flash_attention_reference(q, k, v, mask=None, *, causal: bool = False, scale: float | None = None,
                              softcap: float | None = None, documents: torch.Tensor | None = None):
    """The flash kernel's oracle: attention in plain torch, in fp32, with zeros for rows that see no key (where the
    torch path of kernels.attention follows transformers instead)."""
    dtype = q.dtype
    group = q.shape[1] // k.shape[1]
    q, k, v = q.float(), k.float(), v.float()
    if group > 1:
        k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    scores = q @ k.transpose(-1, -2) * scale
    if softcap is not None:
        scores = torch.tanh(scores / softcap) * softcap
    keep = torch.ones(scores.shape[-2:], dtype=torch.bool, device=q.device)
    if causal:
        keep = keep.tril()
    if mask is not None:
        keep = keep & mask
    if documents is not None:
        keep = keep & (documents[:, None, :, None] == documents[:, None, None, :])
    scores = scores.masked_fill(~keep, float("-inf"))
    probs = torch.softmax(scores, dim=-1).nan_to_num(0.0)
    return (probs @ v).to(dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("case", sorted(ATTENTION_CASES))
def test_flash_attention(case, dtype):
    fa = kernel_module("attention_triton")
    b, h, hk, sq, sk, d, causal, padded = ATTENTION_CASES[case]
    mask = None
    if padded:  # left padding on the first sequence (its first queries see nothing), right padding on the last
        keep = torch.ones(b, sk, dtype=torch.bool)
        keep[0, :3] = False
        keep[-1, sk - 2:] = False
        mask = keep[:, None, None, :].to(DEVICE)
    tensors = [randn(b, h, sq, d, seed=1), randn(b, hk, sk, d, seed=2), randn(b, hk, sk, d, seed=3)]
    check(lambda q, k, v: fa.flash_attention_triton(q, k, v, mask, causal=causal, scale=0.3),
          lambda q, k, v: flash_attention_reference(q, k, v, mask, causal=causal, scale=0.3),
          dtype, tensors, f"flash attention {case}")


@pytest.mark.parametrize("case,dtype", [("causal_padded_gqa", torch.float32), ("causal_padded_gqa", torch.float16),
                                        ("causal_multiblock_mqa", torch.float32),
                                        ("padded_bidirectional", torch.float32)])
def test_flash_attention_softcap(case, dtype):
    """Gemma 2's capped scores, forward and backward: scores of a few units under a cap of 1 (which the reference
    shows changes the output)."""
    fa = kernel_module("attention_triton")
    b, h, hk, sq, sk, d, causal, padded = ATTENTION_CASES[case]
    mask = None
    if padded:
        keep = torch.ones(b, sk, dtype=torch.bool)
        keep[0, :3] = False
        mask = keep[:, None, None, :].to(DEVICE)
    tensors = [randn(*shape, seed=seed).to(DEVICE) for seed, shape in ((1, (b, h, sq, d)), (2, (b, hk, sk, d)),
                                                                       (3, (b, hk, sk, d)))]
    capped = flash_attention_reference(*tensors, mask, causal=causal, scale=0.3, softcap=1.0)
    assert (capped - flash_attention_reference(*tensors, mask, causal=causal, scale=0.3)).abs().max() > 0.05
    check(lambda q, k, v: fa.flash_attention_triton(q, k, v, mask, causal=causal, scale=0.3, softcap=1.0),
          lambda q, k, v: flash_attention_reference(q, k, v, mask, causal=causal, scale=0.3, softcap=1.0),
          dtype, tensors, f"soft-capped flash attention {case}")


def test_flash_attention_reference_matches_sdpa():
    q, k, v = randn(2, 4, 9, 16, seed=1), randn(2, 2, 9, 16, seed=2), randn(2, 2, 9, 16, seed=3)
    expected = torch.nn.functional.scaled_dot_product_attention(q, k.repeat_interleave(2, 1),
                                                                v.repeat_interleave(2, 1), is_causal=True)
    assert_close(flash_attention_reference(q, k, v, causal=True), expected, torch.float32, "reference")


def test_flash_attention_rejects_bad_heads():
    fa = kernel_module("attention_triton")
    q, k = torch.zeros(1, 4, 5, 16, device=DEVICE), torch.zeros(1, 3, 5, 16, device=DEVICE)
    with pytest.raises(ValueError, match="3 key/value heads do not divide 4 query heads"):
        fa.flash_attention_triton(q, k, k)


# ----------------------------------------------------------------------------------------------- rotary


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("per_batch", [False, True], ids=["shared_angles", "per_batch_angles"])
def test_rotary(per_batch, dtype):
    """The kernel takes one angle per rotated pair, the reference the models' cos/sin (two equal halves)."""
    kernels = kernel_module("rope_triton")
    angles = randn(2, 11, 7, seed=5) if per_batch else randn(11, 7, seed=5)  # rotary dim 14 of head dim 20
    cos, sin = angles.cos().to(DEVICE), angles.sin().to(DEVICE)
    full_cos, full_sin = torch.cat((cos, cos), -1), torch.cat((sin, sin), -1)
    x = randn(2, 11, 3, 20, seed=6).transpose(1, 2)  # a strided (batch, heads, seq, dim) view, as from a qkv split
    check(lambda x: kernels.apply_rotary_triton(x, cos, sin),
          lambda x: rope.apply_rotary_reference(x, full_cos, full_sin), dtype, [x], "rotary")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rotary_reference_is_transformers(dtype):
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    x, angles = randn(2, 3, 5, 8, seed=1).to(dtype), randn(2, 5, 4, seed=2)
    cos, sin = torch.cat([angles.cos()] * 2, -1), torch.cat([angles.sin()] * 2, -1)
    expected, _ = apply_rotary_pos_emb(x, x, cos.to(dtype), sin.to(dtype))  # HF's rotary embedding casts them first
    assert torch.equal(rope.apply_rotary_reference(x, cos, sin), expected)


# ----------------------------------------------------------------------------------------------- activations


@pytest.mark.parametrize("dtype", DTYPES)
def test_swiglu(dtype):
    act = kernel_module("activations_triton")
    act_block, act.BLOCK = act.BLOCK, 64  # several programs and a masked tail on a tiny tensor
    try:
        check(act.swiglu_triton, activations.swiglu_reference, dtype,
              [randn(5, 77, seed=1, scale=3), randn(5, 77, seed=2)], "swiglu")
    finally:
        act.BLOCK = act_block


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("approximate", ["none", "tanh"])
@pytest.mark.parametrize("with_bias", [True, False], ids=["bias", "no_bias"])
def test_bias_gelu(with_bias, approximate, dtype):
    act = kernel_module("activations_triton")
    act_block, act.BLOCK = act.BLOCK, 64
    tensors = [randn(5, 77, seed=1, scale=3)] + ([randn(77, seed=2)] if with_bias else [])
    try:
        check(lambda x, *b: act.bias_gelu_triton(x, *b, approximate=approximate),
              lambda x, *b: activations.bias_gelu_reference(x, *b, approximate=approximate), dtype, tensors,
              "bias gelu")
    finally:
        act.BLOCK = act_block


# ----------------------------------------------------------------------------------------------- cross entropy


@pytest.fixture
def small_vocab_blocks():
    ce = kernel_module("cross_entropy_triton")
    block, ce.BLOCK_V = ce.BLOCK_V, 16  # vocab 37 -> three blocks, the last one masked
    yield ce
    ce.BLOCK_V = block


def _targets(n, vocab, seed=7):
    t = torch.randint(0, vocab, (n,), generator=torch.Generator().manual_seed(seed))
    t[2] = t[5] = -100
    return t.to(DEVICE)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("smoothing", [0.0, 0.1])
def test_cross_entropy(small_vocab_blocks, smoothing, dtype):
    ce = small_vocab_blocks
    target = _targets(12, 37).view(3, 4)
    check(lambda logits: ce.cross_entropy_triton(logits, target, 37, label_smoothing=smoothing),
          lambda logits: torch_cross_entropy(logits, target, 37, label_smoothing=smoothing),
          dtype, [randn(3, 4, 37, seed=1, scale=3)], "cross entropy", out_dtype=torch.float32)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("smoothing", [0.0, 0.1])
def test_linear_cross_entropy(small_vocab_blocks, smoothing, dtype):
    ce = small_vocab_blocks
    target = _targets(11, 37)
    tensors = [randn(11, 24, seed=1), randn(37, 24, seed=2, scale=0.3), randn(37, seed=3, scale=0.1)]
    check(lambda h, w, b: ce.linear_cross_entropy_triton(h, w, target, 37, bias=b, label_smoothing=smoothing,
                                                         chunk_size=4),  # 3 chunks, the last one short
          lambda h, w, b: torch_cross_entropy(torch.nn.functional.linear(h, w, b), target, 37, label_smoothing=smoothing),
          dtype, tensors, "linear cross entropy", out_dtype=torch.float32)


def _vocab_parallel_cross_entropy_task(fused: bool, smoothing: float):
    """On each tp rank: the kernel on the rank's vocab slice equals the full-vocab reference."""
    import torch.distributed as dist

    from colozoo.core.groups import vocab_range

    ce = kernel_module("cross_entropy_triton")
    ce.BLOCK_V = 16
    group = dist.group.WORLD
    vocab = 37  # padded to 38 over 2 ranks: the last rank holds one padded column
    start, stop, per = vocab_range(vocab, group)
    target = _targets(11, vocab)
    hidden, weight = randn(11, 24, seed=1), randn(vocab, 24, seed=2, scale=0.3)
    local_weight = torch.zeros(per, 24)
    local_weight[: stop - start] = weight[start:stop]
    hidden, weight, local_weight = (t.to(DEVICE).requires_grad_() for t in (hidden, weight, local_weight))
    if fused:
        loss = ce.linear_cross_entropy_triton(hidden, local_weight, target, vocab, group=group,
                                              label_smoothing=smoothing, chunk_size=4)
    else:
        loss = ce.cross_entropy_triton(hidden @ local_weight.t(), target, vocab, group=group,
                                       label_smoothing=smoothing)
    ref = torch_cross_entropy(hidden @ weight.t(), target, vocab, label_smoothing=smoothing)
    grad = torch.linspace(0.5, 1.5, 11, device=DEVICE)
    dh, dw = torch.autograd.grad(loss, (hidden, local_weight), grad)
    dist.all_reduce(dh, group=group)  # what copy_to_parallel's backward does in the LM head
    ref_dh, ref_dw = torch.autograd.grad(ref, (hidden, weight), grad)
    assert_close(loss, ref, torch.float32, "vocab-parallel loss")
    assert_close(dh, ref_dh, torch.float32, "vocab-parallel hidden grad")
    assert_close(dw[: stop - start], ref_dw[start:stop], torch.float32, "vocab-parallel weight grad")
    assert dw[stop - start:].abs().max().item() == 0 if per > stop - start else True, "padded rows got gradient"
    return True


@pytest.mark.parametrize("fused", [False, True], ids=["logits", "fused_lm_head"])
def test_vocab_parallel_cross_entropy_tp2(fused):
    assert run_distributed(_vocab_parallel_cross_entropy_task, 2, fused=fused, smoothing=0.1,
                           timeout=120) == [True, True]


# ----------------------------------------------------------------------------------------------- MoE


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("top_k", [1, 2])
def test_moe_permute_unpermute(top_k, dtype):
    """The ops on the Triton path (the kernels move the rows the op's torch sort placed) against the references."""
    kernel_module("moe_triton")
    tokens, hidden, experts = 13, 20, 5
    g = torch.Generator().manual_seed(0)
    expert_ids = torch.stack([torch.randperm(experts, generator=g)[:top_k] for _ in range(tokens)]).to(DEVICE)
    row_scale = torch.linspace(0.5, 2.0, tokens * top_k, device=DEVICE)[:, None]  # stands in for the experts

    def pipeline(permute, unpermute, mode):
        def run(x, weights):
            with dispatch.use_kernels(mode):
                permuted, row_map, counts = permute(x, expert_ids, experts)
                out = unpermute(permuted * row_scale.to(permuted.dtype), row_map, weights)
            return permuted, out
        return run

    check(pipeline(moe.permute, moe.unpermute, "triton"),
          pipeline(moe.permute_reference, moe.unpermute_reference, "torch"), dtype,
          [randn(tokens, hidden, seed=1), torch.softmax(randn(tokens, top_k, seed=2), -1)], "moe")


def test_moe_routing_groups_by_expert():
    kernel_module("moe_triton")
    expert_ids = torch.tensor([[2, 0], [1, 2], [0, 1]], device=DEVICE)
    row_map, order, counts = moe.route(expert_ids, 4)
    assert counts.tolist() == [2, 2, 2, 0]
    assert order.tolist() == [1, 4, 2, 5, 0, 3]  # (token, slot) entries sorted by expert, stable
    assert row_map[order].tolist() == list(range(6))
    with dispatch.use_kernels("triton"), pytest.raises(ValueError, match=r"expert ids must lie in \[0, 2\)"):
        moe.permute(torch.zeros(3, 4, device=DEVICE), expert_ids, 2)


# ----------------------------------------------------------------------------------------------- layers

GPT2 = dict(vocab_size=101, n_positions=32, n_embd=64, n_layer=2, n_head=4, resid_pdrop=0.0, embd_pdrop=0.0,
            attn_pdrop=0.0)


KERNEL_MODULES = ("norms_triton", "attention_triton", "rope_triton", "activations_triton", "cross_entropy_triton",
                  "moe_triton")
LLAMA = dict(vocab_size=101, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=32, pad_token_id=0)
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
    for name in ("layer_norm_triton", "rms_norm_triton"):
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
    ("llama", LLAMA, "rms_norm_triton", 2),         # post_attention_layernorm of each layer
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

    pc = init_parallel(tp=tp, sequence_parallel=sequence_parallel)

    config, hf = hf_causal_lm(model_type, config_kwargs)
    ids, mask, labels = batch(config.vocab_size, 12)
    ref = hf(ids, attention_mask=mask, labels=labels)
    ref.loss.backward()
    model = build_model(config, pc=pc, device="meta")
    converter = family_module(model_type)
    if hasattr(converter, "module_sources"):  # transformers fuses experts in memory, not in its files
        with tempfile.TemporaryDirectory() as directory:
            hf.save_pretrained(directory)
            load_hf_weights(model, SafetensorsReader(directory), device="cpu")
    else:
        load_hf_weights(model, StateDictReader(hf.state_dict()), device="cpu")
    with dispatch.use_kernels("triton"):
        out = model.eval()(ids, attention_mask=mask, labels=labels)
        out.loss.backward()
    assert out.logits is None
    close(out.loss, ref.loss, 1e-5, "loss")
    sources = getattr(converter, "module_sources", converter.hf_sources)(config)  # names of HF's in-memory grads
    hf_grads = StateDictReader({n: p.grad for n, p in hf.named_parameters()})
    for name, p in model.named_parameters():
        expected = GlobalTensor(hf_grads, sources[name], name).read()
        full = gather_tensor(p.grad, spec_of(p), expected.shape, pc.groups, coords_of(pc))
        assert_close(full, expected, torch.float32, f"grad of {name}")
    return True


@CPU_PARITY
def test_llama_on_triton_path_matches_transformers(monkeypatch):
    """RMSNorm, rotary, flash attention (GQA, padded), SwiGLU, cross entropy on Triton: logits, loss and
    gradients within 1e-5 of HF; then a training step through the fused LM-head loss, also against HF."""
    calls = count_kernel_calls(monkeypatch)
    _parity_on_kernels("triton", "llama", LLAMA)
    assert {"rms_norm_triton", "apply_rotary_triton", "flash_attention_triton", "swiglu_triton",
            "cross_entropy_triton"} <= set(calls), calls
    assert calls["apply_rotary_triton"] == 2 * LLAMA["num_hidden_layers"]  # q and k in every layer
    assert "linear_cross_entropy_triton" not in calls  # logits were requested: no fused head
    calls.clear()
    _fused_loss_parity("llama", LLAMA)
    assert calls["linear_cross_entropy_triton"] == 1 and "cross_entropy_triton" not in calls, calls


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
    assert fused == {"rms_norm_triton": layers}, fused  # pre_feedforward_layernorm takes the residual sum


@CPU_PARITY
def test_llama_fused_loss_tp2_sequence_parallel():
    """The fused LM-head loss keeps its vocab slices and sequence-parallel gather over two ranks."""
    assert run_distributed(_fused_loss_parity, 2, model_type="llama", config_kwargs=LLAMA, tp=2,
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
        wired = {"apply_rotary_triton", "swiglu_triton", "linear_cross_entropy_triton"}
        if model_type == "mixtral":
            wired |= {"moe_permute_triton", "moe_unpermute_triton"}
        assert wired <= set(calls), (model_type, calls)
        calls.clear()
