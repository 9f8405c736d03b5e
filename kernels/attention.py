"""Attention over the heads this rank owns and the tokens it holds, (batch, heads_local, seq, head_dim) inputs:

    local_attention(q, k, v, mask=None, *, causal, scale=None, dropout_p=0.0, upcast=False, softcap=None,
                    documents=None, sinks=None)

The op runs torch's scaled_dot_product_attention, GPT-2's upcast order or Gemma 2's capped scores (the torch path),
or on the Triton path the flash-attention kernel (`attention_triton`) or, for one query token against a KV cache,
the flash-decoding kernel (the `decode` op). Dropout inside attention runs on the tracked tensor-parallel RNG, since
each rank holds different heads. `colozoo.layers.attention` adds attention across context-parallel ranks on top.
"""
from __future__ import annotations

from contextlib import contextmanager, nullcontext
from contextvars import ContextVar

import torch
import torch.nn.functional as F

from colozoo.core.rng import get_rng_tracker

from .decode import decode_attention
from .dispatch import use_triton


# the device a symbolic trace (colozoo.cost) prices: tensors on the meta device then take that device's kernels
_PRICED_DEVICE: ContextVar[str | None] = ContextVar("priced_device", default=None)


@contextmanager
def priced_as(device: str):
    """Inside the block, attention on meta tensors takes the path `device` ("cuda", "cpu", "eager") would run: the
    fused kernels' saved set, not the torch path's (for this context only; nothing global changes)."""
    token = _PRICED_DEVICE.set(device)
    try:
        yield
    finally:
        _PRICED_DEVICE.reset(token)


def _priced_on_cuda(q) -> bool:
    return q.is_meta and _PRICED_DEVICE.get() == "cuda"


def local_attention(q, k, v, mask=None, *, causal: bool, scale: float | None = None, dropout_p: float = 0.0,
                    upcast: bool = False, softcap: float | None = None,
                    documents: torch.Tensor | None = None, sinks: torch.Tensor | None = None,
                    unpadded: bool = False) -> torch.Tensor:
    """softmax(q k^T * scale + mask) v, grouped-query aware (k/v heads repeat to match q). One query token against
    a KV cache with a key mask (batch, 1, 1, keys) takes the flash-decoding kernel on the Triton path.

    `softcap` (Gemma 2) caps the scores to softcap * tanh(scores / softcap) before masking. SDPA cannot cap: the
    torch path then computes the scores explicitly; the flash-attention kernel caps (decoding takes it too).

    `documents` (batch, seq) (self-attention of packed sequences, colozoo.layers.documents): a token attends only
    to tokens of its own document. The flash kernel compares the ids; the torch path folds them into a dense mask.

    `sinks` (heads,): gpt-oss's attention sinks, one learned logit per head that joins every row's softmax and takes
    its share of the weight without adding a value (a row may so attend to nothing). The torch path appends it to
    the scores; the flash kernel attends without it and rescales each row by sigmoid(lse - sink) (`with_sinks`);
    the decoding kernel merges it as one more chunk of the cache.

    `unpadded`: the mask is only causal and a sliding window (no padding), so every query sees at least itself."""
    decoding = q.shape[2] == 1 and mask is not None and mask.dtype == torch.bool and mask.shape[2] == 1
    # the kernels take values as wide as queries and keys; MLA's narrower values (v_head_dim) go to SDPA
    kernel = not upcast and dropout_p == 0.0 and q.shape[-1] <= 256 and v.shape[-1] == q.shape[-1]
    if decoding and kernel and softcap is None and use_triton(q, k, v):
        key_mask = mask[:, 0, 0, :].expand(q.shape[0], k.shape[2])
        return decode_attention(q, k, v, k.shape[2], key_mask, scale, sinks=sinks)
    # torch's fused CUDA attention (flash, cuDNN, memory-efficient) trains about twice as fast as the Triton kernel;
    # 'auto' takes the kernel where torch has none: capped scores and packed documents. A padded batch keeps the
    # capped scores on torch, since transformers' eager attention spreads a row that sees no key over all keys; a
    # window without padding leaves no such row, and torch's path would keep every layer's scores whole.
    only_kernel = documents is not None or sinks is not None or (softcap is not None and (mask is None or unpadded))
    if kernel and only_kernel and (sinks is not None or softcap is not None) and _priced_on_cuda(q):
        return _flash_stand_in(q, k, v, mask, causal=causal, scale=scale, dropout_p=dropout_p, sinks=sinks)
    if kernel and (mask is None or mask.dtype == torch.bool) and use_triton(q, k, v, auto=only_kernel):
        from .attention_triton import flash_attention_triton

        out = flash_attention_triton(q, k, v, mask, causal=causal and mask is None, scale=scale, softcap=softcap,
                                     documents=documents, return_lse=sinks is not None)
        return out if sinks is None else with_sinks(*out, sinks)
    if documents is not None:
        mask = with_documents(mask, documents, causal)
    grouped = k.shape[1] != q.shape[1]
    if grouped and not upcast and softcap is None and sinks is None and (not torch.is_grad_enabled()
                                                                        or _flash_takes_groups(q, mask)):
        # inference (the KV cache): SDPA shares each kv head with its query group, no copy of the whole cache
        # (bit-identical to the repeat; training on the CPU keeps the repeat, whose backward the parity tests check).
        # Training on CUDA too where the flash kernel takes the groups: it then keeps k and v, not their repeats
        with _dropout_rng(q, dropout_p):
            return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=dropout_p,
                                                  is_causal=causal and mask is None, scale=scale, enable_gqa=True)
    if grouped:
        repeat = q.shape[1] // k.shape[1]
        k = k.repeat_interleave(repeat, dim=1)
        v = v.repeat_interleave(repeat, dim=1)
    if sinks is not None:
        return _sink_attention(q, k, v, mask, causal=causal, scale=scale, dropout_p=dropout_p, sinks=sinks)
    if softcap is not None:
        return _softcap_attention(q, k, v, mask, causal=causal, scale=scale, dropout_p=dropout_p, softcap=softcap)
    if upcast:
        return _upcast_attention(q, k, v, mask, causal=causal, scale=scale, dropout_p=dropout_p)
    is_causal = causal and mask is None
    with _dropout_rng(q, dropout_p):
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=dropout_p, is_causal=is_causal,
                                             scale=scale)
    return out


def _flash_takes_groups(q, mask) -> bool:
    """Whether SDPA runs grouped-query attention in its flash kernel (CUDA, sm80 or later, fp16 / bf16, no mask):
    elsewhere a grouped SDPA falls back to its math kernel, slower than the repeat."""
    if mask is not None or q.dtype not in (torch.float16, torch.bfloat16):
        return False
    return _priced_on_cuda(q) or (q.is_cuda and torch.cuda.get_device_properties(q.device).major >= 8)


def _dropout_rng(q, dropout_p: float):
    """The tracked tensor-parallel generator where attention dropout draws (each rank holds other heads); without
    dropout nothing is drawn, and swapping generator states would only cost time (and break torch.compile's graph)."""
    return get_rng_tracker().fork(device_type=q.device.type) if dropout_p > 0.0 else nullcontext()


def _upcast_attention(q, k, v, mask, *, causal: bool, scale: float | None, dropout_p: float) -> torch.Tensor:
    """GPT-2's reorder_and_upcast_attn, in transformers' order: scores and softmax in fp32, then the weights are
    cast down to v's dtype before they multiply v (so low-precision results match, not just fp32 ones)."""
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    device = q.device.type  # autocast would run the fp32 matmul in low precision again
    with torch.autocast(device, enabled=False) if torch.amp.is_autocast_available(device) else nullcontext():
        scores = torch.matmul(q.float(), k.float().transpose(-1, -2)) * scale
    if causal and mask is None:
        mask = torch.ones(q.shape[-2], k.shape[-2], dtype=torch.bool, device=q.device).tril()
    if mask is not None:  # added, not filled in: a fully masked (padding) row still passes gradient, as in HF
        if mask.dtype == torch.bool:
            mask = torch.zeros_like(mask, dtype=scores.dtype).masked_fill(~mask, torch.finfo(scores.dtype).min)
        scores = scores + mask.float()
    weights = torch.softmax(scores, dim=-1).to(v.dtype)
    if dropout_p > 0.0:
        with get_rng_tracker().fork(device_type=q.device.type):
            weights = F.dropout(weights, dropout_p)
    return torch.matmul(weights, v)


def _softcap_attention(q, k, v, mask, *, causal: bool, scale: float | None, dropout_p: float,
                       softcap: float) -> torch.Tensor:
    """Scores in q's dtype, capped, masked, softmax in fp32 and cast back before v (transformers' eager order)."""
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    scores = torch.matmul(q, k.transpose(-1, -2)) * scale
    scores = torch.tanh(scores / softcap) * softcap
    if causal and mask is None:
        mask = torch.ones(q.shape[-2], k.shape[-2], dtype=torch.bool, device=q.device).tril()
    if mask is not None:  # added, not filled in: a fully masked (padding) row still passes gradient, as in HF
        if mask.dtype == torch.bool:
            mask = torch.zeros_like(mask, dtype=scores.dtype).masked_fill(~mask, torch.finfo(scores.dtype).min)
        scores = scores + mask
    weights = torch.softmax(scores, dim=-1, dtype=torch.float32).to(v.dtype)
    if dropout_p > 0.0:
        with get_rng_tracker().fork(device_type=q.device.type):
            weights = F.dropout(weights, dropout_p)
    return torch.matmul(weights, v)


def with_sinks(out: torch.Tensor, lse: torch.Tensor, sinks: torch.Tensor) -> torch.Tensor:
    """Attention without sinks -> with them: a sink adds exp(sink) to each row's normaliser exp(lse), so the row is
    scaled by exp(lse) / (exp(lse) + exp(sink)) = sigmoid(lse - sink) (1 where the row sees no key: lse = +inf,
    and the output is zero there anyway)."""
    weight = torch.sigmoid(lse - sinks.float().view(1, -1, 1))
    return (out.float() * weight[..., None]).to(out.dtype)


def _flash_stand_in(q, k, v, mask, *, causal: bool, scale: float | None, dropout_p: float,
                    sinks: torch.Tensor | None) -> torch.Tensor:
    """What a trace prices for the flash kernel where torch has none (capped scores, sinks): SDPA, which the trace
    routes to a fused kernel saving q, k, v, its output and the log-sum-exp as the kernel does; with sinks a rescale
    of its output (the kernel rescales each row by sigmoid(lse - sink))."""
    grouped = k.shape[1] != q.shape[1]
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=dropout_p,
                                         is_causal=causal and mask is None, scale=scale, enable_gqa=grouped)
    return out if sinks is None else out * torch.sigmoid(sinks.float()).to(out.dtype).view(1, -1, 1, 1)


def _sink_attention(q, k, v, mask, *, causal: bool, scale: float | None, dropout_p: float,
                    sinks: torch.Tensor) -> torch.Tensor:
    """Scores, masked, each row joined by its head's sink logit, softmax in fp32 with the sink's column dropped
    after it (transformers' eager order for gpt-oss), cast to v's dtype before v."""
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    scores = torch.matmul(q, k.transpose(-1, -2)).float() * scale
    if causal and mask is None:
        mask = torch.ones(q.shape[-2], k.shape[-2], dtype=torch.bool, device=q.device).tril()
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf")) if mask.dtype == torch.bool else scores + mask.float()
    sink = sinks.float().view(1, -1, 1, 1).expand(*scores.shape[:-1], 1)
    weights = torch.softmax(torch.cat([scores, sink], dim=-1), dim=-1)[..., :-1].to(v.dtype)
    if dropout_p > 0.0:
        with get_rng_tracker().fork(device_type=q.device.type):
            weights = F.dropout(weights, dropout_p)
    return torch.matmul(weights, v)


def same_document(q_documents: torch.Tensor, k_documents: torch.Tensor) -> torch.Tensor:
    """Boolean (batch, 1, q, k): True where query and key belong to one document."""
    return (q_documents[:, :, None] == k_documents[:, None, :])[:, None]


def with_documents(mask: torch.Tensor | None, documents: torch.Tensor, causal: bool) -> torch.Tensor:
    """A self-attention keep-mask (None: plain causal, or none) narrowed to pairs within one document."""
    keep = same_document(documents, documents)
    if mask is None:
        if causal:
            keep = keep & torch.ones(keep.shape[-2:], dtype=torch.bool, device=keep.device).tril()
        return keep
    if mask.dtype == torch.bool:
        return mask & keep
    return mask.masked_fill(~keep, torch.finfo(mask.dtype).min)  # an additive float mask
