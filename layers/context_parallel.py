"""Context parallelism: the sequence is split over the cp ranks and attention runs across them.

Sharding. A sequence of length S is cut into 2*cp chunks; rank r holds chunks r and 2*cp-1-r ("zigzag"),
so under a causal mask every rank has the same amount of work. Every per-token tensor of a batch (ids,
position ids, labels, hidden states) is sharded the same way: `zigzag_index` gives the global positions
a rank holds, `shard_sequence` / `gather_sequence` move between the full and the local view.

Two attention modes (`ContextParallel.mode`):

- "ring": K/V blocks travel around the cp ring; each rank attends its queries to every block with a
  blockwise online softmax (running log-sum-exp) and never holds more than two K/V blocks, in forward and
  in backward (where dK/dV travel with their block back to its owner). Causal, padding and sliding-window
  masks are computed per block from global positions, packed documents from the whole sequence's document ids
  (`ContextParallel.documents`, O(S)); fully masked sub-blocks are skipped. A score `softcap`
  (Gemma 2) is applied per block before the mask, and its tanh slope enters the backward pass.
- "all_to_all" (Ulysses): an all-to-all swaps sequence sharding for head sharding, every rank runs full
  attention on heads/cp heads over the whole sequence, and a second all-to-all swaps back.

How a family opts in: pass `cp=batch.cp` to `layers.attention.attention`, take positions from
`batch.position_ids` (already the rank's tokens), and pass `cp=batch.cp` to `VocabParallelLMHead.loss` and
`.full_logits` (labels stay the full sequence; the loss is the mean over all cp ranks' tokens). The batch is
sharded by `shard_batch`, called by `ParallelModel.forward` (pp == 1, via `context_parallel_forward`) and by
each pipeline stage (pp > 1). Families doing so: gpt2, opt, llama/mistral, mixtral, gemma2/gemma3_text.
The `cp_mode=` keyword of each call (the forward, forward_backward) picks the mode; "ring" by default.
Parameter gradients are partial on each cp rank: sum them over the cp group (the dp_cp reduction).
Memory: neither mode builds a (batch, 1, S, S) mask at long S; the family's dense mask is dropped unbuilt. The
ring masks per block. Ulysses without padding, window or packed documents needs no mask; bidirectional attention over padding takes
a (batch, 1, 1, S) key mask; causal attention over padding, sliding windows and packed documents run in chunks of queries, each
against the keys it can reach, with a (batch, 1, chunk, keys) mask: exact at every position, padding included.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from colozoo.kernels.attention import local_attention

from .comm import group_rank, group_size
from .documents import same_document

CP_MODES = ("ring", "all_to_all")


def zigzag_index(seq_len: int, size: int, rank: int, device=None) -> torch.Tensor:
    """Global positions held by `rank`: chunks rank and 2*size-1-rank of 2*size equal chunks."""
    if seq_len % (2 * size):
        raise ValueError(f"context parallel needs the sequence length ({seq_len}) divisible by 2*cp = {2 * size}")
    c = seq_len // (2 * size)
    first = torch.arange(rank * c, (rank + 1) * c, device=device)
    second = torch.arange((2 * size - 1 - rank) * c, (2 * size - rank) * c, device=device)
    return torch.cat([first, second])


def zigzag_order(seq_len: int, size: int, device=None) -> torch.Tensor:
    """Global positions of the rank-major concatenation of every rank's tokens."""
    return torch.cat([zigzag_index(seq_len, size, r, device) for r in range(size)])


@dataclass
class ContextParallel:
    """What attention and the loss need to know about the cp sharding of one batch."""
    group: object
    mode: str
    seq_len: int                              # global sequence length
    attention_mask: torch.Tensor | None       # (batch, seq_len) full padding mask, 1 = token
    documents: torch.Tensor | None = None     # (batch, seq_len) packed document ids of the full sequence

    def __post_init__(self):
        if self.mode not in CP_MODES:
            raise ValueError(f"cp_mode must be one of {CP_MODES}, got {self.mode!r}")
        self.size, self.rank = group_size(self.group), group_rank(self.group)
        # positions stay on the CPU: which blocks to skip is decided there, without device syncs
        self.index = zigzag_index(self.seq_len, self.size, self.rank)

    def index_of(self, rank: int) -> torch.Tensor:
        return zigzag_index(self.seq_len, self.size, rank)

    def shard(self, x: torch.Tensor, dim: int = 1) -> torch.Tensor:
        return x.index_select(dim, self.index.to(x.device))

    def key_keep(self, rank: int) -> torch.Tensor | None:
        if self.attention_mask is None:
            return None
        return self.attention_mask.index_select(1, self.index_of(rank).to(self.attention_mask.device)).bool()


def shard_sequence(x: torch.Tensor, group, dim: int = 1) -> torch.Tensor:
    """The rank's zigzag share of a full per-token tensor (no autograd across ranks needed: inputs are replicated)."""
    size = group_size(group)
    if size == 1:
        return x
    return x.index_select(dim, zigzag_index(x.shape[dim], size, group_rank(group), x.device))


class _GatherSequence(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, dim, group):
        ctx.dim, ctx.group = dim, group
        size = group_size(group)
        parts = [torch.empty_like(x) for _ in range(size)]
        dist.all_gather(parts, x.contiguous(), group=group)
        order = zigzag_order(x.shape[dim] * size, size, x.device)
        stacked = torch.cat(parts, dim)
        return torch.empty_like(stacked).index_copy_(dim, order, stacked)

    @staticmethod
    def backward(ctx, grad):
        return shard_sequence(grad, ctx.group, ctx.dim), None, None


def gather_sequence(x: torch.Tensor, group, dim: int = 1) -> torch.Tensor:
    """Inverse of `shard_sequence`: every rank gets the full tensor in natural order (backward: its share)."""
    return _GatherSequence.apply(x, dim, group) if group_size(group) > 1 else x


# ---------------------------------------------------------------------------------------------------------
# ring attention


def _block_mask(q_pos, k_pos, key_keep, causal: bool, window: int | None, documents=None):
    """Boolean (batch|1, 1, q, k) mask for one block, True = attend; None when everything is allowed.
    `documents`: the whole sequence's (batch, S) packed document ids; pairs of two documents are masked."""
    mask = None
    if causal or window is not None:
        diff = q_pos[:, None] - k_pos[None, :]
        allowed = torch.ones_like(diff, dtype=torch.bool)
        if causal:
            allowed &= diff >= 0
        if window is not None:
            allowed &= diff < window
        mask = allowed[None, None]
    if key_keep is not None:
        keep = key_keep[:, None, None, :]
        mask = keep if mask is None else mask & keep
    if documents is not None:
        same = same_document(documents[:, q_pos], documents[:, k_pos])
        mask = same if mask is None else mask & same
    return mask


def _skippable(q_range, k_range, causal: bool, window: int | None) -> bool:
    """Whether every (q, k) pair of two contiguous position ranges [lo, hi) is masked out."""
    (q_lo, q_hi), (k_lo, k_hi) = q_range, k_range
    if causal and q_hi - 1 < k_lo:
        return True
    return window is not None and q_lo - (k_hi - 1) >= window


def _expand_kv(x, groups: int):
    return x if groups == 1 else x.repeat_interleave(groups, dim=1)


def _reduce_kv(grad, groups: int):
    if groups == 1:
        return grad
    b, h, s, d = grad.shape
    return grad.view(b, h // groups, groups, s, d).sum(2)


def _scores(q, k, scale, softcap):
    """Scores of one block, capped with `softcap`; also d(capped)/d(raw) for backward (None without a cap)."""
    scores = torch.matmul(q, k.transpose(-1, -2)) * scale
    if softcap is None:
        return scores, None
    capped = torch.tanh(scores / softcap)
    return capped * softcap, 1 - capped * capped


def _attend_block(q, k, v, mask, scale, softcap=None):
    """fp32 softmax(q k^T) v of one block and its row log-sum-exp (-inf for fully masked rows)."""
    scores, _ = _scores(q, k, scale, softcap)
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    lse = torch.logsumexp(scores, dim=-1, keepdim=True)
    probs = torch.exp(scores - _finite(lse))
    return torch.matmul(probs, v), lse


def _finite(lse):
    return torch.where(torch.isinf(lse), torch.zeros_like(lse), lse)


def _merge(out, lse, block_out, block_lse):
    """Fold a block's (normalised output, lse) into the running ones, in place."""
    new_lse = torch.logaddexp(lse, block_lse)
    safe = _finite(new_lse)
    out.mul_(torch.exp(lse - safe)).add_(block_out * torch.exp(block_lse - safe))
    lse.copy_(new_lse)


class _Ring:
    """Pass a tensor to the next rank of the group and receive the previous rank's, asynchronously."""

    def __init__(self, group):
        self.group, self.size, self.rank = group, group_size(group), group_rank(group)
        self.next = dist.get_global_rank(group, (self.rank + 1) % self.size)
        self.prev = dist.get_global_rank(group, (self.rank - 1) % self.size)

    def start(self, tensor):
        recv = torch.empty_like(tensor)
        ops = [dist.P2POp(dist.isend, tensor, self.next, self.group),
               dist.P2POp(dist.irecv, recv, self.prev, self.group)]
        return recv, dist.batch_isend_irecv(ops)

    @staticmethod
    def wait(requests):
        for r in requests:
            r.wait()


def _chunks(pos: torch.Tensor, device, n: int = 2):
    """The two zigzag chunks of a rank's (CPU) positions: (local slice, positions on `device`, (lo, hi))."""
    step = pos.shape[0] // n
    out = []
    for i in range(n):
        run = pos[i * step:(i + 1) * step]
        out.append((slice(i * step, (i + 1) * step), run.to(device), (int(run[0]), int(run[-1]) + 1)))
    return out


class _RingAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, cp: ContextParallel, causal, scale, window, softcap):
        ring, groups = _Ring(cp.group), q.shape[1] // k.shape[1]
        qf = q.float()
        b, h, s, d = q.shape
        out = torch.zeros(b, h, s, d, dtype=torch.float32, device=q.device)
        lse = torch.full((b, h, s, 1), float("-inf"), dtype=torch.float32, device=q.device)
        q_chunks = _chunks(cp.index, q.device)
        kv = torch.stack([k, v])  # travels in the input dtype; blocks are computed in fp32
        for step in range(ring.size):
            pending = ring.start(kv) if step < ring.size - 1 else None
            src = (ring.rank - step) % ring.size
            keep = cp.key_keep(src)
            for kslice, k_pos, k_range in _chunks(cp.index_of(src), q.device):
                kk, vv = (_expand_kv(t[:, :, kslice].float(), groups) for t in kv)
                for qslice, q_pos, q_range in q_chunks:
                    if _skippable(q_range, k_range, causal, window):
                        continue
                    mask = _block_mask(q_pos, k_pos, keep[:, kslice] if keep is not None else None, causal, window,
                                       cp.documents)
                    block_out, block_lse = _attend_block(qf[:, :, qslice], kk, vv, mask, scale, softcap)
                    _merge(out[:, :, qslice], lse[:, :, qslice], block_out, block_lse)
            if pending is not None:
                kv, requests = pending
                ring.wait(requests)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.cp, ctx.causal, ctx.scale, ctx.window, ctx.softcap = cp, causal, scale, window, softcap
        return out.to(q.dtype)

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse = ctx.saved_tensors
        cp, causal, scale, window = ctx.cp, ctx.causal, ctx.scale, ctx.window
        ring, groups = _Ring(cp.group), q.shape[1] // k.shape[1]
        qf, dout = q.float(), dout.float()
        delta = (dout * out).sum(-1, keepdim=True)
        dq = torch.zeros_like(qf)
        q_chunks = _chunks(cp.index, q.device)
        kv = torch.stack([k, v]).float()
        dkv = torch.zeros_like(kv)
        for step in range(ring.size):
            src = (ring.rank - step) % ring.size
            keep = cp.key_keep(src)
            for kslice, k_pos, k_range in _chunks(cp.index_of(src), q.device):
                kk, vv = (_expand_kv(t[:, :, kslice], groups) for t in kv)
                dk = torch.zeros_like(kk)
                dv = torch.zeros_like(vv)
                for qslice, q_pos, q_range in q_chunks:
                    if _skippable(q_range, k_range, causal, window):
                        continue
                    mask = _block_mask(q_pos, k_pos, keep[:, kslice] if keep is not None else None, causal, window,
                                       cp.documents)
                    qq, do = qf[:, :, qslice], dout[:, :, qslice]
                    scores, slope = _scores(qq, kk, scale, ctx.softcap)
                    probs = torch.exp(scores - _finite(lse[:, :, qslice]))
                    if mask is not None:
                        probs = probs.masked_fill(~mask, 0.0)
                    dv += torch.matmul(probs.transpose(-1, -2), do)
                    dscores = probs * (torch.matmul(do, vv.transpose(-1, -2)) - delta[:, :, qslice]) * scale
                    if slope is not None:
                        dscores = dscores * slope
                    dq[:, :, qslice] += torch.matmul(dscores, kk)
                    dk += torch.matmul(dscores.transpose(-1, -2), qq)
                dkv[0][:, :, kslice] += _reduce_kv(dk, groups)
                dkv[1][:, :, kslice] += _reduce_kv(dv, groups)
            # K/V go on to the next rank; their gradients follow and, after size hops, are back home
            # one message per hop (two in flight to the same peer could be matched out of order)
            moving = torch.cat([kv, dkv]) if step < ring.size - 1 else dkv
            moving, requests = ring.start(moving)
            ring.wait(requests)
            kv, dkv = (moving[:2], moving[2:]) if step < ring.size - 1 else (kv, moving)
        dk, dv = dkv
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), None, None, None, None, None


def ring_attention(q, k, v, cp: ContextParallel, *, causal: bool, scale: float | None = None,
                   window: int | None = None, softcap: float | None = None) -> torch.Tensor:
    """Attention of the rank's queries to the whole (cp-sharded) sequence; q/k/v are (batch, heads, local_seq, d)."""
    if scale is None:
        scale = q.shape[-1] ** -0.5
    return _RingAttention.apply(q, k, v, cp, causal, scale, window, softcap)


# ---------------------------------------------------------------------------------------------------------
# all-to-all (Ulysses)


def _all_to_all(x, scatter_dim: int, gather_dim: int, group):
    size = group_size(group)
    send = torch.stack(x.chunk(size, dim=scatter_dim)).contiguous()
    recv = torch.empty_like(send)
    dist.all_to_all_single(recv, send, group=group)
    return torch.cat(recv.unbind(0), dim=gather_dim)


class _AllToAll(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, scatter_dim, gather_dim, group):
        ctx.dims, ctx.group = (scatter_dim, gather_dim), group
        return _all_to_all(x, scatter_dim, gather_dim, group)

    @staticmethod
    def backward(ctx, grad):
        scatter_dim, gather_dim = ctx.dims
        return _all_to_all(grad, gather_dim, scatter_dim, ctx.group), None, None, None


def all_to_all(x, group, scatter_dim: int, gather_dim: int):
    """Autograd-aware all-to-all: split `scatter_dim` over the ranks, concatenate what arrives along `gather_dim`."""
    return _AllToAll.apply(x, scatter_dim, gather_dim, group) if group_size(group) > 1 else x


def ulysses_attention(q, k, v, cp: ContextParallel, *, causal: bool, scale=None, dropout_p: float = 0.0,
                      upcast: bool = False, window: int | None = None, softcap: float | None = None,
                      sinks: torch.Tensor | None = None) -> torch.Tensor:
    if q.shape[1] % cp.size:
        raise ValueError(f"cp_mode='all_to_all' needs the local attention heads ({q.shape[1]}) divisible by cp={cp.size}")
    if k.shape[1] % cp.size:  # too few kv heads to split: give every q head its own copy
        k, v = (_expand_kv(t, q.shape[1] // t.shape[1]) for t in (k, v))
    order = zigzag_order(cp.seq_len, cp.size, q.device)
    natural = torch.argsort(order)

    def to_heads(x):  # (b, h, s_local, d) -> (b, h/cp, S, d) in natural order
        return all_to_all(x, cp.group, scatter_dim=1, gather_dim=2).index_select(2, natural)

    q, k, v = to_heads(q), to_heads(k), to_heads(v)
    options = dict(scale=scale, dropout_p=dropout_p, upcast=upcast, softcap=softcap)
    if sinks is not None:  # the heads this rank attends over after the all-to-all
        options["sinks"] = sinks.chunk(cp.size)[group_rank(cp.group)]
    padding, documents = cp.attention_mask, cp.documents
    window = window if window is not None and window < cp.seq_len else None  # a window as long masks nothing
    if padding is None and window is None and documents is None:
        out = local_attention(q, k, v, causal=causal, **options)
    elif window is None and not causal and documents is None:  # a key mask broadcasts over the queries
        out = local_attention(q, k, v, padding.to(q.device).bool()[:, None, None, :], causal=False, **options)
    else:
        out = _chunked_attention(q, k, v, padding, causal, window, documents, **options)
    return all_to_all(out.index_select(2, order), cp.group, scatter_dim=2, gather_dim=1)


QUERY_CHUNK = 512  # at least this many queries per chunk of masked attention


def _chunked_attention(q, k, v, padding, causal: bool, window: int | None, documents=None, **options):
    """Masked attention in chunks of queries, each against the keys it can reach (causal: none after the chunk;
    a window: none before it): masks are (batch|1, 1, chunk, keys), never (S, S), and unreachable keys are not
    computed at all."""
    seq, chunk = q.shape[2], max(window or 0, QUERY_CHUNK)
    pos = torch.arange(seq, device=q.device)
    keep = padding.to(q.device).bool() if padding is not None else None
    outs = []
    for start in range(0, seq, chunk):
        stop = min(start + chunk, seq)
        keys = slice(max(0, start - window + 1) if window else 0, stop if causal else seq)
        mask = _block_mask(pos[start:stop], pos[keys], keep[:, keys] if keep is not None else None, causal, window,
                           documents)
        outs.append(local_attention(q[:, :, start:stop], k[:, :, keys], v[:, :, keys], mask, causal=False, **options))
    return torch.cat(outs, dim=2)


def full_mask(attention_mask, seq_len: int, causal: bool, window: int | None, device=None):
    """Boolean (batch|1, 1, S, S) mask of the whole sequence, or None for plain causal / no masking (the reference
    the cp modes are tested against)."""
    if attention_mask is None and window is None:
        return None
    pos = torch.arange(seq_len, device=device)
    keep = attention_mask.to(device).bool() if attention_mask is not None else None
    return _block_mask(pos, pos, keep, causal, window)


def context_parallel_attention(q, k, v, cp: ContextParallel, *, causal: bool, scale=None, dropout_p: float = 0.0,
                               upcast: bool = False, window: int | None = None,
                               softcap: float | None = None, sinks: torch.Tensor | None = None) -> torch.Tensor:
    if cp.mode == "all_to_all":
        return ulysses_attention(q, k, v, cp, causal=causal, scale=scale, dropout_p=dropout_p, upcast=upcast,
                                 window=window, softcap=softcap, sinks=sinks)
    if sinks is not None:
        raise ValueError("attention sinks are not supported with cp_mode='ring'; use cp_mode='all_to_all'")
    if dropout_p > 0.0:
        raise ValueError("attention dropout is not supported with cp_mode='ring'; use cp_mode='all_to_all'")
    # no `upcast` to pass: the ring computes scores, softmax and their product with v in fp32 whatever the dtype
    return ring_attention(q, k, v, cp, causal=causal, scale=scale, window=window, softcap=softcap)
