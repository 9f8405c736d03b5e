"""Every Triton kernel against its op's torch reference (flash attention: against an fp32 oracle here), forward and
backward, on small odd shapes.

Without a GPU the kernels run on triton's CPU interpreter in fp32 and fp16 (it computes bf16 wrongly, so bf16
runs only on CUDA). triton decides whether to interpret when a kernel is decorated, i.e. when its module
(colozoo.kernels.<op>_triton) is imported, so TRITON_INTERPRET is set here before any kernel module loads, and
`kernel_module` reloads a module that something imported earlier in the other mode. References are evaluated in
fp32 on the same (rounded) inputs. The layers on the kernels, end to end: tests/test_kernels_in_models.py.
"""
from __future__ import annotations

import importlib
import os

import pytest
import torch

CUDA = torch.cuda.is_available()
if not CUDA:
    os.environ["TRITON_INTERPRET"] = "1"
triton = pytest.importorskip("triton")

from distributed import run_distributed  # noqa: E402



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
def test_cross_entropy_and_entropy(small_vocab_blocks, dtype):
    """The entropy from the loss's own pass (three blocks: its running sum moved to each new max); the loss and its
    gradient unchanged."""
    ce = small_vocab_blocks
    target, logits = _targets(12, 37).view(3, 4), randn(3, 4, 37, seed=1, scale=3).to(DEVICE, dtype).requires_grad_()
    loss, entropy = ce.cross_entropy_triton(logits, target, 37, entropy=True)
    alone = ce.cross_entropy_triton(logits, target, 37)
    assert torch.equal(loss, alone) and not entropy.requires_grad
    assert torch.equal(*(torch.autograd.grad(out.sum(), logits)[0] for out in (loss, alone)))
    assert_close(entropy, _entropy(logits), torch.float32, "entropy")


def _entropy(logits):
    log_probs = logits.detach().float().log_softmax(-1)
    return -(log_probs.exp() * log_probs).sum(-1)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("smoothing,softcap", [(0.0, None), (0.1, None), (0.1, 2.0)])
def test_linear_cross_entropy(small_vocab_blocks, smoothing, softcap, dtype):
    """The summed loss with its gradients taken in the forward, 3 chunks the last one short (the tensor-parallel and
    sequence-parallel cases: tests/test_linear_cross_entropy.py)."""
    ce = small_vocab_blocks
    target = _targets(11, 37)
    tensors = [randn(11, 24, seed=1), randn(37, 24, seed=2, scale=0.3), randn(37, seed=3, scale=0.1)]

    def reference(h, w, b):
        logits = torch.nn.functional.linear(h, w, b)
        if softcap is not None:
            logits = torch.tanh(logits / softcap) * softcap
        return torch_cross_entropy(logits, target, 37, label_smoothing=smoothing).sum()

    check(lambda h, w, b: ce.linear_cross_entropy_triton(h, w, target, 37, bias=b, label_smoothing=smoothing,
                                                         softcap=softcap, chunk_size=4),
          reference, dtype, tensors, "linear cross entropy", out_dtype=torch.float32)


def _vocab_parallel_cross_entropy_task(smoothing: float):
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
    loss = ce.cross_entropy_triton(hidden @ local_weight.t(), target, vocab, group=group, label_smoothing=smoothing)
    ref = torch_cross_entropy(hidden @ weight.t(), target, vocab, label_smoothing=smoothing)
    _, entropy = ce.cross_entropy_triton(hidden @ local_weight.t(), target, vocab, group, -100, smoothing, entropy=True)
    assert_close(entropy, _entropy(hidden @ weight.t()), torch.float32, "vocab-parallel entropy")
    grad = torch.linspace(0.5, 1.5, 11, device=DEVICE)
    dh, dw = torch.autograd.grad(loss, (hidden, local_weight), grad)
    dist.all_reduce(dh, group=group)  # what copy_to_parallel's backward does in the LM head
    ref_dh, ref_dw = torch.autograd.grad(ref, (hidden, weight), grad)
    assert_close(loss, ref, torch.float32, "vocab-parallel loss")
    assert_close(dh, ref_dh, torch.float32, "vocab-parallel hidden grad")
    assert_close(dw[: stop - start], ref_dw[start:stop], torch.float32, "vocab-parallel weight grad")
    assert dw[stop - start:].abs().max().item() == 0 if per > stop - start else True, "padded rows got gradient"
    return True


def test_vocab_parallel_cross_entropy_tp2():
    """The logits path's vocab-parallel cross entropy at tp 2, with label smoothing (the fused LM head at tp 2 and
    under sequence parallelism: tests/test_linear_cross_entropy.py)."""
    assert run_distributed(_vocab_parallel_cross_entropy_task, 2, smoothing=0.1, timeout=120) == [True, True]


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
