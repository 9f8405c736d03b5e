"""LoRA adapters on the tensor-parallel linears, laid out so the low-rank path rides the base layer's collectives.

    column-parallel base, weight (out/tp, in): A (k*r, in) replicated, B (out_adapted, r) sharded like the weight.
        One (A, B) pair per adapted fused chunk (q, k, v of a fused qkv; gate, up): A stacks the pairs' A along
        its rows, and B's split lists the adapted chunks, so each tp rank holds its share of every chunk's B.
    row-parallel base, weight (out, in/tp): A (r, in) split on the input dim, B (out, r) replicated; the low-rank
        path's partial output joins the base's partial sum before its all-reduce / reduce-scatter.
    key/value chunks replicated over tp (tp > kv heads): B's rows of such a chunk carry the same `parts`, so a rank
        holds the B rows of its whole kv head, and their gradient is summed over the head's replica group as the
        weight's is (each replica computes it from its own query heads).
    replicated base (layers.linear.ReplicatedLinear, MLA's compressions), weight (out, in) whole: A (r, in) and
        B (out, r) whole on every rank; their gradients are whole and equal on every rank as the weight's are, or,
        under sequence parallelism (each rank its share of the tokens), partial and summed over tp.

The replicated factor sees only this rank's share of the output (column) or of the input (row), so its gradient is
partial: `copy_to_parallel` sums it over tp in backward (a parameter-sized all-reduce, as the sequence-parallel norms
make); the activations pass through no collective the base layer does not already make.
    y = base(x) + scaling * B(A(dropout(x)))      scaling = alpha / r, or alpha / sqrt(r) with rsLoRA
computed in the adapters' dtype (fp32 by default, whatever the base's) and added in the base's.
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from .comm import copy_to_parallel, group_rank, group_size, sum_replica_grads
from .dropout import dropout
from .shard import Split, local_pieces, replicated_pieces, shard, shard_tensor


class LoRA(nn.Module):
    """The adapter of one Column/RowParallelLinear or ReplicatedLinear (`base`), attached to it as `base.lora`.

    `groups`: the base's fused chunks each HF module covers (OPT's q/k/v: one chunk each; GPT-2's c_attn: one
    module over all three; unfused: one module, one chunk); `adapted`: the groups that get an (A, B) pair;
    `hf_modules`: the HF module name of each adapted group (what PEFT names the pair after); `regroup`: the HF
    module's rows are ours viewed (groups, parts) (GPT-NeoX's per-head query_key_value, converters' Source)."""

    def __init__(self, base: nn.Module, r: int, alpha: float, dropout: float = 0.0, *, row: bool,
                 groups: tuple[tuple[int, ...], ...] | None = None, adapted: tuple[int, ...] = (0,),
                 hf_modules: tuple[str, ...] = (), use_rslora: bool = False, dtype=torch.float32,
                 regroup: tuple[int, int] | None = None):
        super().__init__()
        if r <= 0:
            raise ValueError(f"LoRA rank r must be a positive integer, got {r!r}")
        spec = base.weight.shard_spec[0] if getattr(base.weight, "shard_spec", ()) else Split("tp", 0)
        self.spec = spec
        self.chunks = spec.chunks or (base.out_features,)
        self.groups = tuple(groups) if groups is not None else (tuple(range(len(self.chunks))),)
        if sorted(c for g in self.groups for c in g) != list(range(len(self.chunks))):
            raise ValueError(f"module groups {self.groups} do not cover the base's chunks {self.chunks} once")
        self.replicated = getattr(base, "replicated", False)
        adapted = (0,) if row or self.replicated else tuple(adapted)
        if not adapted or sorted(set(adapted)) != list(adapted) or not 0 <= adapted[0] <= adapted[-1] < len(self.groups):
            raise ValueError(f"adapted groups {adapted} do not fit the base's module groups {self.groups}")
        self.r, self.alpha, self.p, self.row, self.adapted = r, alpha, dropout, row, tuple(adapted)
        self.use_rslora = use_rslora
        self.scaling = alpha / math.sqrt(r) if use_rslora else alpha / r
        self.hf_modules = tuple(hf_modules)
        self.regroup = regroup
        self.group, self.sequence_parallel = base.group, getattr(base, "sequence_parallel", False)
        self.in_features, self.out_features = base.in_features, base.out_features
        tp = group_size(self.group)
        self.coords = {"tp": (group_rank(self.group), tp)}
        device = base.weight.device
        k = len(self.adapted)
        if row:
            self.a_spec, self.b_spec = (Split("tp", 1),), ()
            a_shape, b_shape = (r, self.in_features // tp), (self.out_features, r)
        elif self.replicated:
            self.a_spec, self.b_spec = (), ()
            a_shape, b_shape = (r, self.in_features), (self.out_features, r)
        else:
            adapted_chunks = [c for g in self.adapted for c in self.groups[g]]
            sizes = tuple(self.chunks[c] for c in adapted_chunks)
            parts = tuple(spec.parts[c] for c in adapted_chunks) if spec.parts else None
            self.a_spec = ()
            self.b_spec = (Split("tp", 0, chunks=sizes if spec.chunks else None, parts=parts),)
            a_shape, b_shape = (k * r, self.in_features), (local_pieces(self.b_spec[0], sum(sizes), 0, tp)[1], r)
        self.A = shard(nn.Parameter(torch.zeros(a_shape, device=device, dtype=dtype)), *self.a_spec)
        self.B = shard(nn.Parameter(torch.zeros(b_shape, device=device, dtype=dtype)), *self.b_spec)
        self.replica_group = getattr(base, "replica_group", None)
        self.replicated_rows = [(l0, l1) for _, l0, l1, _, _ in replicated_pieces(self.b_spec, self.coords)]

    @property
    def pair_sizes(self) -> list[int]:
        """The output length of each adapted pair's B (global)."""
        if self.row or self.replicated:
            return [self.out_features]
        return [sum(self.chunks[c] for c in self.groups[g]) for g in self.adapted]

    @property
    def global_shapes(self) -> tuple[tuple[int, int], tuple[int, int]]:
        """(A, B) shapes of the whole adapter, as a tp=1 model holds them: the pairs stacked along dim 0."""
        return (len(self.adapted) * self.r, self.in_features), (sum(self.pair_sizes), self.r)

    @torch.no_grad()
    def reset_parameters(self, generators: list[torch.Generator]):
        """PEFT's init: each pair's A kaiming-uniform(a=sqrt(5)) drawn whole from its generator (so every mesh
        gets the same adapter), B zeros."""
        if self.A.device.type == "meta":
            return
        pairs = [nn.init.kaiming_uniform_(torch.empty(self.r, self.in_features), a=math.sqrt(5), generator=g)
                 for g in generators]
        full = torch.cat(pairs, 0)
        self.A.copy_(shard_tensor(full, self.a_spec, self.coords))
        self.B.zero_()

    def _replicated(self, p):
        return copy_to_parallel(p, self.group)  # partial gradient on each rank: summed over tp in backward

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """`y` (this rank's base output: partial sums for a row-parallel base) plus the low-rank path on `x`."""
        dtype = self.A.dtype
        if self.row:
            sharded = group_size(self.group) > 1
            h = F.linear(dropout(x, self.p, self.training, sharded=sharded).to(dtype), self.A)
            return y + (F.linear(h, self._replicated(self.B)) * self.scaling).to(y.dtype)
        if self.replicated:
            sp = self.sequence_parallel
            a, b = (copy_to_parallel(p, self.group) if sp else p for p in (self.A, self.B))
            h = F.linear(dropout(x, self.p, self.training, sharded=sp).to(dtype), a)
            return y + (F.linear(h, b) * self.scaling).to(y.dtype)
        a = self._replicated(self.A)
        local = self._local_chunks()
        b = sum_replica_grads(self.B, self.replicated_rows, self.replica_group)
        b_parts = b.split([sum(local[c] for c in self.groups[g]) for g in self.adapted], 0)
        deltas = {}
        for i, g in enumerate(self.adapted):  # each HF module draws its own dropout mask, as in PEFT
            h = F.linear(dropout(x, self.p, self.training, sharded=False).to(dtype), a[i * self.r:(i + 1) * self.r])
            delta = (F.linear(h, b_parts[i]) * self.scaling).to(y.dtype)
            deltas.update(zip(self.groups[g], delta.split([local[c] for c in self.groups[g]], -1)))
        if len(deltas) == len(self.chunks):
            return y + torch.cat([deltas[c] for c in range(len(self.chunks))], -1)
        parts = y.split(local, -1)
        return torch.cat([part + deltas[c] if c in deltas else part for c, part in enumerate(parts)], -1)

    def _local_chunks(self) -> list[int]:
        """This rank's length of each of the base's chunks (a replicated kv chunk: one whole head)."""
        rank, tp = self.coords["tp"]
        pieces, _ = local_pieces(self.spec, sum(self.chunks), rank, tp)
        return [l1 - l0 for _, _, l0, l1 in pieces]

    @torch.no_grad()
    def delta_weight(self) -> torch.Tensor:
        """scaling * B @ A laid out like this rank's base weight (for merging)."""
        if self.row or self.replicated:
            return (self.B @ self.A) * self.scaling
        local = self._local_chunks()
        starts = [sum(local[:c]) for c in range(len(local))]
        out = self.B.new_zeros(sum(local), self.in_features)
        rows = self.B.split([local[c] for g in self.adapted for c in self.groups[g]], 0)
        pairs = [i for i, g in enumerate(self.adapted) for _ in self.groups[g]]
        chunks = [c for g in self.adapted for c in self.groups[g]]
        for b, i, c in zip(rows, pairs, chunks):
            out[starts[c]:starts[c] + local[c]] = b @ self.A[i * self.r:(i + 1) * self.r] * self.scaling
        return out

    def extra_repr(self):
        kind = "row" if self.row else "replicated" if self.replicated else "column"
        return f"r={self.r}, alpha={self.alpha}, {kind}, {', '.join(self.hf_modules) or 'adapted'}"
