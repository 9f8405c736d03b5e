"""A family map's unit: which HF tensors make up one of our global parameters, and how."""
from __future__ import annotations

from dataclasses import dataclass

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

    @classmethod
    def of(cls, *names: str, transpose: bool = False, cat_dim: int = 0, stack: int = 0) -> "Source":
        if stack and len(names) % stack:
            raise ValueError(f"{len(names)} names cannot form {stack} stacked items")
        return cls(tuple(names), transpose, cat_dim, stack)

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
        if sizes is None:
            sizes = [tensor.shape[self.cat_dim] // len(self.names)] * len(self.names)
        parts = tensor.split(list(sizes), dim=self.cat_dim)
        return {name: (part.t() if self.transpose else part).contiguous() for name, part in zip(self.names, parts)}
