"""A family map's unit: which HF tensors make up one of our global parameters, and how."""
from __future__ import annotations

import re
from dataclasses import dataclass, replace

import torch

from colozoo.core.errors import CheckpointError


@dataclass(frozen=True)
class Source:
    names: tuple[str, ...]
    transpose: bool = False
    cat_dim: int = 0
    # stack > 0: `names` are `stack` equal groups (one per expert); each group is concatenated along cat_dim
    # (a dim of the HF tensors) into one item, and the items are stacked along a new leading dim of ours
    stack: int = 0
    # regroup (groups, parts): one HF tensor whose cat_dim is laid out (groups, parts, rest), e.g. GPT-NeoX's fused
    # query_key_value stored per head as (heads, 3, head_dim); ours holds the same rows as (parts, groups, rest),
    # i.e. [q; k; v], so the shard spec's chunks cut whole heads of each part
    regroup: tuple[int, int] | None = None

    @classmethod
    def of(cls, *names: str, transpose: bool = False, cat_dim: int = 0, stack: int = 0,
           regroup: tuple[int, int] | None = None) -> "Source":
        if stack and len(names) % stack:
            raise ValueError(f"{len(names)} names cannot form {stack} stacked items")
        if regroup is not None and (len(names) != 1 or stack or transpose):
            raise ValueError("regroup reorders one plain HF tensor (no stack, no transpose)")
        return cls(tuple(names), transpose, cat_dim, stack, tuple(regroup) if regroup is not None else None)

    def renamed(self, renames) -> "Source":
        """The same tensors under another naming: `renames` is a list of (regex, replacement) applied in turn."""
        names = self.names
        for pattern, replacement in renames:
            names = tuple(re.sub(pattern, replacement, n) for n in names)
        return replace(self, names=names)

    def hf_positions(self, length: int) -> torch.Tensor:
        """For each position along cat_dim of ours (regrouped), its position in the HF tensor."""
        groups, parts = self.regroup
        return torch.arange(length).view(groups, parts, -1).transpose(0, 1).reshape(-1)

    def groups(self) -> list["Source"]:
        """One plain Source per stacked item."""
        n = len(self.names) // self.stack
        return [Source(self.names[i * n:(i + 1) * n], self.transpose, self.cat_dim) for i in range(self.stack)]

    def split(self, tensor: torch.Tensor, sizes: list[int] | None = None) -> dict[str, torch.Tensor]:
        """Our global tensor back into its HF tensors; `sizes` are the part lengths along cat_dim (default equal)."""
        if self.stack:
            if tensor.shape[0] != self.stack:
                raise CheckpointError(f"expected {self.stack} stacked items, got a tensor of shape {tuple(tensor.shape)}")
            return {k: v for item, group in zip(tensor.unbind(0), self.groups()) for k, v in group.split(item, sizes).items()}
        if self.regroup:
            groups, parts = self.regroup
            return {self.names[0]: _swap(tensor, self.cat_dim, (parts, groups)).contiguous()}
        if sizes is None:
            sizes = [tensor.shape[self.cat_dim] // len(self.names)] * len(self.names)
        parts = tensor.split(list(sizes), dim=self.cat_dim)
        return {name: (part.t() if self.transpose else part).contiguous() for name, part in zip(self.names, parts)}


def _swap(tensor: torch.Tensor, dim: int, outer: tuple[int, int]) -> torch.Tensor:
    """View `dim` as (outer[0], outer[1], rest) and swap the two outer factors (a pure copy: bit exact)."""
    a, b = outer
    if tensor.shape[dim] % (a * b):
        raise ValueError(f"dimension {dim} of length {tensor.shape[dim]} cannot be regrouped as {a} x {b} x rest")
    return tensor.unflatten(dim, (a, b, -1)).transpose(dim, dim + 1).flatten(dim, dim + 2)
