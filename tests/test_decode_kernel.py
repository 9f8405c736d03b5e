"""The flash-decoding kernel (colozoo.kernels.decode_triton) against the decode op's torch reference, and the
reference against torch's scaled_dot_product_attention.

Without a GPU the kernel runs on triton's CPU interpreter in fp32 and fp16 (it computes bf16 wrongly, so bf16 runs
only on CUDA). Cache lengths are odd and the chunk sizes do not divide them, so every case has a ragged last
chunk; left padding is long enough to blank out whole chunks.
"""
from __future__ import annotations

import os

import pytest
import torch

CUDA = torch.cuda.is_available()
if not CUDA:
    os.environ["TRITON_INTERPRET"] = "1"  # before any kernel module is imported
pytest.importorskip("triton")

from colozoo.kernels import decode, decode_triton, use_kernels  # noqa: E402

DEVICE = "cuda" if CUDA else "cpu"
NEEDS_GPU = pytest.mark.skipif(not CUDA, reason="the triton interpreter computes bf16 wrongly; bf16 needs a GPU")
DTYPES = [torch.float32, torch.float16, pytest.param(torch.bfloat16, marks=NEEDS_GPU)]
TOLERANCE = {torch.float32: dict(rtol=1e-5, atol=1e-5), torch.float16: dict(rtol=1e-2, atol=1e-2),
             torch.bfloat16: dict(rtol=2e-2, atol=2e-2)}

CASES = {
    # name: (batch, q heads, kv heads, length, max_len, head dim, chunk size, left padding, window, scale)
    "len1_mha": (2, 4, 4, 1, 5, 64, 16, False, None, None),
    "len7_gqa_padded": (2, 8, 2, 7, 9, 64, 3, True, None, None),
    "len33_gqa_padded_d80": (2, 8, 2, 33, 40, 80, 16, True, None, 0.3),
    "len33_mha_d80": (1, 4, 4, 33, 33, 80, 10, False, None, None),
    "len130_gqa_window": (1, 8, 2, 130, 160, 64, 32, False, 37, None),
    "len130_mha_padded_window_d80": (2, 4, 4, 130, 131, 80, 48, True, 50, 0.2),
    "len130_gqa_padded_d64_one_chunk": (2, 8, 2, 130, 130, 64, 256, True, None, None),
}


def randn(*shape, seed):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def inputs(b, hq, hk, length, max_len, d, padded, dtype, seed=0):
    q = randn(b, hq, 1, d, seed=seed).to(DEVICE, dtype)
    k = randn(b, hk, max_len, d, seed=seed + 1).to(DEVICE, dtype)
    v = randn(b, hk, max_len, d, seed=seed + 2).to(DEVICE, dtype)
    mask = None
    if padded:  # the first sequence is left-padded over two thirds of the cache, the last by one position
        mask = torch.ones(b, length, dtype=torch.bool)
        mask[0, : 2 * length // 3] = False
        mask[-1, :1] = False
        mask = mask.to(DEVICE)
    return q, k, v, mask


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("case", sorted(CASES))
def test_kernel_matches_reference(case, dtype):
    b, hq, hk, length, max_len, d, chunk, padded, window, scale = CASES[case]
    assert chunk >= length or length % chunk  # a ragged last chunk (or a single one)
    q, k, v, mask = inputs(b, hq, hk, length, max_len, d, padded, dtype)
    out = decode_triton.decode_attention_triton(q, k, v, length, mask, scale, window, chunk_size=chunk)
    expected = decode.decode_attention_reference(q, k, v, length, mask, scale, window)
    assert out.shape == (b, hq, 1, d) and out.dtype == dtype
    torch.testing.assert_close(out, expected, **TOLERANCE[dtype])


def test_kernel_reads_strided_caches_and_gives_zeros_where_nothing_is_visible():
    # a (batch, max_len, heads, head_dim) cache seen as (batch, heads, max_len, head_dim)
    q = randn(2, 8, 1, 64, seed=1).to(DEVICE)
    k = randn(2, 21, 2, 64, seed=2).to(DEVICE).transpose(1, 2)
    v = randn(2, 21, 2, 64, seed=3).to(DEVICE).transpose(1, 2)
    mask = torch.ones(2, 19, dtype=torch.bool, device=DEVICE)
    mask[0] = False  # the first sequence sees no key at all
    out = decode_triton.decode_attention_triton(q, k, v, 19, mask, chunk_size=5)
    torch.testing.assert_close(out, decode.decode_attention_reference(q, k, v, 19, mask), rtol=1e-5, atol=1e-5)
    assert torch.equal(out[0], torch.zeros_like(out[0]))


@pytest.mark.parametrize("window", [None, 6], ids=["full", "window"])
def test_reference_matches_sdpa(window):
    length, max_len = 23, 30
    q, k, v, mask = inputs(2, 8, 2, length, max_len, 16, True, torch.float32, seed=4)
    keep = mask.clone()
    if window is not None:
        keep[:, : length - window] = False
    expected = torch.nn.functional.scaled_dot_product_attention(
        q, k[:, :, :length], v[:, :, :length], attn_mask=keep[:, None, None, :], scale=0.25, enable_gqa=True)
    out = decode.decode_attention_reference(q, k, v, length, mask, 0.25, window)
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("mode", ["triton", "torch"])
def test_dispatch(mode, monkeypatch):
    calls = []
    for module, name in ((decode_triton, "decode_attention_triton"), (decode, "decode_attention_reference")):
        fn = getattr(module, name)
        monkeypatch.setattr(module, name, lambda *a, _fn=fn, _name=name: calls.append(_name) or _fn(*a))
    q, k, v, mask = inputs(2, 4, 2, 9, 12, 16, True, torch.float32)
    with use_kernels(mode):
        out = decode.decode_attention(q, k, v, 9, mask, None, 4)
    assert calls == ["decode_attention_triton" if mode == "triton" else "decode_attention_reference"]
    torch.testing.assert_close(out, decode.decode_attention_reference(q, k, v, 9, mask, None, 4),
                               rtol=1e-5, atol=1e-5)


BAD_INPUTS = {
    # name: (q shape, cache shape, length, message)
    "two_tokens": ((1, 4, 2, 16), (1, 2, 8, 16), 5, "one new token per sequence"),
    "heads": ((1, 4, 1, 16), (1, 3, 8, 16), 5, "3 key/value heads do not divide 4 query heads"),
    "too_long": ((1, 4, 1, 16), (1, 2, 8, 16), 9, r"length 9 must lie in \[1, 8\]"),
}


@pytest.mark.parametrize("mode", ["triton", "torch"])
@pytest.mark.parametrize("bad", sorted(BAD_INPUTS))
def test_bad_inputs_are_a_clear_value_error(bad, mode):
    q_shape, cache_shape, length, message = BAD_INPUTS[bad]
    cache = torch.zeros(cache_shape, device=DEVICE)
    with use_kernels(mode), pytest.raises(ValueError, match=message):
        decode.decode_attention(torch.zeros(q_shape, device=DEVICE), cache, cache, length)


def test_kernel_refuses_head_dim_over_256():
    q, cache = torch.zeros(1, 2, 1, 264, device=DEVICE), torch.zeros(1, 2, 4, 264, device=DEVICE)
    with pytest.raises(ValueError, match="head_dim up to 256"):
        decode_triton.decode_attention_triton(q, cache, cache, 3)
