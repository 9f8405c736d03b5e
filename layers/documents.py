"""Packed sequences: several documents in one row of the batch, told apart by their position ids.

transformers' convention (masking_utils.find_packed_sequence_indices): when `position_ids` are given, there is no
`attention_mask` and no KV cache, a position that is not the previous position + 1 starts a new document, and each
token attends only to earlier tokens of its own document (sliding windows and soft-capping apply as usual). The
batch context computes the document ids once per batch (`BatchContext.documents`); every attention path takes these
(batch, seq) ids: the torch path turns them into a dense keep-mask (`kernels.attention.with_documents`), the flash
kernel and ring / all-to-all attention compare ids per block."""
from __future__ import annotations

import torch

from colozoo.kernels.attention import same_document, with_documents  # noqa: F401 (the dense-mask side, for attention)


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
