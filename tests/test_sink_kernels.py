"""gpt-oss's attention sinks on every attention path: the attention op's torch path against transformers' eager
attention of a GptOssAttention (the same scores, mask and sinks), and the flash-attention and flash-decoding kernels
(under triton's CPU interpreter in fp32 and fp16; it computes bf16 wrongly) against the torch path: outputs and the
gradients of q, k, v and the sinks, with grouped-query heads, left padding (rows that see no key but the sink) and a
sliding window in the decoding kernel."""
from __future__ import annotations

import os

import pytest
import torch

CUDA = torch.cuda.is_available()
if not CUDA:
    os.environ["TRITON_INTERPRET"] = "1"  # before any kernel module is imported
pytest.importorskip("triton")

from colozoo.kernels import decode, use_kernels  # noqa: E402
from colozoo.kernels.attention import local_attention  # noqa: E402

DEVICE = "cuda" if CUDA else "cpu"
TOLERANCE = {torch.float32: dict(rtol=1e-5, atol=1e-5), torch.float16: dict(rtol=1e-2, atol=1e-2)}


def inputs(batch=2, heads=4, kv_heads=2, seq=13, dim=16, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(batch, h, seq, dim, generator=g) for h in (heads, kv_heads, kv_heads))
    sinks = torch.randn(heads, generator=g) * 2
    return [t.to(DEVICE, dtype).requires_grad_() for t in (q, k, v, sinks)]


def padded_mask(batch, seq, padding=4):
    keep = torch.ones(batch, seq, dtype=torch.bool)
    keep[0, :padding] = False  # left padding: those queries see no key
    causal = torch.ones(seq, seq, dtype=torch.bool).tril()
    return (causal[None, None] & keep[:, None, None, :]).to(DEVICE)


def run(mode, q, k, v, sinks, mask):
    with use_kernels(mode):
        out = local_attention(q, k, v, mask, causal=True, scale=0.3, sinks=sinks)
    grads = torch.autograd.grad((out.float() * torch.linspace(-1, 1, out.shape[-1], device=DEVICE)).sum(),
                                (q, k, v, sinks))
    return out, grads


def test_torch_path_matches_transformers_eager():
    from transformers.models.gpt_oss.modeling_gpt_oss import eager_attention_forward

    q, k, v, sinks = inputs()
    mask = padded_mask(2, 13)
    module = torch.nn.Module()
    module.sinks, module.num_key_value_groups, module.training = sinks, 2, False
    additive = torch.zeros(mask.shape).masked_fill(~mask, torch.finfo(torch.float32).min)
    expected = eager_attention_forward(module, q, k, v, additive, scaling=0.3)[0].transpose(1, 2)
    with use_kernels("torch"):
        ours = local_attention(q, k, v, mask, causal=True, scale=0.3, sinks=sinks)
    torch.testing.assert_close(ours[1], expected[1])  # the unpadded row
    torch.testing.assert_close(ours[0, :, 4:], expected[0, :, 4:])
    assert ours[0, :, :4].abs().max() < 1e-6  # a row seeing nothing but its sink is zero


@pytest.mark.parametrize("masked", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_flash_kernel_with_sinks(dtype, masked):
    q, k, v, sinks = inputs(dtype=dtype)
    mask = padded_mask(2, 13) if masked else None
    expected, expected_grads = run("torch", q, k, v, sinks, mask)
    out, grads = run("triton", q, k, v, sinks, mask)
    torch.testing.assert_close(out, expected, **TOLERANCE[dtype])
    for name, got, want in zip("qkv", grads, expected_grads):
        torch.testing.assert_close(got, want, **TOLERANCE[dtype], msg=lambda m, name=name: f"d{name}: {m}")
    torch.testing.assert_close(grads[3], expected_grads[3], **TOLERANCE[dtype])  # the sinks' gradient
    assert expected_grads[3].abs().min() > 0  # every head's sink takes a share


@pytest.mark.parametrize("window", [None, 5])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_decode_kernel_with_sinks(dtype, window):
    from colozoo.kernels.decode_triton import decode_attention_triton

    q, k, v, sinks = (t.detach() for t in inputs(batch=3, heads=8, kv_heads=2, seq=21, dtype=dtype))
    q = q[:, :, :1]
    key_mask = torch.ones(3, 21, dtype=torch.bool, device=DEVICE)
    key_mask[0, :9] = False
    key_mask[2] = False  # a row that sees no key: all its weight on the sink, a zero output
    expected = decode.decode_attention_reference(q, k, v, 21, key_mask, 0.3, window, sinks)
    without = decode.decode_attention_reference(q, k, v, 21, key_mask, 0.3, window)
    got = decode_attention_triton(q, k, v, 21, key_mask, 0.3, window, sinks, chunk_size=4)
    torch.testing.assert_close(got, expected, **TOLERANCE[dtype])
    assert expected[2].abs().max() == 0 and (expected[:2] - without[:2]).abs().max() > 1e-3


def test_decode_step_takes_the_kernel_with_sinks():
    """One query against a cache through the attention op: the decoding kernel with sinks, as the torch path."""
    q, k, v, sinks = (t.detach() for t in inputs(batch=2, heads=4, kv_heads=2, seq=11))
    mask = torch.ones(2, 1, 1, 11, dtype=torch.bool, device=DEVICE)
    mask[1, ..., :3] = False
    outs = {}
    for mode in ("torch", "triton"):
        with use_kernels(mode), torch.no_grad():
            outs[mode] = local_attention(q[:, :, -1:], k, v, mask, causal=False, scale=0.3, sinks=sinks)
    torch.testing.assert_close(outs["triton"], outs["torch"])
