"""Packed sequences: several documents in one row of the batch, told apart by their position ids.

transformers' convention (masking_utils.find_packed_sequence_indices): when `position_ids` are given, there is no
`attention_mask` and no KV cache, a position that is not the previous position + 1 starts a new document, and each
token attends only to earlier tokens of its own document (sliding windows and soft-capping apply as usual). The
batch context computes the document ids once per batch (`BatchContext.documents`); every attention path takes these
(batch, seq) ids: the torch path turns them into a dense keep-mask, the flash kernel and ring / all-to-all
attention compare ids per block."""
from __future__ import annotations

import torch


def packed_documents(position_ids: torch.Tensor | None) -> torch.Tensor | None:
    """(batch, seq) int32 index of the document each token belongs to, from 0 in every row; None when no row holds
    more than one document (nothing to mask beyond causality)."""
    if position_ids is None or position_ids.is_meta or position_ids.dim() != 2 or position_ids.shape[1] < 2:
        return None
    starts = (position_ids[:, 1:] - position_ids[:, :-1]) != 1
    documents = torch.cat([torch.zeros_like(starts[:, :1]), starts], dim=1).cumsum(-1, dtype=torch.int32)
    if not bool(documents[:, -1].any()):
        return None
    return documents


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
