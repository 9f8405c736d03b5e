"""The flash-attention kernel of `colozoo.kernels.attention` (forward and backward) for (batch, heads, seq, head_dim)
tensors.

Supports causal masking (top-left aligned, like `scaled_dot_product_attention(is_causal=True)`), any boolean
keep-mask broadcastable to (batch, heads, q, k) such as a key-padding mask, grouped-query attention (k/v
heads divide q heads), any head dim up to 256 (padded to a power of two inside the kernel), Gemma 2's score
soft-capping, softcap * tanh(scores / softcap) before the mask (backward: times the tanh's slope 1 - tanh^2), and
packed sequences: with (batch, seq) document ids a query sees only keys of its own document (compared in the
kernel, like causality, so no (seq, seq) mask is ever built).

The softmax runs online in base 2 with fp32 statistics; the forward pass saves only the row log-sum-exp. The output
lies in memory as (batch, seq, heads, head_dim), returned as a (batch, heads, seq, head_dim) view.
Rows with no visible key give zeros (and zero gradients) instead of NaN. The backward pass is two kernels,
one per key block (dK, dV) and one per query block (dQ), so nothing needs atomics; for GQA the per-q-head
dK/dV are summed over the group afterwards.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

LOG2E = 1.4426950408889634


@triton.jit
def _keep(offs_m, offs_n, Mask, smm, smn, Docs, sdn, SQ, SK, CAUSAL: tl.constexpr, HAS_MASK: tl.constexpr,
          HAS_DOCS: tl.constexpr):
    keep = (offs_m[:, None] < SQ) & (offs_n[None, :] < SK)
    if CAUSAL:
        keep &= offs_n[None, :] <= offs_m[:, None]
    if HAS_DOCS:
        doc_q = tl.load(Docs + offs_m * sdn, mask=offs_m < SQ, other=-1)
        doc_k = tl.load(Docs + offs_n * sdn, mask=offs_n < SK, other=-2)
        keep &= doc_q[:, None] == doc_k[None, :]
    if HAS_MASK:
        keep &= tl.load(Mask + offs_m[:, None] * smm + offs_n[None, :] * smn, mask=keep, other=0) != 0
    return keep


@triton.jit
def _tanh(x):
    e = tl.exp(-2.0 * tl.abs(x))  # never overflows
    t = (1.0 - e) / (1.0 + e)
    return tl.where(x < 0, -t, t)


@triton.jit
def _online_softmax_step(s, v, m_i, l_i, acc, PRECISION: tl.constexpr):
    """Folds one block of base-2 scores `s` (rows x keys, -inf where hidden) and its values into the running row
    maximum, sum and output of an online softmax: (m_i, l_i, acc), each rescaled to the new maximum."""
    m_new = tl.maximum(m_i, tl.max(s, axis=1))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.exp2(m_i - m_safe)
    p = tl.exp2(s - m_safe[:, None])
    l_i = l_i * alpha + tl.sum(p, axis=1)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
    return m_new, l_i, acc


@triton.jit
def _normalized(acc, l_i):
    """The output of an online softmax and whether its rows saw no key (zeros there, not NaN)."""
    empty = l_i == 0.0
    return acc / tl.where(empty, 1.0, l_i)[:, None], empty


@triton.jit
def _probs_and_score_grads(q, k, v, do, lse, delta, rows, cols, qk_scale, cap, Mask, smm, smn, Docs, sdn, SQ, SK,
                           CAUSAL: tl.constexpr, HAS_MASK: tl.constexpr, HAS_DOCS: tl.constexpr,
                           SOFTCAP: tl.constexpr, PRECISION: tl.constexpr):
    """The backward's recompute of one (rows x cols) block: the forward's probabilities P from the saved base-2
    log-sum-exp, and the scores' gradient dS = P (dO V^T - delta), through the tanh cap's slope when there is one."""
    s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * qk_scale
    if SOFTCAP:
        t = _tanh(s / cap)
        s = cap * t
    s = tl.where(_keep(rows, cols, Mask, smm, smn, Docs, sdn, SQ, SK, CAUSAL, HAS_MASK, HAS_DOCS), s, float("-inf"))
    p = tl.exp2(s - lse[:, None])
    dp = tl.dot(do, tl.trans(v), input_precision=PRECISION)
    ds = p * (dp - delta[:, None])
    if SOFTCAP:
        ds = ds * (1.0 - t * t)
    return p, ds


@triton.jit
def _attn_forward(Q, K, V, Mask, O, LSE, qk_scale, cap,
                  sqb, sqh, sqm, sqd, skb, skh, skn, skd, svb, svh, svn, svd, smb, smh, smm, smn,
                  Docs, sdb, sdn, sob, soh, som, sod, H, GROUP, SQ, SK, D,
                  CAUSAL: tl.constexpr, HAS_MASK: tl.constexpr, HAS_DOCS: tl.constexpr, SOFTCAP: tl.constexpr,
                  PRECISION: tl.constexpr,
                  BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr):
    start_m = tl.program_id(0)
    bh = tl.program_id(1)
    b = (bh // H).to(tl.int64)
    h = (bh % H).to(tl.int64)
    hk = h // GROUP
    offs_m = start_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    Q += b * sqb + h * sqh
    K += b * skb + hk * skh
    V += b * svb + hk * svh
    Mask += b * smb + h * smh
    Docs += b * sdb
    q = tl.load(Q + offs_m[:, None] * sqm + offs_d[None, :] * sqd,
                mask=(offs_m[:, None] < SQ) & (offs_d[None, :] < D), other=0.0)
    m_i = tl.full((BLOCK_M,), float("-inf"), dtype=tl.float32)
    l_i = tl.zeros((BLOCK_M,), dtype=tl.float32)
    acc = tl.zeros((BLOCK_M, BLOCK_D), dtype=tl.float32)
    end_n = SK
    if CAUSAL:
        end_n = tl.minimum(SK, (start_m + 1) * BLOCK_M)
    for start_n in range(0, end_n, BLOCK_N):
        cols = start_n + offs_n
        kt = tl.load(K + cols[None, :] * skn + offs_d[:, None] * skd,
                     mask=(cols[None, :] < SK) & (offs_d[:, None] < D), other=0.0)
        v = tl.load(V + cols[:, None] * svn + offs_d[None, :] * svd,
                    mask=(cols[:, None] < SK) & (offs_d[None, :] < D), other=0.0)
        s = tl.dot(q, kt, input_precision=PRECISION) * qk_scale
        if SOFTCAP:  # scores are in base 2 here, and so is `cap`
            s = cap * _tanh(s / cap)
        s = tl.where(_keep(offs_m, cols, Mask, smm, smn, Docs, sdn, SQ, SK, CAUSAL, HAS_MASK, HAS_DOCS), s, float("-inf"))
        m_i, l_i, acc = _online_softmax_step(s, v, m_i, l_i, acc, PRECISION)
    out, empty = _normalized(acc, l_i)
    tl.store(O + b * sob + h * soh + offs_m[:, None] * som + offs_d[None, :] * sod, out.to(O.dtype.element_ty),
             mask=(offs_m[:, None] < SQ) & (offs_d[None, :] < D))
    lse = tl.where(empty, float("inf"), m_i + tl.log2(tl.where(empty, 1.0, l_i)))
    tl.store(LSE + bh.to(tl.int64) * SQ + offs_m, lse, mask=offs_m < SQ)


@triton.jit
def _attn_backward_dkdv(Q, K, V, Mask, DO, LSE, DELTA, DK, DV, qk_scale, sm_scale, cap,
                        sqb, sqh, sqm, sqd, skb, skh, skn, skd, svb, svh, svn, svd, smb, smh, smm, smn,
                        Docs, sdb, sdn, sdob, sdoh, sdom, sdod, H, GROUP, SQ, SK, D,
                        CAUSAL: tl.constexpr, HAS_MASK: tl.constexpr, HAS_DOCS: tl.constexpr, SOFTCAP: tl.constexpr,
                        PRECISION: tl.constexpr,
                        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr):
    start_n = tl.program_id(0)
    bh = tl.program_id(1)
    b = (bh // H).to(tl.int64)
    h = (bh % H).to(tl.int64)
    hk = h // GROUP
    offs_n = start_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_m = tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    Q += b * sqb + h * sqh
    DO += b * sdob + h * sdoh
    Mask += b * smb + h * smh
    Docs += b * sdb
    LSE += bh.to(tl.int64) * SQ
    DELTA += bh.to(tl.int64) * SQ
    kv_mask = (offs_n[:, None] < SK) & (offs_d[None, :] < D)
    k = tl.load(K + b * skb + hk * skh + offs_n[:, None] * skn + offs_d[None, :] * skd, mask=kv_mask, other=0.0)
    v = tl.load(V + b * svb + hk * svh + offs_n[:, None] * svn + offs_d[None, :] * svd, mask=kv_mask, other=0.0)
    dk = tl.zeros((BLOCK_N, BLOCK_D), dtype=tl.float32)
    dv = tl.zeros((BLOCK_N, BLOCK_D), dtype=tl.float32)
    begin_m = 0
    if CAUSAL:
        begin_m = (start_n * BLOCK_N // BLOCK_M) * BLOCK_M
    for start_m in range(begin_m, SQ, BLOCK_M):
        rows = start_m + offs_m
        row_mask = (rows[:, None] < SQ) & (offs_d[None, :] < D)
        q = tl.load(Q + rows[:, None] * sqm + offs_d[None, :] * sqd, mask=row_mask, other=0.0)
        do = tl.load(DO + rows[:, None] * sdom + offs_d[None, :] * sdod, mask=row_mask, other=0.0)
        lse = tl.load(LSE + rows, mask=rows < SQ, other=float("inf"))
        delta = tl.load(DELTA + rows, mask=rows < SQ, other=0.0)
        p, ds = _probs_and_score_grads(q, k, v, do, lse, delta, rows, offs_n, qk_scale, cap, Mask, smm, smn, Docs,
                                       sdn, SQ, SK, CAUSAL, HAS_MASK, HAS_DOCS, SOFTCAP, PRECISION)
        dv += tl.dot(tl.trans(p.to(do.dtype)), do, input_precision=PRECISION)
        dk += tl.dot(tl.trans(ds.to(q.dtype)), q, input_precision=PRECISION)
    out = b * H * SK * D + h * SK * D + offs_n[:, None] * D + offs_d[None, :]
    tl.store(DK + out, (dk * sm_scale).to(DK.dtype.element_ty), mask=kv_mask)
    tl.store(DV + out, dv.to(DV.dtype.element_ty), mask=kv_mask)


@triton.jit
def _attn_backward_dq(Q, K, V, Mask, DO, LSE, DELTA, DQ, qk_scale, sm_scale, cap,
                      sqb, sqh, sqm, sqd, skb, skh, skn, skd, svb, svh, svn, svd, smb, smh, smm, smn,
                      Docs, sdb, sdn, sdob, sdoh, sdom, sdod, H, GROUP, SQ, SK, D,
                      CAUSAL: tl.constexpr, HAS_MASK: tl.constexpr, HAS_DOCS: tl.constexpr, SOFTCAP: tl.constexpr,
                      PRECISION: tl.constexpr,
                      BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr):
    start_m = tl.program_id(0)
    bh = tl.program_id(1)
    b = (bh // H).to(tl.int64)
    h = (bh % H).to(tl.int64)
    hk = h // GROUP
    offs_m = start_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    K += b * skb + hk * skh
    V += b * svb + hk * svh
    Mask += b * smb + h * smh
    Docs += b * sdb
    row_mask = (offs_m[:, None] < SQ) & (offs_d[None, :] < D)
    q = tl.load(Q + b * sqb + h * sqh + offs_m[:, None] * sqm + offs_d[None, :] * sqd, mask=row_mask, other=0.0)
    do = tl.load(DO + b * sdob + h * sdoh + offs_m[:, None] * sdom + offs_d[None, :] * sdod, mask=row_mask,
                 other=0.0)
    lse = tl.load(LSE + bh.to(tl.int64) * SQ + offs_m, mask=offs_m < SQ, other=float("inf"))
    delta = tl.load(DELTA + bh.to(tl.int64) * SQ + offs_m, mask=offs_m < SQ, other=0.0)
    dq = tl.zeros((BLOCK_M, BLOCK_D), dtype=tl.float32)
    end_n = SK
    if CAUSAL:
        end_n = tl.minimum(SK, (start_m + 1) * BLOCK_M)
    for start_n in range(0, end_n, BLOCK_N):
        cols = start_n + offs_n
        col_mask = (cols[:, None] < SK) & (offs_d[None, :] < D)
        k = tl.load(K + cols[:, None] * skn + offs_d[None, :] * skd, mask=col_mask, other=0.0)
        v = tl.load(V + cols[:, None] * svn + offs_d[None, :] * svd, mask=col_mask, other=0.0)
        _, ds = _probs_and_score_grads(q, k, v, do, lse, delta, offs_m, cols, qk_scale, cap, Mask, smm, smn, Docs,
                                       sdn, SQ, SK, CAUSAL, HAS_MASK, HAS_DOCS, SOFTCAP, PRECISION)
        dq += tl.dot(ds.to(k.dtype), k, input_precision=PRECISION)
    tl.store(DQ + b * H * SQ * D + h * SQ * D + offs_m[:, None] * D + offs_d[None, :],
             (dq * sm_scale).to(DQ.dtype.element_ty), mask=row_mask)


def _blocks(sq: int, sk: int, d: int) -> tuple[int, int, int]:
    block_d = max(16, triton.next_power_of_2(d))
    block_m = min(64, max(16, triton.next_power_of_2(sq)))
    block_n = min(64 if block_d <= 64 else 32, max(16, triton.next_power_of_2(sk)))
    return block_m, block_n, block_d


def _mask_strides(mask, shape):
    """The keep-mask as uint8 broadcast to (b, h, q, k) without copying, and its four strides."""
    if mask is None:
        return None, (0, 0, 0, 0)  # the kernel never reads it; a dummy pointer stands in
    if mask.dtype != torch.bool:
        raise TypeError(f"flash attention takes a boolean keep-mask, got dtype {mask.dtype}")
    try:
        expanded = mask.view(torch.uint8).expand(shape)
    except RuntimeError:
        raise ValueError(f"attention mask of shape {tuple(mask.shape)} does not broadcast to {tuple(shape)}") from None
    return expanded, expanded.stride()


def _check(q, k, v):
    if q.dim() != 4 or k.dim() != 4 or v.dim() != 4:
        raise ValueError("flash attention takes (batch, heads, seq, head_dim) tensors, got shapes "
                         f"{tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}")
    if k.shape != v.shape or q.shape[0] != k.shape[0] or q.shape[3] != k.shape[3]:
        raise ValueError(f"q {tuple(q.shape)}, k {tuple(k.shape)} and v {tuple(v.shape)} do not fit together")
    if q.shape[1] % k.shape[1]:
        raise ValueError(f"{k.shape[1]} key/value heads do not divide {q.shape[1]} query heads")
    if not (q.dtype == k.dtype == v.dtype) or q.dtype not in (torch.float16, torch.bfloat16, torch.float32):
        raise TypeError(f"flash attention needs q, k, v of one float dtype, got {q.dtype}, {k.dtype}, {v.dtype}")
    if q.shape[3] > 256:
        raise ValueError(f"flash attention supports head_dim up to 256, got {q.shape[3]}")


def _documents(documents, b: int, sq: int, sk: int):
    """Document ids as int32 (batch|1, seq) and their (batch, seq) strides; (None, (0, 0)) without packing."""
    if documents is None:
        return None, (0, 0)
    if sq != sk or documents.dim() != 2 or documents.shape[1] != sq or documents.shape[0] not in (1, b):
        raise ValueError(f"document ids of shape {tuple(documents.shape)} do not fit a self-attention of {b} rows "
                         f"of {sq} queries and {sk} keys")
    documents = documents.to(torch.int32)
    return documents, (documents.stride(0) if documents.shape[0] == b else 0, documents.stride(1))


class _FlashAttention(torch.autograd.Function):
    """(out, lse): the attention and each row's natural log-sum-exp of its visible scores (+inf where it sees none),
    both differentiable: a gradient on lse enters backward through delta (d lse / d score = probability), which is
    how the attention op adds gpt-oss's sinks on top."""

    @staticmethod
    def forward(ctx, q, k, v, mask, causal, scale, softcap, documents):
        _check(q, k, v)
        ctx.set_materialize_grads(False)
        b, h, sq, d = q.shape
        hk, sk = k.shape[1], k.shape[2]
        mask_t, mask_s = _mask_strides(mask, (b, h, sq, sk))
        mask_arg = q if mask_t is None else mask_t
        docs, docs_s = _documents(documents, b, sq, sk)
        docs_arg = mask_arg if docs is None else docs
        # (batch, seq, heads, head_dim) in memory: merging the heads for the output projection is then a view, and
        # that projection keeps the very tensor kept here
        out = torch.empty(b, sq, h, d, device=q.device, dtype=q.dtype).transpose(1, 2)
        lse = torch.empty(b, h, sq, device=q.device, dtype=torch.float32)
        block_m, block_n, block_d = _blocks(sq, sk, d)
        precision = "ieee" if q.dtype == torch.float32 else "tf32"
        if out.numel():
            _attn_forward[(triton.cdiv(sq, block_m), b * h)](
                q, k, v, mask_arg, out, lse, scale * LOG2E, (softcap or 1.0) * LOG2E, *q.stride(), *k.stride(),
                *v.stride(), *mask_s, docs_arg, *docs_s, *out.stride(), h, h // hk, sq, sk, d, CAUSAL=causal,
                HAS_MASK=mask is not None, HAS_DOCS=docs is not None, SOFTCAP=softcap is not None, PRECISION=precision, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_D=block_d,
                num_warps=4, num_stages=2)
        ctx.save_for_backward(q, k, v, mask_arg, docs_arg, out, lse)
        ctx.causal, ctx.scale, ctx.has_mask, ctx.mask_strides = causal, scale, mask is not None, mask_s
        ctx.has_docs, ctx.docs_strides = docs is not None, docs_s
        ctx.softcap = softcap
        natural_lse = lse / LOG2E
        return out, natural_lse

    @staticmethod
    def backward(ctx, dout, dlse):
        q, k, v, mask_t, docs, out, lse = ctx.saved_tensors
        b, h, sq, d = q.shape
        hk, sk = k.shape[1], k.shape[2]
        group = h // hk
        if dout is None:
            dout = torch.zeros_like(out)
        delta = (dout.float() * out.float()).sum(-1)
        if dlse is not None:  # d lse / d score_j = p_j: the scores' gradient p_j (dp_j - delta + dlse)
            delta = delta - torch.where(torch.isinf(lse), 0.0, dlse.float())
        dq = torch.empty(b, h, sq, d, device=q.device, dtype=q.dtype)
        kv_dtype = torch.float32 if group > 1 else k.dtype
        dk = torch.empty(b, h, sk, d, device=q.device, dtype=kv_dtype)
        dv = torch.empty(b, h, sk, d, device=q.device, dtype=kv_dtype)
        block_m, block_n, block_d = _blocks(sq, sk, d)
        precision = "ieee" if q.dtype == torch.float32 else "tf32"
        cap = (ctx.softcap or 1.0) * LOG2E
        common = (*q.stride(), *k.stride(), *v.stride(), *ctx.mask_strides, docs, *ctx.docs_strides, *dout.stride(),
                  h, group, sq, sk, d)
        flags = dict(CAUSAL=ctx.causal, HAS_MASK=ctx.has_mask, HAS_DOCS=ctx.has_docs, SOFTCAP=ctx.softcap is not None,
                     PRECISION=precision, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_D=block_d, num_warps=4, num_stages=1)
        if q.numel() and k.numel():
            _attn_backward_dkdv[(triton.cdiv(sk, block_n), b * h)](
                q, k, v, mask_t, dout, lse, delta, dk, dv, ctx.scale * LOG2E, ctx.scale, cap, *common, **flags)
            _attn_backward_dq[(triton.cdiv(sq, block_m), b * h)](
                q, k, v, mask_t, dout, lse, delta, dq, ctx.scale * LOG2E, ctx.scale, cap, *common, **flags)
        else:
            dq.zero_(), dk.zero_(), dv.zero_()
        if group > 1:
            dk = dk.view(b, hk, group, sk, d).sum(2).to(k.dtype)
            dv = dv.view(b, hk, group, sk, d).sum(2).to(v.dtype)
        return dq, dk, dv, None, None, None, None, None


def flash_attention_triton(q, k, v, mask=None, *, causal: bool = False, scale: float | None = None,
                           softcap: float | None = None, documents: torch.Tensor | None = None,
                           return_lse: bool = False):
    """softmax(q k^T * scale, masked) v for (batch, heads, seq, head_dim) inputs; `mask` is a boolean keep-mask;
    `softcap` caps the scaled scores to softcap * tanh(scores / softcap) first; `documents` (batch, seq) ids keep
    each query to keys of its own document (self-attention only). `return_lse`: also each row's log-sum-exp
    (batch, heads, seq), +inf where a row sees no key, differentiable."""
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    out, lse = _FlashAttention.apply(q, k, v, mask, causal, float(scale),
                                     None if softcap is None else float(softcap), documents)
    return (out, lse) if return_lse else out
