"""MoE token permute / unpermute: group token copies by expert, then combine the expert outputs back per token.

    permuted, row_map, tokens_per_expert = permute(hidden (T, H), expert_ids (T, k), num_experts)
    out = unpermute(expert_out (T*k, H), row_map, weights (T, k) or None, dtype=None)   # (T, H)

`row_map[t*k + j]` is the row of `permuted` that holds token t's copy for its j-th expert; rows are sorted by
expert (stable, so tokens keep their order inside an expert) and `tokens_per_expert` gives the group sizes.
Expert ids are global. `unpermute` sums each token's rows times its routing weights into `dtype` (default
expert_out's). Each op runs the Triton kernels (`moe_triton`) where `dispatch.use_triton` says so, otherwise its
torch reference here.
"""
from __future__ import annotations

import torch

from .dispatch import use_triton


def permute(hidden, expert_ids, num_experts: int):
    if use_triton(hidden):
        from .moe_triton import moe_permute_triton

        check_rows(hidden, expert_ids)
        check_expert_ids(expert_ids, num_experts)
        row_map, _, counts = route(expert_ids, num_experts)
        return moe_permute_triton(hidden, row_map, expert_ids.shape[1]), row_map, counts
    return permute_reference(hidden, expert_ids, num_experts)


def unpermute(expert_out, row_map, weights=None, dtype: torch.dtype | None = None):
    if use_triton(expert_out):
        from .moe_triton import moe_unpermute_triton

        check_weights(weights, row_map)
        out = moe_unpermute_triton(expert_out, row_map, weights)
        return out if dtype is None else out.to(dtype)
    return unpermute_reference(expert_out, row_map, weights, dtype)


def route(expert_ids: torch.Tensor, num_experts: int):
    """(row_map, order, tokens_per_expert) for (tokens, k) global expert ids: `order` lists the (token, slot) entries
    sorted by expert, `row_map` is its inverse."""
    if expert_ids.dim() != 2:
        raise ValueError(f"expert_ids must be (tokens, top_k), got shape {tuple(expert_ids.shape)}")
    flat = expert_ids.reshape(-1)
    order = torch.argsort(flat, stable=True)
    return _inverse(order), order, torch.bincount(flat, minlength=num_experts)


def _inverse(permutation: torch.Tensor) -> torch.Tensor:
    inverse = torch.empty_like(permutation)
    inverse[permutation] = torch.arange(permutation.numel(), device=permutation.device)
    return inverse


def permute_reference(hidden, expert_ids, num_experts: int):
    check_rows(hidden, expert_ids)
    row_map, order, counts = route(expert_ids, num_experts)
    return hidden[order // expert_ids.shape[1]], row_map, counts


def unpermute_reference(expert_out, row_map, weights=None, dtype: torch.dtype | None = None):
    """Each weighted row is cast to `dtype`, then summed per token in row order (by expert), as transformers' MoE
    blocks add up their experts."""
    check_weights(weights, row_map)
    dtype = expert_out.dtype if dtype is None else dtype
    k = 1 if weights is None else weights.shape[1]
    order = _inverse(row_map)
    if weights is not None:
        expert_out = expert_out * weights.reshape(-1)[order, None]
    combined = torch.zeros(row_map.numel() // k, expert_out.shape[-1], device=expert_out.device, dtype=dtype)
    return combined.index_add(0, order // k, expert_out.to(dtype))


def check_rows(hidden, expert_ids):
    if hidden.dim() != 2 or hidden.shape[0] != expert_ids.shape[0]:
        raise ValueError(f"hidden {tuple(hidden.shape)} must be (tokens, hidden) with tokens matching "
                         f"expert_ids {tuple(expert_ids.shape)}")


def check_expert_ids(expert_ids, num_experts: int):
    """Every id in [0, num_experts): the Triton path reads them back to the host to check (the torch path does not,
    so that it runs on meta tensors too)."""
    flat = expert_ids.reshape(-1)
    if flat.numel() and (int(flat.min()) < 0 or int(flat.max()) >= num_experts):
        raise ValueError(f"expert ids must lie in [0, {num_experts}); got range "
                         f"[{int(flat.min())}, {int(flat.max())}]")


def check_weights(weights, row_map):
    if weights is not None and (weights.dim() != 2 or weights.numel() != row_map.numel()):
        raise ValueError(f"routing weights {tuple(weights.shape)} do not match {row_map.numel()} routed rows")
